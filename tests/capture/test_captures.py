"""The two captures the routes are built on: the conversion's recording of one call
(attnres_fx/capture/recording.py) and a block call traced with its sublayers as calls
(attnres_fx/capture/block_tracer.py).

Structural: which nodes each graph holds (ops with their module stacks, parameters as get_attr, the
sublayers as call_module), what a call shape is made of. Numerical: the recorded graph and the block
graph compute what the model computes (exactly: the same ops). Failure: a construct neither can take
raises TraceError; the model is left as it was (buffers, random state); a trace in one thread leaves
module calls in other threads alone.
"""

import threading

import pytest
import torch
from torch import fx, nn

from attnres_fx.capture.block_tracer import TENSOR, Bound, call_shape, compiled_forward, trace_block
from attnres_fx.errors import TraceError
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.passes.detect import detect_residual_streams
from attnres_fx.capture.recording import MODULE_CALLS, record_graph


def tiny():
    torch.manual_seed(0)
    return TinyTransformer(dim=32, num_layers=2, num_heads=4).eval()


def test_the_recording_holds_each_op_with_its_module_and_the_parameters_as_attributes():
    model = tiny()
    ids = example_ids(model.config)
    graph = record_graph(model, (ids,), {})
    ops = [n for n in graph.graph.nodes if n.op in ("call_function", "call_method")]
    adds = [n for n in ops if n.target == "add"]
    assert len(adds) >= 4 and all(n.meta["example_value"].shape == (2, 16, 32) for n in adds[-4:])
    attrs = {n.target for n in graph.graph.find_nodes(op="get_attr")}
    assert "blocks.0.ln1.weight" in attrs and "head.weight" in attrs
    stacks = {path for n in ops for path, _ in n.meta.get("nn_module_stack", {}).values()}
    assert {"blocks.0", "blocks.0.attn", "blocks.1.mlp"} <= stacks
    assert set(graph.meta[MODULE_CALLS]) >= {"blocks.0", "blocks.1"}
    assert len(detect_residual_streams(graph).streams[0].sites) == 4
    torch.testing.assert_close(graph(ids), model(ids), rtol=0, atol=0)


class NoOps(nn.Module):
    """A cast to the dtype a tensor has already hands the tensor back; the residual add reads the same
    object under another name."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = x.to(torch.float32)
        x = x + self.lin(h)
        return x + self.lin2(x.contiguous())


def test_ops_that_hand_their_input_back_are_not_recorded():
    graph = record_graph(NoOps(), (torch.randn(2, 8),), {})
    names = [n.target for n in graph.graph.nodes if n.op == "call_method"]
    assert "to" not in names and "contiguous" not in names
    (stream,) = detect_residual_streams(graph).streams
    assert [site.stream_in.op for site in stream.sites] == ["placeholder", "call_method"]   # the input, then x + ...


class PythonDtypes(nn.Module):
    """Tensors made with Python's number types as dtypes, as transformers' chunked attention masks are."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        offsets = torch.zeros(x.shape[0], dtype=int) + torch.ones(x.shape[0], dtype=bool)
        scale = torch.full((1,), 0.5, dtype=float).to(x.dtype)
        x = x + self.lin(x) * scale
        return x + self.lin2(x) + offsets[:, None].to(x.dtype)


def test_python_number_types_as_dtypes_are_recorded_as_the_dtypes_torch_reads_them_as():
    model, x = PythonDtypes(), torch.randn(2, 8)
    graph = record_graph(model, (x,), {})
    dtypes = {n.kwargs["dtype"] for n in graph.graph.nodes if "dtype" in n.kwargs}
    assert dtypes == {torch.int64, torch.bool, torch.float64}
    torch.testing.assert_close(graph(x), model(x), rtol=0, atol=0)
    assert len(detect_residual_streams(graph).streams[0].sites) == 2


def test_the_recording_leaves_the_model_and_the_random_state_as_they_were():
    model = nn.Sequential(nn.BatchNorm1d(8), nn.Dropout(0.5)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    record_graph(model, (x,), {})
    assert torch.equal(torch.rand(1), expected)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_model_that_fails_on_the_inputs_raises_trace_error_naming_it():
    with pytest.raises(TraceError, match="fails on the example inputs") as raised:
        record_graph(tiny(), (torch.randn(2, 3),), {})
    assert "model" in raised.value.causes


class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x, scale=None, cache=None):
        if scale is not None:
            x = x * scale
        return x + self.lin(self.ln(x))


def test_a_block_trace_calls_its_sublayers_and_takes_python_numbers_as_inputs():
    """Constants (``None``, booleans, strings) are baked in; a Python number is an input, so that another
    value runs the same graph. Code that needs the number's value is traced with it baked in."""
    block = Branching()
    x = torch.randn(2, 3, 8)
    shape, inputs = call_shape((x,), {"scale": 2.0, "cache": None}, (block,))
    assert shape == ((TENSOR,), (("scale", float), ("cache", (type(None), None))), True)   # the block trains
    assert inputs == [x, 2.0]
    traced = trace_block(block, type(block).forward, (x,), {"scale": 2.0, "cache": None}, frozenset(), shape)
    called = [n.target for n in traced.graph_module.graph.nodes if n.op == "call_module"]
    assert called == ["block.ln", "block.lin"]
    forward = compiled_forward(traced.graph_module.graph, "test")
    torch.testing.assert_close(forward(Bound(block), x, 3.0), block(x, scale=3.0), rtol=0, atol=0)
    baked = trace_block(block, type(block).forward, (x,), {"scale": 2.0, "cache": None}, frozenset(), shape,
                        baked=True)
    forward = compiled_forward(baked.graph_module.graph, "test")
    torch.testing.assert_close(forward(Bound(block), x, 3.0), block(x, scale=2.0), rtol=0, atol=0)


def test_objects_are_inputs_that_answer_isinstance_as_themselves():
    class Cache:
        pass

    class Checks(Branching):
        def forward(self, x, scale=None, cache=None):
            assert isinstance(x, torch.Tensor) and isinstance(cache, Cache)
            return super().forward(x)
    block, x, cache = Checks(), torch.randn(2, 8), Cache()
    shape, inputs = call_shape((x,), {"cache": cache}, (block,))
    assert inputs == [x, cache] and shape[1] == (("cache", Cache),)
    trace_block(block, type(block).forward, (x,), {"cache": cache}, frozenset(), shape)


def test_control_flow_on_a_tensor_value_cannot_be_traced():
    class ValueBranch(Branching):
        def forward(self, x, scale=None, cache=None):
            if x.sum() > 0:
                x = x + 1
            return super().forward(x)
    block, x = ValueBranch(), torch.randn(2, 8)
    shape, _ = call_shape((x,), {}, (block,))
    with pytest.raises(TraceError, match="cannot be traced with its sublayers as calls"):
        trace_block(block, type(block).forward, (x,), {}, frozenset(), shape)


def test_a_random_draw_is_drawn_at_every_call_and_a_branch_on_it_cannot_be_traced():
    """torch.fx runs a draw that takes no traced value once, at trace time, and bakes it in: a layer's
    random scale (or a LayerDrop's coin) would be frozen. Structural: the draw is a node of the graph;
    numerical: each call draws anew, the draws of the original under the same seed; failure: a branch on
    the draw (a LayerDrop) cannot be traced, so that the route does not bake the branch taken."""
    class RandomScale(Branching):
        def forward(self, x, scale=None, cache=None):
            return super().forward(x * torch.rand([]))

    class LayerDrop(Branching):
        def forward(self, x, scale=None, cache=None):
            return x if torch.rand([]) < 0.5 else super().forward(x)

    block, x = RandomScale(), torch.randn(2, 8)
    shape, _ = call_shape((x,), {}, (block,))
    traced = trace_block(block, type(block).forward, (x,), {}, frozenset(), shape)
    assert [n.target for n in traced.graph_module.graph.nodes if n.op == "call_function"][0] is torch.rand
    forward = compiled_forward(traced.graph_module.graph, "test")
    draws = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        got = forward(Bound(block), x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, block(x), rtol=0, atol=0)
        draws.append(got)
    assert not torch.equal(*draws)
    with pytest.raises(TraceError, match="cannot be traced with its sublayers as calls"):
        trace_block(LayerDrop(), LayerDrop.forward, (x,), {}, frozenset(), shape)


def test_a_trace_in_one_thread_leaves_module_calls_in_other_threads_alone():
    """torch.fx patches nn.Module.__call__ while it traces: another thread's calls must run as usual."""
    other, x = nn.Linear(8, 8), torch.randn(4, 8)
    expected = other(x)
    started, results = threading.Event(), []

    class Slow(Branching):
        def forward(self, x, scale=None, cache=None):
            started.set()
            worker.join()            # the other thread calls its module while this trace runs
            return super().forward(x)

    def call_other():
        started.wait()
        results.append(other(x))
    worker = threading.Thread(target=call_other)
    worker.start()
    block = Slow()
    shape, _ = call_shape((x,), {}, (block,))
    trace_block(block, type(block).forward, (x,), {}, frozenset(), shape)
    assert isinstance(results[0], torch.Tensor) and not isinstance(results[0], fx.Proxy)
    torch.testing.assert_close(results[0], expected, rtol=0, atol=0)
