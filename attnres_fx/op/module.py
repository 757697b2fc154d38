"""The module injected at every residual site: softmax attention over depth."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.overrides import has_torch_function

from . import aggregation, ops
from .. import compat
from .kernels import cpu
from ..compat import is_fake

if TYPE_CHECKING:
    from attnres_fx.passes.plan import Site

DEFAULT_EPS = 1e-6
# The key norm adds eps in fp32 whatever the sources' dtype (fp32, bf16, fp16 are all normalised in fp32):
# an eps below fp32's smallest normal number rounds to (nearly) 0 there, and a zero source (a padding
# embedding) then gives 0 * inf = NaN.
SMALLEST_EPS = torch.finfo(torch.float32).tiny


def check_eps(eps) -> float:
    """``eps`` as a float, or ``ValueError`` unless it is a finite number of at least fp32's smallest
    normal number (:data:`SMALLEST_EPS`)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    if eps < SMALLEST_EPS:
        raise ValueError(f"eps must be at least {SMALLEST_EPS:.4g}, the smallest normal float32 number (the key norm "
                         f"adds it in fp32 for every source dtype), got {eps!r}: it would round to 0 there and a zero "
                         "source would give NaN")
    return float(eps)


def aggregate(proj_weight: torch.Tensor, norm_weight: torch.Tensor, sources, *, eps: float,
              preserve_scale: bool) -> torch.Tensor:
    """``sum_i softmax_i(w . RMSNorm(v_i)) * v_i`` over ``sources`` (``[..., D]`` each), fp32 inside.

    The functional form of :class:`BlockAttnRes` (``proj_weight`` ``[1, D]``, ``norm_weight`` ``[D]``).
    The result has the stream's dtype (the sources' promoted dtype), under ``torch.autocast`` too; with
    ``preserve_scale`` it is multiplied by the number of sources. Under a graph capture (Dynamo,
    torch.export, fx) it is :func:`aggregation.fusable`, plain ops Inductor fuses with their neighbours and exporters
    translate; run eagerly, :func:`ops.eager` picks the fastest implementation: the fused operator
    ``attnres::aggregate`` (a C++ or Triton kernel) where there is one.
    """
    if not sources:
        raise ValueError("BlockAttnRes needs at least one source")
    if captured(sources[0]):
        form = aggregation.batched if torch.compiler.is_exporting() else aggregation.fusable
        return form(proj_weight, norm_weight, sources, eps=eps, preserve_scale=preserve_scale)
    return ops.eager(proj_weight, norm_weight, sources, eps=eps, preserve_scale=preserve_scale)


def captured(value: torch.Tensor) -> bool:
    """Whether this call is traced rather than run on data: TorchDynamo's trace, or a value without data
    (fake, possibly inside a functional wrapper: torch.export, AOTAutograd; symbolic: torch.fx; or on the
    meta device). Read from the call itself, not from process-wide flags, which another thread's
    compilation sets."""
    if torch.compiler.is_dynamo_compiling():
        return True
    if type(value) is torch.Tensor or type(value) is nn.Parameter:       # a plain tensor: data, unless meta
        return value.device.type == "meta"
    return (not isinstance(value, torch.Tensor) or is_fake(value) or value.device.type == "meta"
            or not isinstance(value.numel(), int))


class PseudoQuery(nn.Module):
    """The pseudo-query ``w`` of one site: ``weight`` ``[1, dim]``, zero-initialised, stored as the reference
    code's ``Linear(dim, 1, bias=False)`` stores it (the same ``proj.weight`` in a ``state_dict``).

    Deliberately not an ``nn.Linear``: quantizers rewrite every ``nn.Linear`` they find (torchao's
    ``quantize_``, transformers' quantized loading), and a query of one row is no layer to quantize: the
    aggregation reads it in full precision. Zero init draws no random numbers, so building it leaves the
    global RNG where it was.
    """

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[1]}"


class BlockAttnRes(nn.Module):
    """Aggregate residual sources with one learned, input-independent pseudo-query.

    ``forward(*sources)`` takes the completed block sums ``b_0 .. b_{n-1}`` and the current partial sum,
    each of shape ``[..., dim]``, and returns ``sum_i softmax_i(w . RMSNorm(v_i)) * v_i``: keys are
    RMS-normalised, values are not, and there is no 1/sqrt(d) temperature (docs/method.md, section 2).

    Parameters mirror the reference code: ``proj`` holds the pseudo-query ``w`` (a :class:`PseudoQuery`:
    ``weight`` ``[1, dim]`` as in its ``Linear(dim, 1, bias=False)``, zero-initialised so that every source
    starts with equal weight) and
    ``norm = RMSNorm(dim)`` holds the key normalisation (weight ``[dim]``, ones).

    The logits, the softmax and the weighted sum run in fp32 whatever the sources' dtype, under
    ``torch.autocast`` too; the result has the stream's dtype (the sources' promoted dtype: a bf16
    embedding and fp32 sublayer outputs make an fp32 stream, as the residual adds gave). With
    ``preserve_scale=True`` the aggregate is multiplied by the number of sources, so at zero init it equals the plain
    sum of the sources (the original residual stream) exactly, on any architecture.

    Written to fuse: the sources are never stacked into one tensor; one pass over each source gives its
    key scale and its dot product with the (norm-folded) pseudo-query; the softmax over the few sources
    works on per-token scalars only (running max, exponentials, their sum), and the weighted sum is one
    more pass with the normalisation (and ``preserve_scale``) folded into the per-source weights. Under
    Inductor on CPU the module is one kernel with no full-size temporary (tests/op/test_kernels.py); it
    reads each source twice (logits, then weighted sum), which bounds it at about (k + 1) / (2k + 1) of
    a single streaming read of its k sources when memory-bound.

    In this per-site form every site recomputes the key scale of every completed block it reads. A
    completed block's keys never change, so :mod:`attnres_fx.passes.two_phase` computes them once per
    block and scores all of the block's pseudo-queries against them in one product.
    """

    def __init__(self, dim: int, eps: float = DEFAULT_EPS, *, preserve_scale: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = dim
        self.eps = check_eps(eps)
        self.preserve_scale = preserve_scale
        # Where this module sits in a converted model (attnres_fx.sites reads it); None for a free module.
        self.site: Site | None = None
        # Ordinary tensors even when built inside torch.inference_mode() (a conversion there): inference
        # tensors cannot be saved for backward, so the first training step would fail.
        with torch.inference_mode(False):
            # Built as reset_parameters leaves them: zero pseudo-query, unit key-norm weight.
            self.proj = PseudoQuery(dim, device=device, dtype=dtype)
            self.norm = nn.RMSNorm(dim, eps=eps, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)
        nn.init.ones_(self.norm.weight)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}, preserve_scale={self.preserve_scale}"

    def forward(self, *sources: torch.Tensor) -> torch.Tensor:
        return aggregate(self.proj.weight, self.norm.weight, sources, eps=self.eps,
                         preserve_scale=self.preserve_scale)


def run_site(module: BlockAttnRes, entered, *sources: torch.Tensor) -> torch.Tensor:
    """``module(*entered, *sources)`` (``entered``: the completed blocks a layer's graph received, as one
    sequence), without ``nn.Module``'s call machinery where the module is a ``BlockAttnRes`` without hooks
    (any hook, its own or global, or a module of another class put in its place, and the call goes through
    the module as usual): what a block's graph calls for each aggregation. On the CPU, for tensors without
    ``__torch_function__``, straight to the C++ operator (its autograd registered in C++ too), which checks
    its inputs itself (sources of mixed shapes or dtypes take :func:`aggregate`): a decoding step's few
    microseconds, and no Python at all in a training step's backward. Under TorchDynamo (a block graph
    compiled by Inductor) the plain ops of :func:`aggregate`, which Inductor fuses. The common case (a
    ``BlockAttnRes`` without hooks, plain CPU tensors) is checked and run in C (:class:`cpu.Entries`)."""
    entry = cpu.Entries.run_site
    if entry is not None:
        result = entry(BlockAttnRes, module, entered, sources)
        if result is not None:
            return result
    if type(module) is not BlockAttnRes or compat.module_hooks(module):
        return module(*entered, *sources)         # hooks, or another module put in the site's place (a wrapper)
    listed = [*entered, *sources]
    # The weights by dict look-ups (nn.Module's __getattr__ is a Python call each), by attribute where the
    # parameter is not a plain entry (a parametrization's property).
    proj = module._modules["proj"]._parameters.get("weight")
    norm = module._modules["norm"]._parameters.get("weight")
    if proj is None or norm is None:
        proj, norm = module.proj.weight, module.norm.weight
    first = listed[0]
    if type(first) is torch.Tensor and first.is_cpu and proj.is_cpu and not torch.compiler.is_dynamo_compiling():
        kernel = cpu.aggregate_op()
        if kernel and not has_torch_function((*listed, proj, norm)):
            try:
                return kernel(listed, proj, norm, module.eps, module.preserve_scale)
            except RuntimeError:
                pass
    return aggregate(proj, norm, listed, eps=module.eps, preserve_scale=module.preserve_scale)


_ABSENT = object()


@dataclass(frozen=True)
class FusedNorm:
    """A norm module as :func:`attnres_fx.passes.fuse_norms.match_norm` matched it: its class and that class's
    forward then, the names of its weight parameter and its eps attribute (read at every call), its other
    constants (name, value), which its code may branch on: a module of the class with other values (a block
    graph is shared by the blocks of one kind, their norms' constants aside) is not fused; the constant its
    forward adds to the weight before scaling by it (Gemma's ``1 + weight``; 0.0: none); whether it is a
    layer norm (``centred``: the mean taken off) rather than an RMS norm, and the name of a layer norm's bias
    parameter (None: it adds none)."""

    norm_class: type
    forward: Callable
    weight: str
    eps: str
    constants: tuple = ()
    weight_offset: float = 0.0
    centred: bool = False
    bias: str | None = None


def site_normed(fused: FusedNorm) -> Callable:
    """``site_normed(module, norm, entered, *sources)``: ``norm(run_site(module, entered, *sources))``, as one
    operator call (:mod:`attnres_fx.passes.fuse_norms`; with gradients recorded, one autograd node that keeps
    no copy of the rows between the two) where ``norm`` is still the module ``fused`` describes, without hooks,
    and the tensors are plain fp32 CPU ones (checked in C, :class:`cpu.Entries`)."""
    norm_class, forward, weight, eps = fused.norm_class, fused.forward, fused.weight, fused.eps
    constants, offset, bias, centred = fused.constants, fused.weight_offset, fused.bias, fused.centred

    def site_normed(module: BlockAttnRes, norm: nn.Module, entered, *sources: torch.Tensor) -> torch.Tensor:
        entry = cpu.Entries.run_site_normed
        if entry is None and (sources or entered)[0].is_cpu and not torch.compiler.is_dynamo_compiling() \
                and cpu.loaded():
            # The process's first aggregation on the CPU loads the kernel: this call fused as every later one.
            entry = cpu.Entries.run_site_normed
        attributes = norm.__dict__
        if entry is not None and all(attributes.get(name, _ABSENT) == value for name, value in constants):
            result = entry(BlockAttnRes, module, entered, sources, norm, norm_class, forward, weight, eps, offset,
                           bias, centred)
            if result is not None:
                return result
        return norm(run_site(module, entered, *sources))
    return site_normed
