"""The module injected at every residual site: softmax attention over depth."""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_EPS = 1e-6


class BlockAttnRes(nn.Module):
    """Aggregate residual sources with one learned, input-independent pseudo-query.

    ``forward(*sources)`` takes the completed block sums ``b_0 .. b_{n-1}`` and the current partial sum,
    each of shape ``[..., dim]``, and returns ``sum_i softmax_i(w . RMSNorm(v_i)) * v_i``: keys are
    RMS-normalised, values are not, and there is no 1/sqrt(d) temperature (METHOD.md section 2).

    Parameters mirror the reference code: ``proj = Linear(dim, 1, bias=False)`` holds the pseudo-query
    ``w`` (weight ``[1, dim]``, zero-initialised so that every source starts with equal weight) and
    ``norm = RMSNorm(dim)`` holds the key normalisation (weight ``[dim]``, ones).

    The logits, the softmax and the weighted sum run in fp32 whatever the sources' dtype; the result is
    cast back to the dtype of the first source. With ``preserve_scale=True`` the aggregate is multiplied
    by the number of sources, so at zero init it equals the plain sum of the sources (the original
    residual stream) exactly, on any architecture.

    The sources are never stacked into one tensor: each one is read once to get its key scale and its
    dot product with the (norm-weighted) pseudo-query, and once more for the weighted sum.
    """

    def __init__(self, dim: int, eps: float = DEFAULT_EPS, *, preserve_scale: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = dim
        self.eps = eps
        self.preserve_scale = preserve_scale
        self.proj = nn.Linear(dim, 1, bias=False, device=device, dtype=dtype)
        self.norm = nn.RMSNorm(dim, eps=eps, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)
        nn.init.ones_(self.norm.weight)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}, preserve_scale={self.preserve_scale}"

    def forward(self, *sources: torch.Tensor) -> torch.Tensor:
        if not sources:
            raise ValueError("BlockAttnRes needs at least one source")
        out_dtype = sources[0].dtype
        # w . (g * v / rms(v)) == ((w * g) . v) / rms(v): fold the key-norm weight into the query.
        query = (self.proj.weight[0] * self.norm.weight).float()
        logits = []
        for value in sources:
            value = value.float()
            key_scale = torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + self.eps)
            logits.append((value * query).sum(-1, keepdim=True) * key_scale)
        weights = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
        out = weights[..., 0:1] * sources[0].float()
        for i in range(1, len(sources)):
            out = out + weights[..., i:i + 1] * sources[i].float()
        if self.preserve_scale:
            out = out * len(sources)
        return out.to(out_dtype)
