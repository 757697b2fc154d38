"""Live routing: every call of a converted model runs the Block AttnRes rewrite of the graph captured for it.

A converted model keeps its class, submodules and methods. What changes:

- the ``BlockAttnRes`` modules of the plan are registered where the plan names them
  (``model.layers.3.attn_res``, ``model.final_res``): ordinary parameters for optimizers, ``state_dict``,
  ``.to()``, DDP;
- the root and every module that owns a stream (``model``, ``encoder``, ``decoder``: a Hugging Face
  ``generate`` calls an encoder on its own) get a :class:`Router` as their instance attribute ``forward``.

A call goes ``module(...)`` -> ``nn.Module.__call__`` (hooks of the module itself as usual) ->
``Router`` -> TorchDynamo (``fullgraph``) on the module's own ``forward``. Dynamo captures one graph per
call signature, train/eval mode, dtype and shape class, with guards and recompilation as for any
``torch.compile``; :class:`AttnResBackend` copies each graph, detects its streams, matches them with the
plan by their signature (a stream that does not match raises :class:`~attnres_fx.StreamMismatchError`),
rewrites them, and runs the result eagerly (calling the model's own ``BlockAttnRes`` modules) or hands
it to Inductor (:func:`attnres_fx.compile`; the pseudo-queries and key norms are then extra graph
inputs). Routed modules reached inside that capture (the
encoder within the root's call) are traced as written, so one graph holds every stream of the call.

What a Dynamo graph keeps, the converted model keeps: keyword and optional arguments, ``no_grad`` and
autocast regions, dropout in train mode, hooks on submodules (traced into the graph, with guards so that
a hook added later triggers a new capture), KV caches. Pickling keeps the routing: a ``Router`` pickles
without its compiled state and compiles again at its first call.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from attnres_fx.block_attnres import BlockAttnRes
from attnres_fx.errors import AttnResError, RoutingError, TraceError
from attnres_fx.passes.checkpoints import close_checkpoints, open_checkpoints
from attnres_fx.passes.detect import detect_residual_streams
from attnres_fx.passes.plan import Plan, match_streams
from attnres_fx.passes.rewrite import BlockAttnResRewrite, ModuleCalls, ParameterInputs

from .capture import STATE, capturing, entry_function

COMPILERS = ("eager", "inductor")
LOG = logging.getLogger("attnres_fx")
# Dynamo's default is 8 graphs per code object; one converted module can legitimately need more (train
# and eval, two dtypes, prefill and decode, static and dynamic shapes).
RECOMPILE_LIMIT = 64


@dataclass
class Conversion:
    """What ``attnresify`` did to a model: the plan, the routed modules, the compiler the routes use."""

    plan: Plan
    routed: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)     # the attnresify arguments that made the plan
    compiler: str = "eager"
    compile_options: dict[str, Any] = field(default_factory=dict)


class Router:
    """``module.forward`` of a routed module; see the module docstring.

    ``root`` is the converted model (it holds the AttnRes modules and the :class:`Conversion`), ``path``
    this module's path in it.
    """

    is_attnres_router = True          # what attnres_fx.capture looks for

    def __init__(self, root: nn.Module, module: nn.Module, path: str, conversion: Conversion):
        self.root = root
        self.module = module
        self.path = path
        self.conversion = conversion
        # One Dynamo entry per compiler: a temporary switch to eager (:func:`eager_route`) keeps the
        # compiled route's graphs, and the eager ones serve the next switch.
        self._entries: dict[str, Any] = {}

    @property
    def __signature__(self) -> inspect.Signature:
        # What inspect.signature(model.forward) reports: Hugging Face generate() and Trainer read it.
        return inspect.signature(type(self.module).forward.__get__(self.module))

    @property
    def __wrapped__(self):
        return type(self.module).forward.__get__(self.module)

    @property
    def __code__(self):
        # torch.export reads the code of forward before calling it.
        return type(self.module).forward.__code__

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_entries": {}}

    def __repr__(self) -> str:
        return f"<attnres_fx routed forward of {type(self.module).__name__} at {self.path or '<root>'}>"

    def __call__(self, *args, **kwargs):
        if STATE.depth:
            # Traced inside an attnres_fx capture (of this model or a parent): the code as written.
            return type(self.module).forward(self.module, *args, **kwargs)
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return self._under_foreign_compiler(*args, **kwargs)
        with capturing():
            try:
                return self.entry(self.module, *args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as err:
                if isinstance(err.inner_exception, AttnResError):
                    raise err.inner_exception.with_traceback(None) from err
                raise
            except torch._dynamo.exc.Unsupported as err:
                raise TraceError(_graph_break_message(self, err), {"dynamo": err}) from err
            finally:
                _HookGuards.restore()

    @property
    def entry(self):
        """The Dynamo-compiled entry of this module for the conversion's compiler: built at its first
        call, again after a pickle or :func:`set_compiler`."""
        compiler = self.conversion.compiler
        if compiler not in self._entries:
            # Eager runs gain nothing from static shapes: capture with dynamic ones from the start, so
            # that a new length or batch reuses the graph (generate: prefill, then every decode step).
            # Inductor specialises first and makes a dimension dynamic once it changes.
            dynamic = True if compiler == "eager" else None
            self._entries[compiler] = torch.compile(
                entry_function(type(self.module).forward), backend=AttnResBackend(self, compiler),
                fullgraph=True, dynamic=dynamic, recompile_limit=RECOMPILE_LIMIT)
        return self._entries[compiler]

    def reset(self) -> None:
        self._entries.clear()

    @torch._dynamo.disable(reason=(
        "a model converted by attnres_fx runs its AttnRes rewrite through its own TorchDynamo route; "
        "torch.compile(model) cannot include it in its graph. Use attnres_fx.compile(model) for Inductor "
        "(without fullgraph=True, torch.compile(model) works too: this call then runs the AttnRes route)"))
    def _under_foreign_compiler(self, *args, **kwargs):
        if torch.compiler.is_exporting():
            raise RoutingError(
                f"torch.export of a model converted by attnres_fx ({type(self.root).__name__}): the AttnRes "
                "rewrite is applied to the graphs attnres_fx captures itself. Use attnres_fx.rewrite(model, "
                "example_inputs) for an explicit graph, or attnres_fx.export.to_onnx(model, ...).")
        return self(*args, **kwargs)


class _HookGuards:
    """Make Dynamo guard on *empty* hook dicts of the captured modules, so that a hook registered after a
    call is not silently ignored: ``skip_nnmodule_hook_guards`` is read when guards are built, right
    after the backend returns; the router restores the user's setting once the call is over."""

    saved: bool | None = None

    @classmethod
    def enable(cls) -> None:
        if cls.saved is None:
            cls.saved = torch._dynamo.config.skip_nnmodule_hook_guards
            torch._dynamo.config.skip_nnmodule_hook_guards = False

    @classmethod
    def restore(cls) -> None:
        if cls.saved is not None:
            torch._dynamo.config.skip_nnmodule_hook_guards = cls.saved
            cls.saved = None


class AttnResBackend:
    """The Dynamo backend of one router: rewrite the captured graph as planned, then run or compile it."""

    def __init__(self, router: Router, compiler: str):
        self.router = router
        self.compiler = compiler

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        start = time.perf_counter()
        compiled = self._rewrite(gm, example_inputs)
        LOG.info("rewrote the graph Dynamo captured for a call of %s (%s route) in %.2f s", _where(self.router),
                 self.compiler, time.perf_counter() - start)
        return compiled

    def _rewrite(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        _HookGuards.enable()
        router = self.router
        conversion = router.conversion
        # Dynamo's own graph must stay as it is (its bookkeeping refers to it): rewrite a copy.
        graph_module = fx.GraphModule(gm, _copy_graph(gm.graph), class_name=type(router.module).__name__)
        regions = open_checkpoints(graph_module)
        detection = detect_residual_streams(graph_module)
        streams = match_streams(detection, conversion.plan, prefix=router.path, where=_where(router))
        if self.compiler == "eager":
            # The model's own BlockAttnRes modules are called: hooks on them fire, as on any submodule.
            modules = {site.name: router.root.get_submodule(site.name) for s in streams for site in s.sites}
            BlockAttnResRewrite(conversion.plan, detection, ModuleCalls(graph_module, modules),
                                streams=streams)(graph_module)
            close_checkpoints(graph_module, regions)
            return graph_module.forward
        # Inductor takes parameters as graph inputs only (they then get gradients through AOTAutograd).
        emitter = ParameterInputs(conversion.plan)
        BlockAttnResRewrite(conversion.plan, detection, emitter, streams=streams)(graph_module)
        close_checkpoints(graph_module, regions)
        weights = _WeightReader(router.root, emitter.names)
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(graph_module, [*example_inputs, *weights.fake(example_inputs)],
                              config_patches=conversion.compile_options or None)
        return _RoutedGraph(compiled, weights)


class _WeightReader:
    """The AttnRes weights a rewritten graph takes as extra inputs, read from the model at every call
    (so ``.to()``, ``load_state_dict(assign=True)`` and optimizer steps are seen)."""

    def __init__(self, root: nn.Module, names: list[str]):
        self.names = names
        self.holders = [(root.get_submodule(name.rsplit(".", 2)[0]), *name.rsplit(".", 2)[1:]) for name in names]

    def read(self) -> list[torch.Tensor]:
        return [getattr(getattr(module, child), attr) for module, child, attr in self.holders]

    def fake(self, example_inputs: list) -> list[torch.Tensor]:
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        tensors = self.read()
        return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors] if fake_mode else tensors


class _RoutedGraph:
    """Dynamo calls this with the graph's own inputs; the AttnRes weights are appended."""

    def __init__(self, compiled, weights: _WeightReader):
        self.compiled = compiled
        self.weights = weights

    def __call__(self, *args):
        return self.compiled(*args, *self.weights.read())


def _graph_break_message(router: Router, err: Exception) -> str:
    lines = [f"TorchDynamo could not capture this call of {_where(router)} as one graph: "
             f"{type(err).__name__}: {str(err).strip().splitlines()[0]}",
             "A converted model runs each call as one Dynamo graph (fullgraph), so that every residual "
             "stream is rewritten whole; a graph break would leave part of a stream unconverted."]
    if _has_sharded_submodules(router.module):
        lines.append("Here: FSDP2's fully_shard was applied to submodules (per layer); its hooks are kept out "
                     "of Dynamo graphs, which splits the stream at every layer. Shard the root module only "
                     "(fully_shard(model)), or use DistributedDataParallel.")
    else:
        lines.append("Remove the construct named above from forward() (data-dependent Python control flow, "
                     "print, an unsupported library call); the full report is this error's __cause__.")
    return "\n".join(lines)


def _has_sharded_submodules(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules() if m is not module)


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    output = copied.graph_copy(graph, {})
    copied.output(output)
    return copied


def _where(router: Router) -> str:
    return f"{type(router.module).__name__} at '{router.path}'" if router.path else type(router.module).__name__


def routers(model: nn.Module) -> list[Router]:
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), Router)]


def conversion_of(model: nn.Module) -> Conversion | None:
    """The conversion of a converted model (``None`` for any other module)."""
    router = model.__dict__.get("forward")
    return router.conversion if isinstance(router, Router) and router.root is model else None


def install(model: nn.Module, plan: Plan, modules: dict[str, BlockAttnRes], options: dict[str, Any]) -> Conversion:
    """Register the AttnRes modules and the routers on ``model``; all or nothing."""
    routed = tuple(dict.fromkeys(["", *(s.owner for s in plan.streams)]))
    targets = [(path, model.get_submodule(path)) for path in routed]
    for path, module in targets:
        if "forward" in module.__dict__:
            raise RoutingError(
                f"{type(module).__name__} at '{path or '<root>'}' has an instance attribute 'forward' (a "
                f"wrapper installed by another library, e.g. accelerate's device-map hooks: "
                f"{module.__dict__['forward']!r}); attnres_fx routes calls through forward itself. Convert "
                "the model before adding such wrappers.")
    conversion = Conversion(plan, routed, dict(options))
    registered: list[tuple[nn.Module, str]] = []
    try:
        for name, module in modules.items():
            parent, _, attribute = name.rpartition(".")
            holder = model.get_submodule(parent)
            holder.add_module(attribute, module)
            registered.append((holder, attribute))
        for path, module in targets:
            module.forward = Router(model, module, path, conversion)
    except BaseException:
        for holder, attribute in registered:
            delattr(holder, attribute)
        for _, module in targets:
            module.__dict__.pop("forward", None)
        raise
    return conversion


def uninstall(model: nn.Module, conversion: Conversion) -> None:
    """Undo :func:`install`: the AttnRes modules and routers go; nothing else was touched."""
    for site in conversion.plan.sites:
        parent, _, attribute = site.name.rpartition(".")
        delattr(model.get_submodule(parent), attribute)
    for path in conversion.routed:
        model.get_submodule(path).__dict__.pop("forward", None)


@contextlib.contextmanager
def eager_route(model: nn.Module):
    """Within: the calls of the converted ``model`` take the eager route, whatever its compiler, so that
    its ``BlockAttnRes`` modules run as modules (their hooks fire). The compiled route's graphs are
    kept: after the block the model runs them again without recompiling."""
    conversion = conversion_of(model)
    if conversion is None:
        raise ValueError(f"model: eager_route needs a converted model, got a {type(model).__name__}")
    compiler = conversion.compiler
    conversion.compiler = "eager"
    try:
        yield model
    finally:
        conversion.compiler = compiler


def set_compiler(model: nn.Module, conversion: Conversion, compiler: str, options: dict[str, Any]) -> None:
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    conversion.compiler = compiler
    conversion.compile_options = dict(options)
    for router in routers(model):
        router.reset()
