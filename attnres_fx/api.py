"""Public entry points: convert a model in place, undo it, compile it, inspect it, get an explicit graph.

The pipeline: capture (:mod:`attnres_fx.capture.tracers`) -> detect (:mod:`attnres_fx.passes.detect`) -> plan
(:mod:`attnres_fx.passes.plan`) -> rewrite (:mod:`attnres_fx.passes.rewrite`, at every routed call:
:mod:`attnres_fx.routing`) -> schedule (:mod:`attnres_fx.passes.two_phase`) -> hand-off
(:mod:`attnres_fx.export`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import torch
from torch import fx, nn

from attnres_fx.passes.detect import Detection, detect_residual_streams
from attnres_fx.passes.pipeline import rewrite_captured
from attnres_fx.passes.plan import Plan, make_plan
from attnres_fx.passes.provenance import modules_not_run
from attnres_fx.passes.rewrite import ModuleCalls, new_modules

from . import routing
from .op.module import BlockAttnRes
from .config import AttnResConfig
from .capture.tracers import (as_args, capture_dynamo, capture_for_plan, default_call, plan_inputs, ready_to_capture,
                              trace)
from .capture.recording import MODULE_CALLS
from .routing import trial
from .compat import unwrapped, wrappers
from .conversion import conversion_of, require, stats
from .conversion import conversion_options, is_converted, plan_of, sites  # noqa: F401 - the public face
from .errors import AttnResWarning, NoResidualStreamError, RoutingError, UnsupportedArchitectureError

DETECT_TRACERS = ("auto", "dynamo", "fx", "export")
LOG = logging.getLogger("attnres_fx")


def attnresify(model: nn.Module, example_inputs: Any = None, *, example_kwargs: dict | None = None,
               config: AttnResConfig | None = None, **options: Any) -> nn.Module:
    """Convert ``model`` in place to Block Attention Residuals and return it (the same object).

    The model keeps its class, submodules, methods, call signature and train/eval behaviour. It gains one
    ``BlockAttnRes`` per sublayer of each residual stream, on the module that performs the residual add
    (``model.layers.3.attn_res``, ``model.layers.3.mlp_res``) and one per stream before its final norm
    (``model.final_res``), and every call runs the AttnRes rewrite of the graphs TorchDynamo captures for
    it (:mod:`attnres_fx.routing`).

    Args:
        model: a pre-norm Transformer (any ``nn.Module`` whose graph has a residual-add chain). A
            ``torch.compile`` or PEFT wrapper is converted through the model it wraps (both then count
            as converted; ``remove`` takes either).
        example_inputs: positional inputs as the model is called (a tensor, tuple or list). The model is
            captured with them by TorchDynamo on fake tensors; nothing runs for real. Without them a
            Hugging Face model is captured with dummy inputs from its config, any other model with
            ``torch.fx`` symbolic tracing.
        example_kwargs: keyword inputs (a dict).
        config: the options below as one :class:`~attnres_fx.AttnResConfig`; keyword options given
            beside it replace its fields.

    Options (keyword arguments, or fields of ``config``):
        num_blocks: target number of blocks N per stream (default 8); ``block_size = ceil(M / N)`` for
            the M residual sites of a stream.
        block_size: sites per block S; wins over the default ``num_blocks``; ``1`` is Full AttnRes.
            Passing both is allowed only when they agree for every stream.
        preserve_scale: multiply every aggregate by its number of sources, so that at zero init the
            converted model computes exactly the original function on any architecture. ``False`` (the
            paper's convex combination) is identical only up to the pre-norms' ``eps``.
        eps: epsilon of the keys' RMSNorm (a positive number).
        allow_partial: convert the residual streams even where an add that continues one is no
            residual site (a bias added between layers, a long skip that adds an earlier value of the
            stream back): such adds stay plain adds, reading the aggregate that stands for the
            stream value they read. By default they raise :class:`~attnres_fx.UnsupportedArchitectureError` naming
            them; ``print(attnres_fx.detect(model, ...))`` lists them too.
        route: how calls run (:mod:`attnres_fx.routing`). ``"layer"``: every module that performs residual
            sites (a transformer block) runs its own rewritten graph, the completed block sums passed
            along with the stream, and the code around the blocks runs as written; what per-block
            ``fully_shard``, activation checkpointing, pipeline stages and per-block compilation need.
            ``"model"``: each call of the model is one rewritten graph. ``"auto"`` (the default): the
            layer route for every stream that passes between its blocks untouched, the model route for
            the others. ``attnres_fx.plan_of(model).table()`` shows each site's route.

    Conversion is atomic: on any error the model is exactly as before. Undo it with :func:`remove`.
    """
    config = _config(config, options)
    _check_arguments(model, example_inputs, example_kwargs)
    wrapper, model = model, unwrapped(model)
    num_blocks, block_size, preserve_scale = config.num_blocks, config.block_size, config.preserve_scale
    eps, allow_partial, route = config.eps, config.allow_partial, config.route
    if conversion_of(model) is not None:
        raise RoutingError(f"{type(model).__name__} is already converted (attnres_fx.sites(model) lists its "
                           "sites); call attnres_fx.remove(model) first to convert it again")
    _refuse_synchronised_wrapper(wrapper, model)
    start = time.perf_counter()
    example_inputs = as_args(example_inputs)
    with ready_to_capture(model):
        stats.captures += 1
        traced = capture_for_plan(model, example_inputs, example_kwargs)
        detection = detect_residual_streams(traced.graph_module)
        _check_detection(model, detection, allow_partial)
        _warn_raw_reads(detection, preserve_scale)
        _warn_not_run(model, traced.graph_module, example_inputs is None and example_kwargs is None)
        plan = make_plan(detection, dict(model.named_modules()), num_blocks=num_blocks, block_size=block_size,
                         preserve_scale=preserve_scale, eps=eps, route=route)
        modules = new_modules(plan, like=model)
    # Outside the capture's setting: the blocks are prepared as the model's first call will find them (without
    # the output recorders the capture installed, which would put them on TorchDynamo).
    prepared = _try_routes(model, plan, modules, traced, example_inputs, example_kwargs, config)
    if prepared is not None:
        call = default_call(model, example_inputs, example_kwargs)
        if call is not None:
            trial.try_default_call(model, plan, modules, prepared, call)
        captured = plan_inputs(model, example_inputs, example_kwargs)
        trial.try_other_mode(model, plan, modules, prepared,
                             [(each, each is captured) for each in (captured, call) if each is not None])
    routing.install(model, plan, modules, config, prepared).captured_training = model.training
    LOG.info("converted %s in %.1f s (%s capture): %d sites in %d stream(s), block sizes %s, routes %s",
             type(model).__name__, time.perf_counter() - start, traced.frontend, len(plan.sites),
             len(plan.streams), ", ".join(map(str, plan.block_sizes)), ", ".join(plan.routes))
    return wrapper


def convert_as_planned(model: nn.Module, plan: Plan, config: AttnResConfig) -> nn.Module:
    """Convert ``model`` in place to ``plan``, made by an earlier conversion of a model of its architecture
    and size (a saved checkpoint's, :mod:`attnres_fx.integrations.checkpoint`), with the ``config`` that
    made it: the AttnRes modules registered and the calls routed as :func:`attnresify` would, without
    capturing the model, so its weights may still be on the meta device. The caller has checked that the
    plan's modules are the model's; the plan is checked against the model's graphs by its routes, which
    make them at the first call (a block that holds other sites than planned raises
    :class:`~attnres_fx.StreamMismatchError` naming it), as they do for every call shape a conversion's
    trial did not see. Returns ``model``."""
    wrapper, model = model, unwrapped(model)
    if conversion_of(model) is not None:
        raise RoutingError(f"{type(model).__name__} is already converted; call attnres_fx.remove(model) first")
    routing.install(model, plan, new_modules(plan, like=model), config)
    LOG.info("converted %s from its saved plan: %d sites in %d stream(s), block sizes %s, routes %s",
             type(model).__name__, len(plan.sites), len(plan.streams), ", ".join(map(str, plan.block_sizes)),
             ", ".join(plan.routes))
    return wrapper


def _refuse_synchronised_wrapper(wrapper: nn.Module, model: nn.Module) -> None:
    """DistributedDataParallel fixes the parameters whose gradients it averages across ranks when it is
    built: AttnRes parameters added inside it would train apart on every rank."""
    if any(isinstance(module, nn.parallel.DistributedDataParallel) for module in wrappers(wrapper)):
        raise RoutingError(f"{type(model).__name__} is inside a DistributedDataParallel, which synchronises only "
                           "the parameters it had when it was built: the AttnRes parameters would not be averaged "
                           "across ranks. Convert the model first, then wrap it: "
                           "DistributedDataParallel(attnres_fx.attnresify(model, ...))")


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`attnresify` in place: the AttnRes modules and the routing go; forward, ``state_dict``
    keys and outputs are the original's again. Returns ``model``."""
    conversion = require(model, "remove")
    routing.uninstall(unwrapped(model), conversion)
    return model


def compile(model: nn.Module, **inductor_options) -> nn.Module:  # noqa: A001 - mirrors torch.compile
    """Route the converted ``model``'s calls through Inductor, in place, and return it.

    The same routing as eager (one Dynamo graph per call signature and mode, ``fullgraph``: a graph break
    is an error), with each rewritten graph compiled by Inductor; the AttnRes weights are graph inputs,
    so they get gradients. ``inductor_options`` are Inductor config patches (e.g. ``max_autotune=True``).
    ``attnres_fx.compile(model, backend="eager")`` switches back to eager execution.
    """
    conversion = require(model, "compile")
    compiler = inductor_options.pop("backend", "inductor")
    routing.set_compiler(unwrapped(model), conversion, compiler, inductor_options)
    return model


def rewrite(model: nn.Module, example_inputs: Any = None, *, example_kwargs: dict | None = None,
            tracer: str = "auto", dynamic_shapes: Any = None) -> fx.GraphModule:
    """An explicit ``GraphModule`` of the converted ``model``: its AttnRes rewrite as one graph, for
    export (:func:`attnres_fx.export.to_onnx`) and inspection.

    ``tracer``: ``"fx"`` (symbolic tracing), ``"export"`` (``torch.export``, batch and sequence dynamic;
    needs example inputs) or ``"auto"`` (fx, then export). The graph calls the model's own
    ``BlockAttnRes`` modules and shares all its weights: it computes what the model computes now, and
    follows later training. A graph made by ``torch.export`` is fixed to the model's train/eval mode at
    the time of the call. The model is not modified.
    """
    require(model, "rewrite")
    model = unwrapped(model)
    return explicit_graph(model, model, "", example_inputs, example_kwargs, tracer, dynamic_shapes)


def explicit_graph(root: nn.Module, model: nn.Module, within: str, example_inputs: Any, example_kwargs: dict | None,
                   tracer: str, dynamic_shapes: Any = None) -> fx.GraphModule:
    """The explicit graph of ``root``, a module that holds the converted ``model`` at path ``within``
    (``root`` itself when ``within`` is ``""``; a wrapper such as the ONNX decoder with a KV cache
    otherwise), its streams rewritten as ``model`` was converted."""
    conversion = conversion_of(model)
    traced = trace(root, as_args(example_inputs), example_kwargs, tracer, dynamic_shapes)
    gm = traced.graph_module
    modules = {site.name: model.get_submodule(site.name) for site in conversion.plan.sites}
    rewrite = rewrite_captured(gm, conversion.plan, lambda g: ModuleCalls(g, modules, prefix=within),
                               within=within, where=type(model).__name__).rewrite
    gm.meta["attnres"] = {"frontend": traced.frontend, "block_sizes": [s.planned.block_size for s in rewrite.spans],
                          "preserve_scale": conversion.plan.preserve_scale}
    return gm


def detect(model: nn.Module, example_inputs: Any = None, *, example_kwargs: dict | None = None,
           tracer: str = "auto", dynamic_shapes: Any = None) -> Detection:
    """Dry run: capture ``model`` and return the residual streams found, without changing anything.

    ``print(detect(model))`` shows one row per site: layer, kind, whether the branch reads the stream
    through a norm; ``.rejected`` lists every other add, and why; ``.unconverted`` the adds that
    continue a stream but are no site (:func:`attnresify` refuses them unless ``allow_partial=True``).
    ``tracer="auto"`` captures the way :func:`attnresify` does; ``"dynamo"``, ``"fx"`` and ``"export"``
    force one capture. On a converted model it shows the streams as the model was written.
    """
    if tracer not in DETECT_TRACERS:
        raise ValueError(f"tracer must be one of {DETECT_TRACERS}, got {tracer!r}")
    example_inputs = as_args(example_inputs)
    stats.captures += 1
    if tracer == "auto":
        gm = capture_for_plan(model, example_inputs, example_kwargs).graph_module
    elif tracer == "dynamo":
        gm, _ = capture_dynamo(model, example_inputs or (), dict(example_kwargs or {}))
    else:
        gm = trace(model, example_inputs, example_kwargs, tracer, dynamic_shapes).graph_module
    return detect_residual_streams(gm)


def _try_routes(model: nn.Module, plan, modules: dict, traced, example_inputs, example_kwargs,
                config: AttnResConfig):
    """Every route's rewrite tried before the model is touched (:mod:`attnres_fx.routing.trial`): a plan
    that cannot be applied fails here, not at the model's first call. Returns what the layer route's trial
    prepared, to install (``None``: nothing). A graph that is no recording (fx symbolic tracing,
    TorchDynamo's capture) is the routes' own IR: its rewrite is the trial."""
    calls = traced.graph_module.meta.get(MODULE_CALLS)
    if calls is None:
        rewrite_captured(traced.graph_module, plan, lambda g: ModuleCalls(g, modules), where=type(model).__name__)
        return None
    prepared = trial.try_layer_route(model, plan, modules, calls, config)
    if "model" in plan.routes:
        trial.try_model_route(model, plan, modules, plan_inputs(model, example_inputs, example_kwargs))
    return prepared


def _config(config: AttnResConfig | None, options: dict[str, Any]) -> AttnResConfig:
    """One config from ``config`` and the keyword options given beside it (they win)."""
    if config is not None and not isinstance(config, AttnResConfig):
        raise TypeError(f"config must be an attnres_fx.AttnResConfig, got {type(config).__name__}")
    known = AttnResConfig().options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"attnresify() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"its options are {', '.join(known)}")
    return dataclasses.replace(config or AttnResConfig(), **options)


def _check_arguments(model, example_inputs, example_kwargs) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedArchitectureError(
            f"model is a TorchScript module ({type(model).__name__}, made by torch.jit.script or "
            "torch.jit.trace): it has no Python forward for attnres_fx to capture and rewrite. Convert "
            "the original nn.Module, then script or export the converted one (attnres_fx.export).")
    if any(isinstance(m, BlockAttnRes) for m in model.modules()) and conversion_of(model) is None:
        raise ValueError("model: it already contains BlockAttnRes modules (is it an attnres_fx.rewrite "
                         "graph?); pass the original model")
    if example_inputs is not None and not isinstance(example_inputs, (torch.Tensor, tuple, list)):
        raise TypeError(f"example_inputs must be a tensor, a tuple or a list of the positional inputs, got "
                        f"{type(example_inputs).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}")


def _check_detection(model: nn.Module, detection: Detection, allow_partial: bool) -> None:
    name = type(model).__name__
    if detection.streams and detection.unconverted and not allow_partial:
        adds = "\n".join(f"  - {add}" for add in detection.unconverted)
        raise UnsupportedArchitectureError(
            f"the residual stream of {name} continues through adds or ops that are no residual site:\n{adds}\n"
            "Converting the rest would leave them as they are, so the model would be converted only in "
            "part. Pass allow_partial=True to do that anyway (each such add or op then reads the aggregate "
            "that stands for the stream value it read), or write the model so that these adds are residual "
            "sites.")
    if detection.streams:
        return
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


def _warn_not_run(model: nn.Module, graph_module, dummy_inputs: bool) -> None:
    """Name the parts of ``model`` the example call did not run: a residual stream inside them (a vision
    tower called without images) is left as it is, so the conversion covers the model only in part."""
    skipped = modules_not_run(graph_module, model)
    if skipped:
        given = "the model's dummy inputs" if dummy_inputs else "the example inputs"
        warnings.warn(
            f"{type(model).__name__}: the call with {given} did not run {', '.join(skipped)}; "
            "residual streams inside stay as they are (this conversion covers what that call ran). To convert "
            "them too, pass example inputs that run them (attnresify(model, example_kwargs={...}) with the "
            "inputs they take).", AttnResWarning, stacklevel=3)


def _warn_raw_reads(detection: Detection, preserve_scale: bool) -> None:
    raw = [f"{s.owner or s.add.name} ({s.kind})" for st in detection.streams for s in st.sites if not s.normalised]
    if raw and not preserve_scale:
        warnings.warn(
            f"{len(raw)} residual site(s) read the stream without a norm: {', '.join(raw)}. With "
            "preserve_scale=False the aggregates are averages, not sums, so the converted model will not "
            "start out identical to the original; pass preserve_scale=True for an exact conversion.",
            AttnResWarning, stacklevel=3)
