"""BlockAttnRes on its own, against the reference ``block_attn_res`` (stack, RMSNorm, einsum)."""

import pytest
import torch
from torch import nn

from attnres_fx import BlockAttnRes
from attnres_fx.testing.reference import block_attn_res


def _random_module(dim, seed=0, preserve_scale=False):
    torch.manual_seed(seed)
    module = BlockAttnRes(dim, preserve_scale=preserve_scale)
    nn.init.normal_(module.proj.weight, std=0.5)
    nn.init.uniform_(module.norm.weight, 0.5, 1.5)
    return module


def test_parameters_follow_the_reference_layout():
    module = BlockAttnRes(16)
    assert dict((k, tuple(v.shape)) for k, v in module.state_dict().items()) == {
        "proj.weight": (1, 16), "norm.weight": (16,)}
    assert torch.count_nonzero(module.proj.weight) == 0, "pseudo-query must start at zero"
    assert torch.equal(module.norm.weight, torch.ones(16))


@pytest.mark.parametrize("num_sources", [1, 2, 5])
@pytest.mark.parametrize("preserve_scale", [False, True])
def test_matches_reference(num_sources, preserve_scale):
    module = _random_module(32, preserve_scale=preserve_scale)
    sources = [torch.randn(2, 7, 32) * (i + 1) for i in range(num_sources)]
    got = module(*sources)
    want = block_attn_res(sources[:-1], sources[-1], module.proj, module.norm, preserve_scale=preserve_scale)
    # fp32 throughout; the two only differ in summation order (folded norm weight, no stack).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_zero_init_is_the_mean_and_preserve_scale_the_sum():
    sources = [torch.randn(3, 4, 8) for _ in range(4)]
    mean = BlockAttnRes(8)(*sources)
    total = BlockAttnRes(8, preserve_scale=True)(*sources)
    torch.testing.assert_close(mean, sum(sources) / 4)
    torch.testing.assert_close(total, sum(sources))


def test_single_source_is_identity_and_its_query_gets_no_gradient():
    module = _random_module(8)
    x = torch.randn(2, 3, 8)
    out = module(x)
    torch.testing.assert_close(out, x)
    out.sum().backward()
    assert torch.count_nonzero(module.proj.weight.grad) == 0


def test_bf16_sources_keep_dtype_and_use_fp32_softmax():
    module = _random_module(64)
    with torch.no_grad():
        module.proj.weight.mul_(40)                      # large, close logits: bf16 softmax would drift
    sources = [torch.randn(4, 16, 64) for _ in range(3)]
    bf16 = [s.bfloat16() for s in sources]
    out = module(*bf16)
    assert out.dtype == torch.bfloat16
    exact = block_attn_res([s.float() for s in bf16[:-1]], bf16[-1].float(), module.proj, module.norm)
    err = (out.float() - exact).abs().max()
    # Only the final cast to bf16 may round: at most half a bf16 ulp of the largest value (2**-8).
    assert err <= exact.abs().max() * 2 ** -8


def test_no_sources_is_an_error():
    with pytest.raises(ValueError, match="at least one source"):
        BlockAttnRes(4)()
