"""Host captures (attnres_fx/routing/host.py): another program's compiler traces a converted model's call whole
as one Dynamo graph and compiles it with its own backend, wrapped by ``rewriting_backend`` (what vLLM's
plugin does). Checked here with Dynamo and eager backends, no inference engine: the host's graph computes
what the converted model computes, also where the host replaced the model's layers by operators that
write their results into tensors allocated for them (vLLM's CPU GEMM); a graph compiled without the
rewrite refuses to run; without a host, a fullgraph compile is still refused; a graph of another
implementation of the converted model (an engine's own classes, vLLM's fused add and norm) is rewritten by
the plan, its stream matched site by site in order."""

import copy

import pytest
import torch
from torch import nn

import attnres_fx
from attnres_fx.conversion import conversion_of
from attnres_fx.models import TinyConfig, TinyTransformer, example_ids
from attnres_fx.routing import host
from attnres_fx.testing import randomise_pseudo_queries

# fp32; the host's graph runs the aggregations as plain ops (attnres_fx.op.aggregation.fusable), the eager
# route the C++ kernel: the same sums in another order. Random pseudo-queries (std 1) make the depth
# softmaxes sharp: each is within 2.2e-5 of the float64 model on logits of size 2, so they agree to 5e-5.
TOLERANCE = dict(rtol=1e-5, atol=5e-5)


@torch.library.custom_op("attnres_test::linear_into", mutates_args=("out",))
def linear_into(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor) -> None:
    out.view(-1, packed.shape[0]).copy_(x @ packed.t())


@linear_into.register_fake
def _(out, x, packed):
    return None


class EngineLinear(nn.Module):
    """An inference engine's replacement of a Linear, as vLLM's CPU build makes it: the weight packed into a
    plain tensor attribute, the product written into a tensor allocated for it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = linear.weight.detach().clone()
        self.bias = linear.bias

    def forward(self, x):
        out = torch.empty((*x.shape[:-1], self.packed.shape[0]), dtype=x.dtype)
        torch.ops.attnres_test.linear_into(out, x.reshape(-1, x.shape[-1]), self.packed)
        return out + self.bias


def converted_model() -> nn.Module:
    torch.manual_seed(0)
    model = attnres_fx.attnresify(TinyTransformer(TinyConfig(dim=32, num_layers=2)).eval(), block_size=2)
    randomise_pseudo_queries(model)
    return model


def hosted(model: nn.Module, backend=None):
    """``model`` compiled by a host: its call (the stream owner's hooks included), fullgraph, dynamic shapes,
    ``backend`` (eager by default) wrapped by the rewrite."""
    host.host(model, "test")
    inner = backend or (lambda graph, example_inputs: graph.forward)
    return torch.compile(model, fullgraph=True, dynamic=True, backend=host.rewriting_backend(lambda: model, inner))


def test_a_host_graph_computes_what_the_converted_model_computes():
    model = converted_model()
    ids = example_ids(model.config, seq=12)
    with torch.no_grad():
        expected = model(ids)
        compiled = hosted(model)
        torch.testing.assert_close(compiled(ids), expected, **TOLERANCE)
        # Another length and batch reuse the graph (dynamic shapes): rewritten once.
        longer = example_ids(model.config, batch=3, seq=20, seed=1)
        torch.testing.assert_close(compiled(longer), model(longer), **TOLERANCE)
    assert conversion_of(model).host_graphs == 1


def test_the_host_graph_reads_the_declared_parameters_as_inputs():
    """What the host's backend gets: one aggregation per site on graph inputs (parameters the host's compiled
    code reads at every call, so an artifact it saves holds none of them), no declarations left, no
    attribute of the graph module."""
    model = converted_model()
    seen = []

    def inspect(graph, example_inputs):
        seen.append(graph)
        return graph.forward
    ids = example_ids(model.config)
    compiled = hosted(model, inspect)
    with torch.no_grad():
        compiled(ids)
        # A pseudo-query changed after compilation changes the result: it is read at each call, not baked in.
        model.get_submodule(attnres_fx.sites(model)[-1].name).proj.weight.add_(1.0)
        torch.testing.assert_close(compiled(ids), model(ids), **TOLERANCE)
    (graph,) = seen
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "fusable"]
    assert len(calls) == len(attnres_fx.sites(model))
    weights = {n for call in calls for n in call.args[:2]}
    assert {n.op for n in weights} == {"placeholder"} and len(weights) == 2 * len(calls)
    assert not graph.graph.find_nodes(op="get_attr")
    assert "site_parameters" not in graph.code


def test_layers_replaced_by_operators_that_write_into_their_arguments():
    """vLLM replaces a model's Linear layers by its own after conversion; on the CPU their product is written
    into a tensor allocated for it, so the residual add's operand is that allocation: the rewrite finds the
    value it reads after the write."""
    model = converted_model()
    ids = example_ids(model.config, seq=12)
    with torch.no_grad():
        expected = model(ids)
        for block in model.blocks:
            block.attn.out = EngineLinear(block.attn.out)
            block.mlp.fc2 = EngineLinear(block.mlp.fc2)
        torch.testing.assert_close(hosted(model)(ids), expected, **TOLERANCE)
    assert conversion_of(model).host_graphs == 1


def test_a_host_graph_compiled_without_the_rewrite_refuses_to_run():
    model = converted_model()
    host.host(model, "test")
    compiled = torch.compile(model.forward, fullgraph=True, backend=lambda graph, example_inputs: graph.forward)
    with torch.no_grad(), pytest.raises(attnres_fx.RoutingError, match="without the AttnRes rewrite"):
        compiled(example_ids(model.config))


def test_without_a_host_a_fullgraph_compile_is_still_refused():
    model = converted_model()
    with torch.no_grad(), pytest.raises(attnres_fx.ForeignCompileError):
        torch.compile(model.forward, fullgraph=True, backend="eager")(example_ids(model.config))


# -- another implementation of the same model: vLLM's own classes ------------------------------------------------

class FusedAddNorm(nn.Module):
    """vLLM's RMSNorm called with the residual: the sublayer's output added to the stream inside the norm."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual=None):
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x


class DeferredBlock(nn.Module):
    """vLLM's decoder layer form: each sublayer's output is handed on beside the stream, and added to it by the
    next norm (the next layer's, or the final one), so that no add sits in the module the plan names."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln1, self.attn = FusedAddNorm(block.ln1), block.attn
        self.ln2, self.mlp = FusedAddNorm(block.ln2), block.mlp

    def forward(self, x, residual):
        if residual is None:
            residual, x = x, self.ln1(x)
        else:
            x, residual = self.ln1(x, residual)
        x, residual = self.ln2(self.attn(x), residual)
        return self.mlp(x), residual


class DeferredTiny(nn.Module):
    """TinyTransformer as an engine writes it, with the converted model's AttnRes modules registered under their
    names and declared when its first block runs."""

    def __init__(self, original: nn.Module, converted: nn.Module):
        super().__init__()
        self.tok_emb, self.pos_emb, self.head = original.tok_emb, original.pos_emb, original.head
        self.blocks = nn.ModuleList(DeferredBlock(block) for block in original.blocks)
        self.ln_f = FusedAddNorm(original.ln_f)
        sites = attnres_fx.sites(converted)
        for site in sites:
            parent, _, attribute = site.name.rpartition(".")
            self.get_submodule(parent).register_module(attribute, converted.get_submodule(site.name))
        self.blocks[0].register_forward_pre_hook(lambda module, args: host.declare(self, sites))

    def forward(self, ids):
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1]))
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual)
        return self.head(self.ln_f(x, residual)[0])


def twins(num_layers: int = 2):
    """A converted TinyTransformer and the same weights as an engine's implementation."""
    torch.manual_seed(0)
    original = TinyTransformer(TinyConfig(dim=32, num_layers=num_layers)).eval()
    engine_copy = copy.deepcopy(original)
    converted = randomise_pseudo_queries(attnres_fx.attnresify(original, block_size=2))
    return converted, DeferredTiny(engine_copy, converted)


def compiled_in_order(engine: nn.Module, plan) -> nn.Module:
    def rewriting(graph, example_inputs):
        return host.rewritten_by(plan, graph, "DeferredTiny", "DeferredTiny (test's graph)", in_order=True).forward
    return torch.compile(engine, fullgraph=True, dynamic=True, backend=rewriting)


def test_another_implementations_graph_computes_what_the_converted_model_computes():
    converted, engine = twins()
    ids = example_ids(converted.config, seq=12)
    torch.manual_seed(0)
    plain = TinyTransformer(TinyConfig(dim=32, num_layers=2)).eval()
    with torch.no_grad():
        compiled = compiled_in_order(engine, attnres_fx.plan_of(converted))
        torch.testing.assert_close(compiled(ids), converted(ids), **TOLERANCE)
        longer = example_ids(converted.config, batch=3, seq=20, seed=1)
        torch.testing.assert_close(compiled(longer), converted(longer), **TOLERANCE)
        assert not torch.allclose(plain(ids), converted(ids), **TOLERANCE), "the pseudo-queries change the logits"


def test_another_implementation_with_other_sites_is_refused():
    converted, _ = twins(num_layers=3)
    _, engine = twins(num_layers=2)
    # Dynamo hands on what the backend raised inside its own error.
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        compiled_in_order(engine, attnres_fx.plan_of(converted))(example_ids(converted.config))
    assert isinstance(raised.value.inner_exception, attnres_fx.StreamMismatchError)
    assert "4 sites, planned 6; first difference at site 4" in str(raised.value.inner_exception)
