"""Three ways to compute one aggregation, the same function each (to fp32 round-off):

``out = s * sum_i softmax_i(q . v_i * r_i) * v_i``, with ``q = proj.weight[0] * norm.weight`` (the
pseudo-query with the key norm's weight folded in), ``r_i = rsqrt(mean(v_i ** 2) + eps)`` (the key
norm of source ``i``) and ``s`` the number of sources with ``preserve_scale``, else 1. Logits, softmax
and accumulation run in fp32, under ``torch.autocast`` too (which would otherwise run the dot products in
its lower precision); the result has the stream's dtype: the sources' promoted dtype, as the residual adds
it replaces give (a bf16 embedding added to fp32 sublayer outputs is an fp32 stream).

- :func:`fusable`: one pass per source for its logit, the softmax on per-token scalars, one more pass for
  the weighted sum; no stacking, so Inductor fuses it into one kernel and exporters see plain ops. What
  every graph capture sees (Inductor, torch.export, ONNX).
- :func:`stacked`: the sources in one tensor, a handful of ops whatever their number. For small
  sources (decoding one token at a time) the fixed cost of each op dominates, and fewer ops win.
- :func:`reference_backward`: the gradients in a few passes over each source (Note [backward]) instead
  of autograd's dozen small nodes through :func:`fusable`.

Eager calls run the operator of :mod:`attnres_fx.op.ops` (a C++ or Triton kernel); these formulations are
what graph captures see and what the operator falls back to where no kernel is available
(:func:`attnres_fx.op.ops.eager` picks).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Without a kernel, sources up to this many elements go through ``stacked`` (measured on CPU: below it
# the op count dominates, e.g. 80 us stacked vs 140-450 us per source for 2-9 sources of [1, 1, 128];
# above some 16k elements the stacked copy costs more than it saves).
STACKED_MAX_ELEMENTS = 16_384


# Note [negligible weights]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Inside every softmax over sources, an exponential exp(z_i - max_j z_j) below NEGLIGIBLE_WEIGHT (the
# weight relative to the largest of that softmax) is exactly zero, in every implementation (C++, Triton,
# these ops, ONNX) but the pass on onnxruntime-genai's builder graph (export/builder_stream.py: inference
# only, no gradients to slow down, and 4 nodes per site cost its decoding 5-10%). Why: with pseudo-queries
# of std 1 and more the softmax saturates, weights such as e^-100 are subnormal floats, and so are the gradients
# they scale (p_i * g); CPUs compute on subnormals some 6x slower, and the backward matmuls of a whole model slow
# down with them. Flushing the global floating-point mode (torch.set_flush_denormal) would change every other
# computation of the process. Why 2^-32 is exact: a dropped term p_i v_i is below 2^-32 |v_i| / |v_max| of the
# largest-weighted term,
# so under half an ulp (2^-24 relative) of it unless source i is over 2^8 = 256x larger than that source,
# and fp32 already rounds the sum at one ulp of its largest term; its share of the normalising sum is
# at most 8 * 2^-32 < 2^-28 for 9 sources. A kept weight is at least 2^-32 / K of the total, so its
# products (s p_i g, p_i v_i) stay normal floats for any factor above 2^-126 * 2^32 * K ~ 1e-27.
NEGLIGIBLE_WEIGHT = 2.0 ** -32


def negligible_to_zero(exps: torch.Tensor) -> torch.Tensor:
    """``exps`` (``exp(logit - max)``, at most 1) with those below :data:`NEGLIGIBLE_WEIGHT` exactly zero
    (Note [negligible weights]); the gradient through a zeroed one is zero too."""
    return torch.where(exps < NEGLIGIBLE_WEIGHT, 0.0, exps)


def flushed_softmax(logits: torch.Tensor, dim: int) -> torch.Tensor:
    """``softmax(logits, dim)`` with negligible weights exactly zero (Note [negligible weights]), their
    gradients too: taken as ``exp(logit - max) / sum``, since zeroing the output of ``torch.softmax``
    would leave its backward to scale the gradient by the unflushed (subnormal) weights."""
    exps = negligible_to_zero(torch.exp(logits - logits.amax(dim=dim, keepdim=True)))
    return exps / exps.sum(dim=dim, keepdim=True)


# Device types torch.autocast knows (asking about another, such as "meta", is an error).
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")


def stream_dtype(sources) -> torch.dtype:
    """The dtype of the residual stream the sources make up: their promoted dtype (what adding them gives).
    Under fx symbolic tracing (proxies, no dtypes to compare) the first source's."""
    if not all(isinstance(source, torch.Tensor) for source in sources):
        return sources[0].dtype
    return functools.reduce(torch.promote_types, [source.dtype for source in sources])


def autocast_on(device_type: str) -> bool:
    return device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


def in_fp32(aggregation):
    """``aggregation(proj_weight, norm_weight, sources, ...)`` with autocast off for the sources' device:
    the formulation computes in fp32 on purpose, and autocast would run its matmuls in bf16/fp16."""
    @functools.wraps(aggregation)
    def run(proj_weight, norm_weight, sources, **options):
        if isinstance(sources[0], torch.Tensor) and autocast_on(sources[0].device.type):
            device_type = sources[0].device.type
            with torch.autocast(device_type, enabled=False):
                return aggregation(proj_weight, norm_weight, sources, **options)
        return aggregation(proj_weight, norm_weight, sources, **options)
    return run


def folded_query(proj_weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """The pseudo-query with the key-norm weight folded in, in fp32: ``w . (g * k) == (w * g) . k``."""
    return proj_weight[0].float() * norm_weight.float()


def key_scale(value: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(v**2) + eps)`` over the last dim of an fp32 ``value``, keepdim: the RMSNorm of a key.

    ``vector_norm`` is one reduction kernel in eager mode (``pow`` then ``mean`` would write a full-size
    temporary); under Inductor it fuses with the dot product that reads the same source.
    """
    norm = torch.linalg.vector_norm(value, dim=-1, keepdim=True)
    return torch.rsqrt(norm.square() / value.shape[-1] + eps)


def depth_logit(value: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """``query . RMSNorm(value)`` per token (``[..., 1]``) for an fp32 ``value``: one pass over it."""
    return torch.matmul(value, query).unsqueeze(-1) * key_scale(value, eps)


def softmax_parts(logits: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Softmax over a few per-token logits without stacking them: ``(max, exp(logit - max), sum)``, the
    negligible exponentials zero (Note [negligible weights])."""
    top = logits[0]
    for logit in logits[1:]:
        top = torch.maximum(top, logit)
    exps = [negligible_to_zero(torch.exp(logit - top)) for logit in logits]
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    return top, exps, total


def weighted_sum(weights: list[torch.Tensor], values) -> torch.Tensor:
    """``sum_i weights[i] * values[i]`` in fp32 (weights are fp32 ``[..., 1]``).

    Mixed-dtype products promote to fp32 inside the kernel: no fp32 copy of a bf16 value is made.
    """
    out = weights[0] * values[0]
    for weight, value in zip(weights[1:], values[1:]):
        out = torch.addcmul(out, weight, value)
    return out


def _probabilities(query, sources, eps, preserve_scale):
    """Per source: fp32 value, key scale, dot with the query; and the softmax weights times ``s``."""
    values = [value.float() for value in sources]
    scales = [key_scale(value, eps) for value in values]
    dots = [torch.matmul(value, query).unsqueeze(-1) for value in values]
    _, exps, total = softmax_parts([dot * scale for dot, scale in zip(dots, scales)])
    inverse = (len(sources) if preserve_scale else 1.0) / total
    return values, scales, dots, [e * inverse for e in exps]


@in_fp32
def fusable(proj_weight, norm_weight, sources, *, eps: float, preserve_scale: bool) -> torch.Tensor:
    """The aggregation as plain per-source ops: what graph captures see (module docstring)."""
    query = folded_query(proj_weight, norm_weight)
    logits = [depth_logit(value.float(), query, eps) for value in sources]
    _, exps, total = softmax_parts(logits)
    inverse = (len(sources) if preserve_scale else 1.0) / total
    return weighted_sum([e * inverse for e in exps], sources).to(stream_dtype(sources))


@in_fp32
def stacked(proj_weight, norm_weight, sources, *, eps: float, preserve_scale: bool) -> torch.Tensor:
    """The aggregation in a few ops on the stacked sources: for small sources (module docstring)."""
    values = torch.stack([source.float() for source in sources])
    logits = F.rms_norm(values, (values.shape[-1],), eps=eps) @ folded_query(proj_weight, norm_weight)
    weights = flushed_softmax(logits, dim=0).unsqueeze(-1)
    if preserve_scale:
        weights = weights * len(sources)
    return (weights * values).sum(0).to(stream_dtype(sources))


@in_fp32
def batched(proj_weight, norm_weight, sources, *, eps: float, preserve_scale: bool) -> torch.Tensor:
    """The aggregation as two batched matrix products over the sources stacked along ``-2``
    (``[..., K, D]``): logits ``V q``, then ``softmax(...)^T V``. What ONNX graphs hold (measured
    fastest in onnxruntime, which runs MatMul as one kernel and each elementwise op as a pass of its own:
    ``benchmarks/bench.py``'s ``onnx_forms``)."""
    values = torch.stack([source.float() for source in sources], dim=-2)
    scales = key_scale(values, eps).squeeze(-1)
    weights = flushed_softmax(torch.matmul(values, folded_query(proj_weight, norm_weight)) * scales, dim=-1)
    if preserve_scale:
        weights = weights * len(sources)
    return torch.matmul(weights.unsqueeze(-2), values).squeeze(-2).to(stream_dtype(sources))


# Note [backward]
# ~~~~~~~~~~~~~~~
# With p_i the softmax weights, s the scale, l_i = d_i r_i (d_i = q . v_i, r_i the key scale) and
# g the gradient of the output:
#   dL/dp_i = s (g . v_i);   dL/dl_i = s p_i (g . v_i - sum_j p_j g . v_j)            (softmax)
#   dL/dd_i = dL/dl_i r_i;   dL/dr_i = dL/dl_i d_i;   dr_i/dv_i = -r_i^3 v_i / D
#   dL/dv_i = s p_i g + dL/dd_i q - dL/dr_i r_i^3 / D v_i                         (one full-size pass)
#   dL/dq   = sum_i sum_tokens dL/dd_i v_i;   dL/dproj = dL/dq * norm.weight;   dL/dnorm = dL/dq * proj
# Per source that is one dot product with g, one full-size write and one reduction for dL/dq: a few
# passes, where autograd through `fusable` runs a dozen nodes and accumulates the gradient of each
# source from three of them. The kernels do it in two looks at each source row per token: g . v_i (with
# the logit recomputed, or on the CPU read from what the forward kept: q . v_i and r_i per token), then
# dL/dv_i and the dL/dq sum.


def reference_backward(grad, sources, proj_weight, norm_weight, eps: float, preserve_scale: bool):
    """Note [backward] in PyTorch ops: the gradients of every source (in its dtype) and of the folded
    query (fp32 ``[D]``). What ``attnres::aggregate_backward`` computes where no kernel does
    (:mod:`attnres_fx.op.ops`); the per-token logits are recomputed here, not saved by the forward."""
    if isinstance(grad, torch.Tensor) and autocast_on(grad.device.type):
        with torch.autocast(grad.device.type, enabled=False):
            return reference_backward(grad, sources, proj_weight, norm_weight, eps, preserve_scale)
    query = folded_query(proj_weight, norm_weight)
    values = [source.float() for source in sources]
    grad = grad.float()
    dim = grad.shape[-1]
    scales = [key_scale(value, eps) for value in values]
    dots = [torch.matmul(value, query).unsqueeze(-1) for value in values]
    _, exps, total = softmax_parts([dot * scale for dot, scale in zip(dots, scales)])
    scale_factor = len(sources) if preserve_scale else 1.0
    weights = [e * (scale_factor / total) for e in exps]                          # s * p_i
    along = [torch.linalg.vecdot(grad, value).unsqueeze(-1) for value in values]
    # dL/dl_i = w_i (g . v_i - sum_j p_j g . v_j), with sum_j w_j = s.
    mean_along = sum(w * a for w, a in zip(weights, along)) / scale_factor
    grad_query = torch.zeros_like(query)
    grads = []
    for value, scale, dot, weight, a in zip(values, scales, dots, weights, along):
        grad_logit = weight * (a - mean_along)
        grad_dot = grad_logit * scale
        grad_query = grad_query + torch.matmul(grad_dot.reshape(1, -1), value.reshape(-1, dim)).reshape(dim)
        coefficient = -(grad_logit * dot) * scale.pow(3) / dim
        grads.append(torch.addcmul(torch.addcmul(grad_dot * query, weight, grad), coefficient, value))
    return [g.to(s.dtype) for g, s in zip(grads, sources)], grad_query
