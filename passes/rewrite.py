"""Rewrite: replace each planned residual stream by Block Attention Residuals.

Contract
    requires  the :class:`~attnres_fx.passes.detect.Detection` of this very graph, and for each of its
              streams the :class:`~attnres_fx.passes.plan.StreamPlan` to apply (by default the plan's
              streams, in order).
    ensures   every site's branches read ``aggregate(b_0, ..., b_{n-1}, partial)`` instead of the stream;
              block starts commit the partial sum; what the last site's output fed now reads the
              stream's final aggregation; no add of the original stream is left; the graph lints.
    modifies  the graph only, plus whatever the :class:`Emitter` adds to emit aggregations (submodules,
              or graph inputs). ``preserves_computation`` is True only with ``preserve_scale=True`` (at
              zero init, where every pseudo-query is zero).

Semantics (docs/method.md, section 3, at sublayer granularity), for one stream with block size ``S``::

    blocks, partial = [], b_0
    for j, site in enumerate(sites):
        for each branch k: input_k = aggregate_jk(*blocks, partial)     # read before the boundary
        if j % S == 0: blocks.append(partial); partial = sum_k f_k(input_k)
        else:          partial = partial + sum_k f_k(input_k)
    final = aggregate_final(*blocks, partial)

Worked example, two sequential sites and ``S = 1`` (Full AttnRes)::

    before:  add = emb + attn(ln1(emb));  add_1 = add + mlp(ln2(add));  out = ln_f(add_1)
    after:   a0 = attn_res(emb);   p0 = attn(ln1(a0))
             a1 = mlp_res(emb, p0);   p1 = mlp(ln2(a1))
             fin = final_res(emb, p0, p1);   out = ln_f(fin)

Between two sites the stream may pass through casts, dropout and reshapes of its leading dimensions
(:attr:`ResidualSite.inbound`, e.g. ``h.reshape(-1, d)`` before an MLP that runs on tokens): a site's
aggregate is taken where the previous stream value was, in that value's layout, and the same ops are
applied to it (:func:`_read_through`); sources of another layout are reshaped to it first
(:meth:`_StreamSurgery.in_layout`, a ``reshape_as``), and so are branch outputs added to a partial sum of
another layout::

    before:  add_1 = add + mlp(ln2(add.reshape(-1, d)))             # the MLP site runs on [b * t, d]
    after:   a1 = mlp_res(emb, p0);   p1 = mlp(ln2(a1.reshape(-1, d)))
             p = p0 + reshape_as(p1, p0)                               # the partial sum stays [b, t, d]

How an aggregation becomes a node is the emitter's business: :class:`ModuleCalls` calls a
``BlockAttnRes`` submodule (explicit graphs, ONNX export); :class:`ParameterInputs` calls the
functional :func:`attnres_fx.op.aggregation.fusable` with the weights as new graph inputs (the Inductor
route, where parameters must be inputs).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from attnres_fx import compat
from attnres_fx.op.aggregation import fusable
from attnres_fx.op.module import BlockAttnRes
from attnres_fx.errors import PassContractError

from . import node_kinds as nk
from . import provenance
from .checkpoints import REGION
from .detect import Detection, ResidualSite, ResidualStream
from .plan import Plan, Site, StreamPlan
from .signature import WEIGHT_INPUT, StateLayout

ATTNRES_META = "attnres"
_ATTNRES_CLASS = f"{BlockAttnRes.__module__}.{BlockAttnRes.__qualname__}"


@dataclass(frozen=True)
class Replacement:
    """What the rewrite did for one aggregation: the node it inserted and the adds it replaced."""

    site: Site
    node: str
    replaced: tuple[str, ...]


class Emitter:
    """Turns one planned aggregation into a graph node. ``entered``: where a layer's graph takes the
    blocks it receives as one list (:attr:`~attnres_fx.passes.signature.StateLayout.as_list`), that list's
    node, its blocks the first sources; emitters that take no such list refuse it."""

    def emit(self, graph: fx.Graph, site: Site, sources: list[fx.Node], entered: fx.Node | None = None) -> fx.Node:
        raise NotImplementedError

    @staticmethod
    def _no_list(entered: fx.Node | None) -> None:
        if entered is not None:
            raise PassContractError("this emitter takes each source as a node of its own, not a list of them")


class ModuleCalls(Emitter):
    """``call_module`` of the ``BlockAttnRes`` named after the site, registered on the GraphModule.

    ``modules`` maps every site name to its module: a converted model's own (the explicit graph then
    shares its weights), or :func:`new_modules`. ``prefix``: where the converted model sits in the
    graph's root (a wrapper around it), ``""`` when it is the root.
    """

    def __init__(self, gm: fx.GraphModule, modules: Mapping[str, BlockAttnRes], prefix: str = ""):
        self.gm = gm
        self.modules = modules
        self.prefix = prefix

    def emit(self, graph, site, sources, entered=None):
        self._no_list(entered)
        target = f"{self.prefix}.{site.name}" if self.prefix else site.name
        self.gm.add_submodule(target, self.modules[site.name])
        return graph.call_module(target, tuple(sources))


class ParameterInputs(Emitter):
    """``fusable(proj_weight, norm_weight, sources)`` (:mod:`attnres_fx.op.aggregation`) with both weights
    as new graph inputs.

    ``names`` lists the parameter names of the new inputs in graph order (``model.layers.0.attn_res.
    proj.weight``, then its ``norm.weight``, ...): the caller passes those tensors after the graph's
    own inputs.
    """

    def __init__(self, plan: Plan):
        self.plan = plan
        self.names: list[str] = []

    def emit(self, graph, site, sources, entered=None):
        self._no_list(entered)
        weights = []
        last_input = list(graph.find_nodes(op="placeholder"))[-1]
        for parameter in ("proj.weight", "norm.weight"):
            with graph.inserting_after(last_input):
                last_input = graph.placeholder(f"{site.name}.{parameter}".replace(".", "_"))
            last_input.meta[WEIGHT_INPUT] = True
            self.names.append(f"{site.name}.{parameter}")
            weights.append(last_input)
        return graph.call_function(fusable, (weights[0], weights[1], list(sources)),
                                   {"eps": self.plan.eps, "preserve_scale": self.plan.preserve_scale})


@dataclass(frozen=True)
class StreamSpan:
    """What the rewrite does with one detected stream: its planned stream and the planned position of each
    detected site (:class:`~attnres_fx.passes.plan.MatchedStream`), and, for one layer's own graph on the
    layer route (``layer=True``), where the stream's state comes from (``entry``, None when the graph
    starts the stream) and whether the graph ends it.

    In a layer's graph, what reads the stream outside the branches (the layer's result, the next
    layer's input) keeps reading the plain residual sum of the branch outputs, the *carrier*, and unless
    the graph ends the stream, it also returns the partial sum and the blocks it committed, after its own
    outputs. The graph that ends the stream returns its final aggregation where the stream's last value
    was returned.
    """

    planned: StreamPlan
    positions: tuple[int, ...]
    layer: bool = False
    entry: StateLayout | None = None
    ends: bool = True
    # The placeholders the state enters by where the graph has them already (a TorchDynamo capture through
    # the block entry, :func:`~attnres_fx.passes.signature.state_slots`): blocks, then the partial sum.
    entered: tuple[fx.Node, ...] = ()


class BlockAttnResRewrite(PassBase):
    """Rewrite the detected streams of a GraphModule in place, as planned; ``records`` says what was done,
    ``state_outputs`` how many outputs a layer's graph gained (see :class:`StreamSpan`)."""

    def __init__(self, plan: Plan, detection: Detection, emitter: Emitter | None = None, *,
                 spans: Sequence[StreamSpan] | None = None):
        super().__init__()
        spans = tuple(StreamSpan(s, tuple(range(s.num_positions))) for s in plan.streams) if spans is None \
            else tuple(spans)
        if len(spans) != len(detection.streams):
            raise PassContractError(f"the plan has {len(spans)} stream(s), detection found "
                                    f"{len(detection.streams)}")
        for span, found in zip(spans, detection.streams):
            planned_branches = [len(span.planned.branch_sites(p)) for p in span.positions]
            if planned_branches != [len(s.branches) for s in found.sites]:
                raise PassContractError(f"stream {span.planned.index} of the plan does not fit the stream "
                                        f"detected at {found.start.name}")
        self.plan = plan
        self.detection = detection
        self.spans = spans
        self.emitter = emitter
        self.records: list[Replacement] = []
        self.state_outputs = 0
        self.carriers: list[fx.Node] = []
        self.state_inputs: list[fx.Node] = []
        self.stream_origin: fx.Node | None = None     # a layer's graph with state inputs: the stream's input

    @property
    def preserves_computation(self) -> bool:
        return self.plan.preserve_scale

    def requires(self, graph_module: fx.GraphModule) -> None:
        nodes = set(graph_module.graph.nodes)
        for stream in self.detection.streams:
            if stream.start not in nodes or any(s.add not in nodes for s in stream.sites):
                raise PassContractError("the detected streams do not belong to this graph")

    def ensures(self, graph_module: fx.GraphModule) -> None:
        graph_module.graph.lint()
        nodes = set(graph_module.graph.nodes)
        left = [a.name for stream, span in zip(self.detection.streams, self.spans) if not span.layer
                for site in stream.sites for a in site.adds if a in nodes]
        if left:
            raise PassContractError(f"original residual adds left on the stream: {left}")

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        emitter = self.emitter or ModuleCalls(graph_module, new_modules(self.plan, graph_module))
        for stream, span in zip(self.detection.streams, self.spans):
            surgery = _StreamSurgery(graph_module.graph, emitter, stream, span, self.records)
            surgery.run()
            self.carriers.append(surgery.carrier_out)
            self.state_inputs.extend(surgery.entered)
            self.stream_origin = self.stream_origin or surgery.origin
            self.state_outputs += surgery.return_state()
        graph_module.recompile()
        return PassResult(graph_module, True)


class _StreamSurgery:
    """The rewrite of one stream, in named steps; state: the completed blocks and the partial sum, and
    the layout (leading shape) each of them has."""

    def __init__(self, graph: fx.Graph, emitter: Emitter, stream: ResidualStream, span: StreamSpan,
                 records: list[Replacement]):
        self.graph = graph
        self.emitter = emitter
        self.stream = stream
        self.span = span
        self.planned = span.planned
        self.records = records
        aten = isinstance(stream.end.target, compat.OpOverload)
        self.partial_add = torch.ops.aten.add.Tensor if aten else operator.add
        self.reshape_as = torch.ops.aten.reshape_as.default if aten else torch.Tensor.reshape_as
        self.contiguous = torch.ops.aten.contiguous.default if aten else torch.Tensor.contiguous
        self.layout_of: dict[fx.Node, str] = {stream.start: stream.layout}
        self.carrier: dict[str, fx.Node] = {stream.layout: stream.start}    # a node of each layout
        self.reshaped: dict[tuple[fx.Node, str], fx.Node] = {}
        self.dead: list[fx.Node] = []
        self.blocks: list[fx.Node] = []
        self.partial: fx.Node | None = stream.start
        # The branch outputs the partial sum adds, in order, where it is a plain sum of this graph's branch
        # outputs (a block started in this graph, no reshape); None otherwise.
        self.terms: list[fx.Node] | None = None
        self.sums: list[tuple[fx.Node, fx.Node, tuple[fx.Node, ...]]] = []   # (site add, partial, terms)
        self.position = 0
        self.entered_blocks = 0
        self.carrier_out: fx.Node | None = None
        self.entered: list[fx.Node] = []
        self.entered_list: fx.Node | None = None
        self.origin: fx.Node | None = None

    def _enter(self, entry: StateLayout, origin: fx.Node) -> None:
        """The placeholders of the state the layer's graph receives: the graph's own where it has them
        (:attr:`StreamSpan.entered`), else new ones after the graph's own inputs."""
        blocks = 0 if entry.as_list else entry.blocks
        nodes = list(self.span.entered)
        if nodes:
            if entry.as_list or len(nodes) != entry.blocks + entry.has_partial:
                raise PassContractError(f"the graph takes {len(nodes)} state tensors, the state it enters with has "
                                        f"{entry.blocks} blocks and {int(entry.has_partial)} partial sum")
        else:
            anchor = list(self.graph.find_nodes(op="placeholder"))[-1]
            if entry.as_list:
                with self.graph.inserting_after(anchor):
                    anchor = self.entered_list = self.graph.placeholder("attnres_blocks")
            names = [f"attnres_block_{k}" for k in range(blocks)] + (["attnres_partial"] if entry.has_partial else [])
            for name in names:
                with self.graph.inserting_after(anchor):
                    anchor = self.graph.placeholder(name)
                nodes.append(anchor)
        for node in nodes:
            layout = _layout(node, self.stream.layout)
            self.layout_of[node] = layout
            self.carrier.setdefault(layout, node)
        self.blocks = nodes[:blocks]
        self.partial = nodes[blocks] if entry.has_partial else None
        self.position = entry.position
        self.entered_blocks = blocks
        self.entered = ([self.entered_list] if entry.as_list else []) + nodes

    def run(self) -> None:
        value_nodes = [self.stream.start]      # nodes carrying the stream value the next site reads
        layout = self.stream.layout            # the layout of value_nodes[0]
        sites = self.stream.sites
        if self.span.entry is not None:
            # The stream enters as the layer's argument, the carrier: the first site reads it through the
            # stream ops between the argument and the site (a dropout, a reshape), as any later site does.
            origin = sites[0].inbound[0].all_input_nodes[0] if sites[0].inbound else sites[0].stream_in
            if origin.op != "placeholder":
                raise PassContractError(f"the stream of this layer's graph does not start at one of its inputs "
                                        f"but at {origin.format_node()}")
            value_nodes = [origin, *sites[0].inbound]
            self.origin = origin
            layout = _layout(origin, self.stream.layout)
            self.layout_of[origin] = layout
            self.carrier.setdefault(layout, origin)
            self._enter(self.span.entry, origin)
        for k, site in enumerate(sites):
            position = self.span.positions[k]
            self.skip_to(position)
            if self.span.layer:
                # The residual adds stay, computing the carrier; written in place (``x += f``) they would
                # change a tensor that is also a source (``b_0``, a block, a branch output).
                for add in site.adds:
                    _out_of_place(add)
            regions = _separate_shared_reads(self.graph, site)
            self.insert_aggregates(position, site, regions, value_nodes, layout)
            if position % self.planned.block_size == 0:
                self.commit()
            self.rebuild_partial_sum(site)
            if self.span.layer and self.terms is not None:
                self.sums.append((site.add, self.partial, tuple(self.terms)))
            self.position = position + 1
            if not self.span.layer:
                self.dead.extend(value_nodes[1:])
                self.dead.extend(site.adds)
            value_nodes = [site.add, *(sites[k + 1].inbound if k + 1 < len(sites) else ())]
            layout = site.layout
        if self.span.ends:
            self.skip_to(self.planned.num_positions)
            self.insert_final(value_nodes, layout)
        else:
            self.carrier_out = self.stream.end
        self.carry_partial_sums()
        self.erase_dead()

    def skip_to(self, position: int) -> None:
        """Planned sites this graph does not hold (a sublayer the call does not run) add nothing, but a
        block start among them still commits the partial sum."""
        for skipped in range(self.position, position):
            if skipped % self.planned.block_size == 0:
                self.commit()
        self.position = max(self.position, position)

    def commit(self) -> None:
        if self.partial is not None:
            self.blocks.append(self.partial)
        self.partial = None
        self.terms = None

    def sources(self) -> list[fx.Node]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def insert_aggregates(self, position: int, site: ResidualSite, regions: list[frozenset[fx.Node]],
                          value_nodes: list[fx.Node], layout: str) -> None:
        """Each branch reads its own aggregate of the committed blocks and the partial sum, taken in the
        layout of the previous stream value and passed through the stream ops that led from that value
        to the site's input. In a layer's graph only the branches read it; other readers keep the
        carrier."""
        readers = _external_users(value_nodes, set(site.adds))
        if self.span.layer:
            inside = frozenset().union(*regions)
            readers = [(reader, value) for reader, value in readers if reader in inside]
        with self.graph.inserting_before(_first(self.graph, [r for r, _ in readers] + value_nodes[1:])):
            sources = [self.in_layout(source, layout, site.add) for source in self.sources()]
            aggregates = [self._emit(planned, sources, site.add, "aggregate")
                          for planned in self.planned.branch_sites(position)]
        counterparts = [_read_through(self.graph, value_nodes, aggregate) for aggregate in aggregates]
        for reader, value in readers:
            reader.replace_input_with(value, counterparts[_branch_of(reader, regions)][value])
        self.records.append(Replacement(self.planned.branch_sites(position)[0],
                                        aggregates[0].name, tuple(a.name for a in site.adds)))
        for planned, node in zip(self.planned.branch_sites(position)[1:], aggregates[1:]):
            self.records.append(Replacement(planned, node.name, ()))

    def rebuild_partial_sum(self, site: ResidualSite) -> None:
        """``partial = partial + f_k`` for each branch output (a block start begins with the output), in
        the layout of the partial sum."""
        outputs = [output for branch in site.branches for output in branch.outputs]
        self.carrier.setdefault(site.layout, outputs[0])
        with self.graph.inserting_before(site.add.next):
            for output in outputs:
                self.layout_of[output] = site.layout
                if self.partial is None:
                    self.partial = output
                    self.terms = [output]
                    continue
                addend = self.in_layout(output, self.layout_of[self.partial], site.add)
                self.terms = self.terms + [output] if self.terms is not None and addend is output else None
                partial = self.graph.create_node(
                    "call_function", self.partial_add, (self.partial, addend),
                    name=f"{site.owner.replace('.', '_') or 'root'}_partial")
                _annotate(partial, site.add, site.owner, "partial", with_module=False, inside=True)
                self.layout_of[partial] = self.layout_of[self.partial]
                self.partial = partial

    def carry_partial_sums(self) -> None:
        """In a layer's graph, a carrier that adds the same branch outputs after a carrier value ``c`` as the
        partial sum of a block started in this graph, in the same order, becomes ``c + partial``: the
        carrier adds in between are left to nobody and erased, so the graph makes as many stream-sized adds
        as the original (``x + (a + f)`` instead of ``(x + a) + f``: the carrier differs by rounding).
        Only a carrier something else reads (the layer's result, a hidden state) is rewritten, and only
        where the carrier values in between are read by the chain alone: one read elsewhere stays
        computed, and the carrier after it is left as it is."""
        for add, partial, terms in self.sums:
            if len(terms) < 2 or not _read_outside(add, self.stream):
                continue
            order = {node: i for i, node in enumerate(self.graph.nodes)}
            chain = _peel(add, terms)
            if chain is None or any(order[user] < order[partial] for user in add.users):
                continue
            base, between = chain
            alike = _recorded_alike(base, terms)
            if alike is False or (alike is None and self.partial_add is not operator.add):
                continue
            if alike:
                add.args = (base, partial)
            else:
                add.op, add.target, add.args = "call_function", carry, (base, partial, *terms)
            partial.append(add)
            self.dead.extend(between)

    def insert_final(self, value_nodes: list[fx.Node], layout: str) -> None:
        """What read the stream after its last site reads the final aggregation (none is taken where
        nothing reads it: an encoder whose result a call does not use)."""
        readers = _external_users(value_nodes, set())
        final = self.planned.final
        if not readers:
            self.records.append(Replacement(final, "", ()))
            self.dead.extend(value_nodes)
            return
        with self.graph.inserting_before(_first(self.graph, [r for r, _ in readers])):
            sources = [self.in_layout(source, layout, self.stream.end, inside=False) for source in self.sources()]
            node = self._emit(final, sources, self.stream.end, "final")
        for reader, value in readers:
            reader.replace_input_with(value, node)
        self.records.append(Replacement(final, node.name, ()))
        self.dead.extend(value_nodes[1:])
        if self.span.layer:
            self.dead.extend(add for site in self.stream.sites for add in site.adds)
        self.carrier_out = node

    def return_state(self) -> int:
        """A layer's graph that does not end the stream also returns the partial sum and the blocks it
        committed, after its own outputs; how many outputs that adds. They are returned contiguous: the
        next layer's graph takes them as inputs like its stream input (:meth:`_enter`), and a graph
        compiled by Inductor asserts its inputs' strides (an embedding that is a transposed view, as
        SigLIP's patches are, would enter as block 0 with other strides). Free where they are contiguous."""
        if not self.span.layer or self.span.ends:
            return 0
        (output,) = self.graph.find_nodes(op="output")
        state = [self._contiguous(node, output) for node in [self.partial, *self.blocks[self.entered_blocks:]]]
        results = output.args[0]
        results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
        output.args = (results + tuple(state),)
        return len(state)

    def _contiguous(self, node: fx.Node | None, output: fx.Node) -> fx.Node | None:
        if node is None:
            return None
        with self.graph.inserting_before(output):
            contiguous = self.graph.call_function(self.contiguous, (node,))
        _annotate(contiguous, node, self.planned.owner, "state", with_module=False, inside=False)
        return contiguous

    def in_layout(self, node: fx.Node, layout: str, origin: fx.Node, inside: bool = True) -> fx.Node:
        """``node`` reshaped to ``layout`` where the stream left it in another one (``h.reshape(-1, d)``
        between sites): ``reshape_as`` a node of that layout, inserted at the current insertion point,
        once per node and layout. Stream values of all layouts have the same number of elements."""
        if self.layout_of[node] == layout:
            return node
        if (node, layout) not in self.reshaped:
            reshaped = self.graph.call_function(self.reshape_as, (node, self.carrier[layout]))
            _annotate(reshaped, origin, node.name, "layout", with_module=False, inside=inside)
            self.layout_of[reshaped] = layout
            self.reshaped[node, layout] = reshaped
        return self.reshaped[node, layout]

    def erase_dead(self) -> None:
        position = {node: i for i, node in enumerate(self.graph.nodes)}
        for node in sorted(set(self.dead), key=position.__getitem__, reverse=True):
            if not node.users:
                self.graph.erase_node(node)

    def _emit(self, site: Site, sources: list[fx.Node], origin: fx.Node, role: str) -> fx.Node:
        node = self.emitter.emit(self.graph, site, sources, self.entered_list) if self.entered_list is not None \
            else self.emitter.emit(self.graph, site, sources)
        # A site's aggregate belongs where its residual add was (a checkpointed layer recomputes it);
        # the final one is read after the last layer, outside it.
        path = node.target if node.op == "call_module" else site.name
        _annotate(node, origin, path, role, with_module=True, inside=role != "final")
        return node


_OUT_OF_PLACE = {operator.iadd: operator.add, "add_": "add", "__iadd__": "__add__",
                 torch.ops.aten.add_.Tensor: torch.ops.aten.add.Tensor}


def _out_of_place(add: fx.Node) -> None:
    """Make an in-place add (``x += y``, ``x.add_(y)``) compute a new tensor; its users already read its
    result."""
    if add.target in _OUT_OF_PLACE:
        add.target = _OUT_OF_PLACE[add.target]


_PLAIN_ADDS = {operator.add, torch.add, torch.ops.aten.add.Tensor, "add", "__add__"}


def _is_plain_add(node: fx.Node) -> bool:
    """``a + b`` of two nodes, out of place, without ``alpha``."""
    return (node.op in ("call_function", "call_method") and node.target in _PLAIN_ADDS and not node.kwargs
            and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args))


def _peel(add: fx.Node, terms: Sequence[fx.Node]) -> tuple[fx.Node, list[fx.Node]] | None:
    """Where ``add`` is ``((c + terms[0]) + ...) + terms[-1]``, a chain of plain adds whose values in
    between nothing else reads: ``c`` and those values; else None."""
    node, between = add, []
    for term in reversed(terms):
        if not _is_plain_add(node) or term not in node.args:
            return None
        if node is not add:
            if len(node.users) != 1:
                return None
            between.append(node)
        left, right = node.args
        node = left if right is term else right
    return node, between


def _recorded_alike(base: fx.Node, terms: Sequence[fx.Node]) -> bool | None:
    """Whether the capture recorded one shape and dtype for ``base`` and all ``terms`` (no broadcast, and
    no promotion, where a sum of branch outputs of a lower precision than the carrier would round the
    carrier more than the original chain does); ``None`` where it recorded none (a block traced with its
    sublayers as calls: :func:`carry` decides at the call)."""
    metas = [_value_meta(node) for node in (base, *terms)]
    if None in metas:
        return None
    return all(meta == metas[0] for meta in metas)


def carry(base: torch.Tensor, partial: torch.Tensor, *terms: torch.Tensor) -> torch.Tensor:
    """A layer's carrier where its trace recorded no dtypes: ``base + partial`` (``partial`` the sum of
    ``terms``, the branch outputs the chain adds) where the partial sum has the carrier's dtype; else the
    terms added one at a time, as the original chain does: under ``torch.autocast`` bf16 branch outputs
    on an fp32 stream would otherwise reach the carrier rounded to bf16 as a sum."""
    if partial.dtype == base.dtype:
        return base + partial
    for term in terms:
        base = base + term
    return base


def _value_meta(node: fx.Node) -> tuple | None:
    for key in ("val", "example_value", "tensor_meta"):
        value = node.meta.get(key)
        if getattr(value, "shape", None) is not None and getattr(value, "dtype", None) is not None:
            return tuple(value.shape), value.dtype
    return None


def _read_outside(add: fx.Node, stream: ResidualStream) -> bool:
    """Whether a site's stream value is read by more than the next site's add."""
    adds = {a for site in stream.sites for a in site.adds}
    return any(user not in adds for user in add.users)


def _layout(node: fx.Node, default: str) -> str:
    """The layout key of a stream value (see :attr:`~attnres_fx.passes.detect.ResidualSite.layout`)."""
    shape = nk.shape_of(node)
    return str(tuple(shape[:-1])) if shape else default


def _read_through(graph: fx.Graph, value_nodes: list[fx.Node], aggregate: fx.Node) -> dict[fx.Node, fx.Node]:
    """The stream ops between two sites (``value_nodes[1:]``: casts, dropout, reshapes), applied to an
    aggregate that stands for ``value_nodes[0]``; returns the counterpart of every value node. Each copy
    goes right after the op it copies, where that op's other arguments (sizes) are defined."""
    counterpart = {value_nodes[0]: aggregate}
    for op in value_nodes[1:]:
        with graph.inserting_after(op):
            counterpart[op] = graph.node_copy(op, lambda n: counterpart.get(n, n))
    return counterpart


def _branch_of(reader: fx.Node, regions: list[frozenset[fx.Node]]) -> int:
    """Which branch's aggregate a reader gets: the branch containing it (or, for a shape query such as
    ``x.dtype``, its users); readers outside every branch get the first branch's aggregate."""
    for candidates in ([reader], list(reader.users)):
        for k, region in enumerate(regions):
            if any(c in region for c in candidates):
                return k
    return 0


def _first(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    wanted = set(nodes)
    return next(node for node in graph.nodes if node in wanted)


def _external_users(value_nodes: list[fx.Node], skip: set[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """(user, value) pairs that read the stream value, except ``skip`` (the site's adds) and the chain.
    Refuses a user that changes the value in place (``h.add_(v)`` between two sites, as a forward hook
    that steers a layer's output does): rewired, it would change only what one branch reads."""
    skip = skip | set(value_nodes)
    users = [(user, value) for value in value_nodes for user in list(value.users) if user not in skip]
    for user, value in users:
        if user.args and user.args[0] is value and nk.writes_first_argument(user):
            raise nk.in_place_edit_error(user)
    return users


def _separate_shared_reads(graph: fx.Graph, site: ResidualSite) -> list[frozenset[fx.Node]]:
    """Give each branch of a parallel site its own copy of reads they share (Phi: one LayerNorm for
    attention and MLP), so that each branch can read its own aggregate. Returns the branches' regions
    as they are afterwards."""
    regions = [branch.region for branch in site.branches]
    first = regions[0]
    for k in range(1, len(regions)):
        shared = first & regions[k]
        if not shared:
            continue
        order = {node: i for i, node in enumerate(graph.nodes)}
        copies: dict[fx.Node, fx.Node] = {}
        for node in sorted(shared, key=order.__getitem__):
            with graph.inserting_after(node):
                copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
        for node in regions[k] - shared:
            for original, copy in copies.items():
                node.replace_input_with(original, copy)
        regions[k] = (regions[k] - shared) | frozenset(copies.values())
    return regions


def _annotate(node: fx.Node, origin: fx.Node, name: str, role: str, *, with_module: bool, inside: bool) -> None:
    """Provenance: the new node inherits its site's module stack and stack trace; an aggregation adds
    its own ``BlockAttnRes`` to the stack, so reports and errors name ``model.layers.3.attn_res``.
    ``inside``: the node belongs to the checkpointed region of ``origin``, if any."""
    stack = dict(origin.meta.get("nn_module_stack") or {})
    if with_module:
        # The aggregation's module sits on its parent (a stream's final one on the stream's owner, not
        # in the last layer whose add it replaces): the stack keeps the parent's ancestors only.
        parent = name.rpartition(".")[0]
        stack = {key: value for key, value in stack.items()
                 if provenance.within(parent, provenance.clean_path(str(value[0])))}
        stack[name] = (name, _ATTNRES_CLASS if _stack_uses_strings(stack) else BlockAttnRes)
    if stack:
        node.meta["nn_module_stack"] = stack
    if origin.meta.get("stack_trace"):
        node.meta["stack_trace"] = origin.meta["stack_trace"]
    if inside and REGION in origin.meta:
        node.meta[REGION] = origin.meta[REGION]
    node.meta[ATTNRES_META] = {"name": name, "role": role, "replaces": origin.name}


def _stack_uses_strings(stack: dict) -> bool:
    """torch.export records module classes as qualified names, fx and Dynamo as classes."""
    for value in stack.values():
        return len(value) > 1 and isinstance(value[1], str)
    return False


def lift_attnres_weights(gm: fx.GraphModule) -> list[str]:
    """Make every ``get_attr`` of a ``BlockAttnRes`` weight in ``gm`` a new graph input, as
    :class:`ParameterInputs` emits them (Inductor takes parameters as inputs), and drop the modules; in
    place. Returns the weights' names in input order, for the caller to pass after the graph's inputs."""
    graph = gm.graph
    names = []
    last = list(graph.find_nodes(op="placeholder"))[-1]
    for node in list(graph.find_nodes(op="get_attr")):
        holder = nk.get_submodule_or_none(gm, node.target.rsplit(".", 2)[0])
        if not isinstance(holder, BlockAttnRes):
            continue
        with graph.inserting_after(last):
            last = graph.placeholder(node.target.replace(".", "_"))
        node.replace_all_uses_with(last)
        graph.erase_node(node)
        names.append(node.target)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return names


def new_modules(plan: Plan, like: nn.Module) -> dict[str, BlockAttnRes]:
    """One zero-initialised ``BlockAttnRes`` per planned site, on ``like``'s device and float dtype, in
    ``like``'s training mode, each carrying its :class:`Site`."""
    reference = next(like.parameters(), None)
    kwargs = {}
    if reference is not None:
        kwargs["device"] = reference.device
        if reference.dtype.is_floating_point:
            kwargs["dtype"] = reference.dtype
    modules = {}
    for stream in plan.streams:
        for site in stream.sites:
            module = BlockAttnRes(stream.dim, plan.eps, preserve_scale=plan.preserve_scale, **kwargs)
            module.site = site
            if not like.training:        # built in training mode
                module.eval()
            modules[site.name] = module
    return modules
