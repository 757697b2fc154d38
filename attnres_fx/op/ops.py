"""The aggregation as one operator, ``torch.ops.attnres.aggregate``, with a fused backward.

    out = torch.ops.attnres.aggregate(sources, proj_weight, norm_weight, eps, preserve_scale)

``sources`` is a list of tensors of one shape ``[..., D]`` and one dtype (fp32, bf16 or fp16);
``proj_weight`` ``[1, D]`` and ``norm_weight`` ``[D]`` are the pseudo-query and the key norm's weight.
The function is :mod:`attnres_fx.op.aggregation`'s (its docstring gives the formula); fp32 inside, the
result in the sources' dtype.

Implementations, by the device of the sources:

- CPU: the C++ kernel (:mod:`attnres_fx.op.kernels.cpu`): per token, the logits from one read of the
  sources' rows, then the weighted sum from cache; where it cannot be built, the PyTorch formulation
  (one warning says why). The library also defines ``attnres_cpu::aggregate`` with its autograd
  registered in C++ (and meta kernels for fake tensors): what eager calls on the CPU run
  (:func:`eager`, :func:`attnres_fx.op.module.run_site`), with no Python in a training step's forward
  or backward. Its forward keeps, beside its inputs, each token's ``q . v`` and key scale per source
  ([2, K, T] fp32, ``attnres_cpu::aggregate_saving_logits``), so that its backward
  (``attnres_cpu::aggregate_backward_saved``) does not recompute them. ``attnres_cpu::aggregate_normed``
  (a site and the RMS or layer norm that alone reads it, :mod:`attnres_fx.passes.fuse_norms`) records the same
  node, which keeps the norm's weight too but not the aggregate: its backward
  (``attnres_cpu::aggregate_normed_backward_saved``) recomputes each row from the sources;
- CUDA: the Triton kernel (:mod:`attnres_fx.op.kernels.gpu`) where Triton is installed;
- anything else, and CUDA without Triton: the PyTorch formulation.

Autograd: the backward is one more operator, ``attnres::aggregate_backward``, returning the gradients
of all sources and of the folded query (Note [backward] in :mod:`attnres_fx.op.aggregation`); the
forward of ``attnres::aggregate`` saves only its inputs, through ``ctx.save_for_backward`` (so
``saved_tensors_hooks``, activation offloading and checkpointing manage them), and the backward
recomputes the per-token logits in the same look at each source that gives ``g . v``. A backward that
records its graph (``create_graph=True``) differentiates :func:`~attnres_fx.op.aggregation.fusable`
instead, on both operators' nodes: the kernels' backward has no derivative of its own. Fake (meta) implementations let
torch.export and AOTAutograd trace the operator. Graph captures of :class:`attnres_fx.BlockAttnRes`
nevertheless see plain ops (:func:`attnres_fx.op.module.aggregate`): Inductor treats a custom
operator as an opaque call and fuses plain ops with their neighbours; exporters get the form
onnxruntime runs fastest, into which :data:`EXPORT_DECOMPOSITIONS` also turns the operator where a
model calls it itself.
"""

from __future__ import annotations

import torch
from torch.overrides import has_torch_function

from . import aggregation
from .kernels import cpu

_LIBRARY = torch.library.Library("attnres", "DEF")
_LIBRARY.define("aggregate(Tensor[] sources, Tensor proj_weight, Tensor norm_weight, float eps, "
                "bool preserve_scale) -> Tensor")
_LIBRARY.define("aggregate_backward(Tensor grad, Tensor[] sources, Tensor proj_weight, Tensor norm_weight, "
                "float eps, bool preserve_scale) -> (Tensor[], Tensor)")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(sources, proj_weight: torch.Tensor, norm_weight: torch.Tensor, what: str = "attnres::aggregate"):
    """Raise ``ValueError`` naming the problem unless the inputs are what the operator takes."""
    if not sources:
        raise ValueError(f"{what}: needs at least one source")
    first = sources[0]
    if first.dim() < 1 or first.shape[-1] == 0:
        raise ValueError(f"{what}: sources must be [..., D] with D > 0, got shape {tuple(first.shape)}")
    for source in sources[1:]:
        if source.shape != first.shape or source.dtype != first.dtype or source.device != first.device:
            raise ValueError(f"{what}: every source must have the first's shape, dtype and device "
                             f"({tuple(first.shape)}, {first.dtype}, {first.device}); got {tuple(source.shape)}, "
                             f"{source.dtype}, {source.device}")
    if first.dtype not in DTYPES:
        raise ValueError(f"{what}: sources must be float32, bfloat16 or float16, got {first.dtype}")
    dim = first.shape[-1]
    if proj_weight.numel() != dim or norm_weight.numel() != dim:
        raise ValueError(f"{what}: proj_weight [1, D] and norm_weight [D] must have D = {dim} elements, got "
                         f"{tuple(proj_weight.shape)} and {tuple(norm_weight.shape)}")


def uniform(sources) -> bool:
    """Whether the operator takes these sources: one shape, dtype and device, a supported dtype."""
    first = sources[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    if dtype not in DTYPES:
        return False
    for source in sources:
        if source.shape != shape or source.dtype != dtype or source.device != device:
            return False
    return True


def reference_forward(sources, proj_weight, norm_weight, eps: float, preserve_scale: bool) -> torch.Tensor:
    return aggregation.fusable(proj_weight, norm_weight, list(sources), eps=eps, preserve_scale=preserve_scale)


reference_backward = aggregation.reference_backward


# ------------------------------------------------------------------------------ registrations
@torch.library.register_fake("attnres::aggregate")
def _aggregate_fake(sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight)
    return torch.empty_like(sources[0])


@torch.library.register_fake("attnres::aggregate_backward")
def _aggregate_backward_fake(grad, sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight, "attnres::aggregate_backward")
    return [torch.empty_like(s) for s in sources], grad.new_empty(grad.shape[-1], dtype=torch.float32)


@torch.library.impl("attnres::aggregate", "CPU")
def _aggregate_cpu(sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight)
    if cpu.available():
        return torch.ops.attnres_cpu.aggregate(sources, proj_weight, norm_weight, eps, preserve_scale)
    return reference_forward(sources, proj_weight, norm_weight, eps, preserve_scale)


@torch.library.impl("attnres::aggregate_backward", "CPU")
def _aggregate_backward_cpu(grad, sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight, "attnres::aggregate_backward")
    if cpu.available():
        return torch.ops.attnres_cpu.aggregate_backward(grad, sources, proj_weight, norm_weight, eps, preserve_scale)
    return reference_backward(grad, sources, proj_weight, norm_weight, eps, preserve_scale)


@torch.library.impl("attnres::aggregate", "CUDA")
def _aggregate_cuda(sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight)
    gpu = _gpu_kernels()
    if gpu is not None and gpu.supports(sources):
        return gpu.aggregate(sources, proj_weight, norm_weight, eps, preserve_scale)
    return reference_forward(sources, proj_weight, norm_weight, eps, preserve_scale)


@torch.library.impl("attnres::aggregate_backward", "CUDA")
def _aggregate_backward_cuda(grad, sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight, "attnres::aggregate_backward")
    gpu = _gpu_kernels()
    if gpu is not None and gpu.supports(sources):
        return gpu.aggregate_backward(grad, sources, proj_weight, norm_weight, eps, preserve_scale)
    return reference_backward(grad, sources, proj_weight, norm_weight, eps, preserve_scale)


# Every other device (MPS, XPU, ...): the PyTorch formulation.
@torch.library.impl("attnres::aggregate", "CompositeExplicitAutograd")
def _aggregate_any(sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight)
    return reference_forward(sources, proj_weight, norm_weight, eps, preserve_scale)


@torch.library.impl("attnres::aggregate_backward", "CompositeExplicitAutograd")
def _aggregate_backward_any(grad, sources, proj_weight, norm_weight, eps, preserve_scale):
    check_inputs(sources, proj_weight, norm_weight, "attnres::aggregate_backward")
    return reference_backward(grad, sources, proj_weight, norm_weight, eps, preserve_scale)


def _gpu_kernels():
    """:mod:`attnres_fx.op.kernels.gpu`, or ``None`` without Triton."""
    try:
        from .kernels import gpu
    except ImportError:
        return None
    return gpu


def _setup_context(ctx, inputs, output):
    sources, proj_weight, norm_weight, eps, preserve_scale = inputs
    ctx.save_for_backward(proj_weight, norm_weight, *sources)
    ctx.eps, ctx.preserve_scale = eps, preserve_scale


def _backward(ctx, grad):
    proj_weight, norm_weight, *sources = ctx.saved_tensors
    if torch.is_grad_enabled():
        # A backward recording its graph (create_graph=True, gradients of gradients): the gradients of the
        # PyTorch formulation, with theirs; attnres::aggregate_backward's would have no derivative. Each
        # input through an alias of its own: a source computed from another (a block's sum from the blocks
        # before it) would otherwise get, through that other, the total derivative, not its own.
        inputs = [tensor.view_as(tensor) if tensor.requires_grad else tensor
                  for tensor in (*sources, proj_weight, norm_weight)]
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        out = aggregation.fusable(inputs[-2], inputs[-1], inputs[:-2], eps=ctx.eps, preserve_scale=ctx.preserve_scale)
        found = iter(torch.autograd.grad(out, wanted, grad, create_graph=True, allow_unused=True) if wanted else ())
        grads = [next(found) if tensor.requires_grad else None for tensor in inputs]
        return grads[:-2], grads[-2], grads[-1], None, None
    grads, grad_query = torch.ops.attnres.aggregate_backward(grad, sources, proj_weight, norm_weight, ctx.eps,
                                                             ctx.preserve_scale)
    grad_proj = (grad_query * norm_weight.float()).reshape(proj_weight.shape).to(proj_weight.dtype)
    grad_norm = (grad_query * proj_weight.reshape(-1).float()).to(norm_weight.dtype)
    return list(grads), grad_proj, grad_norm, None, None


torch.library.register_autograd("attnres::aggregate", _backward, setup_context=_setup_context)


def aggregate(sources, proj_weight: torch.Tensor, norm_weight: torch.Tensor, *, eps: float,
              preserve_scale: bool) -> torch.Tensor:
    """``torch.ops.attnres.aggregate``; inputs checked first (``ValueError`` naming the problem)."""
    sources = list(sources)
    check_inputs(sources, proj_weight, norm_weight)
    return torch.ops.attnres.aggregate(sources, proj_weight, norm_weight, eps, preserve_scale)


def eager(proj_weight: torch.Tensor, norm_weight: torch.Tensor, sources, *, eps: float,
          preserve_scale: bool) -> torch.Tensor:
    """The aggregation as eager PyTorch runs it fastest (``benchmarks/bench.py``'s ``kernels`` section
    measures the choices):

    - on the CPU, the C++ operator ``attnres_cpu::aggregate`` straight away (through the library's own entry,
      :func:`~attnres_fx.op.kernels.cpu.aggregate_op`, for tensors without ``__torch_function__``), with a
      gradient too: its autograd is registered in C++, and it checks its inputs itself (sources of mixed
      shapes or dtypes, which it refuses, take :func:`~attnres_fx.op.aggregation.fusable`: broadcasting,
      promotion);
    - on other devices, the operator ``attnres::aggregate`` (the Triton kernel on CUDA) for sources of one
      shape and dtype, :func:`~attnres_fx.op.aggregation.fusable` for the others;
    - no kernel (no compiler): :func:`~attnres_fx.op.aggregation.stacked` for small sources, where the op
      count dominates, else the operator's PyTorch formulation with its fused backward, or
      :func:`~attnres_fx.op.aggregation.fusable` without a gradient.
    """
    sources = list(sources)
    if proj_weight.device != sources[0].device:
        raise RuntimeError(
            f"the AttnRes weights of this aggregation are on {proj_weight.device}, its sources on {sources[0].device}: "
            "something moved the weights of a BlockAttnRes's submodules away without calling them (accelerate's "
            "cpu_offload / disk offload: pass preload_module_classes=['BlockAttnRes'], which loads a module's "
            "submodules' weights when it is called)")
    on_cpu = sources[0].device.type == "cpu"
    if on_cpu and cpu.available():
        try:
            if has_torch_function((*sources, proj_weight, norm_weight)):
                return torch.ops.attnres_cpu.aggregate(sources, proj_weight, norm_weight, eps, preserve_scale)
            return cpu.aggregate_op()(sources, proj_weight, norm_weight, eps, preserve_scale)
        except RuntimeError:
            if uniform(sources):
                raise
            return aggregation.fusable(proj_weight, norm_weight, sources, eps=eps, preserve_scale=preserve_scale)
    if not uniform(sources):
        return aggregation.fusable(proj_weight, norm_weight, sources, eps=eps, preserve_scale=preserve_scale)
    if on_cpu:
        if len(sources) > 1 and sources[0].numel() <= aggregation.STACKED_MAX_ELEMENTS:
            return aggregation.stacked(proj_weight, norm_weight, sources, eps=eps, preserve_scale=preserve_scale)
        needs_grad = torch.is_grad_enabled() and (proj_weight.requires_grad or norm_weight.requires_grad
                                                  or any(s.requires_grad for s in sources))
        if not needs_grad:
            return aggregation.fusable(proj_weight, norm_weight, sources, eps=eps, preserve_scale=preserve_scale)
    return torch.ops.attnres.aggregate(sources, proj_weight, norm_weight, eps, preserve_scale)


def _aggregate_for_export(sources, proj_weight, norm_weight, eps, preserve_scale):
    return aggregation.batched(proj_weight, norm_weight, list(sources), eps=eps, preserve_scale=preserve_scale)


# What exporters turn the operator into: the plain-op form onnxruntime runs fastest
# (:func:`attnres_fx.op.aggregation.batched`); ``ExportedProgram.run_decompositions(EXPORT_DECOMPOSITIONS)``.
EXPORT_DECOMPOSITIONS = {torch.ops.attnres.aggregate.default: _aggregate_for_export}
