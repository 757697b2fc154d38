"""What a layer's rewritten graph takes and returns, by kind (after ``torch.export``'s
``ExportGraphSignature``): one record for every block graph, fx-traced or captured by TorchDynamo, built
once by the pass that rewrites it (:func:`~attnres_fx.passes.pipeline.rewrite_captured` with a
:class:`~attnres_fx.passes.pipeline.LayerTarget`) and stored with the graph (``graph_module.meta[SIGNATURE]``).

Inputs, one kind per graph input in order: the call's own inputs (``INPUT``; ``STREAM`` the one the stream
enters by), then the stream's state (``BLOCKS``: the completed block sums as one list, however many; or
``BLOCK``: one of them each; then ``PARTIAL``: the partial sum). The AttnRes weights a graph compiled by
Inductor takes after them are not listed: its runner appends them (:class:`~attnres_fx.routing.graphs.
RoutedGraph`). Outputs: the graph's own (``OUTPUT``), then unless the graph ends the stream the
partial sum (``PARTIAL``) and each block the graph commits (``BLOCK``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx

SIGNATURE = "attnres_signature"          # where a layer's graph keeps its signature (graph_module.meta)
WEIGHT_INPUT = "attnres_weight"          # marks a placeholder that takes an AttnRes weight (node.meta)

INPUT, STREAM, BLOCKS, BLOCK, PARTIAL, OUTPUT = "input", "stream", "blocks", "block", "partial", "output"


@dataclass(frozen=True)
class LayerGraphSignature:
    """``inputs`` and ``outputs``: the kind of each, in order (see the module docstring). ``carrier``: where
    the stream leaves, a path of indices and keys into the graph's outputs (``None`` where the graph ends
    the stream: its result holds the final aggregation). ``next_offset``: the residual site after the
    graph's last one, counted from its first (the graph then serves every block of its kind at that place
    in a stream block)."""

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
        """How many of the outputs are the graph's own (the stream's state follows them)."""
        return self.outputs.count(OUTPUT)

    def state_arguments(self, tensors: tuple) -> tuple:
        """The state inputs from ``tensors`` (the completed block sums, then the partial sum where the graph
        takes one), as the graph takes them."""
        count = len(tensors) - (PARTIAL in self.inputs)
        if BLOCKS in self.inputs:
            return (list(tensors[:count]), *tensors[count:])
        return tuple(tensors)


def layer_signature(graph_module: fx.GraphModule, rewrite, entry, stream: fx.Node | None, carrier: tuple | None,
                    next_offset: int) -> LayerGraphSignature:
    """The signature of ``graph_module``, a layer's graph ``rewrite`` (a
    :class:`~attnres_fx.passes.rewrite.BlockAttnResRewrite`) has just rewritten for the state ``entry`` (an
    :class:`~attnres_fx.passes.rewrite.Entry`, ``None`` at the stream's start): ``stream`` the placeholder
    the stream enters by (or ``None``), ``carrier`` the path to where it leaves."""
    kinds = () if entry is None else (
        ((BLOCKS,) if entry.as_list else (BLOCK,) * entry.blocks) + ((PARTIAL,) if entry.has_partial else ()))
    state = dict(zip(rewrite.state_inputs, kinds, strict=True))
    inputs = tuple(state.get(node) or (STREAM if node is stream else INPUT)
                   for node in graph_module.graph.find_nodes(op="placeholder") if WEIGHT_INPUT not in node.meta)
    (output,) = graph_module.graph.find_nodes(op="output")
    count = len(output.args[0])
    kept = rewrite.state_outputs
    outputs = (OUTPUT,) * (count - kept) + ((PARTIAL,) + (BLOCK,) * (kept - 1) if kept else ())
    return LayerGraphSignature(inputs, outputs, carrier, next_offset)


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
