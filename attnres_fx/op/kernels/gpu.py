"""Triton kernels of the aggregation, forward and backward (:mod:`attnres_fx.op.ops` registers them for CUDA).

One program per token row for the forward: a first look at the row of each source gives its logit and
the maximum; a second (from cache) the weights and the weighted sum, held in registers, so the output is
written once. Two looks rather than an online softmax because a weight below
:data:`~attnres_fx.op.aggregation.NEGLIGIBLE_WEIGHT` of the largest is exactly zero (Note [negligible
weights] in :mod:`attnres_fx.op.aggregation`), and which are is known only once the maximum is.
Arithmetic is fp32 after the load, whatever the storage type (Triton's CPU interpreter computes bf16 wrongly, so nothing
is computed in it).

The backward takes a chunk of rows per program: a first look at each source per row gives the online
softmax with the weighted sum of ``g . v_i``; a second recomputes each source's logit from the row it
loads anyway for ``dL/dv_i`` and its weight, exactly zero where negligible (Note [backward] in
:mod:`attnres_fx.op.aggregation`), and accumulates ``dL/dq`` in registers; one partial ``dL/dq`` per program is summed
afterwards (deterministic, no atomics). Sources are a tuple argument: the kernels specialise on their number.

Rows wider than :data:`MAX_DIM` are left to the PyTorch formulation (:func:`supports`): a row must
fit in one program's registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres_fx.op.aggregation import NEGLIGIBLE_WEIGHT

MAX_DIM = 16_384
MAX_BACKWARD_PROGRAMS = 1024


def supports(sources) -> bool:
    return sources[0].shape[-1] <= MAX_DIM


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _source_logit(value, query, dim, eps):
    """The depth logit of one source row: ``q . v / rms(v)`` (the key norm's weight is folded into q)."""
    return tl.sum(value * query) / tl.sqrt(tl.sum(value * value) / dim + eps)


@triton.jit
def _weight_or_zero(gap, negligible):
    """``exp(gap)`` (``gap = logit - max <= 0``), exactly zero below ``negligible``."""
    e = tl.exp(gap)
    return tl.where(e < negligible, 0.0, e)


@triton.jit
def _online_softmax_step(top, logit):
    """One step of an online softmax: the new running maximum, and the factors that rescale what was
    accumulated (``old``) and weigh the new term (``new``)."""
    new_top = tl.maximum(top, logit)
    return new_top, tl.exp(top - new_top), tl.exp(logit - new_top)


@triton.jit
def _aggregate_kernel(sources, query_ptr, out_ptr, dim, eps, scale, negligible, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    query = tl.load(query_ptr + cols, mask=mask, other=0.0)
    top = tl.full([], float("-inf"), tl.float32)
    for k in tl.static_range(len(sources)):
        value = tl.load(sources[k] + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        top = tl.maximum(top, _source_logit(value, query, dim, eps))
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(len(sources)):
        value = tl.load(sources[k] + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        weight = _weight_or_zero(_source_logit(value, query, dim, eps) - top, negligible)
        acc += value * weight
        total += weight
    out = acc * (scale / total)
    tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _aggregate_backward_kernel(grad_ptr, sources, grads, query_ptr, partial_query_ptr, rows, dim, eps, scale,
                               negligible, ROWS_PER_PROGRAM, BLOCK: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < dim
    query = tl.load(query_ptr + cols, mask=in_row, other=0.0)
    grad_query = tl.zeros([BLOCK], tl.float32)
    for r in range(ROWS_PER_PROGRAM):
        row = program * ROWS_PER_PROGRAM + r
        mask = in_row & ((cols * 0 + row) < rows)
        grad = tl.load(grad_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        # First look: online softmax of the logits, with sum_i exp(z_i - max) g . v_i beside it (the
        # negligible terms included: they change these sums by under 2^-28 of their largest term).
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        weighted_along = tl.zeros([], tl.float32)
        for k in tl.static_range(len(sources)):
            value = tl.load(sources[k] + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
            top, old, new = _online_softmax_step(top, _source_logit(value, query, dim, eps))
            total = total * old + new
            weighted_along = weighted_along * old + new * tl.sum(value * grad)
        mean_along = weighted_along / total
        # Second look: each source's logit again, dL/dv_i, and dL/dq.
        for k in tl.static_range(len(sources)):
            value = tl.load(sources[k] + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
            dot = tl.sum(value * query)
            key_scale = 1.0 / tl.sqrt(tl.sum(value * value) / dim + eps)
            weight = scale * _weight_or_zero(dot * key_scale - top, negligible) / total
            grad_logit = weight * (tl.sum(value * grad) - mean_along)
            grad_dot = grad_logit * key_scale
            coefficient = -grad_logit * dot * key_scale * key_scale * key_scale / dim
            grad_value = weight * grad + grad_dot * query + coefficient * value
            tl.store(grads[k] + row * dim + cols, grad_value.to(grads[k].dtype.element_ty), mask=mask)
            grad_query += grad_dot * value
    tl.store(partial_query_ptr + program * dim + cols, grad_query, mask=in_row)


def _folded_query(proj_weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    return (proj_weight.reshape(-1).float() * norm_weight.float()).contiguous()


def aggregate(sources, proj_weight, norm_weight, eps: float, preserve_scale: bool) -> torch.Tensor:
    """The forward on the sources' device (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    sources = tuple(s.contiguous() for s in sources)
    dim = sources[0].shape[-1]
    rows = sources[0].numel() // dim
    out = torch.empty_like(sources[0])
    block = triton.next_power_of_2(dim)
    scale = float(len(sources)) if preserve_scale else 1.0
    _aggregate_kernel[(rows,)](sources, _folded_query(proj_weight, norm_weight), out, dim, eps, scale,
                               NEGLIGIBLE_WEIGHT, BLOCK=block, num_warps=_warps(block))
    return out


def aggregate_backward(grad, sources, proj_weight, norm_weight, eps: float, preserve_scale: bool):
    """``(source gradients, folded-query gradient)``, as ``attnres::aggregate_backward``."""
    sources = tuple(s.contiguous() for s in sources)
    grad = grad.to(sources[0].dtype).contiguous()
    dim = sources[0].shape[-1]
    rows = sources[0].numel() // dim
    programs = max(1, min(rows, MAX_BACKWARD_PROGRAMS))
    rows_per_program = -(-rows // programs)
    grads = tuple(torch.empty_like(s) for s in sources)
    partial_query = torch.empty(programs, dim, dtype=torch.float32, device=grad.device)
    block = triton.next_power_of_2(dim)
    scale = float(len(sources)) if preserve_scale else 1.0
    _aggregate_backward_kernel[(programs,)](grad, sources, grads, _folded_query(proj_weight, norm_weight),
                                            partial_query, rows, dim, eps, scale, NEGLIGIBLE_WEIGHT,
                                            rows_per_program,
                                            BLOCK=block, num_warps=_warps(block))
    return list(grads), partial_query.sum(0)
