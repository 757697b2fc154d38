"""Detect: find the residual streams ``h_{l+1} = h_l + f_l(...)`` in a traced graph.

Contract
    requires  a GraphModule from any capture (torch.fx symbolic tracing, torch.export, TorchDynamo).
    ensures   nothing about the graph: detection only reads it.
    returns   :class:`Detection`, immutable: every stream with its sites, the sublayers (branches) of
              each site and the nodes they span, the ops the stream passes through between sites
              (casts, dropout, reshapes of the leading dimensions) and the layout they leave it in, its
              hidden size, every add that was looked at and rejected, with the reason, and the rejected
              adds that continue a stream (converting the stream around them would be partial). The
              plan and the rewrite read it; ``print()`` shows it (a dry run).

A *residual site* is an add ``h + b`` whose operand ``b`` is computed from ``h`` (data flow; shape
queries do not count; writes into buffers, ``y[:, t] = ...``, carry values like any op) through a branch
that contains parameterised compute (a Linear, matmul or conv with learned weights). A *stream* is a
maximal chain of sites, each site's output being the next one's ``h``; between sites the stream may pass
through dtype casts, dropout and reshapes that keep the feature (last) dimension (``h.reshape(-1, d)``,
``.view(b, t, d)``): it starts at ``b_0``, a node that is no site.

A site's *sublayers* are told apart by data flow. ``h + f(h) + g(h)`` and ``h + (f(h) + g(h))`` (in any
order, ``+=`` included) put two summands on the stream; a summand that mixes positions (attention, a
scan, a linear-attention state) is a sublayer of its own, and summands that mix only channels and read
the same input (a mixture of experts' routed and shared experts) are one MLP sublayer. Each sublayer
gets its own pseudo-query.

Worked example, for ``x = emb(ids); x = x + attn(ln1(x)); x = x + mlp(ln2(x)); y = head(ln_f(x))``::

    detection = detect_residual_streams(gm)
    # one ResidualStream: start=emb, sites=(add: attn branch, add_1: mlp branch), dim=D
    print(detection)          # the table a dry run prints

and for a parallel layer ``x = x + (attn(ln(x)) + moe(ln(x)))`` with ``moe(u) = routed(u) + shared(u)``:
one site, two branches, ``attn`` and ``mlp`` (the MoE's two summands read the same ``ln(x)``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx, nn

from attnres_fx.errors import TraceError
from attnres_fx.text import format_table

from . import node_kinds as nk

MIN_STREAM_SITES = 2
TOKEN_MIXING = ("attn", "mixer")


@dataclass(frozen=True, eq=False)
class Branch:
    """One sublayer ``f(norm(h))`` of a site: its output(s) and the nodes between ``h`` and them.

    ``outputs`` has one node, or several for channel-mixing summands added to the stream one by one
    (``h + routed(u) + shared(u)``): the sublayer's output is their sum."""

    outputs: tuple[fx.Node, ...]
    region: frozenset[fx.Node]
    kind: str                       # "attn" | "mixer" (other token mixing) | "mlp" | "branch" (neither told)
    module_path: str
    normalised: bool                # reads the stream only through a norm


@dataclass(frozen=True, eq=False)
class ResidualSite:
    """An add (or a tree of adds, for parallel layers) that puts branch outputs onto the stream."""

    add: fx.Node                    # the add whose output is the stream after this site
    adds: tuple[fx.Node, ...]       # every add node of the site (more than one for parallel layers)
    stream_in: fx.Node              # the stream value h as this site reads it
    inbound: tuple[fx.Node, ...]    # stream ops from the previous stream value to stream_in, in order
    branches: tuple[Branch, ...]
    owner: str                      # dotted path of the module whose forward performs the add
    # The leading dimensions of ``stream_in`` (and of the site's output): two stream values of one
    # layout have the same shape. Values of different layouts hold the same number of elements.
    layout: str

    @property
    def normalised(self) -> bool:
        return all(b.normalised for b in self.branches)

    @property
    def kind(self) -> str:
        return "+".join(b.kind for b in self.branches)


@dataclass(frozen=True, eq=False)
class ResidualStream:
    """A chain of sites: ``start`` is ``b_0`` (e.g. the embedding), ``sites`` in execution order."""

    start: fx.Node
    sites: tuple[ResidualSite, ...]
    dim: int | None                 # hidden size, None where the graph does not tell
    layout: str                     # the layout of ``start`` (see ResidualSite.layout)

    @property
    def end(self) -> fx.Node:
        return self.sites[-1].add

    @property
    def layers_path(self) -> str:
        """The container of the stream's layers: ``blocks``, ``model.layers``, ``encoder.block``."""
        common = _common_parts(s.owner for s in self.sites)
        while common and common[-1].isdigit():
            common.pop()
        return ".".join(common)

    @property
    def owner(self) -> str:
        """The module holding the stream: the one above its layer list (``''``, ``model``, ``encoder``)."""
        layers = self.layers_path
        numbered = bool(layers) and any(
            s.owner.startswith(layers + ".") and s.owner[len(layers) + 1:].split(".")[0].isdigit()
            for s in self.sites)
        if not numbered:
            return layers
        return layers.rsplit(".", 1)[0] if "." in layers else ""


@dataclass(frozen=True)
class RejectedAdd:
    node: str
    owner: str
    reason: str

    def __str__(self) -> str:
        where = f" in {self.owner}" if self.owner else ""
        return f"{self.node}{where}: {self.reason}"


@dataclass(frozen=True)
class Detection:
    """What detection found: the streams, every add it rejected (and why), the post-norm links, and the
    rejected adds that continue a stream (``unconverted``: converting the stream leaves them as they
    are, so the conversion would be partial)."""

    streams: tuple[ResidualStream, ...]
    rejected: tuple[RejectedAdd, ...]
    post_norm: tuple[str, ...]
    unconverted: tuple[RejectedAdd, ...]

    @property
    def num_sites(self) -> int:
        return sum(len(s.sites) for s in self.streams)

    def table(self) -> str:
        rows = [(str(s_idx), str(j), site.owner or "<root>", site.kind, "yes" if site.normalised else "NO (raw)")
                for s_idx, stream in enumerate(self.streams) for j, site in enumerate(stream.sites)]
        return format_table(("stream", "site", "layer", "kind", "normalised"), rows)

    def __str__(self) -> str:
        owners = ", ".join(f"stream {i} in {s.owner or '<root>'}" for i, s in enumerate(self.streams))
        text = f"{self.num_sites} residual sites in {len(self.streams)} stream(s) ({owners})\n{self.table()}"
        if self.unconverted:
            text += "\nadds on a stream that are no residual site (left as they are):\n" + "\n".join(
                f"  - {add}" for add in self.unconverted)
        return text


class _Ancestry:
    """Data-flow reachability on one graph (:class:`~attnres_fx.passes.node_kinds.DataFlow`), bounded by
    topological position to stay cheap."""

    def __init__(self, graph: fx.Graph):
        self.flow = nk.DataFlow(graph)
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


class _Rejections:
    """The rejected adds, in the order they were seen; a later decision can withdraw one."""

    def __init__(self):
        self._by_node: dict[str, RejectedAdd] = {}

    def add(self, node: fx.Node, reason: str) -> None:
        self._by_node[node.name] = RejectedAdd(node.name, nk.owner_path(node), reason)

    def withdraw(self, node: fx.Node) -> None:
        self._by_node.pop(node.name, None)

    def reason(self, node: fx.Node) -> str | None:
        rejected = self._by_node.get(node.name)
        return rejected.reason if rejected else None

    def result(self) -> tuple[RejectedAdd, ...]:
        return tuple(self._by_node.values())


def detect_residual_streams(gm: fx.GraphModule, *, min_sites: int = MIN_STREAM_SITES) -> Detection:
    """Find the residual streams of ``gm``; see the module docstring."""
    matcher = _SiteMatcher(gm)
    rejected = _Rejections()
    candidates: dict[fx.Node, ResidualSite] = {}
    absorbed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in absorbed:
            continue
        operands = nk.add_operands(node)
        if operands is None:
            if nk.tensor_add_operands(node) is not None:
                alpha = nk.add_alpha(node)
                rejected.add(node, f"torch.add(a, b, alpha={alpha}) scales its second operand; write "
                                   f"a + {alpha} * b for a residual add")
            continue
        site, reason = matcher.match(node, operands)
        if site is None:
            rejected.add(node, reason)
            continue
        for inner in site.adds:
            if inner is not node:
                absorbed.add(inner)
                candidates.pop(inner, None)
                rejected.withdraw(inner)
        candidates[node] = site

    candidates = _resolve_overlaps(candidates, gm, rejected)
    post_norm = _post_norm_sites(candidates, gm)
    for add in post_norm:
        rejected.add(add, "post-norm: the sum is normalised before the next layer reads it")
        del candidates[add]

    streams = []
    for start, sites in _chain(candidates, rejected):
        if len(sites) < min_sites:
            for site in sites:
                rejected.add(site.add, f"isolated residual add (a stream needs at least {min_sites} sites)")
            continue
        start_layout, layouts = _layouts(start, sites)
        sites = [dataclasses.replace(site, layout=layout) for site, layout in zip(sites, layouts)]
        streams.append(ResidualStream(start, tuple(sites), _hidden_size(gm, start, sites, matcher.param_derived),
                                      start_layout))
    return Detection(tuple(streams), rejected.result(), tuple(a.name for a in post_norm),
                     _unconverted(streams, gm, rejected))


@dataclass(frozen=True, eq=False)
class _Summand:
    """One summand a site adds to the stream, before summands are grouped into sublayers."""

    output: fx.Node
    region: frozenset[fx.Node]
    kind: str
    reads: frozenset            # what it reads the stream through (keys of the stream's readers)

    @property
    def mixes_tokens(self) -> bool:
        return self.kind in TOKEN_MIXING


class _SiteMatcher:
    """Decides whether an add is a residual site, and splits a site into sublayers."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.ancestry = _Ancestry(gm.graph)
        self.param_derived = nk.parameter_derived_nodes(gm.graph)

    def match(self, node: fx.Node, operands: tuple[fx.Node, fx.Node]) -> tuple[ResidualSite | None, str]:
        if nk.op_name(node).endswith("_") and not node.users:
            # ``x.add_(f(x))`` with ``x`` used afterwards: the graph reads the mutated ``x`` through the
            # operand's node, so the sum's own node carries no data flow to rewrite.
            return None, "in-place add whose result is never used; write x = x + f(x) (or x = x.add_(...))"
        a, b = operands
        adds = [node]
        reaches = self.ancestry.reaches
        if reaches(a, b):
            stream_in, outputs = a, [b]
        elif reaches(b, a):
            stream_in, outputs = b, [a]
        else:
            parallel = self._parallel_form(a, b)
            cast = None if parallel is not None else self._cast_residual_form(a, b)
            if parallel is not None:
                stream_in, outputs, inner = parallel
                adds.extend(inner)
            elif cast is not None:
                stream_in, outputs = cast
            else:
                return None, "operands are independent: neither is computed from the other"
        for output in outputs:
            if not self._has_parameterised_compute(stream_in, output):
                return None, (f"the branch {stream_in.name} -> {output.name} has no parameterised compute "
                              "(Linear, matmul or conv with weights)")
        before, after = nk.shape_of(stream_in), nk.shape_of(node)
        if before is not None and after is not None and str(before) != str(after):
            return None, f"the branch output broadcasts the stream {stream_in.name} from {before} to {after}"
        summands: list[_Summand] = []
        for output in outputs:
            summands.extend(self._summands(stream_in, output, adds))
        branches = [self._branch(stream_in, group) for group in _sublayers(summands)]
        _, inbound = _stream_source(stream_in, self.gm)
        return ResidualSite(node, tuple(adds), stream_in, inbound, tuple(branches),
                            _site_owner(node, branches), layout=""), ""

    def _has_parameterised_compute(self, stream_in: fx.Node, output: fx.Node) -> bool:
        return any(nk.is_parameterised_compute(n, self.gm, self.param_derived)
                   for n in self.ancestry.region(stream_in, output))

    def _cast_residual_form(self, a: fx.Node, b: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
        """``residual = h.to(torch.float32); residual + f(norm(h))`` (Mamba's ``residual_in_fp32``): the
        residual operand is a cast of the value the branch reads, so the two are siblings. The site reads
        ``h``; the cast, an identity on values, is left behind with the add it fed."""
        for residual, branch in ((a, b), (b, a)):
            origin = residual
            while nk.is_transparent(origin, self.gm) and len(origin.all_input_nodes) == 1:
                origin = origin.all_input_nodes[0]
            if origin is not residual and self.ancestry.reaches(origin, branch):
                return origin, [branch]
        return None

    def _parallel_form(self, a: fx.Node, b: fx.Node):
        """``(h + f) + g``, ``((h + f) + g) + k``, ... with every summand computed from ``h``: returns
        (h, [f, g, ...], the inner adds)."""
        reaches = self.ancestry.reaches
        for inner, other in ((a, b), (b, a)):
            inner_operands = nk.add_operands(inner)
            if inner_operands is None or len(inner.users) != 1:
                continue
            x, y = inner_operands
            for h, f in ((x, y), (y, x)):
                if reaches(h, f) and reaches(h, other):
                    return h, [f, other], [inner]
            deeper = self._parallel_form(x, y)
            if deeper is not None and reaches(deeper[0], other):
                h, outputs, inners = deeper
                return h, [*outputs, other], [*inners, inner]
        return None

    def _summands(self, stream_in: fx.Node, output: fx.Node, split: list[fx.Node]) -> list[_Summand]:
        """``output`` as the summands a pre-summed branch ``h + (f + g)`` adds, recursively; a sum whose
        summands are one sublayer stays whole. Adds taken apart are appended to ``split``, and so are the
        identities on values (an inactive dropout, a cast) between such an add and the stream: the
        branches' sum may pass through them on its way (Falcon's ``mlp_output += attention_output``
        then ``residual + dropout(mlp_output)``)."""
        passed = []
        while (nk.is_transparent(output, self.gm) and len(output.all_input_nodes) == 1 and len(output.users) == 1
               and nk.add_operands(output.all_input_nodes[0]) is not None):
            passed.append(output)
            output = output.all_input_nodes[0]
        if passed:
            parts = self._summands(stream_in, output, split)
            if len(parts) > 1:
                split.extend(passed)
                return parts
            return [self._summand(stream_in, passed[0])]
        operands = nk.add_operands(output)
        if (operands is None or len(output.users) != 1
                or self.ancestry.reaches(operands[0], operands[1]) or self.ancestry.reaches(operands[1], operands[0])
                or not all(self.ancestry.reaches(stream_in, o) and self._has_parameterised_compute(stream_in, o)
                           for o in operands)):
            return [self._summand(stream_in, output)]
        parts = self._summands(stream_in, operands[0], split) + self._summands(stream_in, operands[1], split)
        if len(parts) == 2 and _one_sublayer(*parts):
            return [self._summand(stream_in, output)]
        split.append(output)
        return parts

    def _summand(self, stream_in: fx.Node, output: fx.Node) -> _Summand:
        region = self.ancestry.region(stream_in, output)
        reads = frozenset(_computation_key(u) for u in stream_in.users if u in region)
        return _Summand(output, region, self._kind(region), reads)

    def _branch(self, stream_in: fx.Node, group: list[_Summand]) -> Branch:
        region = frozenset().union(*(s.region for s in group))
        readers = [u for u in stream_in.users if u in region]
        kinds = {s.kind for s in group}
        kind = "mlp" if len(group) > 1 and "mlp" in kinds else group[0].kind
        paths = [nk.node_module_path(n) for n in region if n.op != "get_attr"]
        return Branch(outputs=tuple(s.output for s in group), region=region, kind=kind,
                      module_path=".".join(_common_parts(p for p in paths if p)),
                      normalised=nk.reads_normalised(stream_in, readers, self.gm))

    def _kind(self, region: frozenset[fx.Node]) -> str:
        """What a branch does, from data flow: 'attn' if it attends (SDPA, or a softmax over products of
        activations such as ``q @ k^T``), 'mlp' if it routes tokens to experts (top-k) or is position-wise
        with a nonlinearity, 'mixer' if it otherwise mixes positions (a scan, a cumulative sum, a
        linear-attention product, a loop over positions, a convolution over them). Module names only
        label a branch the data flow leaves undecided."""
        gm = self.gm
        if any(nk.is_attention_op(n, gm) or (nk.is_softmax(n) and self._scores_products(n, region))
               for n in region):
            return "attn"
        if any(nk.is_routing(n) for n in region):
            return "mlp"
        if self._mixes_positions(region):
            return "mixer"
        if any(nk.is_activation(n, gm) for n in region):
            return "mlp"
        names = " ".join(nk.node_module_path(n) for n in region if n.op != "get_attr").lower()
        if any(hint in names for hint in ("self_attn", "attention", ".attn")):
            return "attn"
        if any(hint in names for hint in ("mixer", "ssm", "mamba")):
            return "mixer"
        if any(hint in names for hint in ("mlp", "ffn", "feed_forward", "feedforward")):
            return "mlp"
        return "branch"

    def _scores_products(self, softmax: fx.Node, region: frozenset[fx.Node]) -> bool:
        """Whether the softmax normalises scores computed by a product of two activations."""
        seen, todo = {softmax}, [softmax]
        while todo:
            for parent in self.ancestry.flow.parents(todo.pop()):
                if parent in region and parent not in seen:
                    if nk.is_activation_product(parent, self.param_derived):
                        return True
                    seen.add(parent)
                    todo.append(parent)
        return False

    def _mixes_positions(self, region: frozenset[fx.Node]) -> bool:
        if any(nk.is_scan(n, self.gm) or nk.is_activation_product(n, self.param_derived) for n in region):
            return True
        steps: dict[tuple[fx.Node, int], set] = {}
        for node in region:
            step = nk.position_index(node)
            if step is not None:
                steps.setdefault(step[:2], set()).add(str(step[2]))
        return any(len(indices) > 1 for indices in steps.values())


def _one_sublayer(first: _Summand, second: _Summand) -> bool:
    """Channel-mixing summands that read the stream the same way make one sublayer."""
    return not first.mixes_tokens and not second.mixes_tokens and first.reads == second.reads


def _sublayers(summands: list[_Summand]) -> list[list[_Summand]]:
    """Group a site's summands into sublayers, in order: token mixers alone, channel mixers by input."""
    groups: list[list[_Summand]] = []
    for summand in summands:
        group = next((g for g in groups if _one_sublayer(g[0], summand)), None)
        if group is None:
            groups.append([summand])
        else:
            group.append(summand)
    return groups


def _computation_key(node: fx.Node) -> tuple:
    """Nodes with equal keys compute the same value (same op on the same arguments): two calls of one
    norm on the stream are one input."""
    return node.op, str(node.target), repr(node.args), repr(node.kwargs)


def _common_parts(paths: Iterable[str]) -> list[str]:
    """The longest common dotted prefix of ``paths``, as a list of parts."""
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for column in zip(*split):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return common


def _site_owner(node: fx.Node, branches: list[Branch]) -> str:
    owner = nk.owner_path(node)
    if owner:
        return owner
    # An add written in the root's forward (``x = x + blk.attn(...)``): the layer the branches share,
    # not the branch's own sublayer (``blocks.0``, not ``blocks.0.attn``).
    common = ".".join(_common_parts(b.module_path for b in branches if b.module_path))
    if len(branches) == 1 and common == branches[0].module_path and "." in common \
            and not common.rsplit(".", 1)[1].isdigit():
        common = common.rsplit(".", 1)[0]
    return common


def _stream_source(stream_in: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """Walk back from a site's input through stream ops: (origin, the ops passed, in graph order)."""
    passed = []
    node = stream_in
    while nk.is_stream_op(node, gm) and node.all_input_nodes:
        passed.append(node)
        node = node.all_input_nodes[0]
    return node, tuple(reversed(passed))


def _origin(site: ResidualSite) -> fx.Node:
    """The value the site's stream input comes from, before the stream ops."""
    return site.inbound[0].all_input_nodes[0] if site.inbound else site.stream_in


def _chain(candidates: dict[fx.Node, ResidualSite], rejected: _Rejections):
    """Link sites into streams: ``(start, sites)`` per stream, in execution order. A stream ends where
    two sites read the same sum (a fork); the sites after a fork are rejected."""
    successors: dict[fx.Node, list[ResidualSite]] = {}
    for site in candidates.values():
        origin = _origin(site)
        if origin in candidates:
            successors.setdefault(origin, []).append(site)
    following = {site.add for sites in successors.values() for site in sites}
    for add, site in candidates.items():
        if add in following:
            continue
        sites = [site]
        while len(successors.get(sites[-1].add, ())) == 1:
            sites.append(successors[sites[-1].add][0])
        fork = sites[-1].add
        todo = list(successors.get(fork, ()))
        while todo:
            after = todo.pop()
            if _origin(after) is fork:
                reason = f"the stream forks at {fork.name}: {len(successors[fork])} residual sites read that sum"
            else:
                reason = f"follows a residual site after the fork at {fork.name}"
            rejected.add(after.add, reason)
            todo.extend(successors.get(after.add, ()))
        yield site.stream_in, sites


def _layouts(start: fx.Node, sites: list[ResidualSite]) -> tuple[str, list[str]]:
    """The layout of the stream's start and of each site (see :attr:`ResidualSite.layout`): the recorded
    leading shape where the capture recorded shapes; else a new layout after every reshape on the
    stream (two reshapes may lead to equal shapes: the rewrite then reshapes a value to the shape it
    has, which costs nothing)."""
    shapes = [nk.shape_of(start), *(nk.shape_of(site.stream_in) for site in sites)]
    if all(shape is not None and shape for shape in shapes):
        keys = [str(tuple(shape[:-1])) for shape in shapes]
        return keys[0], keys[1:]
    layout, layouts = "start", []
    for position, site in enumerate(sites):
        reshapes = [op for op in site.inbound if nk.is_reshape(op)]
        if position and reshapes:
            layout = f"after {reshapes[-1].name}"
        layouts.append(layout)
    return "start", layouts


def _unconverted(streams: list[ResidualStream], gm: fx.GraphModule, rejected: _Rejections
                 ) -> tuple[RejectedAdd, ...]:
    """Adds outside every site that take a stream value as an operand (the stream continues through
    them): a bias added between two layers, a long skip that adds an earlier value of the stream back,
    a site after a fork. Converting the streams leaves them as plain adds."""
    value_of: dict[fx.Node, int] = {}
    inside: set[fx.Node] = set()
    for index, stream in enumerate(streams):
        values = [stream.start]
        for position, site in enumerate(stream.sites):
            if position:                    # the first site's inbound ops come before the start
                values.extend(site.inbound)
            values.append(site.add)
        node = stream.end
        while len(node.users) == 1 and nk.is_stream_op(next(iter(node.users)), gm):
            node = next(iter(node.users))
            values.append(node)
        value_of.update(dict.fromkeys(values, index))
        for site in stream.sites:
            inside.update(site.adds)
            for branch in site.branches:
                inside.update(branch.region)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    found = []
    for node in gm.graph.nodes:
        operands = nk.tensor_add_operands(node)
        if operands is None or node in inside or not any(o in value_of for o in operands):
            continue
        first, second = operands
        if first in value_of and second in value_of and value_of[first] == value_of[second]:
            earlier = min(operands, key=order.__getitem__)
            reason = (f"a long skip: adds an earlier value of the residual stream ({earlier.name}) back onto "
                      "it; Block AttnRes has no source for it")
        else:
            reason = rejected.reason(node) or "it continues the residual stream"
        found.append(RejectedAdd(node.name, nk.owner_path(node), reason))
    return tuple(found)


def _post_norm_sites(candidates: dict[fx.Node, ResidualSite], gm) -> list[fx.Node]:
    """Sites linked as ``h' = norm(h + f(h))`` (BERT-style post-norm), not ``h' = h + f(norm(h))``."""
    post_norm: dict[fx.Node, None] = {}
    for add, site in candidates.items():
        origin = _origin(site)
        if not nk.is_norm_op(origin, gm) or not origin.all_input_nodes:
            continue
        normalised, _ = _stream_source(origin.all_input_nodes[0], gm)
        if normalised in candidates:
            post_norm.update({add: None, normalised: None})
    return list(post_norm)


def _resolve_overlaps(candidates: dict[fx.Node, ResidualSite], gm, rejected: _Rejections):
    """Settle candidates whose branch contains other candidates, in execution order.

    - *nested*: the sites inside the branch form a chain whose start is inside the branch too (a
      residual MLP within a layer). The inner sites are left alone; the outer one stays.
    - *crossing*: the branch reaches earlier sites but not the start of their stream. The "branch" is
      then the residual stream itself: ``scores + mask`` in layer 2, where the mask also fed layer 1's
      scores and so reaches layer 2's scores through the stream. Such an add is no residual site.
    """
    accepted: dict[fx.Node, ResidualSite] = {}
    stream_start: dict[fx.Node, fx.Node] = {}
    for add, site in candidates.items():
        region = frozenset().union(*(b.region for b in site.branches))
        inside = [earlier for earlier in accepted if earlier in region]
        outside_starts = [stream_start[e] for e in inside if stream_start[e] not in region]
        if outside_starts:
            rejected.add(add, "its operands are linked only through the residual stream that starts at "
                              f"{outside_starts[0].name} (e.g. an attention mask or position bias reused by "
                              "later layers)")
            continue
        for earlier in inside:
            rejected.add(earlier, f"nested inside the branch of the residual site {add.name}")
            del accepted[earlier]
        accepted[add] = site
        stream_start[add] = stream_start.get(_origin(site), site.stream_in)
    return accepted


def _hidden_size(gm: fx.GraphModule, start: fx.Node, sites: list[ResidualSite], param_derived) -> int | None:
    """Hidden size of the stream: from shape metadata if the capture left it, else from weights."""
    for node in [start, *(s.add for s in sites)]:
        shape = nk.shape_of(node)
        if shape and isinstance(shape[-1], int):
            return int(shape[-1])
    for node in [*(o for s in sites for b in s.branches for o in b.outputs), start]:
        dim = _output_features(node, gm, param_derived)
        if dim:
            return dim
    return None


def _output_features(node: fx.Node, gm, param_derived) -> int | None:
    """Walk back from a stream value to the Linear / embedding / conv that produced it; its width."""
    seen = set()
    while node is not None and node not in seen:
        seen.add(node)
        module = nk.submodule(gm, node)
        if isinstance(module, nn.Linear):
            return module.out_features
        if isinstance(module, nn.Embedding):
            return module.embedding_dim
        if nk.op_name(node) in {"linear", "addmm", "embedding"} and node.op == "call_function":
            weight = next((a for a in node.all_input_nodes if a.op == "get_attr"), None)
            if weight is not None:
                shape = operator.attrgetter(weight.target)(gm).shape
                return int(shape[-1] if nk.op_name(node) != "linear" else shape[0])
        inputs = [i for i in nk.data_inputs(node) if i not in param_derived]
        node = inputs[0] if inputs else None
    return None


def require_dim(stream: ResidualStream) -> int:
    """The stream's hidden size, or a TraceError saying how to provide it."""
    if stream.dim is None:
        raise TraceError("cannot tell the hidden size of the residual stream from the graph; "
                         "pass example_inputs so that shapes can be propagated")
    return stream.dim
