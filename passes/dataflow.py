"""Data flow on a captured graph: which inputs a node's value depends on (shape queries depend on
none), the edges in-place writes leave implicit (:class:`DataFlow`), which nodes are computed from
parameters alone, and reachability between nodes (:class:`Ancestry`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from torch import fx, nn

from attnres_fx import compat

from .node_kinds import IN_PLACE_OPERATORS, VIEW_OPS, is_shape_query, op_name


DTYPE_OF_SECOND_OPS = {"type_as", "to"}


def data_inputs(node: fx.Node) -> Iterable[fx.Node]:
    """Inputs whose *values* the node depends on (shape queries depend on none; ``y.type_as(x)``
    and ``y.to(x)`` read only ``x``'s dtype)."""
    if is_shape_query(node):
        return ()
    if op_name(node) in DTYPE_OF_SECOND_OPS and node.args and isinstance(node.args[0], fx.Node):
        return [node.args[0]]
    return node.all_input_nodes


def reads_value(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` depends on ``value``'s data, not just on its shape or dtype."""
    return value in data_inputs(user)


def mutated_input(node: fx.Node) -> fx.Node | None:
    """The tensor an in-place op writes into: ``y[:, t] = v`` (``setitem``), ``y.copy_(v)``,
    ``y.index_put_(...)``, ``y += v``, ``torch.add(a, b, out=y)``; None for any other node."""
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_function" and (node.target is operator.setitem or node.target in IN_PLACE_OPERATORS):
        return node.args[0]
    if isinstance(node.target, compat.OpOverload):
        arguments = node.target._schema.arguments
        writes = bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
        return node.args[0] if writes else None
    name = op_name(node)
    return node.args[0] if name.endswith("_") and not name.startswith("_") and node.op != "call_module" else None


class DataFlow:
    """Which nodes carry values into which, for one graph: the graph's edges, minus metadata reads
    (:func:`data_inputs`), plus the edges in-place writes leave implicit.

    ``y = zeros(b, t, d); for t: y[:, t] = f(x[:, t]); out(y)``: no edge leads from the ``setitem``
    nodes to ``out(y)``, which reads ``y`` itself. Here a node that reads a tensor also reads the latest
    write before it into that tensor or into any view of it (``y[:, t]``, a ``reshape``), so the
    writes, and what they wrote, are its ancestors.
    """

    def __init__(self, graph: fx.Graph):
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        base: dict[fx.Node, fx.Node] = {}
        writes: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            base[node] = base.get(source, source) if source is not None and op_name(node) in VIEW_OPS else node
            target = mutated_input(node)
            if target is not None:
                writes.setdefault(base.get(target, target), []).append(node)
        self._parents: dict[fx.Node, tuple[fx.Node, ...]] = {}
        self._children: dict[fx.Node, list[fx.Node]] = {node: [] for node in graph.nodes}
        for node in graph.nodes:
            parents = dict.fromkeys(data_inputs(node))
            for value in list(parents):
                latest = _latest_before(writes.get(base.get(value, value), ()), node, self.position)
                if latest is not None:
                    parents[latest] = None
            self._parents[node] = tuple(parents)
            for parent in parents:
                self._children[parent].append(node)

    def parents(self, node: fx.Node) -> tuple[fx.Node, ...]:
        return self._parents[node]

    def children(self, node: fx.Node) -> list[fx.Node]:
        return self._children[node]


def _latest_before(writes, node: fx.Node, position: dict[fx.Node, int]) -> fx.Node | None:
    """The last of ``writes`` (in graph order) that comes before ``node``."""
    latest = None
    for write in writes:
        if position[write] >= position[node]:
            break
        latest = write
    return latest


def is_parameter(node: fx.Node) -> bool:
    """A learned weight: ``get_attr`` (fx, export) or a Dynamo ``placeholder`` holding an ``nn.Parameter``."""
    if node.op == "get_attr":
        return True
    return node.op == "placeholder" and isinstance(node.meta.get("example_value"), nn.Parameter)


def parameter_derived_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from parameters/buffers alone (weights, and ops such as ``t(weight)``)."""
    derived: set[fx.Node] = set()
    for node in graph.nodes:
        if is_parameter(node):
            derived.add(node)
        elif node.op in ("call_function", "call_method"):
            inputs = node.all_input_nodes
            if inputs and all(i in derived for i in inputs):
                derived.add(node)
    return derived


class Ancestry:
    """Data-flow reachability on one graph (:class:`DataFlow`), bounded by
    topological position to stay cheap."""

    def __init__(self, graph: fx.Graph):
        self.flow = DataFlow(graph)
        self.position = self.flow.position
        self._regions: dict[tuple[fx.Node, fx.Node], frozenset[fx.Node]] = {}

    def ancestors(self, node: fx.Node, lower: fx.Node) -> set[fx.Node]:
        """Data ancestors of ``node`` (itself included) that come after ``lower`` or are ``lower``."""
        bound = self.position[lower]
        seen = {node}
        todo = [node]
        while todo:
            for parent in self.flow.parents(todo.pop()):
                if parent not in seen and self.position[parent] >= bound:
                    seen.add(parent)
                    todo.append(parent)
        return seen

    def reaches(self, source: fx.Node, target: fx.Node) -> bool:
        return source is not target and source in self.ancestors(target, source)

    def region(self, source: fx.Node, target: fx.Node) -> frozenset[fx.Node]:
        """Nodes on a data path from ``source`` to ``target`` (``target`` included, ``source`` not).

        Memoised: splitting a parallel site asks for the same regions as describing its branches."""
        key = (source, target)
        if key not in self._regions:
            self._regions[key] = self._region(source, target)
        return self._regions[key]

    def _region(self, source: fx.Node, target: fx.Node) -> frozenset[fx.Node]:
        upstream = self.ancestors(target, source)
        region: set[fx.Node] = set()
        todo = [source]
        while todo:
            for child in self.flow.children(todo.pop()):
                if child in upstream and child not in region:
                    region.add(child)
                    todo.append(child)
        return frozenset(region)
