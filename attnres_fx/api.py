"""Public entry points: ``attnresify``, ``detect`` and ``sites``."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from attnres_fx.passes import (BlockAttnResRewrite, ResidualStreams, RewrittenSite, block_sizes,
                               detect_residual_streams)

from .block_attnres import DEFAULT_EPS, BlockAttnRes

DEFAULT_NUM_BLOCKS = 8
from .errors import AttnResError, AttnResWarning, NoResidualStreamError, UnsupportedArchitectureError
from .frontends import trace


@dataclass(frozen=True)
class Site(RewrittenSite):
    """One injected aggregation, as :func:`sites` reports it: the rewrite's record plus its module.

    ``index``: execution order over the whole model (the final aggregation of a stream comes after its
    sites). ``name``: dotted path of the ``BlockAttnRes`` in the returned model. ``kind``: ``"attn"``,
    ``"mlp"``, ``"branch"`` (neither could be told) or ``"final"``. ``block``: index of the block the
    site's own output goes into (block 0 is the embedding ``b_0``; ``None`` for ``"final"``).
    ``stream``: which residual stream (encoder-decoder models have two). ``layer``: the module that
    performed the original residual add. ``num_sources``: how many sources it attends over.
    ``normalised``: whether the branch read the stream through a norm (``None`` for ``"final"``).
    ``replaced``: the original add node of the site. ``module``: the ``BlockAttnRes`` itself.
    """

    module: BlockAttnRes

    def __str__(self) -> str:
        block = "-" if self.block is None else str(self.block)
        return (f"Site({self.index}: {self.name}, kind={self.kind}, block={block}, "
                f"stream={self.stream}, sources={self.num_sources})")


def _unwrap(module: nn.Module) -> nn.Module:
    return getattr(module, "_orig_mod", module)


def sites(module: nn.Module) -> list[Site]:
    """Every injected ``BlockAttnRes`` of a rewritten model, in execution order, final ones last per stream."""
    found = []
    for name, sub in _unwrap(module).named_modules():
        record = getattr(sub, "site", None)
        if isinstance(sub, BlockAttnRes) and record is not None:
            found.append(Site(**{**asdict(record), "name": name}, module=sub))
    return sorted(found, key=lambda s: s.index)


def detect(model: nn.Module, example_inputs: tuple | None = None, *, example_kwargs: dict | None = None,
           tracer: str = "auto", dynamic_shapes: Any = None) -> ResidualStreams:
    """Dry run: trace ``model`` and return the residual streams found, without rewriting anything.

    ``print(detect(model))`` shows one row per site: layer, kind, whether the branch reads the stream
    through a norm. The returned object also lists every add that was rejected, and why.
    """
    traced = trace(model, _as_tuple(example_inputs), example_kwargs, tracer, dynamic_shapes)
    return detect_residual_streams(traced.graph_module)


def attnresify(model: nn.Module, example_inputs: tuple | None = None, *, example_kwargs: dict | None = None,
               num_blocks: int | None = None, block_size: int | None = None, preserve_scale: bool = False,
               tracer: str = "auto", dynamic_shapes: Any = None, eps: float = DEFAULT_EPS) -> fx.GraphModule:
    """Return a copy of ``model`` whose residual stream(s) use Block Attention Residuals.

    Args:
        model: a pre-norm Transformer (any ``nn.Module`` whose graph has a residual-add chain).
        example_inputs: positional inputs (a tuple, or one tensor). Needed by ``tracer="export"``;
            when given, the rewritten module is run once on them to check it works.
        example_kwargs: keyword inputs, with ``example_inputs``.
        num_blocks: target number of blocks N per stream (default 8); ``block_size = ceil(M / num_blocks)``
            for the M residual sites of each stream.
        block_size: sites per block S; wins over the default ``num_blocks``. ``1`` is Full AttnRes.
            Passing both is allowed only when they agree (``ceil(M / block_size) == num_blocks`` for
            every stream); otherwise ``ValueError``.
        preserve_scale: multiply every aggregate by its number of sources, so that at zero init the
            rewritten model computes exactly the original function on any architecture. ``False`` (the
            paper's convex combination) is identical only up to the pre-norms' ``eps``.
        tracer: ``"auto"`` (fx, then export), ``"fx"`` or ``"export"``.
        dynamic_shapes: passed to ``torch.export`` (default: batch and sequence dims dynamic).
        eps: epsilon of the keys' RMSNorm.

    The user's module is not modified: no attribute, parameter value or ``state_dict`` key of it
    changes. The returned ``GraphModule`` *shares* the original parameter tensors (no copy is made), so
    training the rewritten model updates the original's weights too; ``copy.deepcopy`` the result (or
    the model first) to decouple them.
    """
    _check_arguments(model, num_blocks, block_size)
    example_inputs = _as_tuple(example_inputs)
    traced = trace(model, example_inputs, example_kwargs, tracer, dynamic_shapes)
    gm = traced.graph_module
    if traced.frontend == "fx" and example_inputs is not None and not example_kwargs:
        _propagate_shapes(gm, example_inputs)
    detection = detect_residual_streams(gm)
    _check_detection(model, detection)
    raw = [f"{s.owner or s.add.name} ({s.kind})" for st in detection.streams for s in st.sites if not s.normalised]
    if raw and not preserve_scale:
        warnings.warn(
            f"{len(raw)} residual site(s) read the stream without a norm: {', '.join(raw)}. With "
            "preserve_scale=False the aggregates are averages, not sums, so the converted model will not "
            "start out identical to the original; pass preserve_scale=True for an exact conversion.",
            AttnResWarning, stacklevel=2)
    _check_sizes_agree(detection, num_blocks, block_size)
    rewrite = BlockAttnResRewrite(detection, block_sizes(detection, num_blocks or DEFAULT_NUM_BLOCKS, block_size),
                                  preserve_scale=preserve_scale, eps=eps, protected_modules=model.modules())
    rewrite(gm)
    gm.meta["attnres"] = {"frontend": traced.frontend, "block_sizes": rewrite.block_sizes,
                          "preserve_scale": preserve_scale, "num_sites": len(rewrite.records)}
    if example_inputs is not None or example_kwargs:
        _smoke_run(gm, example_inputs or (), example_kwargs or {})
    return gm


def _as_tuple(example_inputs) -> tuple | None:
    if example_inputs is None or isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _check_arguments(model, num_blocks, block_size) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if any(isinstance(m, BlockAttnRes) for m in _unwrap(model).modules()):
        raise ValueError("model: it already contains BlockAttnRes modules (was it rewritten before?); "
                         "pass the original model")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size < 1):
        raise ValueError(f"block_size must be a positive int (sites per block), got {block_size!r}")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                   or num_blocks < 1):
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")


def _check_sizes_agree(detection: ResidualStreams, num_blocks: int | None, block_size: int | None) -> None:
    if num_blocks is None or block_size is None:
        return
    for index, stream in enumerate(detection.streams):
        implied = math.ceil(len(stream.sites) / block_size)
        if implied != num_blocks:
            raise ValueError(
                f"block_size={block_size} and num_blocks={num_blocks} disagree: stream {index} has "
                f"{len(stream.sites)} residual sites, so block_size={block_size} makes {implied} blocks. "
                "Pass only one of them.")


def _check_detection(model: nn.Module, detection: ResidualStreams) -> None:
    if detection.streams:
        return
    name = type(model).__name__
    if detection.post_norm:
        raise UnsupportedArchitectureError(
            f"{name} is a post-norm Transformer: each residual sum is normalised before the next layer "
            f"reads it (h' = norm(h + f(h)), at {', '.join(detection.post_norm[:6])}"
            f"{'...' if len(detection.post_norm) > 6 else ''}). Block AttnRes needs a pre-norm residual "
            "stream h' = h + f(norm(h)) whose raw sources (embedding and sublayer outputs) can be "
            "attended over; in a post-norm model there is no such stream, so AttnRes does not apply.")
    seen = "\n".join(f"  - {r}" for r in detection.rejected) or "  (the graph has no tensor adds)"
    raise NoResidualStreamError(
        f"no residual stream found in {name}. Adds seen and why each was rejected:\n{seen}",
        [(r.node, r.owner, r.reason) for r in detection.rejected])


def _propagate_shapes(gm: fx.GraphModule, args: tuple) -> None:
    """Record each node's shape (``tensor_meta``) so the rewrite reads the hidden size off the graph."""
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*args)
    except Exception as err:  # noqa: BLE001 - reported with context below
        raise AttnResError(f"the traced model failed on the example inputs: {type(err).__name__}: {err}") from err


def _smoke_run(gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
    try:
        with torch.no_grad():
            gm(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - reported with context below
        raise AttnResError(f"the rewritten module failed on the example inputs: "
                           f"{type(err).__name__}: {err}") from err
