"""How different two outputs are, and how different a zero-init conversion may be: one definition each.

- :func:`max_abs_diff`: the largest element-wise ``|a - b|``.
- :func:`relative_error`: the largest per-row ``|a - b| / |b|`` (2-norms along the last dimension: per
  token for hidden states and logits, per example for classifier logits). It is what the eps analysis
  below predicts, per token.
- :func:`eps_bound`: the relative error a default (convex, zero-init) conversion is allowed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .conversion import sites
from .errors import RoutingError


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach().double() - expected.detach().double()).abs().max()) if expected.numel() else 0.0


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max over rows of |actual - expected| / |expected|``; 0-d tensors are one row of one element."""
    actual = actual.detach().double().reshape(-1, expected.shape[-1] if expected.dim() else 1)
    expected = expected.detach().double().reshape(actual.shape)
    difference = (actual - expected).norm(dim=-1)
    scale = expected.norm(dim=-1)
    ratios = torch.where(scale > 0, difference / scale.clamp_min(torch.finfo(torch.float64).tiny),
                         torch.where(difference > 0, math.inf, 0.0))
    return float(ratios.max()) if ratios.numel() else 0.0


def eps_bound(exact: nn.Module, args: tuple, kwargs: dict, eps: float) -> float:
    """Predicted relative error of the default (convex) conversion against the original model.

    ``exact`` is the model converted with ``preserve_scale=True`` (eager), whose aggregates reproduce the
    original stream ``h``; ``eps`` is the epsilon of the model's pre-norms. With zero-initialised
    pseudo-queries the default conversion feeds each norm ``h / c`` instead (``c`` = the aggregation's
    number of sources), and a LayerNorm / RMSNorm of ``h / c`` is the norm of ``h`` with ``eps``
    replaced by ``c^2 eps``: it scales the norm's output, per token, by
    ``sqrt((var + eps) / (var + c^2 eps))``. The bound adds, over every aggregation, one minus that
    factor at the token of smallest variance. ``var`` is the variance of ``h``, at most the mean square
    an RMSNorm divides by, so it is conservative for RMSNorm too. The final aggregation's term is exactly
    the relative change of a bias-free head's output; the others move the stream by at most their
    sublayer's share of it, so the sum bounds the output's change at first order.
    """
    variances: dict[str, float] = {}

    def record(name):
        def hook(module, inputs, output):
            variances[name] = float(output.detach().double().var(-1, unbiased=False).min())
        return hook

    found = sites(exact)
    handles = [exact.get_submodule(site.name).register_forward_hook(record(site.name)) for site in found]
    try:
        with torch.no_grad():
            exact(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [s.name for s in found if s.name not in variances]
    if missing:
        raise RoutingError(f"eps_bound: the aggregations {missing} did not run as modules; call it on a model "
                           "converted with the eager route (not attnres_fx.compile)")
    return sum(1.0 - math.sqrt((variances[s.name] + eps) / (variances[s.name] + s.num_sources ** 2 * eps))
               for s in found)
