"""The rewrite pipeline every route runs on a captured graph, as three passes: open checkpointed regions
(:class:`~attnres_fx.passes.checkpoints.OpenCheckpoints`) -> detect, match the plan and rewrite -> close
the regions again (:class:`~attnres_fx.passes.checkpoints.CloseCheckpoints`).

- the model route (:mod:`attnres_fx.routing`): one graph of a whole call, every stream in it matched by
  its signature (:func:`~attnres_fx.passes.plan.match_streams`);
- the layer route: one layer's own graph (:class:`LayerTarget`), its one stream matched against the
  layer's planned sites (:func:`~attnres_fx.passes.plan.match_layer`), the stream's state entering as
  placeholders and leaving as extra outputs (:class:`~attnres_fx.passes.rewrite.StreamSpan`);
- explicit graphs (:func:`attnres_fx.rewrite`) and the conversion's trial rewrite: as the model route;
- a graph of another implementation of the converted model (an inference engine's own classes, ``in_order``):
  its one stream matched to the plan by the order of its sites (:func:`~attnres_fx.passes.plan.match_in_order`).

Contract
    requires  a GraphModule the caller owns (a copy of a Dynamo graph: Dynamo's own must not change), the
              plan, and an emitter factory (how aggregations become nodes, given the GraphModule).
    ensures   what :class:`~attnres_fx.passes.rewrite.BlockAttnResRewrite` ensures, with checkpointed
              regions checkpointed again with their new inputs and outputs.
    returns   :class:`Rewritten`: the rewrite pass (its ``records`` say what it did) and, for a layer's
              graph, its :class:`~attnres_fx.passes.signature.LayerGraphSignature` (also stored with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from attnres_fx.errors import StreamMismatchError

from .checkpoints import CloseCheckpoints, OpenCheckpoints
from .detect import detect_residual_streams
from .layers import LayerSpan
from .node_kinds import is_stream_op
from .plan import Plan, StreamPlan, match_in_order, match_layer, match_streams
from .rewrite import BlockAttnResRewrite, Emitter, StreamSpan
from .signature import SIGNATURE, LayerGraphSignature, StateLayout, at_path, layer_signature, state_slots


@dataclass(frozen=True)
class LayerTarget:
    """One layer's graph on the layer route: the planned stream, the layer's span of it, the state the
    graph receives (``entry``; None when the graph starts the stream) and whether it ends the stream."""

    planned: StreamPlan
    span: LayerSpan
    entry: StateLayout | None
    ends: bool


@dataclass(frozen=True)
class Rewritten:
    """What :func:`rewrite_captured` did: the pass, and for a layer's graph what the graph takes and
    returns (also kept in ``graph_module.meta[SIGNATURE]``)."""

    rewrite: BlockAttnResRewrite
    signature: LayerGraphSignature | None = None


def rewrite_captured(graph_module: fx.GraphModule, plan: Plan, emitter: Callable[[fx.GraphModule], Emitter], *,
                     where: str, prefix: str = "", within: str = "", layer: LayerTarget | None = None,
                     carriers: bool = False, in_order: bool = False) -> Rewritten:
    """Rewrite ``graph_module`` in place; see the module docstring. ``carriers``: a graph of a whole call
    keeps the layer route's carriers for its layer-routed streams (what reads the stream between blocks
    reads the plain residual sum, as when the blocks run their own graphs). ``prefix`` / ``within``: where
    the captured module sits in the converted model, and the model in the captured module
    (:func:`~attnres_fx.passes.plan.signature`). ``in_order``: the graph is another implementation's (see
    the module docstring). The passes run in order, each checking its contract,
    and the graph is linted after each."""
    opening = OpenCheckpoints()
    rewriting = _RewriteStreams(plan, emitter, where, prefix, within, layer, carriers, in_order)
    for step in (opening, rewriting, CloseCheckpoints(opening)):
        step(graph_module)
        graph_module.graph.lint()
    return rewriting.result


class _RewriteStreams(PassBase):
    """Detect the streams of an opened graph, match them to the plan and rewrite them
    (:class:`~attnres_fx.passes.rewrite.BlockAttnResRewrite`); for a layer's graph also find where its
    stream leaves and enters, before the checkpointed regions close (they may take the stream's last
    value inside them)."""

    def __init__(self, plan: Plan, emitter: Callable[[fx.GraphModule], Emitter], where: str, prefix: str,
                 within: str, layer: LayerTarget | None, carriers: bool, in_order: bool = False):
        super().__init__()
        self.plan, self.emitter, self.where, self.prefix, self.within, self.layer = (
            plan, emitter, where, prefix, within, layer)
        self.carriers = carriers
        self.in_order = in_order
        self.result: Rewritten | None = None

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        layer, where = self.layer, self.where
        if layer is None:
            detection = detect_residual_streams(graph_module)
            matched = (match_in_order(detection, self.plan, where=where) if self.in_order else
                       match_streams(detection, self.plan, prefix=self.prefix, within=self.within, where=where))
            detection = dataclasses.replace(detection, streams=tuple(m.stream for m in matched))
            spans = [StreamSpan(m.planned, m.positions, layer=self.carriers and m.planned.route == "layer")
                     for m in matched]
        else:
            slots = _open_slots(graph_module)
            detection = detect_residual_streams(graph_module, min_sites=1)
            stream, positions = match_layer(detection, layer.planned, layer.span, where=where)
            detection = dataclasses.replace(detection, streams=(stream,))
            spans = [StreamSpan(layer.planned, positions, layer=True, entry=layer.entry, ends=layer.ends,
                                entered=tuple(slots[0].args[0]) if slots is not None else ())]
        rewrite = BlockAttnResRewrite(self.plan, detection, self.emitter(graph_module), spans=spans)
        rewrite(graph_module)
        self.result = Rewritten(rewrite)
        if layer is not None:
            # The graph that ends the stream hands nothing on: its result may hold the final aggregation
            # in any form (normalised, in a ModelOutput).
            carrier = None if layer.ends else _output_path(graph_module, rewrite.carriers[0], where)
            _return_carrier(graph_module, carrier, rewrite.state_outputs)
            state_at, spare = None, 0
            if slots is not None:
                state_at, spare, carrier = _fill_slots(graph_module, slots, rewrite.state_outputs, carrier, where)
            stream = _start(graph_module, detection.streams[0]) if layer.entry is None else rewrite.stream_origin
            signature = layer_signature(graph_module, rewrite, layer.entry, stream, carrier,
                                        positions[-1] + 1 - layer.span.start, state_at, spare)
            graph_module.meta[SIGNATURE] = signature
            self.result = Rewritten(rewrite, signature)
        return PassResult(graph_module, True)


def _open_slots(graph_module: fx.GraphModule) -> tuple[fx.Node, tuple[int, ...]] | None:
    """The :func:`~attnres_fx.passes.signature.state_slots` node of a TorchDynamo capture of a block's call and
    where its results are among the graph's outputs, those taken out (the rewrite appends the state it hands
    on); ``None`` for a graph without one."""
    found = list(graph_module.graph.find_nodes(op="call_function", target=state_slots))
    if not found:
        return None
    (slots,) = found
    (output,) = graph_module.graph.find_nodes(op="output")
    results = tuple(output.args[0])
    taken = {user: user.args[1] for user in slots.users}
    at = sorted((taken[value], index) for index, value in enumerate(results) if value in taken)
    output.args = (tuple(value for value in results if value not in taken),)
    return slots, tuple(index for _, index in at)


def _fill_slots(graph_module: fx.GraphModule, slots: tuple[fx.Node, tuple[int, ...]], kept: int,
                carrier: tuple | None, where: str) -> tuple[tuple[int, ...], int, tuple | None]:
    """Put what the rewrite returned after the graph's own outputs (the carrier and ``kept`` state outputs) in
    the places of the capture's first slots (Dynamo's bytecode reads each output at its place), the last of
    them in every slot left over (spare: the call skipped a block start its span has room for), and remove
    the slots node. Returns those places, how many are spare and ``carrier``, the carrier's path in the own
    outputs, as a path in the graph's outputs."""
    node, at = slots
    needed = kept + bool(kept)
    if len(at) != len(node.args[1]) or needed > len(at) or bool(needed) != bool(at):
        raise StreamMismatchError(f"{where}: its TorchDynamo capture has room for {len(node.args[1])} state outputs "
                                  f"and the block hands on {needed}, more than its planned sites make (or none "
                                  "where it does not end the stream). Convert with route='model'.")
    (output,) = graph_module.graph.find_nodes(op="output")
    results = tuple(output.args[0])
    own = results[:len(results) - needed]
    handed = results[len(own):]
    state, mine = iter((*handed, *handed[-1:] * (len(at) - needed))), iter(own)
    places = set(at)
    total = len(own) + len(at)
    output.args = (tuple(next(state) if index in places else next(mine) for index in range(total)),)
    for user in list(node.users):
        graph_module.graph.erase_node(user)
    graph_module.graph.erase_node(node)
    graph_module.recompile()
    if carrier is not None:
        own_places = [index for index in range(total) if index not in places]
        carrier = (own_places[carrier[0]], *carrier[1:])
    return at, len(at) - needed, carrier


def _return_carrier(graph_module: fx.GraphModule, carrier: tuple | None, kept: int) -> None:
    """Return the stream as it leaves (at ``carrier`` in the graph's own outputs) again, after them and before
    the ``kept`` state outputs, so that a caller that cannot index the graph's result finds it."""
    if carrier is None:
        return
    (output,) = graph_module.graph.find_nodes(op="output")
    results = tuple(output.args[0])
    own = results[:len(results) - kept]
    output.args = (own + (at_path(own, carrier),) + results[len(own):],)
    graph_module.recompile()


def _output_path(graph_module: fx.GraphModule, carrier: fx.Node, where: str) -> tuple:
    """Where the stream leaves a layer's graph: the path (indices, keys) in its output to the node itself,
    or to what it becomes through stream ops on the way out (``h.contiguous()``)."""
    (output,) = graph_module.graph.find_nodes(op="output")
    node = carrier
    while True:
        path = _path_to(output.args[0], node)
        if path is not None:
            return path
        following = [user for user in node.users if user.op != "output" and is_stream_op(user, graph_module)]
        if len(following) != 1:
            break
        node = following[0]
    raise StreamMismatchError(f"{where} does not return its residual stream (the value after its last residual "
                              "site): the layer route needs it as the module's result. Convert with route='model'.")


def _path_to(value, node: fx.Node) -> tuple | None:
    if value is node:
        return ()
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (tuple, list)) else ()
    for key, item in items:
        path = _path_to(item, node)
        if path is not None:
            return (key, *path)
    return None


def _start(graph_module: fx.GraphModule, stream) -> fx.Node | None:
    """The input a first layer's graph starts the stream from (``b_0``); None if the stream starts from a
    value the graph computes."""
    first = stream.sites[0]
    origin = first.inbound[0].all_input_nodes[0] if first.inbound else first.stream_in
    return origin if origin.op == "placeholder" else None
