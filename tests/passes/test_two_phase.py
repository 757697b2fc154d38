"""The two-phase schedule pass: exact against the per-site form (forward and gradients), its graph
structure, and its failures."""

import copy
import math

import pytest
import torch
from torch import fx, nn

import attnres_fx
from attnres_fx.op.module import BlockAttnRes
from attnres_fx.models import TinyConfig, TinyTransformer, example_ids
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.passes.two_phase import TwoPhaseSchedule, apply_two_phase, can_apply_two_phase
from conftest import cold_compile

ALL_SITES = 100          # a block size larger than any model here: one block covers every site


def _rewritten(parallel=False, block_size=2, preserve_scale=False, num_layers=3, seed=0):
    """The explicit graph of a converted TinyTransformer with random non-zero pseudo-queries and key-norm
    weights."""
    torch.manual_seed(seed)
    cfg = TinyConfig(dim=32, num_layers=num_layers, num_heads=2, parallel=parallel)
    ids = example_ids(cfg, batch=2, seq=12)
    model = attnres_fx.attnresify(TinyTransformer(cfg), (ids,), block_size=block_size,
                                  preserve_scale=preserve_scale)
    randomise_pseudo_queries(model, seed=seed, std=0.5)
    return attnres_fx.rewrite(model, (ids,)), ids


def _grads(module):
    # A site whose only source is the embedding has a zero gradient per site and none in phase-2-alone.
    return {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in module.named_parameters()}


def _loss(module, ids):
    return module(ids).square().mean()


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("block_size", [1, 2, 3, ALL_SITES], ids=["S1", "S2", "S3", "one_block"])
def test_matches_the_per_site_form_forward_and_gradients(parallel, block_size):
    per_site, ids = _rewritten(parallel, block_size, preserve_scale=block_size == 2)
    two_phase = apply_two_phase(copy.deepcopy(per_site))
    _loss(per_site, ids).backward()
    _loss(two_phase, ids).backward()
    with torch.no_grad():
        torch.testing.assert_close(two_phase(ids), per_site(ids), rtol=1e-5, atol=1e-5)
    want, got = _grads(per_site), _grads(two_phase)
    assert list(got) == list(want)
    queries = [name for name in want if name.endswith("proj.weight")]
    attending = [f"{s.name}.proj.weight" for s in attnres_fx.sites(per_site) if s.num_sources > 1]
    assert attending and all(torch.count_nonzero(want[name]) for name in attending), \
        "the pseudo-query of every site with more than one source must get a gradient"
    for name in [*queries, "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc1.weight"]:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("block_size", [1, 2, ALL_SITES])
def test_structure_one_phase1_per_block_one_phase2_per_site(block_size):
    gm, ids = _rewritten(block_size=block_size)
    keys, params = list(gm.state_dict()), [id(p) for p in gm.parameters()]
    names = [s.name for s in attnres_fx.sites(gm)]
    num_sites = sum(1 for s in attnres_fx.sites(gm) if s.kind != "final")      # 6: 3 layers x 2
    result = TwoPhaseSchedule()(gm)
    assert result.modified and result.graph_module is gm
    nodes = list(gm.graph.nodes)
    phase1 = [n.name for n in nodes if n.meta.get("attnres", {}).get("role") == "phase1"]
    # Commits happen at sites 0, S, 2S, ...: every later site (and the final one) reads 1..ceil(M/S).
    blocks = math.ceil(num_sites / min(block_size, num_sites))
    assert phase1 == [f"attnres_phase1_block{k}" for k in range(1, blocks + 1)]
    phase2 = [n.name for n in nodes if n.meta.get("attnres", {}).get("role") == "phase2"]
    assert phase2 == ["attnres_phase2_" + name.replace(".", "_") for name in names]
    calls = [n for n in nodes if n.op == "call_module"]
    assert not [n for n in calls if isinstance(gm.get_submodule(n.target), BlockAttnRes)]
    gm.graph.lint()
    assert list(gm.state_dict()) == keys
    assert [id(p) for p in gm.parameters()] == params
    assert [s.name for s in attnres_fx.sites(gm)] == names
    assert TwoPhaseSchedule.preserves_computation is True
    assert gm.meta["attnres"]["schedule"] == "two_phase"


def test_checkpoints_load_into_either_form():
    per_site, ids = _rewritten(block_size=2)
    two_phase = apply_two_phase(_rewritten(block_size=2, seed=1)[0])
    two_phase.load_state_dict(per_site.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(two_phase(ids), per_site(ids), rtol=1e-5, atol=1e-5)
        per_site.load_state_dict(two_phase.state_dict(), strict=True)


def test_bf16_keeps_dtype_and_fp32_softmax():
    per_site, ids = _rewritten(block_size=2)
    per_site = per_site.to(torch.bfloat16)
    two_phase = apply_two_phase(copy.deepcopy(per_site))
    with torch.no_grad():
        want, got = per_site(ids), two_phase(ids)
    assert got.dtype == torch.bfloat16
    # Same fp32 aggregates, rounded to bf16 at each site: a few bf16 ulps after 3 layers at most.
    assert (got.float() - want.float()).abs().max() <= 2 ** -5 * want.float().abs().max()


def test_rejects_a_model_that_was_not_rewritten(untouched):
    cfg = TinyConfig(dim=16, num_layers=2, num_heads=2)
    traced = fx.symbolic_trace(TinyTransformer(cfg))
    check = untouched(traced, example_ids(cfg))
    code = traced.code
    assert not can_apply_two_phase(traced) and not can_apply_two_phase(TinyTransformer(cfg))
    with pytest.raises(ValueError, match="attnres_fx.rewrite"):
        apply_two_phase(traced)
    assert traced.code == code
    check()
    with pytest.raises(ValueError, match="GraphModule"):
        apply_two_phase(TinyTransformer(cfg))


def test_rejects_a_second_application():
    gm, _ = _rewritten()
    assert can_apply_two_phase(gm)
    apply_two_phase(gm)
    assert not can_apply_two_phase(gm)
    code = gm.code
    with pytest.raises(ValueError, match="already"):
        apply_two_phase(gm)
    assert gm.code == code


@cold_compile
@pytest.mark.slow
def test_compiles_with_inductor_fullgraph():
    gm, ids = _rewritten(block_size=2)
    gm = apply_two_phase(gm)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(gm, fullgraph=True)(ids), gm(ids), rtol=1e-5, atol=1e-5)


def _phase_inputs(num_blocks, sites, shape, dtype, seed=0):
    torch.manual_seed(seed)
    dim = shape[-1]
    projs = [nn.Linear(dim, 1, bias=False) for _ in range(sites)]
    norms = [nn.RMSNorm(dim, eps=1e-6) for _ in range(sites)]
    for proj, norm in zip(projs, norms):
        nn.init.normal_(proj.weight, std=2.0 / dim ** 0.5)
        nn.init.uniform_(norm.weight, 0.5, 1.5)
    blocks = tuple((torch.randn(shape) * (1 + i)).to(dtype) for i in range(num_blocks))
    partials = [torch.randn(shape).to(dtype) for _ in range(sites)]
    return projs, norms, blocks, partials


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp", "pytorch"])
@pytest.mark.parametrize("num_blocks, sites, shape", [(1, 1, (2, 1, 7)), (4, 3, (3, 1, 1000)), (8, 4, (2, 33, 64)),
                                                      (2, 2, (1, 5, 1))])
def test_phase_functions_match_the_reference(monkeypatch, kernel, num_blocks, sites, shape):
    from attnres_fx.op.kernels import cpu
    from attnres_fx.passes.two_phase import phase1, phase2
    from attnres_fx.testing.reference import block_attn_res

    if kernel and not cpu.available():
        pytest.skip(f"the C++ kernel: {cpu.unavailable_reason()}")
    if not kernel:
        monkeypatch.setattr(cpu, "available", lambda: False)
    projs, norms, blocks, partials = _phase_inputs(num_blocks, sites, shape, torch.float32)
    with torch.no_grad():
        states = phase1(tuple(p.weight for p in projs), tuple(n.weight for n in norms), blocks, eps=1e-6)
        for proj, norm, partial, state in zip(projs, norms, partials, states):
            got = phase2(state, proj.weight, norm.weight, partial, blocks[0], eps=1e-6, scale=num_blocks + 1.0)
            want = block_attn_res(list(blocks), partial, proj, norm, preserve_scale=True)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_phase_kernels_bf16_keep_dtype_and_fp32_state():
    from attnres_fx.op.kernels import cpu
    from attnres_fx.passes.two_phase import phase1, phase2

    if not cpu.available():
        pytest.skip(f"the C++ kernel: {cpu.unavailable_reason()}")
    projs, norms, blocks, partials = _phase_inputs(3, 2, (2, 8, 64), torch.bfloat16)
    with torch.no_grad():
        states = phase1(tuple(p.weight for p in projs), tuple(n.weight for n in norms), blocks, eps=1e-6)
        got = phase2(states[1], projs[1].weight, norms[1].weight, partials[1], blocks[0], eps=1e-6, scale=1.0)
    assert all(t.dtype == torch.float32 for t in states[1]) and got.dtype == torch.bfloat16
    want = attnres_fx.op.aggregation.fusable(projs[1].weight, norms[1].weight, [*blocks, partials[1]], eps=1e-6,
                                          preserve_scale=False)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.float().abs().max().item())
