"""The PyTorch formulations of one aggregation: equal forward, equal gradients, and which implementation
eager calls run."""

import pytest
import torch
from torch import nn

from attnres_fx import BlockAttnRes
from attnres_fx.op import aggregation
from attnres_fx.op.kernels import cpu
from attnres_fx.testing.reference import block_attn_res

SMALL = (2, 1, 32)             # decoding: one token per sequence
LARGE = (2, 256, 64)           # prefill / training: past aggregation.STACKED_MAX_ELEMENTS
WIDE = (2, 512, 32)            # the same size per source with the small width
FORMULATIONS = {"fusable": aggregation.fusable, "stacked": aggregation.stacked}


def _module(dim, seed=0):
    """A BlockAttnRes with random pseudo-query and key-norm weights (the zero init would hide errors)."""
    torch.manual_seed(seed)
    module = BlockAttnRes(dim)
    nn.init.normal_(module.proj.weight, std=0.5)
    nn.init.uniform_(module.norm.weight, 0.5, 1.5)
    return module


def _sources(shape, k, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * (i + 1)).to(dtype).requires_grad_() for i in range(k)]


@pytest.mark.parametrize("name", FORMULATIONS)
@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("preserve_scale", [False, True])
def test_every_formulation_matches_the_reference(name, k, preserve_scale):
    module = _module(SMALL[-1])
    sources = _sources(WIDE, k)
    got = FORMULATIONS[name](module.proj.weight, module.norm.weight, sources, eps=module.eps,
                             preserve_scale=preserve_scale)
    want = block_attn_res(sources[:-1], sources[-1], module.proj, module.norm, preserve_scale=preserve_scale)
    # fp32 throughout, summed in different orders: round-off only, relative to the output's magnitude.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preserve_scale", [False, True])
def test_the_hand_written_backward_equals_autograd(dtype, preserve_scale):
    module = _module(LARGE[-1])
    sources = _sources(LARGE, 4, dtype)
    out = aggregation.fusable(module.proj.weight, module.norm.weight, sources, eps=module.eps,
                              preserve_scale=preserve_scale)
    grad = torch.linspace(-1, 1, LARGE[-1]).expand(LARGE).to(dtype)
    want = torch.autograd.grad(out, [module.proj.weight, module.norm.weight, *sources], grad)
    source_grads, query_grad = aggregation.reference_backward(grad, [s.detach() for s in sources], module.proj.weight,
                                                              module.norm.weight, module.eps, preserve_scale)
    got = [(query_grad * module.norm.weight).unsqueeze(0), query_grad * module.proj.weight[0], *source_grads]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2      # bf16: the gradients are rounded to bf16
    for w, g in zip(want, got):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=tolerance, atol=tolerance * w.float().abs().max().item())


def _count_calls(monkeypatch):
    calls = []
    for name in ("stacked", "fusable"):
        original = getattr(aggregation, name)
        monkeypatch.setattr(aggregation, name, lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
    for namespace, name in ((torch.ops.attnres, "aggregate"), (torch.ops.attnres_cpu, "aggregate")):
        original = getattr(namespace, name)
        monkeypatch.setattr(namespace, name, lambda *a, _o=original, _n=namespace.name: calls.append(_n) or _o(*a))
    # The C++ operator's own Python entry (what eager calls take for plain tensors), counted as the operator.
    entry = cpu.aggregate_op()
    if entry:
        monkeypatch.setattr(cpu, "aggregate_op", lambda: lambda *a: calls.append("attnres_cpu") or entry(*a))
    return calls


@pytest.mark.skipif(not cpu.available(), reason=f"the C++ kernel: {cpu.unavailable_reason()}")
def test_eager_runs_the_cpu_operator_with_and_without_a_gradient(monkeypatch):
    module = _module(SMALL[-1])
    calls = _count_calls(monkeypatch)
    module(*_sources(SMALL, 3))
    with torch.no_grad():
        module(*_sources(SMALL, 3))
        module(*_sources(WIDE, 3))
    module(*_sources(SMALL, 2)[:1], torch.randn(1, 1, SMALL[-1]))        # mixed shapes: broadcasting
    # The C++ operator, its autograd in C++ too; sources it refuses (mixed shapes) go to fusable.
    assert calls == ["attnres_cpu", "attnres_cpu", "attnres_cpu", "attnres_cpu", "fusable"]


def test_without_the_kernel_eager_picks_stacked_for_small_sources_and_the_operator_for_training(monkeypatch):
    monkeypatch.setattr(cpu, "available", lambda: False)
    module = _module(SMALL[-1])
    calls = _count_calls(monkeypatch)
    module(*_sources(SMALL, 3))
    module(*_sources(WIDE, 3))
    with torch.no_grad():
        module(*_sources(WIDE, 3))
    module(*_sources(SMALL, 1))                    # one source: no stacking to do
    # The operator's CPU implementation is then the PyTorch formulation (fusable, reference_backward).
    assert calls == ["stacked", "attnres", "fusable", "fusable", "attnres", "fusable"]


def test_graph_captures_see_the_fusable_form():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.res = _module(8)

        def forward(self, a, b):
            return self.res(a, b)

    code = torch.fx.symbolic_trace(Holder()).code
    assert "stack" not in code and "attnres" not in code and "vector_norm" in code
