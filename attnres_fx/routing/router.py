"""Routers: the ``forward`` of a routed module, and what one call of it does.

- :class:`LayerRouter` (the layer route): the forward of a module that performs residual sites (a block,
  ``model.layers.3``). A call looks up the graph for its call shape and the stream's state
  (:mod:`attnres_fx.routing.graphs`), runs it with the state the carrier brought, and returns the
  block's result with the new state on the carrier (:mod:`attnres_fx.routing.state`). Under Inductor the
  same rewritten graph is compiled: TorchDynamo captures its code (the sublayers it calls inlined, with
  Dynamo's guards on them) and hands it to Inductor. A block whose own code ``torch.fx`` cannot trace runs
  on TorchDynamo instead, its own forward captured and rewritten through the same signature
  (:mod:`attnres_fx.routing.dynamo`).
- :class:`ModelRouter` (the model route): the forward of the root (and of a stream's owner that is
  called on its own): each call is one TorchDynamo graph, every stream in it rewritten.

A routed call goes ``module(...)`` -> ``nn.Module.__call__`` (the module's own hooks, FSDP2's among them,
as usual) -> the router. Nothing a call decides is shared with another thread or model: the stream's
state travels with the call's tensors, the graphs are looked up by what the call is, and a capture in
progress marks only its own thread.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn

from .. import compat
from ..capture.block_tracer import SCALAR_TYPES, CallShape, call_shape
from ..capture.tracers import entry_function, in_own_call
from ..compat import pytree
from ..conversion import Conversion
from ..diagnostics import first_line
from ..errors import RoutingError, TraceError
from ..passes.layers import LayerSpan
from ..passes.pipeline import LayerTarget
from . import dynamo, graphs, host
from ..context import call_context, existing_call_context
from ..passes.signature import LayerGraphSignature, StateLayout, replaced_at
from .state import (ATTRIBUTE, Following, StreamState, attach, bundle, edited, layout_of, remember_for_recomputation,
                    restated, returned, state_of, unbundle)
from .watch import note_stream_end, note_stream_start, refuse_foreign_fullgraph

LOG = logging.getLogger("attnres_fx")
COMPILERS = ("eager", "inductor")
# Two threads' first hooked calls of one block register one router hook between them.
_HOOK_LOCK = threading.Lock()
_NONE = type(None)
# The kinds of positional arguments whose call shape their types alone give (see call_shape).
_POSITIONAL_KINDS = frozenset({torch.Tensor, int, float, _NONE})


class Router:
    """``module.forward`` of a routed module. ``root`` is the converted model (it holds the AttnRes
    modules and the :class:`~attnres_fx.conversion.Conversion`), ``path`` this module's path in it."""

    is_attnres_router = True          # what attnres_fx.capture.tracers looks for
    route_name = ""

    def __init__(self, root: nn.Module, module: nn.Module, path: str, conversion: Conversion):
        self.root = root
        self.module = module
        self.path = path
        self.conversion = conversion
        self.where = f"{type(module).__name__} at '{path}'" if path else type(module).__name__
        # Dynamo entries by compiler and key: a temporary switch of compiler keeps the other's graphs.
        self._entries: dict[Any, Callable] = {}
        # The rewritten graphs of this module's latest calls, to read (as many as the conversion keeps).
        self.rewritten: collections.deque[fx.GraphModule] = collections.deque(
            maxlen=conversion.config.trace_cache_size)

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
        return {**self.__dict__, "_entries": {}, "rewritten": collections.deque(maxlen=self.rewritten.maxlen)}

    def __repr__(self) -> str:
        return (f"<attnres_fx {self.route_name}-routed forward of {type(self.module).__name__} "
                f"at {self.path or '<root>'}>")

    @functools.cached_property
    def checkpointing_flag_holders(self) -> tuple[nn.Module, ...]:
        # Found once: the module tree does not change after conversion.
        return compat.checkpointing_flag_holders(self.module)

    def _while_compiling(self, forward: Callable, args: tuple, kwargs: dict):
        """A call reached by a TorchDynamo trace: attnres_fx's own capture takes the module as written; a host's
        capture too, the module declaring its sites' parameters (:mod:`attnres_fx.routing.host`); a foreign
        ``torch.compile`` (not fullgraph) runs the route between its graphs; fullgraph refuses."""
        if dynamo.inside_own_capture():
            return forward(self.module, *args, **kwargs)
        if self.conversion.host:
            host.declare(self.root, self.own_sites)
            return forward(self.module, *args, **kwargs)
        refuse_foreign_fullgraph(self.where)
        return self._under_foreign_compiler(*args, **kwargs)

    @torch.compiler.disable(reason=(
        "a model converted by attnres_fx runs its AttnRes rewrite through its own route; torch.compile(model) "
        "cannot include it in its graph. Use attnres_fx.compile(model) for Inductor (without fullgraph=True, "
        "torch.compile(model) works too: this call then runs the AttnRes route)"))
    def _under_foreign_compiler(self, *args, **kwargs):
        return self(*args, **kwargs)

    @property
    def own_sites(self) -> tuple:
        """The sites whose aggregations this module's calls compute: all of the model's."""
        return self.conversion.plan.sites

    def _refuse_export(self) -> None:
        raise RoutingError(
            f"torch.export of a model converted by attnres_fx ({type(self.root).__name__}): the AttnRes rewrite is "
            "applied to the graphs attnres_fx captures itself. Use attnres_fx.rewrite(model, example_inputs) for "
            "an explicit graph, or attnres_fx.export.to_onnx(model, ...).")

    def entry(self, key, backend: Callable[[str], Callable], forward: Callable | None = None,
              state_outputs: int | None = None) -> Callable:
        """The Dynamo-compiled entry of ``forward`` (the module class's, by default) for the conversion's
        compiler and ``key``: built at its first call, again after a pickle or :func:`set_compiler`. With
        ``state_outputs``, a block's entry (:func:`~attnres_fx.routing.dynamo.block_entry_function`)."""
        compiler = self.conversion.compiler
        forward = forward or type(self.module).forward
        entry = self._entries.get((compiler, key, forward, state_outputs))
        if entry is None:
            function = (entry_function(forward) if state_outputs is None else
                        dynamo.block_entry_function(forward, state_outputs))
            entry = self._entries[compiler, key, forward, state_outputs] = dynamo.compiled_entry(
                function, backend(compiler), compiler)
        return entry

    def run_dynamo(self, entry: Callable, args: tuple, kwargs: dict, forward: Callable | None = None,
                   state: list | None = None):
        """``entry(module, *args, **kwargs)`` (``entry(module, state, *args, **kwargs)`` for a block's entry)."""
        forward = forward or type(self.module).forward
        module = self.module
        call = ((lambda: entry(module, *args, **kwargs)) if state is None else
                (lambda: entry(module, state, *args, **kwargs)))
        return dynamo.run(call, lambda: forward(module, *args, **kwargs), module,
                          lambda err: _graph_break_message(self, err), self.checkpointing_flag_holders)

    def reset(self) -> None:
        self._entries.clear()
        self.rewritten.clear()


class ModelRouter(Router):
    """The model route: the whole call of the module as one graph, every stream in it rewritten."""

    route_name = "model"
    carriers = False          # whether the graph keeps the layer route's carriers for its layer-routed streams
    layer_checks: tuple = ()  # each raises StreamMismatchError where a stream's layers changed since conversion

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling():
            return self._while_compiling(type(self.module).forward, args, kwargs)
        if in_own_call():
            return type(self.module).forward(self.module, *args, **kwargs)
        for check in self.layer_checks:
            check()
        if torch.compiler.is_exporting():
            self._refuse_export()
        compat.install_output_recorders_for_call(self.module, kwargs)
        return self.run_dynamo(self.entry(None, self._backend), args, kwargs)

    def _backend(self, compiler: str):
        def backend(gm: fx.GraphModule, example_inputs: list):
            start = time.perf_counter()
            compiled, _, _ = graphs.rewritten_dynamo_graph(self, gm, example_inputs, compiler, carriers=self.carriers)
            LOG.info("rewrote the graph Dynamo captured for a call of %s (%s route) in %.2f s", self.where,
                     compiler, time.perf_counter() - start)
            return compiled
        return backend


class WholeCallRouter(ModelRouter):
    """The root of a layer-routed conversion under Inductor (:func:`attnres_fx.compile`): each call as one
    TorchDynamo graph whose layer-routed streams keep the layer route's carriers (a block's result is the
    plain residual sum, as when each block runs its own graph), so that Inductor compiles the whole call,
    as ``torch.compile(model)`` compiles the original. Where Dynamo cannot take the call as one graph
    (FSDP2's hooks on the blocks, a graph break between them) the call runs as written, each block its own
    compiled graph; eagerly (:func:`~attnres_fx.routing.eager_route`) it runs as written too."""

    carriers = True

    def __init__(self, root: nn.Module, module: nn.Module, path: str, conversion: Conversion):
        super().__init__(root, module, path, conversion)
        self.whole = True

    def __call__(self, *args, **kwargs):
        forward = type(self.module).forward
        if torch.compiler.is_dynamo_compiling():
            return self._while_compiling(forward, args, kwargs)
        if in_own_call() or not self.whole or self.conversion.compiler != "inductor":
            return forward(self.module, *args, **kwargs)
        try:
            return self.run_dynamo(self.entry(None, self._backend), args, kwargs)
        except TraceError as err:
            # Nothing ran: Dynamo stops at the construct it cannot take into one graph.
            self.whole = False
            LOG.info("%s is compiled block by block: %s", self.where, first_line(err))
            return forward(self.module, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.whole = True


@contextlib.contextmanager
def intercepting(interceptor):
    """Within, in this thread: every call of a layer-routed module of ``interceptor.conversion`` goes to
    ``interceptor.intercept(router, args, kwargs, proceed)``, where ``proceed(*args, **kwargs)`` runs the
    call as usual (:mod:`attnres_fx.integrations.pipelining`: stage boundaries, and the probe that prepares them)."""
    stack = call_context().interceptors
    stack.append(interceptor)
    try:
        yield interceptor
    finally:
        stack.remove(interceptor)


@dataclass
class _ShapeRoutes:
    """How calls of one shape run on a block: its trace (``None``: on TorchDynamo), which of the call's
    graph inputs carries the stream (found at the first call with a state), and its variants by layout.
    Where the block's code needs the values of the call's Python numbers, ``baked`` holds their places
    among the graph inputs and ``by_value`` the routes of each value (``values``: the one a trace bakes
    in)."""

    shape: CallShape
    traced: Any
    stream_input: int | None
    variants: dict
    baked: tuple[int, ...] | None = None
    by_value: dict | None = None
    values: tuple | None = None
    refusal: TraceError | None = None        # why the block's code could not be traced for this shape


class LayerRouter(Router):
    """The layer route for one module that performs residual sites ``span`` of stream ``stream``; see the
    module docstring and :mod:`attnres_fx.routing.state`. ``opened``: the children whose forwards hold
    part of the stream (traced through; every other child runs as a module)."""

    route_name = "layer"

    def __init__(self, root: nn.Module, module: nn.Module, path: str, conversion: Conversion, stream: int,
                 span: LayerSpan, opened: frozenset[str]):
        super().__init__(root, module, path, conversion)
        self.stream = stream
        self.span = span
        self.opened = opened
        self.planned = conversion.plan.streams[stream]
        self.starts = span.start == 0
        self.ends = span.stop == self.planned.num_positions
        # Where the block that takes the carrier this one returns sits: its forward pre-hooks, or a module
        # put in its place later, see the carrier first.
        following = [later.owner for later in self.planned.layers if later.start == span.stop]
        self.following = None
        if following:
            parent, _, name = following[0].rpartition(".")
            self.following = Following(root.get_submodule(parent), name, root.get_submodule(following[0]))
        self.traced_modules = (module, *(module.get_submodule(path) for path in sorted(opened)))
        self._shapes: dict[CallShape, _ShapeRoutes] = {}
        # The shapes of calls with positional tensors, numbers and None only, by the arguments' types and
        # the block's mode: (shape, which arguments are graph inputs).
        self._positional_shapes: dict[tuple, tuple[CallShape, tuple[bool, ...]]] = {}
        self._forwards: dict[type, tuple] = {}
        # On TorchDynamo, by the state's layout: what the block's graphs take and return, recorded by the
        # backend (:meth:`_dynamo_backend`).
        self._dynamo_graphs: dict[StateLayout | None, _DynamoGraph] = {}
        # The constants the kind was read from, to see a change (graphs.watched_constants).
        self._watched: tuple = ()
        # The key of the router's own forward hook in the block's hooks (:meth:`_after_hooks`), once made.
        self._after_hooks_id: int | None = None

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_shapes": {}, "_positional_shapes": {}, "_forwards": {}, "_watched": ()}

    @property
    def own_sites(self) -> tuple:
        """The sites of this module's span, and the stream's final one where the span ends it."""
        return tuple(site for site in self.planned.sites if (self.span.start <= site.position < self.span.stop
                                                               if site.position is not None else self.ends))

    def reset(self) -> None:
        # The block traces and rewritten graphs serve every compiler: kept (a first call after
        # attnres_fx.compile traces nothing either); what Dynamo made is not.
        super().reset()
        self._dynamo_graphs.clear()

    def installed(self) -> None:
        """Now the module's ``forward`` (an attribute the module did not have when the trial read its
        constants): the constants are watched from here."""
        if self._forwards:
            self._watched = graphs.watched_constants(self.traced_modules)

    def _class_forward(self) -> tuple[Callable, bool, tuple]:
        """``(forward, checkpointed, kind)`` for the module's class now (FSDP2 swaps it): the forward the
        route runs (inside transformers' checkpointing wrapper, if any), whether there is such a wrapper,
        and the kind of block for shared traces."""
        cls = type(self.module)
        found = self._forwards.get(cls)
        if found is None:
            inner = compat.hf_checkpointed_forward(cls)
            forward = inner or cls.forward
            found = self._forwards[cls] = (forward, inner is not None,
                                           graphs.kind_of(self.module, forward, self.opened))
            self._watched = graphs.watched_constants(self.traced_modules)
        return found

    def _constants_changed(self) -> bool:
        """Whether a constant the block's graphs were traced with changed since (Granite's
        ``residual_multiplier`` set after the first call): identity checks of the values read."""
        for attributes, size, constants in self._watched:
            if len(attributes) != size:
                return True
            for name, value in constants:
                if attributes.get(name) is not value:
                    return True
        return False

    @property
    def forward_function(self) -> Callable:
        return self._class_forward()[0]

    @property
    def kind(self) -> tuple:
        return self._class_forward()[2]

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling():
            # Read nothing of the router's own state here: Dynamo would guard on it.
            return self._while_compiling(type(self.module).forward, args, kwargs)
        forward, checkpointed, _ = self._forwards.get(type(self.module)) or self._class_forward()
        context = existing_call_context() or call_context()       # read once
        if context.own:
            # A capture of the model in this thread: the module as written.
            return forward(self.module, *args, **kwargs)
        if torch.compiler.is_exporting():
            self._refuse_export()
        if checkpointed and compat.hf_checkpointing_on(self.module):
            return compat.hf_checkpointed_call(self.module, lambda *a, **k: self._intercepted(a, k), args, kwargs)
        if context.interceptors:
            return self._intercepted(args, kwargs)
        return self._proceed(args, kwargs)

    def _intercepted(self, args: tuple, kwargs: dict):
        for interceptor in reversed(call_context().interceptors):
            if interceptor.conversion is self.conversion:
                return interceptor.intercept(self, args, kwargs, self.proceed)
        return self._proceed(args, kwargs)

    def proceed(self, *args, **kwargs):
        """Run this call of the block on its route (what an interceptor calls to go ahead)."""
        return self._proceed(args, kwargs)

    def _proceed(self, args: tuple, kwargs: dict):
        if self.conversion.compiler != "eager":
            self._refuse_checkpointed_cache(args, kwargs)
        if compat.fx_trace_left_behind():
            compat.undo_fx_trace_left_behind()      # an interrupted trace, anywhere in the process
        if self._constants_changed():
            # Another kind of block now: its own traces (shared with the blocks of that kind).
            self._forwards.clear()
            self._shapes.clear()
        routes, inputs = self._routes(args, kwargs)
        if routes.traced is not None and not (self.opened and self._opened_hooks()):   # _runs_block_graph
            return self._run_block_graph(routes, inputs)
        return self._run_dynamo(args, kwargs)

    def prepare(self, args: tuple, kwargs: dict, layout: StateLayout | None, modules: dict) -> _ShapeRoutes:
        """What a first call with ``args``, ``kwargs`` and the stream's state in ``layout`` makes before it
        runs (:mod:`attnres_fx.routing.trial` calls it before the model is converted, ``modules``: the
        AttnRes modules by site name, not registered yet): the block's trace and its rewritten graph,
        kept here and in the conversion's cache, so that such a call traces and rewrites nothing. Returns
        the call shape's routes (``traced`` is ``None`` where the call runs on TorchDynamo)."""
        routes, _ = self._routes(args, kwargs)
        if self._runs_block_graph(routes):
            graphs.rewritten_block(self, routes.traced, routes.shape, layout, routes.values, modules)
        return routes

    def _routes(self, args: tuple, kwargs: dict) -> tuple[_ShapeRoutes, list]:
        """The routes of this call's shape (and of its Python numbers' values where the code needs them),
        made at the shape's first call; and the call's graph inputs."""
        if kwargs or self.opened:
            shape, inputs = call_shape(args, kwargs, self.traced_modules)
        else:
            # A call with positional arguments only (``layer(h, start_pos, freqs, mask)``): its shape
            # follows from the arguments' types where they are tensors, numbers and None, found by
            # them in C (the walk of call_shape is a block call's largest share of Python).
            kinds = (*map(type, args), self.module.training)
            found = self._positional_shapes.get(kinds)
            if found is None:
                shape, inputs = call_shape(args, kwargs, self.traced_modules)
                if all(kind in _POSITIONAL_KINDS for kind in kinds[:-1]):
                    # Finitely many keys (four kinds per argument): no bound needed.
                    self._positional_shapes[kinds] = (shape, tuple(kind is not _NONE for kind in kinds[:-1]))
            else:
                shape, kept = found
                inputs = [*itertools.compress(args, kept)]
        routes = self._shapes.get(shape) or self._routes_for(shape, args, kwargs, inputs)
        if routes.baked is not None:
            values = tuple([inputs[k] for k in routes.baked])
            routes = routes.by_value.get(values) or self._value_routes_for(routes, values, args, kwargs)
        return routes, inputs

    def _runs_block_graph(self, routes: _ShapeRoutes) -> bool:
        return routes.traced is not None and not (self.opened and self._opened_hooks())

    # -- block graphs --------------------------------------------------------------------------------

    def _routes_for(self, shape: CallShape, args: tuple, kwargs: dict, inputs: list) -> _ShapeRoutes:
        if self._opened_hooks():
            # On TorchDynamo while the hooks are there, not kept: hooks come and go (a conversion installs
            # transformers' output recorders for its capture and removes them), and a later call of this
            # shape without them traces as a call of a reloaded model would.
            return _ShapeRoutes(shape, None, None, {})
        try:
            traced = graphs.trace(self, args, kwargs, shape)
        except TraceError as err:
            numbers = tuple(k for k, value in enumerate(inputs) if type(value) in SCALAR_TYPES)
            if numbers:
                # Perhaps the code needs the numbers' values: a graph per value (bounded), if that traces.
                routes = _ShapeRoutes(shape, None, None, {}, numbers, {})
                values = tuple([inputs[k] for k in numbers])
                found = self._value_routes_for(routes, values, args, kwargs)
                if found.traced is not None:
                    return self._kept(self._shapes, shape, routes)
            LOG.info("%s runs on TorchDynamo for this call shape: %s", self.where, first_line(err))
            routes = _ShapeRoutes(shape, None, None, {}, refusal=err)
            # A failure the traced code happened to raise (not its refusal) is tried again at the next call.
            return self._kept(self._shapes, shape, routes) if graphs.failure_kept(err) else routes
        return self._kept(self._shapes, shape, _ShapeRoutes(shape, traced, None, {}))

    def _value_routes_for(self, routes: _ShapeRoutes, values: tuple, args: tuple, kwargs: dict) -> _ShapeRoutes:
        """The routes of calls of ``routes``' shape whose Python numbers have ``values``, traced with them
        baked in."""
        try:
            traced = graphs.trace(self, args, kwargs, routes.shape, values)
        except TraceError as err:
            LOG.info("%s runs on TorchDynamo for this call shape: %s", self.where, first_line(err))
            found = _ShapeRoutes(routes.shape, None, None, {}, values=values, refusal=err)
            return self._kept(routes.by_value, values, found) if graphs.failure_kept(err) else found
        return self._kept(routes.by_value, values, _ShapeRoutes(routes.shape, traced, None, {}, values=values))

    def _kept(self, cache: dict, key, routes: _ShapeRoutes) -> _ShapeRoutes:
        """``routes`` stored in ``cache`` under ``key``, the oldest entry dropped beyond the conversion's
        ``trace_cache_size``."""
        if len(cache) >= self.conversion.config.trace_cache_size:
            del cache[next(iter(cache))]
            self.conversion.stats.evictions += 1
        cache[key] = routes
        return routes

    def _opened_hooks(self) -> bool:
        """Whether an opened child (traced through, so not called as a module) has hooks, which a block
        graph would leave out: such calls run on TorchDynamo, which traces hooks."""
        return any(compat.module_hooks(module) for module in self.traced_modules[1:])

    def _run_block_graph(self, routes: _ShapeRoutes, inputs: list):
        index = routes.stream_input
        if index is not None and not torch.is_grad_enabled() and self.conversion.compiler == "eager":
            carrier = inputs[index]
            state = getattr(carrier, ATTRIBUTE, None)
            if (state is not None and state.layout is not None and state.owner is self.conversion
                    and state.stream == self.stream and state.position == self.span.start
                    and not carrier.requires_grad and not edited(carrier, state)
                    and not self.module._forward_hooks and not compat.global_forward_hooks()
                    and not self._pre_hooks_unseen(state)):
                variant = routes.variants.get(state.layout)
                if variant is not None:
                    return self._run_plain(routes, variant, inputs, state)
        return self._run_recorded(routes, inputs)

    def _run_plain(self, routes: _ShapeRoutes, variant: graphs.BlockVariant, inputs: list, state: StreamState):
        """:meth:`_run_recorded` for the commonest call of a decoding loop, in fewer steps: eager, no
        gradient recorded, the state found on the carrier as its block left it (not edited, no
        checkpointing, at this block's first site) and no forward hook on the block to see the result.
        A block call's budget there is microseconds, and the route's Python was its largest part."""
        if not variant.blocks_as_list:
            state_arguments = state.tensors
        elif variant.takes_partial:
            state_arguments = ([*state.blocks], state.partial)
        else:
            state_arguments = ([*state.blocks],)
        results = variant.forward(variant.bound, *inputs, *state_arguments)
        after = self._state_after(state, state.blocks, variant.next_offset, results[variant.results + 1:])
        if after is not None:
            # Without gradients the graph's carrier is the carrier returned, inside the block's result.
            after.layout = variant.layout_after(after)
            returned(results[variant.results], after, False, self.following)
            attach(results[variant.results], after)
        result_type = routes.traced.result_type
        return results[0] if result_type is None else result_type(results[0])

    def _run_recorded(self, routes: _ShapeRoutes, inputs: list):
        """A call of the block graph in ``routes`` in general: gradients recorded or not, any compiler, the
        state edited in place or found by storage, forward hooks on the block."""
        carrier, state, via = self._entering(routes, inputs)
        changed = via == "carrier" and edited(carrier, state)
        if via == "carrier" and not changed:
            self._check_pre_hooks_seen(carrier, state)
        # A block graph takes the completed blocks as one list, however many: it serves every depth.
        layout = layout_of(state, changed, as_list=True)
        variant = routes.variants.get(layout)
        if variant is None:
            variant = routes.variants[layout] = graphs.block_variant(self, routes.traced, routes.shape, layout,
                                                                     routes.values)
            if routes.stream_input is None:
                routes.stream_input = variant.stream_input
        given = inputs[variant.stream_input] if variant.stream_input is not None else None
        before, reentrant = (state, False) if given is None or not given.requires_grad else \
            self._recomputable(given, state)
        tensors: tuple[torch.Tensor, ...] = ()
        if layout is not None:
            view, tensors = unbundle(state, carrier)
            if changed:
                blocks = layout.blocks
                tensors = (*tensors[:blocks], restated(view, tensors[:blocks]))
            inputs[routes.stream_input] = view
        state_arguments = variant.state_arguments(tensors)
        if self.conversion.compiler == "eager":
            results = variant.forward(variant.bound, *inputs, *state_arguments)
        else:
            results = self._run_compiled(variant, inputs, state_arguments)
        # The graph returns the block's result as its one output, then the carrier and the state after it.
        after = self._state_after(state, tensors, variant.next_offset, results[variant.results + 1:])
        if after is None:
            return routes.traced.result(results[0])
        after.layout = variant.layout_after(after)
        carrier_out, hooked = self._leaving(results[variant.results], after, before, via, reentrant)
        # The carrier is the block's result itself (path (0,)) or inside it.
        path = variant.carrier
        result = carrier_out if path == (0,) else replaced_at(results, path, carrier_out)[0]
        return self._returning(routes.traced.result(result), carrier_out, after, hooked)

    def _entering(self, routes: _ShapeRoutes, inputs: list) -> tuple[torch.Tensor | None, StreamState | None, str]:
        """The carrier this call takes and the state it brings (``None`` at the stream's start)."""
        carrier, state, via = None, None, ""
        if routes.stream_input is not None:
            carrier = inputs[routes.stream_input]
            state = getattr(carrier, ATTRIBUTE, None)
            if state is not None and state.owner is self.conversion and state.stream == self.stream:
                via = "carrier"
            else:
                state, via = state_of(carrier, self.conversion, self.stream)
        elif not self.starts:
            # The first call of this shape: the carrier is the input that carries the state.
            for index, value in enumerate(inputs):
                if isinstance(value, torch.Tensor):
                    state, via = state_of(value, self.conversion, self.stream)
                    if state is not None:
                        carrier, routes.stream_input = value, index
                        break
        if state is None or state.position > self.span.start:
            self._check_entry(state)
        return (carrier, state, via) if state is not None else (None, None, "")

    def _check_entry(self, state: StreamState | None) -> None:
        """Refuses a call that brings no state to a block that does not start the stream, or the state of
        a later place in it (called where either may be the case)."""
        if state is None:
            if not self.starts:
                raise RoutingError(self._stateless_message())
        elif state.position > self.span.start:
            raise RoutingError(f"{self.where} was called with the stream after residual site {state.position} of "
                               f"stream {self.stream}, but its own sites start at {self.span.start}: the stream's "
                               "modules must be called once each, in order")

    def _pre_hooks_unseen(self, state: StreamState) -> bool:
        """Whether this block has forward pre-hooks (or ones for every module exist) that may have edited a
        carrier without a version counter of which its block kept no copy (hooks registered during the
        call, after that block returned): the general path refuses such a call."""
        return (state.version is None and state.snapshot is None
                and bool(self.module._forward_pre_hooks or compat.global_forward_pre_hooks()))

    def _check_pre_hooks_seen(self, carrier: torch.Tensor, state: StreamState) -> None:
        """Refuses a call whose forward pre-hooks may have edited the carrier in place where nothing can
        tell: an inference tensor (no version counter) of which no copy was kept, because the block that
        returned it looked for the pre-hooks of the block after it, not of this one (a block skipped), or
        they were registered after it returned."""
        if carrier.is_inference() and self._pre_hooks_unseen(state):
            raise RoutingError(
                f"{self.where} has forward pre-hooks (its own, or ones registered for every module) and takes, "
                f"under torch.inference_mode(), the stream after residual site {state.position} of stream "
                f"{self.stream}, which the module before it returned without a copy for these hooks (a module "
                "of the stream skipped, or the hooks registered during the call): an inference tensor has no "
                "version counter, so an edit of it in place by these hooks could not be told. Call the "
                "stream's modules in order with hooks registered before the call, or run under "
                "torch.no_grad(), where edits are seen.")

    def _state_after(self, state: StreamState | None, tensors: tuple, next_offset: int,
                     state_out: tuple) -> StreamState | None:
        """The stream's state after this call (``state_out``: the partial sum, then the blocks it committed),
        the stream's start and end noted; ``None`` where the call ends the stream."""
        if self.starts:
            note_stream_start(self.conversion, self.stream)
        if self.ends:
            note_stream_end(self.conversion, self.stream)
            return None
        entered = tensors[:len(state.blocks)] if state is not None else ()
        return StreamState(self.conversion, self.stream, self.span.start + next_offset,
                           entered + tuple(state_out[1:]), state_out[0])

    def _recomputable(self, given: torch.Tensor | None, state: StreamState | None) -> tuple[StreamState | None, bool]:
        """Activation checkpointing recomputes a block on a copy of its input, which carries no state: in the
        forward of reentrant checkpointing (no gradient recorded for an input that needs one) or of
        non-reentrant checkpointing (saved-tensor hooks in place), remember the input so that the
        recomputation finds its state (a new one at the stream's start). Returns the state the call
        starts from, and whether this is reentrant checkpointing's forward."""
        if given is None or not given.requires_grad:
            return state, False
        reentrant = not torch.is_grad_enabled()
        if not reentrant and not compat.saved_tensor_hooks_active():
            return state, False
        if state is None:
            state = StreamState(self.conversion, self.stream, 0)
            attach(given, state)
        remember_for_recomputation(given)
        return state, reentrant

    def _leaving(self, carrier: torch.Tensor, after: StreamState, before: StreamState | None, via: str,
                 reentrant: bool) -> tuple[torch.Tensor, bool]:
        """The carrier this call returns, with ``after`` attached (and gradients joined for reentrant
        checkpointing, see :mod:`attnres_fx.routing.state`), and whether forward hooks will see it."""
        if via == "storage" and before is not None and before.successor is not None:
            # Reentrant checkpointing recomputes this call on a detached copy of its input: its result
            # joins the state the original call made, whose gradients the next block's recomputation sent.
            return bundle(carrier, after.tensors, grads_from=before.successor), False
        carrier_out = bundle(carrier, after.tensors, grads_from=after)
        attach(carrier_out, after)
        hooked = self._user_hooks()
        returned(carrier_out, after, hooked, self.following)
        if reentrant:
            before.successor = after
        return carrier_out, hooked

    def _run_compiled(self, variant: graphs.BlockVariant, inputs: list, state: tuple):
        """The block graph ``variant`` compiled by Inductor: TorchDynamo captures the rewritten graph's own
        code (the block's sublayers inlined, with Dynamo's guards on them), one cache per block and
        variant (a code object of its own). Without gradients, the graph in the two-phase schedule, as
        for a TorchDynamo graph (:func:`~attnres_fx.routing.graphs.rewritten_dynamo_graph`)."""
        compiler = self.conversion.compiler
        two_phase = not torch.is_grad_enabled()
        key = (compiler, "block graph", variant, two_phase)
        entry = self._entries.get(key)
        if entry is None:
            forward = variant.two_phase_forward() if two_phase else variant.forward
            entry = self._entries[key] = dynamo.compiled_entry(entry_function(forward), self._block_graph_backend,
                                                               compiler)
        bound = variant.bound
        return dynamo.run(lambda: entry(bound, *inputs, *state), lambda: variant.forward(bound, *inputs, *state),
                          self.module, lambda err: _graph_break_message(self, err), self.checkpointing_flag_holders)

    def _block_graph_backend(self, gm: fx.GraphModule, example_inputs: list):
        self.conversion.stats.captures += 1
        return compat.inductor_compile(gm, example_inputs, config_patches=self.conversion.compile_options or None)

    # -- forward hooks on the block ------------------------------------------------------------------

    def _user_hooks(self) -> bool:
        """Whether forward hooks other than the router's own (:meth:`_after_hooks`) will see this call's
        result: the module's, or hooks registered for every module."""
        hooks = self.module._forward_hooks
        if hooks and (len(hooks) > 1 or self._after_hooks_id not in hooks):
            return True
        return compat.global_forward_hooks()

    def _returning(self, result, carrier: torch.Tensor, state: StreamState, hooked: bool):
        """``result``, the block's, with ``carrier`` in it carrying ``state``; where forward hooks will see it
        (``hooked``), the router's own hook is put after them, to find what they return in its place."""
        if hooked:
            hooks = self.module._forward_hooks
            with _HOOK_LOCK:
                if self._after_hooks_id in hooks:
                    hooks.move_to_end(self._after_hooks_id)
                else:
                    self._after_hooks_id = self.module.register_forward_hook(self._after_hooks).id
            call_context().hooked_results[id(self.module)] = (result, carrier, state)
        elif self._after_hooks_id is not None:
            # The user's hooks are gone: the block's calls take nn.Module's path without hooks again.
            self.remove_hook()
        return result

    def _after_hooks(self, module: nn.Module, args: tuple, result):
        """The last forward hook of the block: where the hooks before it returned a new tensor in place of
        the carrier (``out + v``, not ``out.add_(v)``), the stream goes on from that tensor, its partial
        sum restated as for an edit in place (the new value minus the completed blocks): the next block
        reads what the hooks returned, as in the original model. A result of another structure, or a
        tensor of another shape, dtype or device, carries no state: the next block refuses it by name."""
        if torch.compiler.is_dynamo_compiling():
            return None          # a capture of the call as written: its graph holds the hooks
        found = call_context().hooked_results.pop(id(module), None)
        if found is None or result is found[0]:
            return None
        original, carrier, state = found
        leaves, structure = pytree.tree_flatten(original)
        new_leaves, new_structure = pytree.tree_flatten(result)
        if new_structure != structure:
            return None
        new = next((new_leaves[k] for k, leaf in enumerate(leaves) if leaf is carrier), None)
        if (isinstance(new, torch.Tensor) and new is not carrier and getattr(new, ATTRIBUTE, None) is None
                and (new.shape, new.dtype, new.device) == (carrier.shape, carrier.dtype, carrier.device)):
            state.replaced = True
            attach(new, state)
        return None

    def remove_hook(self) -> None:
        """Take the router's own forward hook off the block (the routing removed)."""
        self.module._forward_hooks.pop(self._after_hooks_id, None)
        self._after_hooks_id = None

    # -- TorchDynamo ---------------------------------------------------------------------------------

    def _run_dynamo(self, args: tuple, kwargs: dict):
        carrier, state, via = _find_state((args, kwargs), self.conversion, self.stream)
        self._check_entry(state)
        given = (args, kwargs)
        changed = via == "carrier" and edited(carrier, state)
        if via == "carrier" and not changed:
            self._check_pre_hooks_seen(carrier, state)
        # The graph takes the state's tensors as real inputs (Dynamo guards on their dtypes and shapes); what
        # it depends on besides is the state's layout.
        layout = layout_of(state, changed, as_list=False)
        tensors: tuple[torch.Tensor, ...] = ()
        if layout is not None:
            view, tensors = unbundle(state, carrier)
            if changed:
                tensors = (*tensors[:layout.blocks], restated(view, tensors[:layout.blocks]))
            args, kwargs = _replaced((args, kwargs), carrier, view)
        forward = self.forward_function
        room = self._state_room(layout)
        entry = self.entry(layout, lambda compiler: self._dynamo_backend(compiler, layout), forward, room)
        out, slots = self.run_dynamo(entry, args, kwargs, forward, list(tensors))
        graph = self._dynamo_graphs[layout]
        start = carrier if carrier is not None else graph.stream_argument(*given)
        before, reentrant = self._recomputable(start, state)
        # What the graph hands on is what its rewrite found (its signature), within the room planned.
        after = self._state_after(state, tensors, graph.signature.next_offset,
                                  tuple(slots[1:1 + graph.signature.handed_on]))
        if after is None:
            return out
        carrier_out, hooked = self._leaving(slots[0], after, before, via, reentrant)
        return self._returning(_with_carrier(out, slots[0], carrier_out, f"the result of {self.where}"),
                               carrier_out, after, hooked)

    def _state_room(self, layout: StateLayout | None) -> int:
        """How many state outputs the block's TorchDynamo capture has room for with the state in ``layout``:
        the carrier, the partial sum and a block for each block start from the state's place to the end of
        the span (none where it ends the stream). The rewrite fills what the call hands on (fewer where it
        skips a block start) and leaves the rest spare (:mod:`attnres_fx.passes.signature`)."""
        if self.ends:
            return 0
        start = self.span.start if layout is None else layout.position
        size = self.planned.block_size
        return 2 + sum(1 for position in range(start, self.span.stop) if position % size == 0)

    def _refuse_checkpointed_cache(self, args: tuple, kwargs: dict) -> None:
        """Non-reentrant activation checkpointing recomputes this call in the backward, where a key/value
        cache passed to it holds what the call itself stored: the recomputation is another function (longer
        keys), so Dynamo compiles another graph, whose saved activations the first graph's Inductor backward
        cannot take. Refused before anything runs (transformers' own checkpointing turns the cache off)."""
        if self.conversion.compiler == "eager" or not torch.is_grad_enabled() or not compat.saved_tensor_hooks_active():
            return
        if any(compat.is_hf_cache(value) for value in (*args, *kwargs.values())):
            raise RoutingError(
                f"{self.where} is compiled by attnres_fx.compile and activation-checkpointed, and this call passes "
                "it a key/value cache: the checkpoint's recomputation would find the cache this call fills and "
                "compute another function. Train without a cache (model(..., use_cache=False), as transformers' "
                "gradient_checkpointing_enable() does), or compile with attnres_fx.compile(model, backend=\"eager\").")

    def _dynamo_backend(self, compiler: str, layout: StateLayout | None):
        def backend(gm: fx.GraphModule, example_inputs: list):
            start = time.perf_counter()
            target = LayerTarget(self.planned, self.span, layout, self.ends)
            compiled, result, rewritten = graphs.rewritten_dynamo_graph(self, gm, example_inputs, compiler,
                                                                        layer=target)
            signature = result.signature
            self._dynamo_graphs[layout] = _DynamoGraph(signature, graphs.stream_argument(rewritten, signature))
            LOG.info("rewrote the graph Dynamo captured for a call of %s (layer route, %s) in %.2f s", self.where,
                     compiler, time.perf_counter() - start)
            return compiled
        return backend

    def _stateless_message(self) -> str:
        first = self.planned.layers[0].owner
        captured, now = self.conversion.captured_training, self.module.training
        if captured is not None and captured != now:
            # Another mode, another code path between the blocks (RWKV halves its stream every few layers in
            # eval mode only): the route='model' advice below would fail the same way.
            modes = {True: "train", False: "eval"}
            return (f"{self.where} was called with no AttnRes state for stream {self.stream}: the model was "
                    f"converted in {modes[captured]} mode and is called in {modes[now]} mode, and the code that "
                    f"calls its blocks passes the stream from {first} on differently in this mode (an op on the "
                    f"stream, such as a scaling in eval mode, that the conversion's call did not run). Convert it "
                    f"in the mode it runs in (model.{modes[now]}() before attnres_fx.attnresify, which names such "
                    f"an op), or call it in {modes[captured]} mode.")
        return (f"{self.where} was called with no AttnRes state for stream {self.stream}: its residual sites "
                f"come after those of {first}, so it needs the result the module before it returned, which "
                "carries the completed block sums. Causes: the module was called on its own or with a tensor "
                "the previous module did not return (a copy, a cast, a tensor computed from it: the code "
                "that calls them may do that in a mode, train or eval, other than the conversion's, such as "
                "a scaling of the stream in eval mode; a conversion in this mode names the op; what a forward "
                "hook returned in place of the block's result, of another structure, shape, dtype or device: "
                "an edit in place, out.add_(v), or a new tensor like the result, out + v, is taken into the "
                "stream), or reentrant activation checkpointing recomputes it on inputs it cannot trace "
                "back (use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)). Call the stream's "
                "modules in order with what each returns, or convert with route='model'.")


@dataclass(frozen=True)
class _DynamoGraph:
    """What a block's TorchDynamo graphs for one state layout take and return (``signature``), and where in
    the block's call the stream enters (``argument``: ``("args", index)`` or ``("kwargs", name)``; ``None``
    where the graph starts it from a value it computes)."""

    signature: LayerGraphSignature
    argument: tuple | None

    def stream_argument(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        if self.argument is None:
            return None
        where, key = self.argument
        return args[key] if where == "args" else kwargs[key]


def _with_carrier(out, carrier: torch.Tensor, carrier_out: torch.Tensor, what: str):
    """``out`` with ``carrier_out`` in place of the carrier: the graph's own output that is ``carrier``, or
    (Inductor hands an output returned twice back as two views of one buffer) the same view of its storage."""
    def same(leaf) -> bool:
        return leaf is carrier or (
            isinstance(leaf, torch.Tensor) and leaf.device.type != "meta" and leaf.dtype == carrier.dtype
            and leaf.shape == carrier.shape and leaf.stride() == carrier.stride()
            and leaf.storage_offset() == carrier.storage_offset()
            and leaf.untyped_storage().data_ptr() == carrier.untyped_storage().data_ptr())
    found = []

    def swap(leaf):
        if same(leaf):
            found.append(leaf)
            return carrier_out
        return leaf
    out = pytree.tree_map_only(torch.Tensor, swap, out)
    if not found:
        raise RoutingError(f"{what} holds its residual stream in a container torch.utils._pytree cannot look "
                           "into, so the AttnRes state cannot travel with it; convert with route='model'")
    return out


def _find_state(tree, owner, stream: int) -> tuple[torch.Tensor | None, StreamState | None, str]:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            state, via = state_of(leaf, owner, stream)
            if state is not None:
                return leaf, state, via
    return None, None, ""


def _replaced(tree, old: torch.Tensor, new: torch.Tensor):
    if old is new:
        return tree
    return pytree.tree_map_only(torch.Tensor, lambda leaf: new if leaf is old else leaf, tree)


def _graph_break_message(router: Router, err: Exception) -> str:
    lines = [f"TorchDynamo could not capture this call of {router.where} as one graph: "
             f"{type(err).__name__}: {first_line(err)}"]
    if router.route_name == "layer":
        lines.append("On the layer route a block whose own code torch.fx cannot trace (or any block under "
                     "Inductor) runs as one Dynamo graph (fullgraph), so that its sites are rewritten together.")
    else:
        lines.append("A converted model runs each call as one Dynamo graph (fullgraph), so that every residual "
                     "stream is rewritten whole; a graph break would leave part of a stream unconverted.")
    if (hint := compat.graph_break_release_hint(err)) is not None:
        lines.append(hint)
    elif _has_sharded_submodules(router.module):
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
