"""The Block AttnRes rewrite on the built-in model: equivalence, reference semantics, structure, the pass
contracts, training.

Every check runs on the live converted model (the route its calls take) and, where the graph itself is
the subject, on the explicit graph of :func:`attnres_fx.rewrite`.
"""

import copy
import math
import operator

import pytest
import torch
from torch import nn

import attnres_fx
from attnres_fx.capture.tracers import trace
from attnres_fx.models import NORM_STYLES, TinyConfig, TinyTransformer, example_ids
from attnres_fx.passes import BlockAttnResRewrite, detect_residual_streams, make_plan
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.testing.reference import AttnResTransformer, block_attn_res
from conftest import converted

PRE_NORMS = [n for n in NORM_STYLES if n != "none"]
LAYERS = 3                       # 6 sequential sites: block sizes 1, 2, 3, 4 and 6 all differ
# preserve_scale=True multiplies each zero-init aggregate (the mean of its sources) back to their sum,
# the original stream: exact in real arithmetic; fp32 reassociation of the sums costs ~1e-7.
EXACT = 1e-5


def tiny(norm="layernorm", parallel=False, layers=LAYERS, seed=0, eps=1e-5):
    torch.manual_seed(seed)
    return TinyTransformer(TinyConfig(dim=32, num_layers=layers, num_heads=4, norm=norm,
                                      parallel=parallel, eps=eps)).eval()


def ids(batch=2, seq=12, seed=0):
    return example_ids(TinyConfig(), batch=batch, seq=seq, seed=seed)


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


def run(model, x):
    with torch.no_grad():
        return model(x)


# -- 1. zero-init equivalence -------------------------------------------------------------------------

@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("norm", PRE_NORMS)
def test_preserve_scale_reproduces_the_original_exactly(norm, parallel):
    model = tiny(norm, parallel)
    x = ids()
    new = converted(model, x, block_size=2, preserve_scale=True)
    assert relative(run(new, x), run(model, x)) < EXACT


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("norm", PRE_NORMS)
def test_zero_init_convex_form_matches_up_to_norm_eps(norm, parallel):
    """At zero init each branch sees h / c (c = number of sources). norm(h / c) is norm(h) with eps
    replaced by c^2 eps, a relative change of about (c^2 - 1) eps / (2 var(h)) per norm. The bound
    below takes the largest c and the smallest per-token variance of the stream; the output can
    amplify it through a few layers, hence the factor 10. With eps -> 0 the difference must vanish."""
    x = ids()
    model = tiny(norm, parallel)
    new = converted(model, x, block_size=2)
    largest_c = max(s.num_sources for s in attnres_fx.sites(new))
    with torch.no_grad():
        stream_var = model.embed(x).var(-1, unbiased=False).min()
    bound = 10 * (largest_c ** 2 - 1) * model.config.eps / (2 * stream_var)
    assert relative(run(new, x), run(model, x)) < bound
    no_eps = tiny(norm, parallel, eps=1e-12)
    assert relative(run(converted(no_eps, x, block_size=2), x), run(no_eps, x)) < EXACT


def test_raw_reads_warn_and_only_preserve_scale_is_exact():
    model = tiny("none")
    x = ids()
    with pytest.warns(attnres_fx.AttnResWarning, match=r"6 residual site\(s\) read the stream without a norm"):
        convex = converted(model, x, block_size=2)
    exact = converted(model, x, block_size=2, preserve_scale=True)
    assert relative(run(convex, x), run(model, x)) > 1e-2
    assert relative(run(exact, x), run(model, x)) < EXACT


# -- 2. against the reference implementation ----------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("parallel", [False, True])
def test_matches_reference_with_random_pseudo_queries(block_size, parallel):
    model = tiny("rmsnorm", parallel)
    x = ids()
    new = randomise_pseudo_queries(converted(model, x, block_size=block_size))
    native = AttnResTransformer.from_standard(model, block_size)
    native.load_state_dict({_reference_key(k): v for k, v in new.state_dict().items() if "_res." in k},
                           strict=False)
    explicit = attnres_fx.rewrite(new, (x,))
    # Same fp32 math in a different order (folded norm weight, no stack): 1e-5 relative.
    torch.testing.assert_close(run(new, x), run(native, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(explicit, x), run(new, x), rtol=1e-5, atol=1e-5)
    # The check has teeth: the random pseudo-queries move the output away from plain residuals.
    assert relative(run(new, x), run(model, x)) > 1e-3


def _reference_key(key):
    """``blocks.0.attn_res.proj.weight`` -> ``blocks.0.attn_res_proj.weight``."""
    return key.replace("_res.proj.", "_res_proj.").replace("_res.norm.", "_res_norm.")


def test_reference_follows_the_seed_layer_loop():
    """The reference generalises the seed's per-layer test ``layer % (block_size // 2) == 0`` to
    sublayers; for even block sizes both must agree."""
    model = tiny("rmsnorm", layers=4)
    x = ids()
    for block_size in (2, 4):
        native = AttnResTransformer.from_standard(model, block_size)
        with torch.no_grad():
            for p in native.parameters():
                if p.dim() == 2 and p.shape[0] == 1:
                    p.normal_()
            positions = torch.arange(x.shape[1])
            partial, blocks = native.tok_emb(x) + native.pos_emb(positions), []
            for layer_number, layer in enumerate(native.blocks):
                h = block_attn_res(blocks, partial, layer.attn_res_proj, layer.attn_res_norm)
                if layer_number % (block_size // 2) == 0:
                    blocks.append(partial)
                    partial = None
                attn_out = layer.attn(layer.ln1(h))
                partial = attn_out if partial is None else partial + attn_out
                h = block_attn_res(blocks, partial, layer.mlp_res_proj, layer.mlp_res_norm)
                partial = partial + layer.mlp(layer.ln2(h))
            h = block_attn_res(blocks, partial, native.final_res_proj, native.final_res_norm)
            torch.testing.assert_close(native.head(native.ln_f(h)), native(x))


# -- 3. structure -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size,expected_blocks", [(1, [1, 2, 3, 4, 5, 6]), (2, [1, 1, 2, 2, 3, 3]),
                                                        (4, [1, 1, 1, 1, 2, 2]), (6, [1] * 6)])
def test_sites_blocks_and_source_counts(block_size, expected_blocks):
    new = converted(tiny(), ids(), block_size=block_size)
    found = attnres_fx.sites(new)
    assert [s.kind for s in found] == ["attn", "mlp"] * LAYERS + ["final"]
    assert [s.block for s in found[:-1]] == expected_blocks and found[-1].block is None
    # Site j reads the committed blocks (b_0 included) plus the partial sum, before its own boundary.
    expected_sources = [1] + [(j - 1) // block_size + 2 for j in range(1, 2 * LAYERS)]
    final_sources = (2 * LAYERS - 1) // block_size + 2
    assert [s.num_sources for s in found] == expected_sources + [final_sources]
    assert [s.index for s in found] == list(range(2 * LAYERS + 1))
    assert all(isinstance(new.get_submodule(s.name), attnres_fx.BlockAttnRes) and s.stream == 0 for s in found)


def test_parameter_names_shapes_and_graph_nodes():
    model = tiny()
    x = ids()
    new = converted(model, x, num_blocks=3)
    names = [s.name for s in attnres_fx.sites(new)]
    assert names == [f"blocks.{i}.{k}_res" for i in range(LAYERS) for k in ("attn", "mlp")] + ["final_res"]
    added = {k: tuple(v.shape) for k, v in new.named_parameters() if "_res." in k}
    assert added == {f"{n}.{p}": shape for n in names for p, shape in (("proj.weight", (1, 32)),
                                                                         ("norm.weight", (32,)))}
    assert set(new.state_dict()) == set(model.state_dict()) | set(added)
    gm = attnres_fx.rewrite(new, (x,))
    calls = [n for n in gm.graph.nodes if n.op == "call_module"
             and isinstance(gm.get_submodule(n.target), attnres_fx.BlockAttnRes)]
    assert [c.target for c in calls] == names, "one call per branch plus one final, in execution order"
    assert all(gm.get_submodule(name) is new.get_submodule(name) for name in names), "the model's own modules"
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.add]
    # Only the embedding sum (tok + pos) and the partial sums inside blocks remain; the original
    # stream adds are gone. 3 blocks of 2 sites -> 1 partial add per block.
    assert len(adds) == 1 + 3
    assert all(n.meta["attnres"]["role"] in ("aggregate", "final") for n in calls)
    assert calls[2].meta["nn_module_stack"]["blocks.1.attn_res"][0] == "blocks.1.attn_res"
    assert "blocks.1" in calls[2].meta["nn_module_stack"], "provenance: the owning layer"
    gm.graph.lint()


def test_parallel_layers_are_one_site_with_two_branches():
    found = attnres_fx.sites(converted(tiny(parallel=True), ids(), block_size=1))
    assert [(s.name, s.kind, s.block) for s in found[:4]] == [
        ("blocks.0.attn_res", "attn", 1), ("blocks.0.mlp_res", "mlp", 1),
        ("blocks.1.attn_res", "attn", 2), ("blocks.1.mlp_res", "mlp", 2)]
    assert len(found) == 2 * LAYERS + 1


# -- pass contracts -----------------------------------------------------------------------------------

def _fx_graph(model):
    return trace(model, None, None, "fx").graph_module


def _plan(gm, **options):
    return make_plan(detect_residual_streams(gm), dict(gm.named_modules()), eps=1e-6, **options)


def test_detection_is_read_only_and_immutable():
    gm = _fx_graph(tiny())
    before = str(gm.graph)
    detection = detect_residual_streams(gm)
    assert str(gm.graph) == before and detection.num_sites == 2 * LAYERS
    with pytest.raises(AttributeError):
        detection.streams[0].sites[0].owner = "elsewhere"
    assert isinstance(detection.streams[0].sites[0].branches[0].region, frozenset)


def test_rewrite_replaces_every_original_add_and_records_what_it_did():
    gm = _fx_graph(tiny())
    detection = detect_residual_streams(gm)
    plan = _plan(gm, block_size=2)
    original_adds = {a.name for s in detection.streams for site in s.sites for a in site.adds}
    rewrite = BlockAttnResRewrite(plan, detection)
    assert rewrite(gm).modified
    assert original_adds.isdisjoint(n.name for n in gm.graph.nodes)
    assert [r.site.name for r in rewrite.records] == [s.name for s in plan.sites]
    assert {a for r in rewrite.records for a in r.replaced} == original_adds


@pytest.mark.parametrize("preserve_scale", [False, True])
def test_rewrite_preserves_computation_exactly_when_it_says_so(preserve_scale):
    model = tiny()
    x = ids()
    gm = _fx_graph(model)
    detection = detect_residual_streams(gm)
    rewrite = BlockAttnResRewrite(_plan(gm, block_size=2, preserve_scale=preserve_scale), detection)
    rewrite(gm)
    same = relative(run(gm, x), run(model, x)) < EXACT
    assert rewrite.preserves_computation == preserve_scale == same


def test_rewrite_requires_detection_of_the_same_graph():
    gm_a, gm_b = _fx_graph(tiny()), _fx_graph(tiny())
    detection = detect_residual_streams(gm_a)
    with pytest.raises(attnres_fx.AttnResError, match="do not belong to this graph"):
        BlockAttnResRewrite(_plan(gm_a), detection)(gm_b)


def test_plan_owns_block_sizes_and_refuses_disagreeing_ones():
    gm = _fx_graph(tiny())
    for num_blocks in (1, 2, 4, 8):
        plan = _plan(gm, num_blocks=num_blocks)
        assert plan.block_sizes == (math.ceil(2 * LAYERS / num_blocks),)
    assert _plan(gm, block_size=2, num_blocks=3).block_sizes == (2,)
    with pytest.raises(ValueError, match=r"block_size=1 and num_blocks=1 disagree: stream 0 has 6 residual"):
        _plan(gm, block_size=1, num_blocks=1)


# -- 5. training --------------------------------------------------------------------------------------

def test_training_moves_every_multi_source_query_and_reduces_the_loss():
    new = converted(tiny(), ids(), block_size=2)
    x, target = ids(batch=4, seq=16, seed=3), ids(batch=4, seq=16, seed=4)
    before = {s.name: new.get_submodule(s.name).proj.weight.detach().clone() for s in attnres_fx.sites(new)}
    optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2)
    losses = []
    new.train()
    for _ in range(5):
        loss = nn.functional.cross_entropy(new(x).flatten(0, 1), target.flatten())
        optimizer.zero_grad()
        loss.backward()
        if not losses:
            first = attnres_fx.sites(new)[0]
            query_grad = new.get_submodule(first.name).proj.weight.grad
            assert first.num_sources == 1 and torch.count_nonzero(query_grad) == 0, \
                "the first site's softmax has one source: its query gets no gradient"
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for site in attnres_fx.sites(new):
        moved = not torch.equal(new.get_submodule(site.name).proj.weight, before[site.name])
        assert moved == (site.num_sources > 1), site.name


def test_an_explicit_graph_follows_the_model_it_was_made_from():
    new = converted(tiny(), ids(), block_size=2)
    gm = attnres_fx.rewrite(new, (ids(),))
    randomise_pseudo_queries(new, seed=3)
    torch.testing.assert_close(run(gm, ids()), run(new, ids()), rtol=1e-5, atol=1e-5)
    assert gm.get_parameter("blocks.0.attn.qkv.weight") is new.blocks[0].attn.qkv.weight
    assert not any(n.op == "call_module" and "Router" in str(n.target) for n in gm.graph.nodes)
    assert copy.deepcopy(gm)(ids()).shape == run(new, ids()).shape


def test_checkpointed_regions_open_for_the_rewrite_and_close_again_as_passes():
    """The pipeline's checkpoint passes: opening inlines every checkpointed body (its nodes tagged), the
    rewrite then sees the residual adds inside, closing outlines each region again with the rewrite's
    nodes in it; each pass checks its contract. A graph a capture opened closes again too."""
    from toy_models import NanoGPT

    from attnres_fx.capture.tracers import capture_dynamo
    from attnres_fx.passes.checkpoints import REGION, CloseCheckpoints, OpenCheckpoints

    model = NanoGPT(dropout=0.0, checkpoint=True).train()
    ids_ = torch.randint(0, 64, (2, 8))
    graph_module, _ = capture_dynamo(model, (ids_,), {})          # opened by the capture
    hop = torch.ops.higher_order.tag_activation_checkpoint
    assert not graph_module.graph.find_nodes(op="call_function", target=hop)
    opening = OpenCheckpoints()
    assert not opening(graph_module).modified                     # nothing left to open ...
    assert len(opening.regions) == len(model.h)                  # ... but the capture's regions are known
    assert any(REGION in node.meta for node in graph_module.graph.nodes)
    result = CloseCheckpoints(opening)(graph_module)
    assert result.modified and len(graph_module.graph.find_nodes(op="call_function", target=hop)) == len(model.h)
    assert not any(REGION in node.meta for node in graph_module.graph.nodes) and REGION not in graph_module.meta
