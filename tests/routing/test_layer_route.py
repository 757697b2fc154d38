"""The layer route: each block runs its own rewritten graph, the stream's state (completed block sums and
the partial sum) entering as extra inputs and leaving as extra outputs; the code around the blocks runs
as written.

Numerical: the layer route computes what the model route computes (same rewrite, split per block:
fp32 sums in another order, 1e-6), forward and gradients, with random pseudo-queries. Structural: which
modules are routed, what a block's graph takes and returns, what the carrier between blocks is.
Failures: a call that breaks the route names the block and the cause; a model the route does not fit
falls back to the model route, or is refused with route="layer".
"""

import copy
import operator
import sys
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import attnres_fx
from attnres_fx import routing
from attnres_fx.models import TinyConfig, TinyTransformer, example_ids
from attnres_fx.conversion import conversion_of
from attnres_fx.errors import TraceError
from attnres_fx.capture.block_tracer import compiled_forward
from attnres_fx.op.module import run_site
from attnres_fx.passes import rewrite
from attnres_fx.passes.two_phase import phase1_at, phase2_at
from attnres_fx.passes.signature import BLOCK, CARRIER, PARTIAL, SIGNATURE, SPARE
from attnres_fx.routing import graphs
from attnres_fx.op.kernels import cpu
from attnres_fx.routing.state import ATTRIBUTE, state_of
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.testing.handwritten import HandwrittenConfig, Transformer
from toy_models import DecoderLayer, EncoderDecoder, make_inputs
from conftest import cold_compile

TIGHT = 1e-6
# Between the layer route's eager block code, which runs each site with the layer norm that reads it as one
# operator, and the same model on the model route or TorchDynamo, which run ATen's layer_norm after the
# aggregation: the norm's mean and variance summed in another order, a few fp32 ulps a norm, which these
# d=32 models carry to 2-6e-6 on their logits and second derivatives.
FUSED_NORMS = dict(rtol=1e-5, atol=2e-5)


def tiny(parallel=False, layers=3, cls=TinyTransformer):
    torch.manual_seed(0)
    return cls(dim=32, num_layers=layers, num_heads=4, parallel=parallel).eval()


def both_routes(model, *inputs, **options):
    """The model converted on each route, with the same random pseudo-queries."""
    inputs = inputs or (example_ids(model.config),)
    layer = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(model), inputs, route="layer", **options))
    whole = attnres_fx.attnresify(copy.deepcopy(model), inputs, route="model", **options)
    whole.load_state_dict(layer.state_dict())
    return layer, whole


# Which implementation makes the stream's autograd edges between blocks: the C++ nodes (where the kernel
# library loads: the default), the Python Functions (tensor subclasses, traces), or one of each for the two
# sides of one state (a block whose carrier takes one path and the next block's the other).
EDGES = {"C++": ("bundle", "unbundle"), "Python": (), "C++ bundle": ("bundle",), "C++ unbundle": ("unbundle",)}


@pytest.fixture(params=list(EDGES))
def stream_edges(request, monkeypatch):
    kept = EDGES[request.param]
    if kept and not cpu.available():
        pytest.skip(f"the C++ kernel: {cpu.unavailable_reason()}")
    for name in ("bundle", "unbundle"):
        if name not in kept:
            monkeypatch.setattr(cpu.Entries, name, None)
    return request.param


def grads(model, ids):
    model.zero_grad()
    model(ids).float().square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_both_routes_compute_the_same_model(parallel, block_size, stream_edges):
    layer, whole = both_routes(tiny(parallel), block_size=block_size)
    ids = example_ids(layer.config)
    torch.testing.assert_close(layer(ids), whole(ids), **FUSED_NORMS)
    layer.train(), whole.train()
    want = grads(whole, ids)
    got = grads(layer, ids)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=TIGHT, msg=name)


def test_what_is_routed_and_what_each_block_graph_takes_and_returns():
    model = attnres_fx.attnresify(tiny(), block_size=2)
    plan = attnres_fx.plan_of(model)
    assert plan.routes == ("layer",)
    assert [s.owner for s in plan.streams[0].layers] == ["blocks.0", "blocks.1", "blocks.2"]
    routers = {router.path: router for router in routing.routers(model)}
    assert set(routers) == {"blocks.0", "blocks.1", "blocks.2"}, "the root runs as written"
    assert "forward" not in model.__dict__
    assert all(isinstance(router, routing.LayerRouter) for router in routers.values())
    model(example_ids(model.config))
    # block_size=2: blocks.1 begins at site 2 with b_0 committed and the partial sum of sites 0 and 1; it
    # commits that partial sum as b_1 at site 2, and returns the carrier, its own partial sum and b_1 after
    # its result. The completed blocks come in as one list: the graph serves blocks of this kind at any depth.
    (graph,) = routers["blocks.1"].rewritten
    inputs = [n.name for n in graph.graph.find_nodes(op="placeholder") if n.name.startswith("attnres_")]
    assert inputs == ["attnres_blocks", "attnres_partial"]
    (output,) = graph.graph.find_nodes(op="output")
    assert len(output.args[0]) == 1 + 3 and output.args[0][1] is output.args[0][0]
    (last,) = routers["blocks.2"].rewritten
    assert len(last.graph.find_nodes(op="output")[0].args[0]) == 1, "the last block returns the final aggregate"
    assert any(n.meta.get("attnres", {}).get("name") == "final_res" for n in last.graph.nodes)


def test_between_blocks_the_stream_is_the_plain_sum_of_the_branch_outputs():
    """What a block returns (what the code around the blocks and hooks see) is the residual sum of the
    AttnRes branch outputs: at zero init with preserve_scale the original stream; and always the sum of
    the state it carries."""
    original = tiny()
    ids = example_ids(original.config)
    seen = {}
    for index, block in enumerate(original.blocks):
        block.register_forward_hook(lambda m, a, out, index=index: seen.__setitem__(("original", index), out))
    original(ids)
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), preserve_scale=True, block_size=2)
    for index, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, out, index=index: seen.__setitem__(("converted", index), out))
    model(ids)
    for index in range(2):
        torch.testing.assert_close(seen["converted", index], seen["original", index], rtol=1e-5, atol=1e-6)
    randomise_pseudo_queries(model)
    model(ids)
    carrier = seen["converted", 1]
    state, how = state_of(carrier, conversion_of(model), 0)
    assert how == "carrier" and state.position == 4 and len(state.blocks) == 2
    torch.testing.assert_close(carrier, sum(state.blocks) + state.partial, rtol=1e-6, atol=1e-6)


def test_with_gradients_one_node_makes_the_carrier_from_the_carrier_and_the_state(stream_edges):
    """Recording gradients, the carrier a block returns comes from one autograd node whose inputs are the
    block's carrier and its state's tensors (the C++ node where the kernel library loads, else the Python
    Function), and the next block reads both from one node on the carrier."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(), block_size=2)).train()
    ids = example_ids(model.config)
    seen = {}
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.__setitem__("carrier", out))
    model.blocks[2].register_forward_pre_hook(lambda m, a: seen.__setitem__("read", a[0]))
    model(ids)
    carrier = seen["carrier"]
    state, _ = state_of(carrier, conversion_of(model), 0)
    node = carrier.grad_fn
    assert ("BundleFunction" in node.name()) == (stream_edges in ("C++", "C++ bundle"))
    assert len(node.next_functions) == 1 + len(state.tensors)
    assert seen["read"] is carrier


def test_a_graph_kept_for_a_second_backward_and_second_order_gradients_match_the_model_route(stream_edges):
    """The gradients the nodes between blocks keep for a state are taken once per backward: a graph
    kept (``retain_graph=True``) gives the same gradients at its second backward; gradients of gradients
    (``create_graph=True``, a gradient penalty) through them equal the model route's (1e-5: the same sums)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layer, whole = both_routes(tiny(), block_size=2)
    layer.train(), whole.train()
    ids = example_ids(layer.config)
    layer.zero_grad()
    loss = layer(ids).float().square().mean()
    loss.backward(retain_graph=True)
    first = {name: p.grad.clone() for name, p in layer.named_parameters()}
    loss.backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[name], rtol=1e-5, atol=TIGHT, msg=name)

    def second_order(model):
        params = list(model.parameters())
        with sdpa_kernel(SDPBackend.MATH):       # the flash kernel's backward has no derivative
            grads = torch.autograd.grad(model(ids).float().square().mean(), params, create_graph=True)
            return torch.autograd.grad(sum(g.square().sum() for g in grads), params)

    for got, want in zip(second_order(layer), second_order(whole)):
        torch.testing.assert_close(got, want, **FUSED_NORMS)


@pytest.mark.skipif(not cpu.available(), reason=f"the C++ kernel: {cpu.unavailable_reason()}")
@pytest.mark.parametrize("name", ["TinyTransformer", "hand-written Llama"])
def test_gradients_of_gradients_equal_those_of_the_aggregations_pytorch_ops(name, monkeypatch):
    """A gradient penalty's second derivatives through the C++ operators (aggregation nodes; on the
    hand-written Llama every site fused with its RMS norm) equal those of the same model with every
    aggregation computed by PyTorch ops (the operators declined), the sources built from each other as in
    any stream. fp32 second derivatives: 1e-6 to 1e-5 apart (relative_error); bound 1e-4. Before, they
    were the gradients of the rest of the model alone (the operators' backward had no derivative): some
    100% off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from attnres_fx.checks import relative_error

    torch.manual_seed(0)
    if name == "TinyTransformer":
        model = TinyTransformer(dim=32, num_layers=2, num_heads=4).eval()
        ids = example_ids(model.config)
    else:
        model = Transformer(HandwrittenConfig(dim=32, layers=2, heads=2, vocab=61, max_batch=2, max_seq=16)).eval()
        ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    model = randomise_pseudo_queries(attnres_fx.attnresify(model, (ids,), block_size=2)).train()
    params = list(model.parameters())

    def second_order():
        with sdpa_kernel(SDPBackend.MATH):       # the flash kernel's backward has no derivative
            grads = torch.autograd.grad(model(ids).float().square().mean(), params, create_graph=True)
            return torch.autograd.grad(sum(g.square().sum() for g in grads), params, allow_unused=True)

    got = second_order()
    assert conversion_of(model).stats.fused_norms > 0 or name == "TinyTransformer"
    for entry in ("run_site", "run_site_normed"):
        monkeypatch.setattr(cpu.Entries, entry, None)
    monkeypatch.setattr(cpu, "aggregate_op", lambda: None)
    monkeypatch.setattr(cpu, "available", lambda: False)
    want = second_order()
    for got_grad, want_grad in zip(got, want, strict=True):
        assert (got_grad is None) == (want_grad is None)
        if want_grad is not None:
            assert relative_error(got_grad, want_grad) < 1e-4


def test_a_carrier_recorded_with_gradients_saves_with_torch_save(stream_edges, tmp_path):
    """Hidden states kept from a training forward save and load: the state they carry goes along, without
    the autograd graph's gradient holder."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(), block_size=2)).train()
    ids = example_ids(model.config)
    carrier = model.blocks[1](model.blocks[0](model.embed(ids)))
    torch.save(carrier, tmp_path / "carrier.pt")
    loaded = torch.load(tmp_path / "carrier.pt", weights_only=False)
    torch.testing.assert_close(loaded, carrier, rtol=0, atol=0)
    state, kept = getattr(carrier, ATTRIBUTE), getattr(loaded, ATTRIBUTE)
    assert state.position > 0 and state.blocks
    assert (kept.stream, kept.position, len(kept.blocks)) == (state.stream, state.position, len(state.blocks))
    for saved, block in zip(kept.tensors, state.tensors, strict=True):
        torch.testing.assert_close(saved, block, rtol=0, atol=0)
    assert kept.holder is None


def _adds(graph_module):
    """The stream-sized adds of a block graph: plain ones, and carriers computed as ``c + partial`` where
    the partial sum has the carrier's dtype (one add there)."""
    return [node for node in graph_module.graph.nodes
            if node.op == "call_function" and node.target in (operator.add, rewrite.carry)]


def _hooked_outputs(model, ids):
    seen = []
    handles = [block.register_forward_hook(lambda m, a, out: seen.append(out)) for block in model.blocks]
    result = model(ids)
    for handle in handles:
        handle.remove()
    return result, seen


@pytest.mark.parametrize("parallel, block_size", [(False, 2), (True, 1)], ids=["sequential", "parallel"])
def test_a_block_that_starts_an_attnres_block_adds_as_often_as_the_original_block(parallel, block_size):
    """Structural: each block begins an AttnRes block (its two sites, or its one site of two branches),
    whose partial sum is ``attn + mlp``; the carrier it returns is ``x + partial`` rather than
    ``(x + attn) + mlp``, so its graph makes the block's own two stream-sized adds, not three. The block
    that ends the stream makes only the partial sum's. Numerical: at zero init with preserve_scale the
    carriers and the result are the original's (fp32 sums in another order, as in the test above)."""
    original = tiny(parallel, layers=4)
    ids = example_ids(original.config)
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), preserve_scale=True, block_size=block_size)
    result, carriers = _hooked_outputs(model, ids)
    expected, original_carriers = _hooked_outputs(original, ids)
    graphs_ = [graph for router in routing.routers(model) for graph in router.rewritten]
    assert [len(_adds(graph)) for graph in graphs_] == [2, 2, 2, 1]
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
    for carrier, original_carrier in zip(carriers[:3], original_carriers):
        torch.testing.assert_close(carrier, original_carrier, rtol=1e-5, atol=1e-6)


def test_a_carrier_under_autocast_adds_its_branch_outputs_one_at_a_time_as_the_original():
    """Under ``torch.autocast`` the branch outputs are bf16 and the stream fp32: the carrier a block returns
    is ``(x + attn) + mlp`` in fp32, bit for bit, as the original block adds them, not ``x + partial``
    with the bf16 partial sum's rounding (which doubled the carriers' distance from the original's)."""
    original = tiny(layers=4)
    ids = example_ids(original.config)
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), block_size=2)
    seen = {}
    for index, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, index=index: seen.__setitem__(("x", index), args[0]))
        block.register_forward_hook(lambda m, a, out, index=index: seen.__setitem__(("out", index), out))
        for name in ("attn", "mlp"):
            getattr(block, name).register_forward_hook(
                lambda m, a, out, index=index, name=name: seen.__setitem__((name, index), out))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    for index in range(3):
        assert seen["attn", index].dtype == torch.bfloat16 and seen["out", index].dtype == torch.float32
        expected = (seen["x", index] + seen["attn", index]) + seen["mlp", index]
        assert torch.equal(seen["out", index], expected), index


class Rewired(torch.nn.Module):
    """A block of another class around ``block``'s sublayers (its forward written by the subclass)."""

    def __init__(self, block):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = block.ln1, block.attn, block.ln2, block.mlp


class MidpointBlock(Rewired):
    """A block that also returns its stream value between its two sites."""

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h)), h


class Midpoints(TinyTransformer):
    def forward(self, ids):
        x, midpoints = self.embed(ids), []
        for block in self.blocks:
            x, midpoint = block(x)
            midpoints.append(midpoint)
        return self.head(self.ln_f(x)), torch.stack(midpoints)


def test_a_carrier_value_read_elsewhere_inside_a_block_stays_computed():
    """A stream value between two sites that the block also returns is computed as written, and the
    carrier after it too (``h + mlp``: no add to spare there); at zero init with preserve_scale both are
    the original's."""
    torch.manual_seed(0)
    original = Midpoints(dim=32, num_layers=3, num_heads=4).eval()
    for index, block in enumerate(original.blocks):
        original.blocks[index] = MidpointBlock(block)
    ids = example_ids(original.config)
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), preserve_scale=True, block_size=2)
    (logits, midpoints), (expected_logits, expected_midpoints) = model(ids), original(ids)
    assert attnres_fx.plan_of(model).routes == ("layer",)
    (graph,) = routing.routers(model)[1].rewritten
    (output,) = graph.graph.find_nodes(op="output")
    midpoint = output.args[0][0][1]        # the block's result (carrier, h), then the carrier and the state
    assert midpoint.target is operator.add and len(_adds(graph)) == 3
    assert any(node.target is operator.add and midpoint in node.args for node in midpoint.users)
    torch.testing.assert_close(midpoints, expected_midpoints, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_calls_without_gradients_take_the_short_path_where_nothing_else_applies(mode, monkeypatch):
    """A block called without gradients on the carrier its predecessor returned, unedited and with no
    forward hook on it, runs on the route's short path (LayerRouter._run_plain); its results are the
    general path's, exactly. A carrier edited in place (by a block's forward hook, or by the next one's
    pre-hook), a block with a forward hook and a call with gradients take the general path."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(layers=4), block_size=2), std=1.0)
    ids = example_ids(model.config)
    plain = []
    short = routing.LayerRouter._run_plain
    monkeypatch.setattr(routing.LayerRouter, "_run_plain", lambda self, *a: plain.append(self.path) or short(self, *a))
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def both():
        with context():
            first = model(ids)
            monkeypatch.setattr(routing.LayerRouter, "_run_block_graph", routing.LayerRouter._run_recorded)
            general = model(ids)
            monkeypatch.undo()
            monkeypatch.setattr(routing.LayerRouter, "_run_plain",
                                lambda self, *a: plain.append(self.path) or short(self, *a))
        assert torch.equal(first, general)
        return first

    model(ids)
    plain.clear()
    unhooked = both()
    assert plain == ["blocks.1", "blocks.2", "blocks.3"]       # blocks.0 starts the stream
    handle = model.blocks[1].register_forward_hook(lambda module, args, out: out.add_(0.5))
    plain.clear()
    edited = both()
    assert plain == ["blocks.3"] and not torch.allclose(edited, unhooked)
    handle.remove()
    model(ids)      # the route's own hook, kept after the block's forward hooks, goes with them here
    # An edit of a carrier the short path returned, before the next block reads it (seen by the carrier's
    # version counter, or where it has none, an inference tensor, by a copy kept for the pre-hook).
    handle = model.blocks[2].register_forward_pre_hook(lambda module, args: args[0].add_(0.5))
    plain.clear()
    edited = both()
    assert plain == ["blocks.1", "blocks.3"] and not torch.allclose(edited, unhooked)
    handle.remove()
    plain.clear()
    model(ids)
    assert plain == []


class Wrapper(torch.nn.Module):
    """A module put in a block's place after conversion, as ``checkpoint_wrapper`` is."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("path", ["short", "general"])
@pytest.mark.parametrize("where", ["next block", "every module", "wrapper of the next block"])
def test_a_pre_hook_that_edits_the_carrier_under_inference_mode_is_seen(where, path, monkeypatch):
    """Activation steering in a forward pre-hook (``args[0].add_(v)``) of the block after the one that
    returned the carrier, which has no hook itself, under ``torch.inference_mode()``: the carrier is an
    inference tensor (no version counter), yet the edit reaches the stream as in the original model, at
    the first call after conversion and at the decoding steps after it, on the short path and the general
    one. The hook is the block's own, one registered for every module, or one of a wrapper put in the
    block's place after conversion. Converted with ``preserve_scale`` at zero init (the original
    function): fp32 sums in another order, 1e-5 relative."""
    from attnres_fx.checks import relative_error
    from attnres_fx.testing.handwritten import HandwrittenConfig, Transformer

    torch.manual_seed(0)
    original = Transformer(HandwrittenConfig(dim=32, layers=4, heads=4, vocab=100, max_batch=2, max_seq=64)).eval()
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,), preserve_scale=True, block_size=2)
    if path == "general":
        monkeypatch.setattr(routing.LayerRouter, "_run_block_graph", routing.LayerRouter._run_recorded)
    v = torch.randn(32, generator=torch.Generator().manual_seed(2))
    steps = [(ids, 0), *((ids[:, k:k + 1], 6 + k) for k in range(3))]
    outputs = {}
    for name, each in (("original", original), ("converted", model)):
        if where == "wrapper of the next block":
            each.layers[2] = Wrapper(each.layers[2])
        target = each.layers[2]

        def steer(module, args, target=target):
            if module is target:
                args[0].add_(v)
        handle = (torch.nn.modules.module.register_module_forward_pre_hook(steer) if where == "every module" else
                  target.register_forward_pre_hook(steer))
        try:
            with torch.inference_mode():
                outputs[name] = [each(tokens, start) for tokens, start in steps]
        finally:
            handle.remove()
    with torch.inference_mode():
        unhooked = original(ids)
    assert relative_error(outputs["original"][0], unhooked) > 0.01, "the edit has an effect"
    for got, want in zip(outputs["converted"], outputs["original"]):
        assert relative_error(got, want) < 1e-5, relative_error(got, want)


def test_a_pre_hook_that_may_edit_a_carrier_returned_for_another_block_is_refused_under_inference_mode():
    """Under ``torch.inference_mode()`` a block keeps a copy of its carrier only for the pre-hooks of the
    block after it: a block called on a carrier returned for another (one skipped) with a pre-hook could
    not tell its edit, and says so; under ``torch.no_grad()`` the version counter tells it."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(layers=4), block_size=2), std=1.0)
    ids = example_ids(model.config)
    model.blocks[2].register_forward_pre_hook(lambda module, args: args[0].add_(0.5))
    with torch.no_grad():
        model.blocks[2](model.blocks[0](model.embed(ids)))
        in_order = model.blocks[2](model.blocks[1](model.blocks[0](model.embed(ids))))
    with torch.inference_mode():
        with pytest.raises(attnres_fx.RoutingError, match="(?s)at 'blocks.2' has forward pre-hooks.*no_grad"):
            model.blocks[2](model.blocks[0](model.embed(ids)))
        got = model.blocks[2](model.blocks[1](model.blocks[0](model.embed(ids))))
    torch.testing.assert_close(got, in_order, rtol=TIGHT, atol=TIGHT)


def test_a_pre_hook_registered_after_the_block_before_returned_is_refused_under_inference_mode():
    """A pre-hook registered on the next block after a block returned its carrier, under
    ``torch.inference_mode()``: no copy was kept for it and the carrier has no version counter, so an edit
    could not be told; the call is refused by name on the short path as on the general one."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(layers=4), block_size=2), std=1.0)
    ids = example_ids(model.config)
    with torch.inference_mode():
        model(ids)
        carrier = model.blocks[1](model.blocks[0](model.embed(ids)))
        model.blocks[2].register_forward_pre_hook(lambda module, args: args[0].add_(0.5))
        with pytest.raises(attnres_fx.RoutingError, match="(?s)at 'blocks.2' has forward pre-hooks.*registered"):
            model.blocks[2](carrier)


def test_a_carrier_read_between_blocks_sends_its_gradient_and_an_unread_one_zeros_to_its_hooks(stream_edges):
    """The carrier's gradient reaches the block's residual adds where a loss reads the carrier (a loss on the
    hidden states): the gradients add up over the two losses. Where nothing reads it, its hooks still see
    a gradient, zeros."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(), block_size=2)).train()
    ids = example_ids(model.config)
    seen = {}
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.__setitem__("carrier", out))

    def grads_of(read_output: bool, read_carrier: bool, hook=None):
        model.zero_grad()
        out = model(ids)
        if hook is not None:
            seen["carrier"].register_hook(hook)
        losses = [out.square().mean()] * read_output + [seen["carrier"].square().mean()] * read_carrier
        sum(losses).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    both, output_only, carrier_only = grads_of(True, True), grads_of(True, False), grads_of(False, True)
    assert any(g.abs().sum() > 0 for name, g in carrier_only.items() if name.startswith("blocks.0."))
    for name, grad in both.items():
        torch.testing.assert_close(grad, output_only[name] + carrier_only.get(name, 0), rtol=1e-5, atol=TIGHT,
                                   msg=name)
    hooked = []
    grads_of(True, False, hook=hooked.append)
    assert len(hooked) == 1 and not hooked[0].any()


class Chatty(TinyTransformer):
    """A model whose own forward Dynamo cannot capture as one graph: a warning and a data-dependent
    branch outside every block."""

    def forward(self, ids):
        x = self.embed(ids)
        warnings.warn("the outer forward warns", UserWarning)
        if x.abs().sum() > 0:
            x = x * 1.0
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_a_graph_break_outside_every_block_converts_and_runs(untouched):
    model = tiny(cls=Chatty)
    ids = example_ids(model.config)
    check = untouched(model)
    with pytest.raises(attnres_fx.TraceError, match="as one graph"):
        attnres_fx.attnresify(model, (ids,), route="model")
    check()
    reference = model(ids)
    converted = attnres_fx.attnresify(copy.deepcopy(model), (ids,), preserve_scale=True, block_size=2)
    assert attnres_fx.plan_of(converted).routes == ("layer",)
    assert [s.name for s in attnres_fx.sites(converted)][:2] == ["blocks.0.attn_res", "blocks.0.mlp_res"]
    with pytest.warns(UserWarning, match="the outer forward warns"):
        out = converted(ids)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


class TalkativeBlock(torch.nn.Module):
    """A block whose own forward branches on a value: neither torch.fx nor TorchDynamo (in one graph) can
    take it."""

    def __init__(self, block):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = block.ln1, block.attn, block.ln2, block.mlp

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        if x.abs().sum() > 0:               # data-dependent: no single graph
            x = x + self.mlp(self.ln2(x))
        return x


def test_a_block_that_cannot_be_captured_is_named_with_the_construct():
    model = tiny(cls=Chatty)
    model.blocks[1] = TalkativeBlock(model.blocks[1])
    with pytest.raises(attnres_fx.TraceError, match=r"blocks\.1 \(TalkativeBlock\) cannot be captured as one graph.*"
                                                  r"Data-dependent branching"):
        attnres_fx.attnresify(model, (example_ids(model.config),))


class CastBetweenBlocks(TinyTransformer):
    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x).double().float()       # casts that make new tensors (a no-op .to() hands back its input)
        return self.head(self.ln_f(x))


def test_a_stream_changed_between_blocks_takes_the_model_route_or_is_refused():
    model = tiny(cls=CastBetweenBlocks)
    ids = example_ids(model.config)
    assert attnres_fx.plan_of(attnres_fx.attnresify(copy.deepcopy(model), (ids,))).routes == ("model",)
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match=r"between blocks\.0 and blocks\.1 the stream "
                                                                      r"passes through .*double.* outside both"):
        attnres_fx.attnresify(copy.deepcopy(model), (ids,), route="layer")


def test_a_middle_block_called_on_its_own_says_what_it_needs():
    model = attnres_fx.attnresify(tiny(), block_size=2)
    with pytest.raises(attnres_fx.RoutingError, match="needs the result the module before it returned"):
        model.blocks[1](torch.randn(2, 16, 32))
    after = model.blocks[1](model.blocks[0](model.embed(example_ids(model.config))))
    with pytest.raises(attnres_fx.RoutingError, match="must be called once each, in order"):
        model.blocks[1](after)


@pytest.mark.parametrize("on_dynamo", [False, True], ids=["fx", "dynamo"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_each_block_keeps_the_gradients(reentrant, on_dynamo, monkeypatch, stream_edges):
    """Each block checkpointed, its graph traced by torch.fx or captured by TorchDynamo (torch.fx refused: the
    state enters and leaves the Dynamo graph as real inputs and outputs, the stream's first input found by
    the argument it came from): the gradients of the unchanged calls (1e-5: the same sums, recomputed)."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(), block_size=2)).train()
    ids = example_ids(model.config)
    want = grads(model, ids)
    if on_dynamo:
        def refuse(*args, **kwargs):
            raise TraceError("refused for this test: the block runs on TorchDynamo")
        monkeypatch.setattr(graphs, "routable_trace", refuse)
        model = copy.deepcopy(model)

    def checkpointed(ids):
        x = model.embed(ids)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        return model.head(model.ln_f(x))

    model.zero_grad()
    checkpointed(ids).float().square().mean().backward()
    for name, grad in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=TIGHT, msg=name)
    assert (conversion_of(model).stats.captures > 0) == on_dynamo


class OptionalCrossAttention(DecoderLayer):
    """A decoder layer whose cross-attention runs only when it is given the encoder's memory."""

    def forward(self, x, memory=None):
        x = x + self.self_attn(self.ln1(x))
        if memory is not None:
            x = x + self.cross_attn(self.ln2(x), memory)
        return x + self.mlp(self.ln3(x))


class OptionalMemory(EncoderDecoder):
    def __init__(self):
        super().__init__()
        cfg = TinyConfig(dim=32, num_heads=4, vocab_size=64)
        self.decoder = torch.nn.ModuleList(OptionalCrossAttention(cfg) for _ in range(2))

    def forward(self, src, tgt, use_memory=True):
        memory = self.src_emb(src)
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.enc_norm(memory) if use_memory else None
        x = self.tgt_emb(tgt)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(self.dec_norm(x))


def test_a_call_without_an_optional_sublayer_skips_its_site_on_both_routes():
    """Converted with the encoder's memory, the decoder called without it skips every cross-attention
    site: the site adds nothing, and a block boundary there still commits the partial sum. Both routes
    place the skipped sites alike (by the branch kinds, where sites of one layer look the same)."""
    torch.manual_seed(0)
    src, tgt = make_inputs(), make_inputs(seed=1)
    layer, whole = both_routes(OptionalMemory().eval(), src, tgt, block_size=2)
    for use_memory in (True, False):
        torch.testing.assert_close(layer(src, tgt, use_memory), whole(src, tgt, use_memory), **FUSED_NORMS)
    assert not torch.allclose(layer(src, tgt, False), layer(src, tgt, True))


class TrailingCrossAttention(DecoderLayer):
    """A decoder layer whose last sublayer, the cross-attention, runs only when it is given the memory."""

    def forward(self, x, memory=None):
        x = x + self.self_attn(self.ln1(x))
        x = x + self.mlp(self.ln3(x))
        if memory is not None:
            x = x + self.cross_attn(self.ln2(x), memory)
        return x


class TrailingMemory(OptionalMemory):
    def __init__(self):
        super().__init__()
        cfg = TinyConfig(dim=32, num_heads=4, vocab_size=64)
        self.decoder = torch.nn.ModuleList(TrailingCrossAttention(cfg) for _ in range(2))


def test_a_block_on_torchdynamo_without_its_last_sublayer_hands_on_the_state_its_graph_returns(monkeypatch):
    """Every block captured by TorchDynamo (torch.fx refused), the decoder called without the memory: the
    first decoder layer's skipped last site is a block start (site 2, block size 2), which the next layer
    commits, so the layer hands on fewer state outputs than its planned span has room for. Each block is
    captured once: the slots left over are spare outputs of its signature, and what it hands on is read
    from the signature. The outputs are those of the blocks torch.fx traces (within TIGHT: the same sums,
    in another order), with and without the memory."""
    torch.manual_seed(0)
    src, tgt = make_inputs(), make_inputs(seed=1)
    layer = randomise_pseudo_queries(attnres_fx.attnresify(TrailingMemory().eval(), (src, tgt), block_size=2))
    want = {use_memory: layer(src, tgt, use_memory) for use_memory in (False, True)}

    def refuse(*args, **kwargs):
        raise TraceError("refused for this test: the block runs on TorchDynamo")
    monkeypatch.setattr(graphs, "routable_trace", refuse)
    captured = copy.deepcopy(layer)
    routers = list(routing.routers(captured))
    (first_decoder,) = (router for router in routers if router.path == "decoder.0")
    for use_memory in (False, True):
        torch.testing.assert_close(captured(src, tgt, use_memory), want[use_memory], **FUSED_NORMS)
        if not use_memory:
            assert conversion_of(captured).stats.captures == len(routers), "each block captured once"
            spare = [router.path for router in routers if SPARE in router.rewritten[-1].meta[SIGNATURE].outputs]
            assert spare == ["decoder.0"], "the first decoder layer hands on less than its span has room for"
            # b_0 (the stream starts in this layer) and the partial sum; no block committed at site 2.
            without = first_decoder.rewritten[-1].meta[SIGNATURE]
            assert without.outputs[without.results:] == (CARRIER, PARTIAL, BLOCK, SPARE) and without.handed_on == 2
    with_memory = first_decoder.rewritten[-1].meta[SIGNATURE]
    assert with_memory.outputs[with_memory.results:] == (CARRIER, PARTIAL, BLOCK, BLOCK)


def test_an_explicit_graph_splits_into_pipeline_stages_at_a_block():
    """``torch.distributed.pipelining.pipeline()`` splits a :func:`attnres_fx.rewrite` graph before a
    block's first aggregation: the boundary carries the completed blocks and the partial sum, nothing else."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(layers=4), block_size=3))
    ids = example_ids(model.config)
    graph = attnres_fx.rewrite(model, (ids,), tracer="export")
    pipe = pipeline(graph, mb_args=(ids,), split_spec={"blocks.2.attn_res": SplitPoint.BEGINNING})
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)
    boundary = first(ids)
    # blocks.2 begins at site 4: b_0 and b_1 completed (block size 3), and the partial sum.
    assert len(boundary) == attnres_fx.plan_of(model).streams[0].completed_before(4) + 1 == 3
    torch.testing.assert_close(second(*boundary), model(ids), rtol=1e-5, atol=1e-5)


class AddingSublayer(torch.nn.Module):
    """A sublayer that adds the residual itself, its input normalised by the block (Bloom's layers): the
    block's graph must be traced through it."""

    def __init__(self, branch):
        super().__init__()
        self.branch = branch

    def forward(self, normed, residual):
        return residual + self.branch(normed)


class NestedBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.first, self.second = AddingSublayer(block.attn), AddingSublayer(block.mlp)

    def forward(self, x):
        x = self.first(self.ln1(x), x)
        return self.second(self.ln2(x), x)


def test_a_block_graph_calls_its_sublayers_and_traces_through_the_ones_that_hold_the_stream():
    """Structural: a block's graph calls each sublayer (attention, MLP, norms) as the module, and traces
    through the children that add residuals themselves (opened). A hook registered later on an opened
    child fires too (such calls run on TorchDynamo, which traces hooks), and the outputs stay those of the
    model route."""
    model = tiny()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = NestedBlock(block)
    layer, whole = both_routes(model)
    ids = example_ids(layer.config)
    torch.testing.assert_close(layer(ids), whole(ids), **FUSED_NORMS)
    spans = attnres_fx.plan_of(layer).streams[0].layers
    assert [span.opened for span in spans] == [frozenset({"first", "second"})] * 3
    (graph,) = routing.routers(layer)[1].rewritten
    called = {node.target for node in graph.graph.nodes if node.op == "call_module"}
    assert called == {"block.ln1", "block.first.branch", "block.ln2", "block.second.branch"}
    seen = []
    layer.blocks[1].second.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    torch.testing.assert_close(layer(ids), whole(ids), **FUSED_NORMS)
    assert len(seen) == 1, "the hook on an opened child fired"


def test_a_hook_on_an_opened_child_during_the_conversion_leaves_no_trace_on_the_route():
    """A hook on an opened child puts the calls made while it is there on TorchDynamo, not their call shape:
    a conversion whose capture installs hooks for its own use (transformers' output recorders) and removes
    them leaves blocks whose calls run their block graphs, as a model reloaded from a checkpoint does."""
    model = tiny()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = NestedBlock(block)
    ids = example_ids(model.config)
    want = attnres_fx.attnresify(copy.deepcopy(model), (ids,), route="model")
    seen = []
    handle = model.blocks[1].second.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    layer = attnres_fx.attnresify(model, (ids,))
    handle.remove()
    seen.clear()
    stats = conversion_of(layer).stats
    torch.testing.assert_close(layer(ids), want(ids), rtol=TIGHT, atol=TIGHT)
    assert stats.captures == 0, "no block ran on TorchDynamo"
    assert not seen


def test_a_block_graph_reads_the_children_it_calls_without_module_getattr():
    """Structural: the code of a block's graph reads the children it calls from the block's module dict,
    not through ``nn.Module.__getattr__`` (which CPython reaches only after raising and formatting an
    AttributeError): a converted forward of the hand-written Llama makes four such look-ups fewer per block
    than the original's (``self.attention``, ``self.attention_norm``, ...). Numerical: a child replaced
    after the first call is called (the dict read is the block's own)."""
    torch.manual_seed(0)
    model = Transformer(HandwrittenConfig(dim=32, layers=3, heads=2, vocab=64, max_batch=2, max_seq=16)).eval()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    converted = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(model), (ids,)))
    look_up = torch.nn.Module.__getattr__.__code__

    def look_ups(module) -> int:
        count = 0

        def profile(frame, event, arg):
            nonlocal count
            count += event == "call" and frame.f_code is look_up
        sys.setprofile(profile)
        try:
            module(ids)
        finally:
            sys.setprofile(None)
        return count
    with torch.no_grad():
        converted(ids)
        # + 2: the route's look-ups of the model's ``layers`` once a forward, not once a block.
        assert look_ups(converted) <= look_ups(model) - 4 * len(model.layers) + 2

    whole = attnres_fx.attnresify(copy.deepcopy(model), (ids,), route="model")
    whole.load_state_dict(converted.state_dict())
    for target in (converted, whole):
        target.layers[1].feed_forward = torch.nn.Sequential(target.layers[1].feed_forward, Scale(2.0))
    # 1e-5: the layer route's block code makes each site and the RMS norm that reads it one call
    # (passes/fuse_norms.py), the model route's graph does not: the norm's fp32 sums in another order.
    torch.testing.assert_close(converted(ids), whole(ids), rtol=1e-5, atol=1e-5)


class Scale(torch.nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


@cold_compile
@pytest.mark.slow
def test_compile_takes_the_whole_call_where_it_can_and_block_by_block_where_it_cannot():
    """attnres_fx.compile: one Inductor graph of the whole call, the blocks' results still the plain
    residual sums (the same values the eager layer route returns, 1e-5: Inductor reorders fp32 sums);
    a model whose own forward is no single graph compiles block by block: each block's rewritten graph,
    traced by torch.fx before and kept, captured by Dynamo (nothing traced again), a hook added to a
    sublayer afterwards honoured. Either way remove() restores the original exactly."""
    ids = example_ids(tiny().config)
    for cls, whole in ((TinyTransformer, True), (Chatty, False)):
        model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(cls=cls), (ids,), block_size=2))
        seen = []
        model.blocks[1].register_forward_hook(lambda module, args, out: seen.append(out.detach()))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager = model(ids)
            traced = conversion_of(model).stats.traces
            attnres_fx.compile(model)
            compiled = model(ids)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(seen[-1], seen[0], rtol=1e-5, atol=1e-5)
        root = model.__dict__["forward"]
        assert isinstance(root, routing.WholeCallRouter) and root.whole is whole
        # One Dynamo capture: of the whole call, or of each block's rewritten graph (traced by torch.fx
        # before compile, and kept).
        stats = conversion_of(model).stats
        assert (stats.captures, stats.traces) == ((1 if whole else 3), traced)
        assert not any(router._dynamo_graphs for router in routing.routers(model) if router is not root), \
            "no block's own forward captured and rewritten: the rewritten block graphs are compiled"
        if not whole:
            # Dynamo's guards on the sublayers the compiled block graphs inline: a hook added now fires.
            model.blocks[2].mlp.register_forward_hook(lambda module, args, out: out * 2)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hooked = model(ids)
                attnres_fx.compile(model, backend="eager")
                torch.testing.assert_close(hooked, model(ids), rtol=1e-5, atol=1e-5)
            assert not torch.allclose(hooked, compiled)
        attnres_fx.remove(model)
        assert "forward" not in model.__dict__ and not routing.routers(model)


@cold_compile
@pytest.mark.slow
def test_compiled_block_graphs_run_the_two_phase_schedule_without_gradients(monkeypatch):
    """Block by block under Inductor (a model whose own forward is no single graph), a call without
    gradients compiles each block graph in the two-phase schedule, as the TorchDynamo graphs of the other
    paths are: the graph Dynamo captures holds phase 1's ops, nothing is traced or rewritten again, and the
    result is the eager route's (1e-5: Inductor reorders fp32 sums). A call with gradients compiles the
    per-site graph. A hook put on a site's module afterwards is honoured (Dynamo guards on it)."""
    captured = []
    backend = routing.LayerRouter._block_graph_backend
    monkeypatch.setattr(routing.LayerRouter, "_block_graph_backend",
                        lambda self, gm, inputs: captured.append(gm) or backend(self, gm, inputs))
    ids = example_ids(tiny().config)
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(layers=4, cls=Chatty), (ids,), block_size=4), std=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            eager = model(ids)
        with_grad = model(ids)
        stats = copy.copy(conversion_of(model).stats)
        attnres_fx.compile(model)
        with torch.no_grad():
            compiled = model(ids)
        assert not model.__dict__["forward"].whole
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        after = conversion_of(model).stats
        assert (after.traces, after.rewrites) == (stats.traces, stats.rewrites)
        assert [_runs_phase1(gm) for gm in captured] == [True] * 4
        torch.testing.assert_close(model(ids), with_grad, rtol=1e-5, atol=1e-5)
        assert [_runs_phase1(gm) for gm in captured[4:]] == [False] * 4
        model.blocks[2].mlp_res.register_forward_hook(lambda module, args, out: out * 2)
        with torch.no_grad():
            hooked = model(ids)
            attnres_fx.compile(model, backend="eager")
            torch.testing.assert_close(hooked, model(ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hooked, compiled)


def _runs_phase1(gm):
    """Whether a graph TorchDynamo captured holds ops of the two-phase schedule's phase 1."""
    return any("in phase1" in (node.meta.get("stack_trace") or "") for node in gm.graph.nodes)


def _variants(model):
    return [variant for router in routing.routers(model) if isinstance(router, routing.LayerRouter)
            for routes in router._shapes.values() for variant in routes.variants.values()]


def test_a_block_graph_in_the_two_phase_schedule_computes_the_per_site_graph():
    """The two-phase form of each rewritten block graph (what Inductor compiles for calls without
    gradients), run eagerly, returns what the per-site graph returns (1e-5: the softmax over the completed
    blocks and the partial regrouped, fp32 sums in another order). Structural: one phase 1 per set of
    completed blocks the block's sites read, a phase 2 per site (a site with no completed block keeps its
    call), made from the rewritten graph without a trace or a rewrite. A hook put on a site's module
    afterwards is honoured: that block's sites run as modules again."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(layers=4), block_size=4), std=1.0)
    ids = example_ids(model.config)
    with torch.no_grad():
        per_site = model(ids)
        stats = copy.copy(conversion_of(model).stats)
        for variant in _variants(model):
            calls = variant.graph_module.graph.find_nodes(op="call_function", target=run_site)
            groups = {(c.args[1], tuple(c.args[2:-1])) for c in calls if c.args[1] or len(c.args) > 3}
            variant.forward = variant.two_phase_forward()
            graph = variant.graph_module.meta[graphs.TWO_PHASE_FORWARD][1].graph
            assert len(graph.find_nodes(op="call_function", target=phase1_at)) == len(groups)
            assert (len(graph.find_nodes(op="call_function", target=phase2_at))
                    + len(graph.find_nodes(op="call_function", target=run_site))) == len(calls)
        assert any(len(g.find_nodes(op="call_function", target=phase2_at))
                   > len(g.find_nodes(op="call_function", target=phase1_at))
                   for g in (v.graph_module.meta[graphs.TWO_PHASE_FORWARD][1].graph for v in _variants(model))), \
            "some phase 1 serves two sites"
        torch.testing.assert_close(model(ids), per_site, rtol=1e-5, atol=1e-5)
        assert conversion_of(model).stats == stats, "no trace, no rewrite"
        model.blocks[2].mlp_res.register_forward_hook(lambda module, args, out: out * 2)
        hooked = model(ids)
        for variant in _variants(model):
            variant.forward = compiled_forward(variant.graph_module.graph, "per-site")
        torch.testing.assert_close(hooked, model(ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hooked, per_site)


def test_blocks_of_one_kind_share_their_trace_and_their_rewritten_graphs():
    """Conversion and first call cost what the kinds of block cost, not the depth: one trace for the six
    identical blocks, and one rewritten graph per place in a stream block (12 sites, blocks of 4 sites:
    the first layer, a layer starting a stream block, a layer in the middle of one, the last)."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(layers=6), block_size=4))
    ids = example_ids(model.config)
    model(ids)
    assert len(conversion_of(model).traces) == 1
    routers = routing.routers(model)
    graphs = [router.rewritten[-1] for router in routers]
    assert len({id(graph) for graph in graphs}) == 4
    assert graphs[1] is graphs[3] and graphs[2] is graphs[4]
    whole = attnres_fx.attnresify(tiny(layers=6), block_size=4, route="model")
    whole.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(ids), whole(ids), **FUSED_NORMS)


class BlockOutput(dict):
    """A block result that is a dict subclass, as transformers' ``ModelOutput`` is."""


class RecordBlock(Rewired):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return BlockOutput(hidden=x + self.mlp(self.ln2(x)))


class AttentionWithWeights(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return self.attn(x), None


class ConcatenatingBlock(torch.nn.Module):
    """Builds its result as T5's layers do: ``(h,) + attention_output[1:]``, a tuple whose length a trace
    with the attention as a call does not know."""

    def __init__(self, block):
        super().__init__()
        self.ln1, self.ln2, self.mlp = block.ln1, block.ln2, block.mlp
        self.attn = AttentionWithWeights(block.attn)

    def forward(self, x):
        attention_output = self.attn(self.ln1(x))
        x = x + attention_output[0]
        x = x + self.mlp(self.ln2(x))
        return (x,) + attention_output[1:]


class UnwrappingModel(TinyTransformer):
    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            out = block(x)
            x = out["hidden"] if isinstance(out, dict) else out[0]
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("wrap, block_graph", [(RecordBlock, True), (ConcatenatingBlock, False)],
                         ids=["dict-subclass result", "concatenated tuple result"])
def test_a_block_result_of_any_container_keeps_its_type_and_its_values(wrap, block_graph):
    """A block returning a dict subclass runs its block graph and returns its own type again (fx returns
    any dict as a plain one); a block returning a tuple concatenated with a sublayer's result runs on
    TorchDynamo, which sees the tuple's length. Either way, the values of the model route."""
    torch.manual_seed(0)
    model = UnwrappingModel(dim=32, num_layers=3, num_heads=4).eval()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = wrap(block)
    layer, whole = both_routes(model)
    ids = example_ids(layer.config)
    torch.testing.assert_close(layer(ids), whole(ids), **FUSED_NORMS)
    router = routing.routers(layer)[1]
    assert [routes.traced is not None for routes in router._shapes.values()] == [block_graph]
    with torch.no_grad():
        result = layer.blocks[0](layer.embed(ids))
    assert type(result) is (BlockOutput if wrap is RecordBlock else tuple)


def test_a_stream_continues_in_another_process_from_its_block_sums():
    """What an inference engine's pipeline stages do (vLLM's, under ``torch.inference_mode()``, where a view
    does not know its base): the first stage's last block leaves the completed block sums and the partial
    sum on its carrier (``routing.stream_state``); the next stage holds only its own blocks (the others
    replaced by placeholders) and continues the stream from a tensor of its own with that state
    (``routing.enter_stream``). The result is the whole model's."""
    torch.manual_seed(0)
    model = attnres_fx.attnresify(TinyTransformer(TinyConfig(dim=32, num_layers=4)).eval(), block_size=3)
    randomise_pseudo_queries(model)
    ids = example_ids(model.config)
    planned = conversion_of(model).plan.streams[0]
    with torch.inference_mode():
        expected = model(ids)
        carrier = model.blocks[1](model.blocks[0](model.embed(ids)))
        blocks, partial = routing.stream_state(model, 0, carrier)
        assert len(blocks) == planned.completed_before(planned.layer("blocks.2").start)
        second = copy.deepcopy(model)
        second.blocks[0] = second.blocks[1] = torch.nn.Identity()
        assert [routing.is_routed(block) for block in second.blocks] == [False, False, True, True]
        received = carrier.clone()
        routing.enter_stream(second, 0, received, planned.layer("blocks.2").start,
                             [b.clone() for b in blocks], partial.clone())
        x = received
        for block in second.blocks[2:]:
            x = block(x)
        torch.testing.assert_close(second.head(second.ln_f(x)), expected, rtol=0, atol=0)
    with pytest.raises(attnres_fx.RoutingError, match="carries no AttnRes state"):
        routing.stream_state(model, 0, carrier.clone())
