"""The shapes a pre-norm residual stream takes in real code: each is found whole, and converted exactly.

Every hand-written model goes three ways: detection under torch.fx and torch.export (the sites and their
kinds), the live conversion (the sites injected), and exactness: with ``preserve_scale=True`` at zero init
the live model and the explicit fx / export graphs compute the original function, and under random
pseudo-queries the explicit graphs compute what the live model does.
"""

import copy

import pytest
import torch

import attnres_fx
import toy_models as T
from attnres_fx.testing import randomise_pseudo_queries
from conftest import cold_compile, converted

# preserve_scale=True multiplies each zero-init aggregate (the mean of its sources) back to their sum,
# the original stream: exact in real arithmetic; fp32 reassociation of the sums costs ~1e-7.
EXACT = 1e-5


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


def site_kinds(detection):
    return [site.kind for stream in detection.streams for site in stream.sites]


def module_of(graph, node):
    return graph.get_submodule(node.target) if node.op == "call_module" else None


def check_everywhere(model, expected, tracers=("fx", "export"), block_size=2):
    """Detection finds the ``expected`` site kinds under each tracer and the live conversion injects one
    aggregation per sublayer; every route is exact at zero init and they agree under random queries."""
    ids = T.make_inputs(seq=T.LENGTH)
    model.eval()
    for tracer in tracers:
        detection = attnres_fx.detect(model, (ids,), tracer=tracer)
        assert site_kinds(detection) == expected, tracer
        assert not detection.unconverted, tracer
    new = converted(model, ids, block_size=block_size, preserve_scale=True)
    assert [s.kind for s in attnres_fx.sites(new)] == [k for kind in expected for k in kind.split("+")] + ["final"]
    with torch.no_grad():
        original = model(ids)
        assert relative(new(ids), original) < EXACT
        graphs = {tracer: attnres_fx.rewrite(new, (ids,), tracer=tracer) for tracer in tracers}
        for tracer, graph in graphs.items():
            assert relative(graph(ids), original) < EXACT, tracer
        randomise_pseudo_queries(new)
        live = new(ids)
        assert relative(live, original) > 1e-3, "random pseudo-queries must move the output"
        for tracer, graph in graphs.items():
            assert relative(graph(ids), live) < EXACT, tracer
    return new


# -- 1. shape-only ops on the stream -------------------------------------------------------------------

def test_a_stream_reshaped_between_sites_is_one_stream():
    """The MLP half of each layer runs on ``[batch * seq, d]``: reshape/view in one layer, flatten/
    unflatten/contiguous in the other. Sources of both shapes are aggregated in each site's shape."""
    torch.manual_seed(0)
    model = T.LayerStack([T.ReshapedMLPLayer("reshape"), T.ReshapedMLPLayer("flatten")])
    new = check_everywhere(model, ["attn", "mlp"] * 2, block_size=1)
    graph = attnres_fx.rewrite(new, (T.make_inputs(),), tracer="fx")
    reshapes = [n for n in graph.graph.nodes if n.meta.get("attnres", {}).get("role") == "layout"]
    assert reshapes, "sources of the other layout are reshaped before they are aggregated"
    assert all(n.meta["nn_module_stack"] for n in reshapes), "new nodes keep their provenance"


def test_reshapes_of_the_feature_dimension_break_the_stream():
    """``x.view(b, t * d)`` merges the feature dimension: no longer the same stream."""
    class MergeFeatures(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(T.ReshapedMLPLayer("reshape") for _ in range(2))

        def forward(self, x):
            b, t, d = x.shape
            x = self.layers[0](x)
            x = x.view(b, t * d).view(b, t, d)
            return self.layers[1](x)

    detection = attnres_fx.detect(MergeFeatures(), (torch.randn(2, T.LENGTH, T.DIM),), tracer="export")
    assert [len(stream.sites) for stream in detection.streams] == [2, 2]


# -- 2. parallel branches summed before the add: one query per sublayer ---------------------------------

def test_pre_summed_parallel_branches_are_two_sublayers():
    """``x + (attn(u) + mlp(u))`` and ``m = attn(u); m += mlp(u); x + m``, one shared norm: one site,
    an attention and an MLP sublayer, the norm duplicated per branch."""
    torch.manual_seed(0)
    check_everywhere(T.LayerStack([T.PreSummedLayer(in_place=True), T.PreSummedLayer(in_place=False)]),
                     ["attn+mlp"] * 2)


def test_a_mixture_of_experts_is_one_mlp_sublayer():
    """Routed experts (router softmax, top-k, gather, index_add) plus a shared expert: kind ``mlp`` and
    one pseudo-query, whether the MoE sums them (layer 0) or the layer adds them to the stream one by one
    next to attention (layer 1: ``x + attn(u) + routed(u) + shared(u)``)."""
    torch.manual_seed(0)
    new = check_everywhere(T.LayerStack([T.MoELayer(parallel=False), T.MoELayer(parallel=True)]),
                           ["attn", "mlp", "attn+mlp"])
    assert [s.name for s in attnres_fx.sites(new)] == [
        "layers.0.attn_res", "layers.0.mlp_res", "layers.1.attn_res", "layers.1.mlp_res", "final_res"]


# -- 3. dropout and casts ------------------------------------------------------------------------------

def test_dropout_and_dtype_round_trips_on_branches_and_stream():
    torch.manual_seed(0)
    check_everywhere(T.LayerStack([T.DropoutLayer(), T.DropoutLayer()]), ["attn", "mlp"] * 2)


def test_train_mode_dropout_keeps_every_site():
    """In train mode dropout is no identity, yet the stream goes on through it: all 4 sites, under every
    capture. A dropout on a branch output stays in the branch (same random mask for the same seed: exact);
    a dropout on the stream between sites is applied to the aggregate the next site reads."""
    torch.manual_seed(0)
    model = T.LayerStack([T.DropoutLayer(), T.DropoutLayer()]).train()
    ids = T.make_inputs()
    for tracer in ("fx", "export", "dynamo"):
        assert site_kinds(attnres_fx.detect(model, (ids,), tracer=tracer)) == ["attn", "mlp"] * 2, tracer
    new = converted(model, ids, preserve_scale=True)
    assert len(attnres_fx.sites(new)) == 5
    graph = attnres_fx.rewrite(new, (ids,), tracer="fx")
    dropped = [n for n in graph.graph.nodes if isinstance(module_of(graph, n), torch.nn.Dropout)
               and isinstance(module_of(graph, n.args[0]), attnres_fx.BlockAttnRes)]
    assert len(dropped) == 2, "in each layer the stream's dropout reads the aggregate of the MLP site"

    class BranchDropout(T.DropoutLayer):
        def forward(self, x):
            x = x + self.drop(self.attn(self.ln1(x)))
            return x + self.drop(self.mlp(self.ln2(x)))

    torch.manual_seed(0)
    model = T.LayerStack([BranchDropout(), BranchDropout()]).train()
    new = converted(model, ids, preserve_scale=True)
    with torch.no_grad():
        torch.manual_seed(7)
        expected = model(ids)
        torch.manual_seed(7)
        assert relative(new(ids), expected) < EXACT


def test_parallel_layer_with_hand_written_rms_norms_is_the_same_under_export_and_fx():
    """Casts in a hand-written RMSNorm (``x.to(float32) ... .to(dtype)``) that torch.export records as
    no-op casts: two sublayers per site under both tracers, the same result."""
    torch.manual_seed(0)
    check_everywhere(T.LayerStack([T.ParallelManualNormLayer(), T.ParallelManualNormLayer()]), ["attn+mlp"] * 2)


# -- 4. state-space and linear-attention mixers --------------------------------------------------------

def test_hybrid_of_mixers_attention_and_experts():
    """Linear attention as a recurrence (outputs stacked from a list, copied into a buffer, written with
    index_put_), in cumulative-sum form, a custom-op scan, attention, MLP and MoE sublayers. In the
    copy_ and index_put_ mixers the only path from the input to the output goes through those writes."""
    torch.manual_seed(0)
    model = T.LayerStack([
        T.MixerLayer(T.RecurrentLinearAttention("stack"), T.MoE()),
        T.MixerLayer(T.RecurrentLinearAttention("copy")),
        T.MixerLayer(T.RecurrentLinearAttention("index_put")),
        T.MixerLayer(T.ChunkedLinearAttention()),
        T.MixerLayer(T.CustomScanMixer()),
        T.AttentionLayer(T.MoE()),
    ])
    check_everywhere(model, ["mixer", "mlp", "mixer", "mixer", "mixer", "mixer", "attn", "mlp"])


def test_a_pure_state_space_model_is_one_stream_of_mixers():
    """Selective scans that write each step into a preallocated buffer (``y[:, t] = ...``), no MLP.
    (fx cannot trace item assignment: torch.export and the live route only.)"""
    torch.manual_seed(0)
    check_everywhere(T.LayerStack([T.MixerLayer(T.SelectiveScan()) for _ in range(3)]), ["mixer"] * 3,
                     tracers=("export",))


def test_a_residual_cast_apart_from_the_branch_input_is_still_a_site():
    """``residual = x.to(float32); residual + mixer(norm(x))``: the cast and the branch are siblings."""
    torch.manual_seed(0)
    check_everywhere(T.LayerStack([T.CastResidualLayer(T.SelectiveScan()), T.CastResidualLayer(T.mlp()),
                                   T.MixerLayer(T.SelectiveScan())]), ["mixer", "mlp", "mixer"],
                     tracers=("export",))


@pytest.mark.slow
def test_hugging_face_mamba_converts_exactly_and_generates_the_same_tokens():
    """Mamba: residual_in_fp32 casts the residual operand, and its scan is captured as the generic
    associative scan (slices, vmap and concatenations) under TorchDynamo."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2,
                                      expand=2, conv_kernel=4)
    model = transformers.MambaForCausalLM(config).eval()
    ids = T.make_inputs(vocab=128, seq=12)
    original = copy.deepcopy(model)
    attnres_fx.attnresify(model, (ids,), preserve_scale=True)
    assert [s.name for s in attnres_fx.sites(model)] == [
        "backbone.layers.0.mixer_res", "backbone.layers.1.mixer_res", "backbone.final_res"]
    with torch.no_grad():
        assert relative(model(ids).logits, original(ids).logits) < EXACT
    prompt = ids[:, :6]
    assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False),
                       original.generate(prompt, max_new_tokens=5, do_sample=False))


def test_without_example_inputs_a_scan_that_fx_cannot_trace_asks_for_them(untouched):
    """fx symbolic tracing (the capture without example inputs) cannot trace ``y[:, t] = ...``: the error
    says so and asks for example inputs, with which the same model converts (the test above)."""
    model = T.LayerStack([T.MixerLayer(T.SelectiveScan()) for _ in range(2)])
    check = untouched(model, T.make_inputs())
    with pytest.raises(attnres_fx.TraceError, match=r"(?s)item assignment.*pass example_inputs"):
        attnres_fx.attnresify(model)
    check()


# -- 6. a model whose residual adds are all inside torch.nn modules ------------------------------------

def test_torch_transformer_encoder_is_traced_through():
    """fx keeps torch.nn modules as leaves; the ones holding norms are traced through, so all three
    captures see the encoder's four residual adds, and a conversion without example inputs works."""
    torch.manual_seed(0)
    model = T.TorchTransformerEncoder()
    check_everywhere(model, ["attn", "mlp"] * 2)
    new = attnres_fx.attnresify(copy.deepcopy(model).eval(), preserve_scale=True)
    ids = T.make_inputs()
    with torch.no_grad():
        assert relative(new(ids), model.eval()(ids)) < EXACT
    assert torch.backends.mha.get_fastpath_enabled(), "tracing restores torch's fast-path setting"


@cold_compile
@pytest.mark.slow
def test_inductor_route_on_a_reshaped_stream():
    """attnres_fx.compile emits the aggregations with their weights as graph inputs (the other emitter);
    the reshapes between layouts are the same, and the compiled model computes what eager does (1e-5:
    Inductor reorders the fp32 sums)."""
    torch.manual_seed(0)
    model = T.LayerStack([T.ReshapedMLPLayer("reshape"), T.ReshapedMLPLayer("flatten")]).eval()
    ids = T.make_inputs()
    new = randomise_pseudo_queries(converted(model, ids, block_size=1))
    with torch.no_grad():
        eager = new(ids)
        attnres_fx.compile(new)
        assert relative(new(ids), eager) < EXACT
