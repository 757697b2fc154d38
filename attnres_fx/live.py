"""Live routing: every call of a converted model runs the Block AttnRes rewrite of the graphs captured for it.

A converted model keeps its class, submodules and methods. What changes:

- the ``BlockAttnRes`` modules of the plan are registered where the plan names them
  (``model.layers.3.attn_res``, ``model.final_res``): ordinary parameters for optimizers, ``state_dict``,
  ``.to()``, DDP, FSDP2;
- some modules get a :class:`Router` as their instance attribute ``forward``, by route
  (:class:`~attnres_fx.passes.plan.StreamPlan`):

  - **layer route** (the default wherever a stream allows it, :mod:`attnres_fx.passes.layers`): every
    module that performs residual sites (a transformer block, ``model.layers.3``) gets a
    :class:`LayerRouter`; the code calling the blocks runs as written. A block's call is captured by
    TorchDynamo on its own, rewritten with the stream's state as extra inputs and outputs of its graph,
    and run; the state travels with the block's result (:mod:`attnres_fx.stream_state`). Per-block
    ``fully_shard``, activation checkpointing, pipeline stages and per-block compilation see one block at
    a time, as they do in the original model, and whatever Dynamo cannot capture outside the blocks
    (warnings, output-recording hooks, cache utilities) runs as in the original.
  - **model route**: the root and every module that owns such a stream (an encoder ``generate`` calls on
    its own) get a :class:`ModelRouter`: the whole call is captured as one graph and every stream in it is
    rewritten together.

A routed call goes ``module(...)`` -> ``nn.Module.__call__`` (the module's own hooks, FSDP2's among them,
as usual) -> the router -> TorchDynamo (``fullgraph``) on the module's own ``forward``. Dynamo captures one
graph per call signature, train/eval mode, dtype and shape class, with guards and recompilation as for
any ``torch.compile``; the backend copies each graph and runs the rewrite pipeline on it
(:func:`~attnres_fx.passes.pipeline.rewrite_captured`: a stream that does not match the plan raises
:class:`~attnres_fx.StreamMismatchError`), then runs the result eagerly (calling the model's own
``BlockAttnRes`` modules) or hands it to Inductor (:func:`attnres_fx.compile`; the pseudo-queries and key
norms are then extra graph inputs). Routed modules reached inside a capture run as written, so one graph
holds everything the capture covers.

What a Dynamo graph keeps, the converted model keeps: keyword and optional arguments, ``no_grad`` and
autocast regions, dropout in train mode, hooks on submodules (traced into the graph, with guards so that
a hook added later triggers a new capture), KV caches. Pickling keeps the routing: a router pickles
without its compiled state and compiles again at its first call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn

from attnres_fx.block_attnres import BlockAttnRes
from attnres_fx.errors import AttnResError, RoutingError, StreamMismatchError, TraceError, refuse_fullgraph_trace
from attnres_fx.passes.layers import LayerSpan
from attnres_fx.passes.pipeline import LayerTarget, rewrite_captured
from attnres_fx.passes.plan import Plan, StreamPlan
from attnres_fx.passes.rewrite import Entry, ModuleCalls, ParameterInputs, lift_attnres_weights
from attnres_fx.passes.two_phase import apply_two_phase

from . import compat
from .compat import pytree
from .capture import STATE, capturing, copy_graph_module, entry_function
from .diagnostics import first_line
from .config import AttnResConfig
from .conversion import Conversion, attach, conversion_of, detach
from .stream_state import StreamState, bundle, register, state_of, unbundle

COMPILERS = ("eager", "inductor")
LOG = logging.getLogger("attnres_fx")
# Dynamo's default is 8 graphs per code object; one converted module can legitimately need more (train
# and eval, two dtypes, prefill and decode, static and dynamic shapes).
RECOMPILE_LIMIT = 64


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
        # Dynamo entries by compiler (and layout of the stream's state): a temporary switch to eager
        # (:func:`eager_route`) keeps the compiled route's graphs, and the eager ones serve the next switch.
        self._entries: dict[Any, Any] = {}
        # The rewritten graphs of this module's calls so far, to read.
        self.rewritten: list[fx.GraphModule] = []

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
        return {**self.__dict__, "_entries": {}, "rewritten": []}

    def __repr__(self) -> str:
        return f"<attnres_fx {self.route_name}-routed forward of {type(self.module).__name__} at {self.path or '<root>'}>"

    def __call__(self, *args, **kwargs):
        if STATE.depth:
            # Traced inside an attnres_fx capture (of this model or a parent): the code as written.
            return type(self.module).forward(self.module, *args, **kwargs)
        if torch.compiler.is_exporting():
            return self._under_foreign_compiler(*args, **kwargs)
        if torch.compiler.is_compiling():
            _refuse_foreign_fullgraph(_where(self))
            return self._under_foreign_compiler(*args, **kwargs)
        return self.route(*args, **kwargs)

    def route(self, *args, **kwargs):
        raise NotImplementedError

    @functools.cached_property
    def _checkpointing_flag_holders(self) -> tuple[nn.Module, ...]:
        # Found once: the module tree does not change after conversion, and every call runs through it.
        return compat.checkpointing_flag_holders(self.module)

    def entry(self, key, backend, forward: Callable | None = None):
        """The Dynamo-compiled entry of this module's ``forward`` (its class's, by default) for the
        conversion's compiler and ``key``: built at its first call, again after a pickle or
        :func:`set_compiler`."""
        compiler = self.conversion.compiler
        forward = forward or type(self.module).forward
        key = (key, forward)
        if (compiler, key) not in self._entries:
            # Eager runs gain nothing from static shapes: capture with dynamic ones from the start, so
            # that a new length or batch reuses the graph (generate: prefill, then every decode step).
            # Inductor specialises first and makes a dimension dynamic once it changes.
            dynamic = True if compiler == "eager" else None
            self._entries[compiler, key] = torch.compile(
                entry_function(forward), backend=backend(compiler), fullgraph=True,
                dynamic=dynamic, recompile_limit=RECOMPILE_LIMIT)
        return self._entries[compiler, key]

    def run(self, entry, *args, **kwargs):
        with (capturing(), compat.compiling_despite_force_eager(),
              compat.hf_inner_checkpointing_flags_off(self._checkpointing_flag_holders)):
            try:
                return entry(self.module, *args, **kwargs)
            except compat.BackendCompilerFailed as err:
                if isinstance(err.inner_exception, AttnResError):
                    raise err.inner_exception.with_traceback(None) from err
                raise
            except compat.DynamoUnsupported as err:
                raise TraceError(_graph_break_message(self, err), {"dynamo": err}) from err
            finally:
                _HookGuards.restore()

    def reset(self) -> None:
        self._entries.clear()
        self.rewritten.clear()

    @torch.compiler.disable(reason=(
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


class ModelRouter(Router):
    """The model route: the whole call of the module as one graph, every stream in it rewritten."""

    route_name = "model"

    def route(self, *args, **kwargs):
        compat.install_output_recorders_for_call(self.module, kwargs)
        return self.run(self.entry(None, self._backend), *args, **kwargs)

    def _backend(self, compiler: str):
        def backend(gm: fx.GraphModule, example_inputs: list):
            start = time.perf_counter()
            compiled, _ = _rewritten(self, gm, example_inputs, compiler)
            LOG.info("rewrote the graph Dynamo captured for a call of %s (%s route) in %.2f s", _where(self),
                     compiler, time.perf_counter() - start)
            return compiled
        return backend


@dataclass(frozen=True)
class _Layout:
    """What a layer's rewritten graph depends on besides what Dynamo guards: where the stream's state is
    (``position``), how many blocks it holds, whether it has a partial sum, and for each of its tensors
    the dtype, whether it needs a gradient and whether it has the carrier's shape (else its shape)."""

    position: int
    blocks: int
    has_partial: bool
    tensors: tuple


class _LayerCall:
    """One call of a layer-routed module: the state tensors its graph takes, and what the graph gave back
    (set by :class:`_LayerGraph`)."""

    def __init__(self, state_tensors: tuple[torch.Tensor, ...]):
        self.state_tensors = state_tensors
        self.carrier: torch.Tensor | None = None
        self.state_out: tuple[torch.Tensor, ...] = ()
        self.start: torch.Tensor | None = None
        self.next_position = 0


_CALLS = threading.local()
_INTERCEPTORS = threading.local()


@contextlib.contextmanager
def intercepting(interceptor):
    """Within: every call of a layer-routed module of ``interceptor.conversion`` goes to
    ``interceptor.intercept(router, args, kwargs, proceed)``, where ``proceed(*args, **kwargs)`` runs the
    call as usual (:mod:`attnres_fx.pipelining`: stage boundaries, and the probe that prepares them)."""
    stack = _INTERCEPTORS.__dict__.setdefault("stack", [])
    stack.append(interceptor)
    try:
        yield interceptor
    finally:
        stack.remove(interceptor)


@contextlib.contextmanager
def _active(call: _LayerCall):
    stack = _CALLS.__dict__.setdefault("stack", [])
    stack.append(call)
    try:
        yield call
    finally:
        stack.pop()


class LayerRouter(Router):
    """The layer route for one module that performs residual sites (``span``) of stream
    ``stream``: see the module docstring and :mod:`attnres_fx.stream_state`."""

    route_name = "layer"

    def __init__(self, root: nn.Module, module: nn.Module, path: str, conversion: Conversion, stream: int,
                 span: LayerSpan):
        super().__init__(root, module, path, conversion)
        self.stream = stream
        self.span = span

    @property
    def planned(self) -> StreamPlan:
        return self.conversion.plan.streams[self.stream]

    @property
    def ends(self) -> bool:
        return self.span.stop == self.planned.num_positions

    def route(self, *args, **kwargs):
        checkpointing = compat.hf_layer_checkpointing(self.module)
        if checkpointing is not None:
            return self._checkpointed(*checkpointing, args, kwargs)
        return self._intercepted(args, kwargs, self.proceed)

    def _intercepted(self, args, kwargs, proceed):
        for interceptor in reversed(_INTERCEPTORS.__dict__.get("stack") or ()):
            if interceptor.conversion is self.conversion:
                return interceptor.intercept(self, args, kwargs, proceed)
        return proceed(*args, **kwargs)

    def _checkpointed(self, checkpoint: Callable, forward: Callable, args, kwargs):
        """transformers' gradient checkpointing of this layer, with the checkpoint outside the Dynamo
        graph: its wrapper runs as written (it settles the cache arguments and calls the checkpoint
        function, which may be anything: a test's ``Mock``, a user's own), and the function checkpointed
        runs this layer's route on the layer's own ``forward``, inside the checkpoint as under
        ``checkpoint_wrapper``."""
        def checkpoint_routed(function, *inputs):
            keywords = function.keywords          # transformers passes partial(forward, layer, **kwargs)
            proceed = functools.partial(self.proceed, _checkpointed_forward=forward)
            return checkpoint(lambda *xs: self._intercepted(xs, keywords, proceed), *inputs)
        with compat.hf_checkpoint_function(self.module, checkpoint_routed):
            return type(self.module).forward(self.module, *args, **kwargs)

    def proceed(self, *args, _checkpointed_forward: Callable | None = None, **kwargs):
        carrier, state, via = _find_state((args, kwargs), self.stream)
        if state is None:
            if self.span.start:
                raise RoutingError(self._stateless_message())
            state = StreamState(self.stream, 0)
        elif state.position > self.span.start:
            raise RoutingError(f"{_where(self)} was called with the stream after residual site {state.position} "
                               f"of stream {self.stream}, but its own sites start at {self.span.start}: the "
                               "stream's modules must be called once each, in order")
        recompute = via == "storage" and state.successor is not None
        tensors: tuple[torch.Tensor, ...] = ()
        if state.tensors:
            view, tensors = unbundle(state, carrier)
            args, kwargs = _replaced((args, kwargs), carrier, view)
        layout = _Layout(state.position, len(state.blocks), state.partial is not None, tuple(
            (t.dtype, t.requires_grad, None if t.shape == carrier.shape else tuple(t.shape)) for t in tensors))
        with _active(_LayerCall(tensors)) as call:
            out = self.run(self.entry(layout, lambda compiler: self._backend(compiler, layout), _checkpointed_forward),
                           *args, **kwargs)
        _note_progress(self.conversion, self.stream, self.ends)
        if self.ends:
            return out
        blocks = tensors[:len(state.blocks)] + call.state_out[1:]
        after = StreamState(self.stream, call.next_position, blocks, call.state_out[0])
        if recompute:
            # Reentrant checkpointing recomputes this call on a detached copy of its input: its result
            # joins the state the original call made, whose gradients the next layer's recomputation sent.
            carrier_out = bundle(call.carrier, after.tensors, grads_from=state.successor)
        else:
            carrier_out = bundle(call.carrier, after.tensors, grads_from=after)
            register(carrier_out, after)
            given = carrier if carrier is not None else call.start
            if given is not None and given.requires_grad and not torch.is_grad_enabled():
                # No gradient recorded for an input that needs one: the forward of reentrant
                # checkpointing, whose recomputation will need this call's result state.
                state.successor = after
            if not via and call.start is not None:
                register(call.start, state)
        return _replaced(out, call.carrier, carrier_out, what=f"the result of {_where(self)}")

    def _backend(self, compiler: str, layout: _Layout):
        def backend(gm: fx.GraphModule, example_inputs: list):
            start = time.perf_counter()
            outputs = len(gm.graph.find_nodes(op="output")[0].args[0])
            entry = None if layout.position == 0 and not layout.blocks and not layout.has_partial else Entry(
                layout.position, layout.blocks, layout.has_partial, layout.tensors)
            target = LayerTarget(self.planned, self.span, entry, self.ends)
            compiled, result = _rewritten(self, gm, example_inputs, compiler, layer=target)
            graph = _LayerGraph(compiled, outputs, result.carrier_output, result.start_input, result.next_position)
            LOG.info("rewrote the graph Dynamo captured for a call of %s (layer route, %s) in %.2f s", _where(self),
                     compiler, time.perf_counter() - start)
            return graph
        return backend

    def _stateless_message(self) -> str:
        first = self.planned.layers[0].owner
        return (f"{_where(self)} was called with no AttnRes state for stream {self.stream}: its residual sites "
                f"come after those of {first}, so it needs the result the module before it returned, which "
                "carries the completed block sums. Causes: the module was called on its own or with a tensor "
                "the previous module did not return (a copy, a cast, a tensor computed from it), or "
                "reentrant activation checkpointing recomputes it on inputs it cannot trace back (use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)). Call the stream's modules in "
                "order with what each returns, or convert with route='model'.")


class _LayerGraph:
    """What Dynamo calls for a layer's rewritten graph: appends the call's state tensors to its inputs and
    hands the graph's extra outputs (the new state) to the call."""

    def __init__(self, run, outputs: int, carrier: int, start: int | None, next_position: int):
        self.run = run
        self.outputs = outputs
        self.carrier = carrier
        self.start = start
        self.next_position = next_position

    def __call__(self, *args):
        call = _CALLS.stack[-1]
        results = self.run(*args, *call.state_tensors)
        call.carrier = results[self.carrier] if self.carrier is not None else None
        call.state_out = tuple(results[self.outputs:])
        call.start = args[self.start] if self.start is not None else None
        call.next_position = self.next_position
        return tuple(results[:self.outputs])


def _rewritten(router: Router, gm: fx.GraphModule, example_inputs: list, compiler: str, *,
               layer: LayerTarget | None = None):
    """Rewrite a copy of Dynamo's graph (its own must stay as it is: its bookkeeping refers to it) and
    make it runnable: the graph itself, calling the model's own BlockAttnRes modules (their hooks fire),
    or Inductor's compilation with the AttnRes weights as extra inputs (parameters must be inputs there,
    and then get gradients through AOTAutograd). Returns the runnable and what the rewrite did."""
    _HookGuards.enable()
    plan = router.conversion.plan
    graph_module = copy_graph_module(gm, type(router.module).__name__)
    if compiler == "eager":
        modules = {site.name: router.root.get_submodule(site.name) for site in plan.sites}
        result = rewrite_captured(graph_module, plan, lambda g: ModuleCalls(g, modules), where=_where(router),
                                  prefix=router.path, layer=layer)
        router.rewritten.append(graph_module)
        return graph_module.forward, result
    if torch.is_grad_enabled():
        emitter = ParameterInputs(plan)
        result = rewrite_captured(graph_module, plan, lambda g: emitter, where=_where(router), prefix=router.path,
                                  layer=layer)
        names = emitter.names
    else:
        # Dynamo guards on grad mode, so this graph serves calls without gradients only: inference, where
        # the two-phase schedule scores each block's pseudo-queries against its completed blocks at once
        # (:mod:`attnres_fx.passes.two_phase`); its weights then become inputs as in the training graph.
        modules = {site.name: router.root.get_submodule(site.name) for site in plan.sites}
        result = rewrite_captured(graph_module, plan, lambda g: ModuleCalls(g, modules), where=_where(router),
                                  prefix=router.path, layer=layer)
        apply_two_phase(graph_module)
        names = lift_attnres_weights(graph_module)
    router.rewritten.append(graph_module)
    weights = _WeightReader(router.root, names)
    state = [node.meta["example_value"] for node in result.rewrite.state_inputs]
    compiled = compat.inductor_compile(graph_module, [*example_inputs, *state, *weights.fake(example_inputs)],
                          config_patches=router.conversion.compile_options or None)
    return _RoutedGraph(compiled, weights), result


def _find_state(tree, stream: int) -> tuple[torch.Tensor | None, StreamState | None, str]:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            state, via = state_of(leaf, stream)
            if state is not None:
                return leaf, state, via
    return None, None, ""


def _replaced(tree, old: torch.Tensor, new: torch.Tensor, what: str = ""):
    if old is new:
        return tree
    found = []

    def swap(leaf):
        if leaf is old:
            found.append(leaf)
            return new
        return leaf
    tree = pytree.tree_map_only(torch.Tensor, swap, tree)
    if what and not found:
        raise RoutingError(f"{what} holds its residual stream in a container torch.utils._pytree cannot look "
                           "into, so the AttnRes state cannot travel with it; convert with route='model'")
    return tree


class _HookGuards:
    """Make Dynamo guard on *empty* hook dicts of the captured modules, so that a hook registered after a
    call is not silently ignored: ``skip_nnmodule_hook_guards`` is read when guards are built, right
    after the backend returns; the router restores the user's setting once the call is over."""

    saved: bool | None = None

    @classmethod
    def enable(cls) -> None:
        if cls.saved is None:
            cls.saved = compat.set_nn_module_hook_guards(False)

    @classmethod
    def restore(cls) -> None:
        if cls.saved is not None:
            compat.set_nn_module_hook_guards(cls.saved)
            cls.saved = None


class _WeightReader:
    """The AttnRes weights a rewritten graph takes as extra inputs, read from the model at every call
    (so ``.to()``, ``load_state_dict(assign=True)``, optimizer steps and FSDP2's all-gathered parameters
    are seen)."""

    def __init__(self, root: nn.Module, names: list[str]):
        self.names = names
        self.holders = [(root.get_submodule(name.rsplit(".", 2)[0]), *name.rsplit(".", 2)[1:]) for name in names]

    def read(self) -> list[torch.Tensor]:
        return [getattr(getattr(module, child), attr) for module, child, attr in self.holders]

    def fake(self, example_inputs: list) -> list[torch.Tensor]:
        fake_mode = compat.detect_fake_mode(example_inputs)
        tensors = self.read()
        return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors] if fake_mode else tensors


class _RoutedGraph:
    """Dynamo calls this with the graph's own inputs; the AttnRes weights are appended."""

    def __init__(self, compiled, weights: _WeightReader):
        self.compiled = compiled
        self.weights = weights

    def __call__(self, *args):
        return self.compiled(*args, *self.weights.read())


# -- the end of a layer-routed stream ----------------------------------------------------------------------

class _StreamWatch:
    """Forward hooks on the owner of a layer-routed stream: a call of the owner in which the stream's
    first modules ran but its last one did not (the call ended the stream early) raises
    :class:`~attnres_fx.StreamMismatchError`, as the model route does for the same call; without the
    last module the final aggregation is never taken."""

    def __init__(self, conversion: Conversion, stream: int):
        self.conversion = conversion
        self.stream = stream

    def enter(self, module, args):
        if torch.compiler.is_compiling():
            _refuse_foreign_fullgraph(f"{type(module).__name__} (the owner of residual stream {self.stream})")
        self._enter()

    @torch.compiler.disable
    def _enter(self):
        _WATCHED.__dict__.setdefault("stack", []).append([self.conversion, self.stream, False, False])

    @torch.compiler.disable
    def leave(self, module, args, output):
        stack = _WATCHED.__dict__.get("stack") or []
        record = next((r for r in reversed(stack) if r[0] is self.conversion and r[1] == self.stream), None)
        if record is None:
            return None
        stack.remove(record)
        _, _, started, finished = record
        if started and not finished and sys.exc_info()[0] is None:
            planned = self.conversion.plan.streams[self.stream]
            raise StreamMismatchError(
                f"this call of {type(module).__name__} ran the first modules of residual stream {self.stream} but "
                f"not its last one ({planned.layers[-1].owner}), so the stream ended early and its final "
                "aggregation was never taken. This happens when a call takes a code path the conversion did not "
                "see (fewer layers), or when the model changed after conversion (attnres_fx.remove, then "
                "convert again).")
        return None


_WATCHED = threading.local()


def _refuse_foreign_fullgraph(where: str) -> None:
    """Raise :class:`~attnres_fx.ForeignCompileError` while another ``torch.compile(..., fullgraph=True)``
    traces ``where`` (a routed module or a stream's owner): nothing of a converted model's route can be
    part of its single graph."""
    refuse_fullgraph_trace(
        f"torch.compile(..., fullgraph=True) reached {where}, which runs the AttnRes rewrite through "
        "attnres_fx's own TorchDynamo route and cannot be part of another compilation's single graph. Use "
        "attnres_fx.compile(model) for Inductor (it compiles each block's rewritten graph), or drop "
        "fullgraph=True (this call then runs the AttnRes route between the compiled graphs).")


def _note_progress(conversion: Conversion, stream: int, ends: bool) -> None:
    for record in reversed(_WATCHED.__dict__.get("stack") or []):
        if record[0] is conversion and record[1] == stream:
            record[2] = True
            record[3] = record[3] or ends
            return


# -- installing and removing the routing ------------------------------------------------------------------

def _graph_break_message(router: Router, err: Exception) -> str:
    lines = [f"TorchDynamo could not capture this call of {_where(router)} as one graph: "
             f"{type(err).__name__}: {first_line(err)}"]
    if router.route_name == "layer":
        lines.append("On the layer route each call of a module that performs residual sites runs as one Dynamo "
                     "graph (fullgraph), so that its sites are rewritten together.")
    else:
        lines.append("A converted model runs each call as one Dynamo graph (fullgraph), so that every residual "
                     "stream is rewritten whole; a graph break would leave part of a stream unconverted.")
    if _has_sharded_submodules(router.module):
        lines.append("Here: FSDP2's fully_shard was applied to modules inside it; its hooks are kept out of "
                     "Dynamo graphs. Shard whole blocks (fully_shard on each module that performs residual "
                     "sites, then on the root), or use DistributedDataParallel.")
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


def _where(router: Router) -> str:
    return f"{type(router.module).__name__} at '{router.path}'" if router.path else type(router.module).__name__


def routers(model: nn.Module) -> list[Router]:
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), Router)]


def install(model: nn.Module, plan: Plan, modules: dict[str, BlockAttnRes], config: AttnResConfig) -> Conversion:
    """Register the AttnRes modules, the routers and the stream watches on ``model``; all or nothing."""
    model_routed = [stream.owner for stream in plan.streams if stream.route == "model"]
    routed = {path: None for path in ([""] if model_routed else []) + model_routed}
    layers = {span.owner: (stream.index, span) for stream in plan.streams for span in stream.layers}
    routed.update(dict.fromkeys(layers))
    targets = [(path, model.get_submodule(path)) for path in routed]
    for path, module in targets:
        if "forward" in module.__dict__:
            raise RoutingError(
                f"{type(module).__name__} at '{path or '<root>'}' has an instance attribute 'forward' (a "
                f"wrapper installed by another library, e.g. accelerate's device-map hooks: "
                f"{module.__dict__['forward']!r}); attnres_fx routes calls through forward itself. Convert "
                "the model before adding such wrappers.")
    watched = tuple(stream.owner for stream in plan.streams if stream.route == "layer")
    conversion = Conversion(plan, tuple(routed), config, watched=watched)
    registered: list[tuple[nn.Module, str]] = []
    handles = []
    try:
        for name, module in modules.items():
            parent, _, attribute = name.rpartition(".")
            holder = model.get_submodule(parent)
            holder.add_module(attribute, module)
            registered.append((holder, attribute))
        for path, module in targets:
            if path in layers:
                module.forward = LayerRouter(model, module, path, conversion, *layers[path])
            else:
                module.forward = ModelRouter(model, module, path, conversion)
        for stream in plan.streams:
            if stream.route == "layer":
                watch = _StreamWatch(conversion, stream.index)
                owner = model.get_submodule(stream.owner)
                handles.append(owner.register_forward_pre_hook(watch.enter))
                handles.append(owner.register_forward_hook(watch.leave, always_call=True))
        attach(model, conversion)
    except BaseException:
        detach(model)
        for handle in handles:
            handle.remove()
        for holder, attribute in registered:
            delattr(holder, attribute)
        for _, module in targets:
            module.__dict__.pop("forward", None)
        raise
    return conversion


def uninstall(model: nn.Module, conversion: Conversion) -> None:
    """Undo :func:`install`: the AttnRes modules, routers and watches go; nothing else was touched."""
    for site in conversion.plan.sites:
        parent, _, attribute = site.name.rpartition(".")
        delattr(model.get_submodule(parent), attribute)
    for path in conversion.routed:
        model.get_submodule(path).__dict__.pop("forward", None)
    for path in conversion.watched:
        owner = model.get_submodule(path)
        for hooks in (owner._forward_pre_hooks, owner._forward_hooks):
            for key in [k for k, hook in hooks.items() if isinstance(getattr(hook, "__self__", None), _StreamWatch)]:
                del hooks[key]
                owner._forward_hooks_always_called.pop(key, None)
    detach(model)


@contextlib.contextmanager
def eager_route(model: nn.Module):
    """Within: the calls of the converted ``model`` take the eager route, whatever its compiler, so that
    its ``BlockAttnRes`` modules run as modules (their hooks fire). The compiled route's graphs are
    kept: after the block the model runs them again without recompiling."""
    with compiler_route(model, "eager"):
        yield model


@contextlib.contextmanager
def compiler_route(model: nn.Module, compiler: str):
    """Within: the calls of the converted ``model`` run their rewritten graphs with ``compiler``
    (``"eager"`` or ``"inductor"``); each compiler's graphs are kept for the next time."""
    conversion = conversion_of(model)
    if conversion is None:
        raise ValueError(f"model: compiler_route needs a converted model, got a {type(model).__name__}")
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    before = conversion.compiler
    conversion.compiler = compiler
    try:
        yield model
    finally:
        conversion.compiler = before


def set_compiler(model: nn.Module, conversion: Conversion, compiler: str, options: dict[str, Any]) -> None:
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    conversion.compiler = compiler
    conversion.compile_options = dict(options)
    for router in routers(model):
        router.reset()
