"""What a layer's rewritten graph takes and returns, by kind (after ``torch.export``'s
``ExportGraphSignature``): one record for every block graph, fx-traced or captured by TorchDynamo, built
once by the pass that rewrites it (:func:`~attnres_fx.passes.pipeline.rewrite_captured` with a
:class:`~attnres_fx.passes.pipeline.LayerTarget`) and stored with the graph (``graph_module.meta[SIGNATURE]``).

What the graph was rewritten for is part of the record: the state it enters with
(:class:`StateLayout`, the one description of a stream's state between two blocks; the route makes it
from the state a call brings in one place, :func:`attnres_fx.routing.state.layout_of`).

Inputs, one kind per graph input in order: the call's own inputs (``INPUT``; ``STREAM`` the one the stream
enters by) and the stream's state (``BLOCKS``: the completed block sums as one list, however many; or
``BLOCK``: one of them each; then ``PARTIAL``: the partial sum). The AttnRes weights a graph compiled by
Inductor takes after them are not listed: its runner appends them (:class:`~attnres_fx.routing.graphs.
RoutedGraph`). Outputs: the graph's own (``OUTPUT``), then unless the graph ends the stream the stream as
it leaves (``CARRIER``, also somewhere in the graph's own outputs), the partial sum (``PARTIAL``) and each
block the graph commits (``BLOCK``).

The state is real graph inputs and outputs on both paths. A block's graph torch.fx traces gains them as
new placeholders and outputs. TorchDynamo captures a block's call through an entry that takes the state
tensors as arguments and returns :func:`state_slots` of them beside the block's result: Dynamo makes the
state's placeholders (with its own example values and guards) and leaves one node whose arguments are
those placeholders and whose results are the graph's state outputs; the rewrite takes the placeholders
as the state it enters with and puts the state it hands on in the slots' places (which Dynamo's bytecode
reads: in its graph the carrier and the state need not follow all of the graph's own outputs). The
capture has room for the state its span was planned to hand on; where the call hands on less (it skipped
a block start), the slots left over are ``SPARE`` outputs: how much state the block hands on is what its
graph returns, read from the signature, with no second capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx

SIGNATURE = "attnres_signature"          # where a layer's graph keeps its signature (graph_module.meta)
WEIGHT_INPUT = "attnres_weight"          # marks a placeholder that takes an AttnRes weight (node.meta)

INPUT, STREAM, BLOCKS, BLOCK, PARTIAL, OUTPUT, CARRIER, SPARE = (
    "input", "stream", "blocks", "block", "partial", "output", "carrier", "spare")


class StateLayout(NamedTuple):
    """The stream's state where a layer's graph begins: ``blocks`` committed and the partial sum
    (``has_partial`` is False only after a skipped block start), at residual site ``position``.
    ``as_list``: the blocks as one list input, however many (``blocks`` still says how many this call
    brings): a graph that serves every layer of a kind whatever its depth. A tuple: the route finds a
    block's graphs by it at every call (hashed in C)."""

    position: int
    blocks: int
    has_partial: bool
    as_list: bool = False


@torch.compiler.allow_in_graph
def state_slots(entered: list, kinds: tuple[str, ...]) -> tuple:
    """In a TorchDynamo capture of a block's call: the state outputs the rewrite will fill, one per kind in
    ``kinds`` (the carrier, the partial sum, the committed blocks; strings, which Dynamo takes as constants
    where it would make a number a graph input), made from the state tensors ``entered`` (one graph node: its
    arguments are the state's placeholders). Dynamo runs it on its fake tensors only: the rewrite replaces
    the node."""
    like = entered[-1] if entered else torch.empty(0)
    return tuple(torch.empty_like(like) for _ in kinds)


def state_kinds(count: int, spare: int = 0) -> tuple[str, ...]:
    """The kinds of the ``count`` outputs a layer's graph returns after its own (none where it ends the
    stream), then ``spare`` slots a TorchDynamo capture had room for and the block did not fill."""
    return ((CARRIER, PARTIAL) + (BLOCK,) * (count - 2) if count else ()) + (SPARE,) * spare


@dataclass(frozen=True)
class LayerGraphSignature:
    """``layout``: the state the graph enters with (``None`` at the stream's start), as the route asked the
    rewrite for it (a graph that takes the blocks as one list serves the blocks of its kind at its place in
    a stream block, at any depth: ``position`` and ``blocks`` are those of the first); ``inputs`` and
    ``outputs``: the kind of each, in order (see the module docstring). ``carrier``: where the stream
    leaves, a path of indices and keys into the graph's outputs (``None`` where the graph ends the stream:
    its result holds the final aggregation). ``next_offset``: the residual site after the graph's last one,
    counted from its first (the graph then serves every block of its kind at that place in a stream
    block)."""

    layout: StateLayout | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    carrier: tuple | None
    next_offset: int

    @property
    def stream_input(self) -> int | None:
        """Which of the graph's inputs the stream enters by (``None``: the graph starts it from a value it
        computes)."""
        return self.inputs.index(STREAM) if STREAM in self.inputs else None

    @property
    def results(self) -> int:
        """How many of the outputs are the graph's own (the carrier and the stream's state follow them in a
        graph torch.fx traced)."""
        return self.outputs.count(OUTPUT)

    @property
    def handed_on(self) -> int:
        """How many state tensors the graph hands on after the carrier (the partial sum and the blocks it
        commits): what it returns, as its rewrite found, not what its span was planned to hold."""
        return self.outputs.count(PARTIAL) + self.outputs.count(BLOCK)


def layer_signature(graph_module: fx.GraphModule, rewrite, layout: StateLayout | None, stream: fx.Node | None,
                    carrier: tuple | None, next_offset: int, state_at: tuple[int, ...] | None = None,
                    spare: int = 0) -> LayerGraphSignature:
    """The signature of ``graph_module``, a layer's graph ``rewrite`` (a
    :class:`~attnres_fx.passes.rewrite.BlockAttnResRewrite`) has just rewritten for the state in ``layout``
    (``None`` at the stream's start): ``stream`` the placeholder the stream enters by (or ``None``),
    ``carrier`` the path to where it leaves; ``state_at``: where the carrier and the state are among the
    outputs, if not after the graph's own (a TorchDynamo capture's slots, ``spare`` of them unfilled)."""
    kinds = () if layout is None else (
        ((BLOCKS,) if layout.as_list else (BLOCK,) * layout.blocks) + ((PARTIAL,) if layout.has_partial else ()))
    state = dict(zip(rewrite.state_inputs, kinds, strict=True))
    inputs = tuple(state.get(node) or (STREAM if node is stream else INPUT)
                   for node in graph_module.graph.find_nodes(op="placeholder") if WEIGHT_INPUT not in node.meta)
    (output,) = graph_module.graph.find_nodes(op="output")
    count = len(output.args[0])
    kept = rewrite.state_outputs
    kinds = state_kinds(kept + bool(kept), spare)
    if state_at is None:
        state_at = tuple(range(count - len(kinds), count))
    placed = dict(zip(state_at, kinds, strict=True))
    outputs = tuple(placed.get(index, OUTPUT) for index in range(count))
    return LayerGraphSignature(layout, inputs, outputs, carrier, next_offset)


def at_path(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


def replaced_at(value: Any, path: tuple, new: Any) -> Any:
    """``value`` with the item at ``path`` replaced by ``new`` (tuples and lists rebuilt, dicts copied)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    item = replaced_at(value[key], rest, new)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return (*value[:key], item, *value[key + 1:])
    if isinstance(value, tuple):
        return value._replace(**{value._fields[key]: item})
    if isinstance(value, list):
        return [*value[:key], item, *value[key + 1:]]
    copied = type(value)(value) if isinstance(value, dict) else value
    copied[key] = item
    return copied
