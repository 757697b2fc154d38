"""The three formulations of one aggregation: equal forward, equal gradients, and which one runs when."""

import pytest
import torch
from torch import nn

from attnres_fx import BlockAttnRes, aggregation
from attnres_fx.testing.reference import block_attn_res

SMALL = (2, 1, 32)             # decoding: one token per sequence
LARGE = (2, 256, 64)           # prefill / training: past aggregation.STACKED_MAX_ELEMENTS
WIDE = (2, 512, 32)            # the same size per source with the small width
FORMULATIONS = {"fusable": aggregation.fusable, "stacked": aggregation.stacked,
                "per_source": lambda p, n, s, **kw: aggregation.PerSource.apply(p, n, kw["eps"], kw["preserve_scale"], *s)}


def _module(dim, seed=0):
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
    grads = {}
    for name in ("fusable", "per_source"):
        module.zero_grad()
        sources = _sources(LARGE, 4, dtype)
        out = FORMULATIONS[name](module.proj.weight, module.norm.weight, sources, eps=module.eps,
                                 preserve_scale=preserve_scale)
        (out.float() * torch.linspace(-1, 1, LARGE[-1])).square().sum().backward()
        grads[name] = [module.proj.weight.grad.clone(), module.norm.weight.grad.clone(),
                       *(s.grad.float() for s in sources)]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2      # bf16: the gradients are rounded to bf16
    for want, got in zip(grads["fusable"], grads["per_source"]):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_eager_picks_stacked_for_small_sources_and_the_custom_backward_for_training(monkeypatch):
    module = _module(SMALL[-1])
    calls = []
    for name in ("stacked", "fusable"):
        original = getattr(aggregation, name)
        monkeypatch.setattr(aggregation, name, lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
    monkeypatch.setattr(aggregation.PerSource, "apply",
                        classmethod(lambda cls, *a, _o=aggregation.PerSource.apply: calls.append("per_source") or _o(*a)))
    module(*_sources(SMALL, 3))
    module(*_sources(WIDE, 3))
    with torch.no_grad():
        module(*_sources(WIDE, 3))
    module(*_sources(SMALL, 1))                    # one source: no stacking to do
    assert calls == ["stacked", "per_source", "fusable", "per_source"]


def test_graph_captures_see_the_fusable_form():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.res = _module(8)

        def forward(self, a, b):
            return self.res(a, b)

    code = torch.fx.symbolic_trace(Holder()).code
    assert "stack" not in code and "PerSource" not in code and "vector_norm" in code
