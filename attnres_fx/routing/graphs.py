"""The rewritten graphs the routes run: built from a capture, cached, and made callable.

- **Block graphs** (the layer route): a block call traced with its sublayers as calls
  (:mod:`attnres_fx.capture.block_tracer`), one trace per *kind* of block and call shape (:class:`TraceCache`:
  blocks that run the same code with the same constants share it), then rewritten for one block and one
  state layout (:func:`block_variant`): a copy of the trace, the block's planned sites matched and
  rewritten with the stream's state as extra inputs and outputs, compiled to Python that resolves the
  block's modules when it runs. What the graph takes and returns is one record, the
  :class:`~attnres_fx.passes.signature.LayerGraphSignature` the rewrite stored with it.
  Under Inductor the router compiles that code through TorchDynamo (its sublayers inlined, guarded); for
  calls without gradients the code of its two-phase form (:meth:`BlockVariant.two_phase_forward`).
- **Dynamo graphs** (the model route; the layer route for a block whose own code fx cannot trace): the
  backends that rewrite a copy of each graph TorchDynamo captures (:func:`rewritten_dynamo_graph`) and
  run it eagerly or hand it to Inductor with the AttnRes weights as extra inputs (:class:`WeightReader`).
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import fx, nn

from ..op.module import BlockAttnRes, FusedNorm, run_site
from ..capture.block_tracer import (
    BLOCK,
    CHILDREN,
    FINAL,
    Bound,
    CallShape,
    TracedBlock,
    called_child,
    children_read,
    compiled_forward,
    module_constants,
    module_graph,
    trace_block,
)
from ..capture.tracers import copy_graph_module
from ..config import DEFAULT_TRACE_CACHE_SIZE
from ..conversion import RouteStats
from ..errors import TraceError
from ..passes.detect import detect_residual_streams
from ..passes.fuse_norms import fusable, fuse_site_norms, match_norm
from ..passes.matching import FailedMatch
from ..passes.node_kinds import is_reshape
from ..passes.pipeline import LayerTarget, rewrite_captured
from ..passes.rewrite import Emitter, ModuleCalls, ParameterInputs, lift_attnres_weights
from ..passes.signature import BLOCKS, PARTIAL, SIGNATURE, WEIGHT_INPUT, LayerGraphSignature, StateLayout
from ..passes.two_phase import apply_two_phase, apply_two_phase_to_site_calls
from .. import compat
from .state import StreamState, layout_of

if TYPE_CHECKING:
    from .router import LayerRouter, Router



# In a rewritten block graph's meta: (forward, graph module) of its two-phase form.
TWO_PHASE_FORWARD = "attnres_two_phase_forward"


class BlockVariant:
    """One block's rewritten graph for one call shape and state layout; ``forward(bound, *inputs, *state)``
    returns ``(result, partial, *committed)`` (``(result,)`` where the graph ends the stream)."""

    def __init__(self, forward: Callable, signature: LayerGraphSignature, bound: Bound, graph_module: fx.GraphModule):
        self.forward = forward
        self.signature = signature
        self.bound = bound
        self.graph_module = graph_module
        # What every call reads of the signature, read once (a block call's budget is microseconds).
        self.stream_input = signature.stream_input
        self.results = signature.results
        self.carrier = signature.carrier
        self.next_offset = signature.next_offset
        self.blocks_as_list = BLOCKS in signature.inputs
        self.takes_partial = PARTIAL in signature.inputs
        # The layout of the state a call of this graph leaves (the same at every call), once known.
        self.next_layout: StateLayout | None = None

    def layout_after(self, after: StreamState) -> StateLayout | None:
        """The layout of ``after``, the state a call of this graph left: worked out at the first call, the
        same at every one after it."""
        if self.next_layout is None:
            self.next_layout = layout_of(after, False, as_list=True)
        return self.next_layout

    def two_phase_forward(self) -> Callable:
        """The forward of this graph in the two-phase schedule
        (:func:`~attnres_fx.passes.two_phase.apply_two_phase_to_site_calls`): what Inductor compiles for calls
        without gradients, as for a TorchDynamo graph (:func:`rewritten_dynamo_graph`). Made from the
        rewritten graph at the first such call (no trace, no rewrite), shared by the blocks that share it."""
        found = self.graph_module.meta.get(TWO_PHASE_FORWARD)
        if found is None:
            with compat.lazy_graph_modules():
                gm = apply_two_phase_to_site_calls(copy_graph_module(self.graph_module, "TwoPhaseBlock"))
            found = self.graph_module.meta[TWO_PHASE_FORWARD] = (
                compiled_forward(gm.graph, f"{type(getattr(self.bound, BLOCK)).__name__} two-phase graph"), gm)
        return found[0]

    def state_arguments(self, tensors: tuple) -> tuple:
        """The state inputs from ``tensors`` (the completed block sums, then the partial sum where the graph
        takes one), as the graph takes them: the blocks as one list where its signature says so."""
        if not self.blocks_as_list:
            return tensors
        if self.takes_partial:
            return [*tensors[:-1]], tensors[-1]
        return ([*tensors],)


class TraceCache:
    """Block traces and rewritten block graphs of one converted model, by key (kind of block and call
    shape; place in a stream block for a rewritten graph). A trace only records the block's code and its
    sublayer calls (the sublayers themselves run as modules), so blocks of one kind (:func:`kind_of`)
    share it. Bounded: at most ``size`` entries, the least recently made or used dropped first (counted
    in ``stats.evictions``). Thread-safe: an entry is made once, under a lock.

    A failure is kept where the block's code refused the trace (torch.fx's refusal of control flow on a
    traced value, or attnres_fx's own), or where it failed twice in a row: every later trace of that
    kind and shape would repeat it. A first failure of any other kind (an exception the traced code
    happened to raise, a resource not ready yet) leaves nothing behind: the next call traces again."""

    def __init__(self, size: int = DEFAULT_TRACE_CACHE_SIZE, stats: RouteStats | None = None):
        self.size = size
        self.stats = stats if stats is not None else RouteStats()
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._failed_once: OrderedDict[tuple, None] = OrderedDict()        # bounded as the entries
        self._lock = threading.Lock()
        # Norm modules' matches (passes/fuse_norms.py), by what their graph depends on (_norm_match): read and
        # made by rewrites, under the lock. One per kind of norm in the model.
        self.norms: dict[tuple, FusedNorm | FailedMatch] = {}

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                try:
                    found = make()
                except TraceError as err:
                    if not (refused_by_code(err) or key in self._failed_once):
                        self._failed_once[key] = None
                        if len(self._failed_once) > self.size:
                            self._failed_once.popitem(last=False)
                        raise
                    found = _Kept(err)
                    err.kept = True
                self._failed_once.pop(key, None)
                self._entries[key] = found
                while len(self._entries) > self.size:
                    self._entries.popitem(last=False)
                    self.stats.evictions += 1
            else:
                self._entries.move_to_end(key)
        if isinstance(found, _Kept):
            raise found.error
        return found

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._failed_once.clear()
            self.norms.clear()

    def __len__(self) -> int:
        """How many block traces (not rewritten graphs) it holds."""
        return sum(1 for found in list(self._entries.values()) if isinstance(found, TracedBlock))

    def __getstate__(self) -> dict:
        # Traces hold the model's modules and code: made again after a copy.
        return {"size": self.size, "stats": self.stats}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["size"], state["stats"])


class _Kept:
    """A failed trace, kept (see :class:`TraceCache`)."""

    def __init__(self, error: TraceError):
        self.error = error


def failure_kept(err: TraceError) -> bool:
    """Whether ``err``, a failed trace :meth:`TraceCache.get` raised, is kept (raised again for every call
    of that kind and shape), so that the calls may settle on TorchDynamo."""
    return getattr(err, "kept", False)


def refused_by_code(err: TraceError) -> bool:
    """Whether a failed trace is the block's code refusing it (a refusal of attnres_fx's own, or torch.fx's
    refusal of control flow on a traced value), not an exception the code happened to raise."""
    cause = err.causes.get("fx")
    return cause is None or isinstance(cause, fx.proxy.TraceError)


def kind_of(module: nn.Module, forward: Callable, opened: frozenset[str]) -> tuple:
    """What two blocks must share for one trace to serve both: the code traced (the forward and the
    opened children's classes) and the constants that code may read from its modules (their plain
    attributes: a trace bakes them in)."""
    traced = [("", module), *((path, module.get_submodule(path)) for path in sorted(opened))]
    return (forward, opened, tuple((path, type(m), module_constants(m)) for path, m in traced))


def watched_constants(modules) -> tuple:
    """Per module whose code a trace holds: its attribute dict, that dict's size and the constants
    :func:`kind_of` read from it, to tell a change by identity at each call."""
    return tuple((m.__dict__, len(m.__dict__), tuple((name, value) for name, _, value in module_constants(m)))
                 for m in modules)


def trace(router: LayerRouter, args: tuple, kwargs: dict, shape: CallShape, baked: tuple | None = None) -> TracedBlock:
    """The block trace for this call shape, shared by the blocks of ``router``'s kind; ``baked``: the
    values of the call's Python numbers, for a trace that bakes them in."""
    stats = router.conversion.stats

    def make():
        traced = routable_trace(router.module, router.forward_function, args, kwargs, router.opened, shape,
                                baked is not None)
        stats.traces += 1
        return traced
    return router.conversion.traces.get((router.kind, shape, baked), make)


def routable_trace(block: nn.Module, forward: Callable, args: tuple, kwargs: dict, opened: frozenset[str],
                   shape: CallShape, baked: bool = False) -> TracedBlock:
    """:func:`~attnres_fx.capture.block_tracer.trace_block`, refused (:class:`~attnres_fx.TraceError`) where the
    stream changes its leading shape inside the block (``h.reshape(-1, d)`` before a sublayer): sources
    of two layouts must then be reshaped to each other, which needs the shapes a trace with sublayers as
    calls does not have; or where it builds its result by concatenating a tuple with a sublayer's result
    (``(h,) + attention_output[1:]``), whose length such a trace does not know: the stream then leaves
    in no place of the graph's output. Such a block runs on TorchDynamo."""
    traced = trace_block(block, forward, args, kwargs, opened, shape, baked)
    for stream in detect_residual_streams(traced.graph_module, min_sites=1).streams:
        if any(is_reshape(op) for site in stream.sites for op in site.inbound):
            raise TraceError(f"the residual stream of {type(block).__name__} changes its leading shape between "
                             "sites, which a trace with its sublayers as calls cannot follow")
    (output,) = traced.graph_module.graph.find_nodes(op="output")
    if any(_concatenates_a_sequence(node) for node in output.all_input_nodes):
        raise TraceError(f"{type(block).__name__} returns a tuple concatenated with a sublayer's result, whose "
                         "length a trace with its sublayers as calls does not know")
    return traced


def _concatenates_a_sequence(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.add, operator.concat)
            and any(isinstance(arg, (tuple, list)) for arg in node.args))


class BlockModuleCalls(Emitter):
    """Aggregations of a block graph as calls of the block's own ``BlockAttnRes`` modules (paths under
    :data:`~attnres_fx.capture.block_tracer.BLOCK`), a stream's final one as :data:`FINAL`: resolved when the
    graph runs, on the :class:`~attnres_fx.capture.block_tracer.Bound` it is given."""

    def __init__(self, gm: fx.GraphModule, block_path: str, modules: dict[str, BlockAttnRes]):
        self.gm = gm
        self.block_path = block_path
        self.modules = modules

    def emit(self, graph, site, sources, entered=None):
        prefix = self.block_path + "."
        relative = site.name[len(prefix):] if site.name.startswith(prefix) else None
        # A module the block holds itself is read from its children (Bound), below it through the block.
        target = FINAL if relative is None else f"{CHILDREN if '.' not in relative else BLOCK}.{relative}"
        # On the graph module (a copy of the referenced tree) for the graph's checks; the code runs on the
        # real block, given when it is called.
        self.gm.add_submodule(target, self.modules[site.name])
        return graph.call_function(run_site, (graph.get_attr(target), () if entered is None else entered, *sources))


class SiteModules(nn.Module):
    """Where each site's AttnRes module of a converted model is: its parent module and the name there
    (``parent._modules[name]``), so that a graph looks the module up when it runs and calls what is
    there then (a module replaced after the graph was made, PEFT's ``modules_to_save`` wrapper). A module
    on a rewritten graph (``get_attr``) that refers to the model without owning it."""

    def __init__(self, root: nn.Module, names):
        super().__init__()
        self.__dict__["places"] = {name: place_of(root, name) for name in names}

    def module(self, name: str) -> nn.Module:
        parent, attribute = self.places[name]
        return parent._modules[attribute]


def place_of(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds the module at ``name`` in ``root`` and its name there. A wrapper on the path
    (``checkpoint_wrapper``) forwards attribute reads to the layer it holds, so ``name`` reaches the
    module through it, but the module is held by the wrapped layer: that layer is its place."""
    path, _, attribute = name.rpartition(".")
    parent = root.get_submodule(path)
    module = root.get_submodule(name)
    for holder in parent.modules():
        if holder._modules.get(attribute) is module:
            return holder, attribute
    raise AssertionError(f"{name} is not held by {path} or a module inside it")


def run_site_at(sites: SiteModules, name: str, *sources: torch.Tensor) -> torch.Tensor:
    """:func:`~attnres_fx.op.module.run_site` of the module at site ``name`` now."""
    return run_site(sites.module(name), (), *sources)


SITES = "attnres_sites"          # a Dynamo graph's SiteModules, on the rewritten copy


class SiteModuleCalls(Emitter):
    """Aggregations of an eagerly run Dynamo graph as calls of the module each site holds when the graph
    runs (:func:`run_site_at`)."""

    def __init__(self, gm: fx.GraphModule, sites: SiteModules):
        self.gm = gm
        self.sites = sites

    def emit(self, graph, site, sources, entered=None):
        self._no_list(entered)
        if not hasattr(self.gm, SITES):
            self.gm.add_submodule(SITES, self.sites)
        return graph.call_function(run_site_at, (graph.get_attr(SITES), site.name, *sources))


def rewrite_block(traced: TracedBlock, plan, target: LayerTarget, block_path: str,
                  modules: dict[str, BlockAttnRes], where: str) -> fx.GraphModule:
    """A copy of ``traced`` with the block's planned sites rewritten (``target``: its stream, span, the
    state it receives and whether it ends the stream; ``modules``: the AttnRes modules by site name); its
    :class:`~attnres_fx.passes.signature.LayerGraphSignature` in its ``meta``. The graph returns the block's
    result as one output, the state outputs after it."""
    with compat.lazy_graph_modules():        # the code is generated once, from the final graph
        gm = copy_graph_module(traced.graph_module, where)
        (output,) = gm.graph.find_nodes(op="output")
        output.args = ((output.args[0],),)
        rewrite_captured(gm, plan, lambda g: BlockModuleCalls(g, block_path, modules), where=where, layer=target)
    return gm


def variant_key(kind: tuple, shape: CallShape, planned, span, path: str, layout: StateLayout | None,
                baked: tuple | None = None) -> tuple:
    """What a rewritten block graph is shared by: the kind of block and call shape, its place in a stream
    block (where the state it receives stands), whether it ends the stream, and the names of its
    aggregations below the block (the stream's final one as ``None``)."""
    place = "start" if layout is None else (span.start - layout.position, layout.position % planned.block_size,
                                            layout.has_partial)
    prefix = path + "."
    names = tuple(site.name[len(prefix):] if site.name.startswith(prefix) else None for site in planned.sites
                  if site.position is None or span.start <= site.position < span.stop)
    return ("variant", kind, shape, baked, place, span.stop == planned.num_positions, names)


def block_variant(router: LayerRouter, traced: TracedBlock, shape: CallShape, layout: StateLayout | None,
                  baked: tuple | None = None) -> BlockVariant:
    """``traced`` rewritten for ``router``'s block with the stream's state in ``layout``; see the module
    docstring. The rewritten code is shared by the blocks of one kind that sit at the same place in a
    stream block and name their aggregations alike: it takes the completed blocks as one list and finds
    the block's modules on the ``self`` it is given."""
    planned = router.planned
    forward, gm = rewritten_block(router, traced, shape, layout, baked)
    attributes = [node.target for node in gm.graph.find_nodes(op="get_attr")]
    children = children_read(gm.graph)
    others = {target: getattr(gm, target) for target in attributes
              if not target.startswith((BLOCK + ".", CHILDREN + ".")) and target != FINAL}
    final = place_of(router.root, planned.final.name) if FINAL in gm._modules else None
    router.rewritten.append(gm)
    return BlockVariant(forward, gm.meta[SIGNATURE], Bound(router.module, final, children, **others), gm)


def rewritten_block(router: LayerRouter, traced: TracedBlock, shape: CallShape, layout: StateLayout | None,
                    baked: tuple | None = None, modules: dict[str, BlockAttnRes] | None = None) -> tuple:
    """``(forward, graph_module)``: ``traced`` rewritten for ``router``'s block with the stream's
    state in ``layout``, from the conversion's cache (shared as :func:`block_variant` says). ``modules``: the
    AttnRes modules by site name, where they are not the model's yet (the conversion's trial)."""
    planned = router.planned
    key = variant_key(router.kind, shape, planned, router.span, router.path, layout, baked)

    def rewrite() -> tuple:
        target = LayerTarget(planned, router.span, layout, router.ends)
        # The block's own (another block's may be gone: a pipeline stage holds some of the model's blocks).
        own = {site.name: modules[site.name] if modules is not None else router.root.get_submodule(site.name)
               for site in router.own_sites}
        gm = rewrite_block(traced, router.conversion.plan, target, router.path, own, router.where)
        router.conversion.stats.rewrites += 1
        return compiled_forward(eager_graph(gm, router.conversion.traces), f"{type(router.module).__name__} graph"), gm
    return router.conversion.traces.get(key, rewrite)


def eager_graph(gm: fx.GraphModule, cache: TraceCache) -> fx.Graph:
    """The graph a rewritten block graph's eager code is made from: a copy with each aggregation read by a norm
    alone fused with it (:mod:`attnres_fx.passes.fuse_norms`; counted in ``stats.fused_norms``), else
    ``gm``'s own. ``gm`` stays in the per-site form its two-phase form and TorchDynamo's capture start from.
    Called by a rewrite, under ``cache``'s lock."""
    def match(module: nn.Module) -> FusedNorm | FailedMatch:
        return _norm_match(cache, module)
    if not fusable(gm, match):
        return gm.graph
    with compat.lazy_graph_modules():
        fused = copy_graph_module(gm, type(gm).__name__)
        cache.stats.fused_norms += fuse_site_norms(fused, _read_called_module, match)
    return fused.graph


def _norm_match(cache: TraceCache, module: nn.Module) -> FusedNorm | FailedMatch:
    """:func:`match_norm` of ``module``, kept in ``cache`` by its class, that class's forward, its mode and
    its own constants (:func:`module_constants`, which its code may branch on, as a block kind's)."""
    key = (type(module), type(module).forward, module.training, module_constants(module))
    found = cache.norms.get(key)
    if found is None:
        try:
            found = match_norm(module, module_graph(module))
        except TraceError as err:
            found = FailedMatch(lambda err=err: f"its forward cannot be traced: {err}")
        cache.norms[key] = found
    return found


def _read_called_module(graph: fx.Graph, call: fx.Node) -> fx.Node:
    """A ``get_attr`` of the module ``call`` calls, as the block graph's code reads it: a child the block calls
    directly through :data:`CHILDREN`, a module below one through the block."""
    child = called_child(call)
    target = f"{CHILDREN}.{child}" if child else str(call.target)
    if child:
        # On the graph module too, for the graph's checks (the code reads the block it is given).
        graph.owning_module.add_submodule(target, graph.owning_module.get_submodule(str(call.target)))
    return graph.get_attr(target)


# -- TorchDynamo graphs --------------------------------------------------------------------------------------

def rewritten_dynamo_graph(router: Router, gm: fx.GraphModule, example_inputs: list, compiler: str, *,
                           layer: LayerTarget | None = None, carriers: bool = False):
    """Rewrite a copy of Dynamo's graph (its own must stay as it is: its bookkeeping refers to it) and
    make it runnable: the graph itself, calling the model's own BlockAttnRes modules (their hooks fire),
    or Inductor's compilation with the AttnRes weights as extra inputs (parameters must be inputs there,
    and then get gradients through AOTAutograd). A block's graph (``layer``) takes and returns the stream's
    state as real inputs and outputs (:mod:`attnres_fx.passes.signature`). Returns the runnable, what the
    rewrite did and the rewritten graph."""
    plan = router.conversion.plan
    router.conversion.stats.captures += 1
    graph_module = copy_graph_module(gm, type(router.module).__name__)
    modules = {site.name: router.root.get_submodule(site.name) for site in plan.sites}
    if compiler == "eager":
        sites = SiteModules(router.root, modules)
        result = rewrite_captured(graph_module, plan, lambda g: SiteModuleCalls(g, sites), where=router.where,
                                  prefix=router.path, layer=layer, carriers=carriers)
        compat.checkpoint_regions_when_run_eagerly(graph_module)
        router.rewritten.append(graph_module)
        return graph_module.forward, result, graph_module
    if torch.is_grad_enabled():
        emitter = ParameterInputs(plan)
        result = rewrite_captured(graph_module, plan, lambda g: emitter, where=router.where, prefix=router.path,
                                  layer=layer, carriers=carriers)
        names = emitter.names
    else:
        # Dynamo guards on grad mode, so this graph serves calls without gradients only: inference, where
        # the two-phase schedule scores each block's pseudo-queries against its completed blocks at once
        # (:mod:`attnres_fx.passes.two_phase`); its weights then become inputs as in the training graph.
        result = rewrite_captured(graph_module, plan, lambda g: ModuleCalls(g, modules), where=router.where,
                                  prefix=router.path, layer=layer, carriers=carriers)
        apply_two_phase(graph_module)
        names = lift_attnres_weights(graph_module)
    router.rewritten.append(graph_module)
    weights = WeightReader(router.root, names)
    compiled = compat.inductor_compile(graph_module, [*example_inputs, *weights.fake(example_inputs)],
                                       config_patches=router.conversion.compile_options or None)
    return RoutedGraph(compiled, weights), result, graph_module


def stream_argument(graph_module: fx.GraphModule, signature: LayerGraphSignature) -> tuple | None:
    """Where the stream enters a block's call whose TorchDynamo graph is ``graph_module``: the argument its
    stream input was made from (``("args", index)`` or ``("kwargs", name)``), ``None`` where there is none."""
    if signature.stream_input is None:
        return None
    inputs = [node for node in graph_module.graph.find_nodes(op="placeholder") if WEIGHT_INPUT not in node.meta]
    return compat.dynamo_argument(inputs[signature.stream_input])


class WeightReader:
    """The AttnRes weights a rewritten graph takes as extra inputs (``names``: ``<site>.proj.weight`` and
    ``<site>.norm.weight``), read at every call from the module each site holds then (so ``.to()``,
    ``load_state_dict(assign=True)``, optimizer steps, FSDP2's all-gathered parameters and a module
    replaced after compilation are seen)."""

    def __init__(self, root: nn.Module, names: list[str]):
        self.names = names
        split = [name.rsplit(".", 2) for name in names]
        self.sites = SiteModules(root, dict.fromkeys(site for site, _, _ in split))
        self.holders = [(site, child, attr) for site, child, attr in split]

    def read(self) -> list[torch.Tensor]:
        modules = {name: self.sites.module(name) for name in self.sites.places}
        return [getattr(getattr(modules[site], child), attr) for site, child, attr in self.holders]

    def fake(self, example_inputs: list) -> list[torch.Tensor]:
        fake_mode = compat.detect_fake_mode(example_inputs)
        tensors = self.read()
        return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors] if fake_mode else tensors


class RoutedGraph:
    """Dynamo calls this with the graph's own inputs; the AttnRes weights are appended."""

    def __init__(self, compiled, weights: WeightReader):
        self.compiled = compiled
        self.weights = weights

    def __call__(self, *args):
        return self.compiled(*args, *self.weights.read())
