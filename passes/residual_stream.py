"""Residual-stream detection: find the chains ``h_{l+1} = h_l + f_l(...)`` in a traced graph.

Contract
    requires  a GraphModule from any frontend (torch.fx symbolic tracing or torch.export).
    ensures   nothing about the graph: this pass only reads it.
    returns   :class:`ResidualStreams`: every stream with its sites, and every add that was looked at
              and rejected, with the reason. The rewrite consumes it; ``print()`` shows it (a dry run).

A *residual site* is an add ``h + b`` whose operand ``b`` is computed from ``h`` (data flow; shape
queries do not count) through a branch that contains parameterised compute (a Linear, matmul or conv
with learned weights). Parallel layers ``h + f(h) + g(h)``, in either add order, are one site with two
branches. A *stream* is a maximal chain of sites, each site's output being the next one's ``h`` (eval
dropout and dtype casts in between are seen through); it starts at ``b_0``, a node that is no site.

Worked example, for ``x = emb(ids); x = x + attn(ln1(x)); x = x + mlp(ln2(x)); y = head(ln_f(x))``::

    streams = DetectResidualStreams()(gm).streams
    # one ResidualStream: start=emb, sites=[add (attn branch), add_1 (mlp branch)]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from . import graph_patterns as gp

MIN_STREAM_SITES = 2


@dataclass(eq=False)
class Branch:
    """One branch ``f(norm(h))`` of a site: its output node and the nodes between ``h`` and it."""

    output: fx.Node
    region: set[fx.Node]
    kind: str
    module_path: str
    normalised: bool


@dataclass(eq=False)
class ResidualSite:
    """An add (or a tree of adds, for parallel layers) that puts branch outputs onto the stream."""

    add: fx.Node                    # the add whose output is the stream after this site
    adds: list[fx.Node]             # every add node of the site (more than one for parallel layers)
    stream_in: fx.Node              # the stream value h as this site reads it
    branches: list[Branch]
    owner: str                      # dotted path of the module whose forward performs the add

    @property
    def normalised(self) -> bool:
        return all(b.normalised for b in self.branches)

    @property
    def kind(self) -> str:
        return "+".join(b.kind for b in self.branches)


@dataclass(eq=False)
class ResidualStream:
    """A chain of sites: ``start`` is ``b_0`` (e.g. the embedding), ``sites`` in execution order."""

    start: fx.Node
    sites: list[ResidualSite]

    @property
    def end(self) -> fx.Node:
        return self.sites[-1].add

    @property
    def layers_path(self) -> str:
        """The container of the stream's layers: ``blocks``, ``model.layers``, ``encoder.block``."""
        parts = [s.owner.split(".") if s.owner else [] for s in self.sites]
        common: list[str] = []
        for column in zip(*parts):
            if len(set(column)) != 1:
                break
            common.append(column[0])
        while common and common[-1].isdigit():
            common.pop()
        return ".".join(common)

    @property
    def owner(self) -> str:
        """The module holding the stream: the one above its layer list (``''``, ``model``, ``encoder``)."""
        layers = self.layers_path
        numbered = any(s.owner.startswith(layers + ".") and s.owner[len(layers) + 1:].split(".")[0].isdigit()
                       for s in self.sites) if layers else False
        return layers.rsplit(".", 1)[0] if numbered and "." in layers else ("" if numbered else layers)


@dataclass
class RejectedAdd:
    node: str
    owner: str
    reason: str

    def __str__(self) -> str:
        where = f" in {self.owner}" if self.owner else ""
        return f"{self.node}{where}: {self.reason}"


@dataclass
class ResidualStreams:
    """Detection result: the streams found and every add that was rejected, with why."""

    streams: list[ResidualStream] = field(default_factory=list)
    rejected: list[RejectedAdd] = field(default_factory=list)
    post_norm: list[str] = field(default_factory=list)

    @property
    def num_sites(self) -> int:
        return sum(len(s.sites) for s in self.streams)

    def table(self) -> str:
        header = ("stream", "site", "layer", "kind", "normalised", "add")
        rows = []
        for s_idx, stream in enumerate(self.streams):
            for j, site in enumerate(stream.sites):
                rows.append((str(s_idx), str(j), site.owner or "<root>", site.kind,
                             "yes" if site.normalised else "NO (raw)", site.add.name))
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])

    def __str__(self) -> str:
        starts = ", ".join(f"stream {i} starts at {s.start.name}" for i, s in enumerate(self.streams))
        return f"{self.num_sites} residual sites in {len(self.streams)} stream(s) ({starts})\n{self.table()}"


class _Ancestry:
    """Data-flow reachability on one graph, bounded by topological position to stay cheap."""

    def __init__(self, graph: fx.Graph):
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self._regions: dict[tuple[fx.Node, fx.Node], set[fx.Node]] = {}

    def ancestors(self, node: fx.Node, lower: fx.Node) -> set[fx.Node]:
        """Data ancestors of ``node`` (itself included) that come after ``lower`` or are ``lower``."""
        bound = self.position[lower]
        seen = {node}
        todo = [node]
        while todo:
            for parent in gp.data_inputs(todo.pop()):
                if parent not in seen and self.position[parent] >= bound:
                    seen.add(parent)
                    todo.append(parent)
        return seen

    def reaches(self, source: fx.Node, target: fx.Node) -> bool:
        return source is not target and source in self.ancestors(target, source)

    def region(self, source: fx.Node, target: fx.Node) -> set[fx.Node]:
        """Nodes on a data path from ``source`` to ``target`` (``target`` included, ``source`` not).

        Memoised: splitting a parallel site asks for the same regions as describing its branches."""
        key = (source, target)
        if key not in self._regions:
            self._regions[key] = self._region(source, target)
        return self._regions[key]

    def _region(self, source: fx.Node, target: fx.Node) -> set[fx.Node]:
        upstream = self.ancestors(target, source)
        region: set[fx.Node] = set()
        todo = [source]
        while todo:
            node = todo.pop()
            for user in node.users:
                if user in upstream and user not in region and gp.reads_value(user, node):
                    region.add(user)
                    todo.append(user)
        return region


class DetectResidualStreams(PassBase):
    """Find residual streams. Read-only: ``PassResult.modified`` is always False."""

    preserves_computation = True

    def __init__(self, min_sites: int = MIN_STREAM_SITES):
        super().__init__()
        self.min_sites = min_sites
        self.result: ResidualStreams | None = None

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        self.result = detect_residual_streams(graph_module, min_sites=self.min_sites)
        return PassResult(graph_module, False)


def detect_residual_streams(gm: fx.GraphModule, *, min_sites: int = MIN_STREAM_SITES) -> ResidualStreams:
    ancestry = _Ancestry(gm.graph)
    param_derived = gp.parameter_derived_nodes(gm.graph)
    result = ResidualStreams()
    candidates: dict[fx.Node, ResidualSite] = {}
    absorbed: set[fx.Node] = set()

    def reject(node: fx.Node, reason: str) -> None:
        result.rejected.append(RejectedAdd(node.name, gp.owner_path(node), reason))

    for node in gm.graph.nodes:
        operands = gp.add_operands(node)
        if operands is None or node in absorbed:
            continue
        site, reason = _match_site(node, operands, gm, ancestry, param_derived)
        if site is None:
            reject(node, reason)
            continue
        for inner in site.adds:
            if inner is not node:
                absorbed.add(inner)
                candidates.pop(inner, None)
                result.rejected = [r for r in result.rejected if r.node != inner.name]
        candidates[node] = site

    candidates = _resolve_overlaps(candidates, gm, reject)

    post_norm = _post_norm_sites(candidates, gm)
    for add in post_norm:
        reject(add, "post-norm: the sum is normalised before the next layer reads it")
        result.post_norm.append(add.name)
        del candidates[add]

    streams = _chain(candidates, gm, reject)
    kept = []
    for stream in streams:
        if len(stream.sites) < min_sites:
            for site in stream.sites:
                reject(site.add, f"isolated residual add (a stream needs at least {min_sites} sites)")
        else:
            kept.append(stream)
    result.streams = kept
    return result


def _match_site(node, operands, gm, ancestry, param_derived) -> tuple[ResidualSite | None, str]:
    if gp.op_name(node).endswith("_") and not node.users:
        # ``x.add_(f(x))`` with ``x`` used afterwards: the graph reads the mutated ``x`` through the
        # operand's node, so the sum's own node carries no data flow to rewrite.
        return None, "in-place add whose result is never used; write x = x + f(x) (or x = x.add_(...))"
    a, b = operands
    adds = [node]
    if ancestry.reaches(a, b):
        stream_in, outputs = a, [b]
    elif ancestry.reaches(b, a):
        stream_in, outputs = b, [a]
    else:
        parallel = _parallel_form(node, a, b, ancestry)
        if parallel is None:
            return None, "operands are independent: neither is computed from the other"
        stream_in, outputs, inner = parallel
        adds.append(inner)
    outputs, split_adds = _split_parallel_branches(node, stream_in, outputs, ancestry, gm, param_derived)
    adds.extend(split_adds)
    branches = []
    for output in outputs:
        region = ancestry.region(stream_in, output)
        if not any(gp.is_parameterised_compute(n, gm, param_derived) for n in region):
            return None, (f"the branch {stream_in.name} -> {output.name} has no parameterised compute "
                          "(Linear, matmul or conv with weights)")
        branches.append(_describe_branch(stream_in, output, region, gm))
    return ResidualSite(node, adds, stream_in, branches, _site_owner(node, branches)), ""


def _parallel_form(node, a, b, ancestry):
    """``(h + f) + g`` with ``g`` also computed from ``h``: returns (h, [f, g], inner add)."""
    for inner, other in ((a, b), (b, a)):
        inner_operands = gp.add_operands(inner)
        if inner_operands is None or len(inner.users) != 1:
            continue
        x, y = inner_operands
        for h, f in ((x, y), (y, x)):
            if ancestry.reaches(h, f) and ancestry.reaches(h, other):
                return h, [f, other], inner
    return None


def _split_parallel_branches(node, stream_in, outputs, ancestry, gm, param_derived):
    """``h + (f + g)``: a branch that is itself a sum of two independent branches of ``h``."""
    result, split = [], []
    for output in outputs:
        operands = gp.add_operands(output)
        if (operands is not None and len(output.users) == 1
                and not ancestry.reaches(operands[0], operands[1])
                and not ancestry.reaches(operands[1], operands[0])
                and all(ancestry.reaches(stream_in, o) and any(
                    gp.is_parameterised_compute(n, gm, param_derived)
                    for n in ancestry.region(stream_in, o)) for o in operands)):
            result.extend(operands)
            split.append(output)
        else:
            result.append(output)
    return result, split


def _describe_branch(stream_in, output, region, gm) -> Branch:
    readers = [u for u in stream_in.users if u in region]
    paths = [gp.node_module_path(n) for n in region if n.op != "get_attr"]
    return Branch(output=output, region=region, kind=_branch_kind(region, paths, gm),
                  module_path=_common_path(p for p in paths if p),
                  normalised=gp.reads_normalised(stream_in, readers, gm))


def _branch_kind(region, paths, gm) -> str:
    """'attn' if the branch mixes positions (softmax / SDPA), 'mlp' if it is a position-wise MLP with
    a nonlinearity. Module names are only a last resort (they name, they never detect)."""
    if any(gp.is_attention(n, gm) for n in region):
        return "attn"
    if any(gp.is_activation(n, gm) for n in region):
        return "mlp"
    names = " ".join(paths).lower()
    if any(hint in names for hint in ("self_attn", "attention", ".attn")):
        return "attn"
    if any(hint in names for hint in ("mlp", "ffn", "feed_forward", "feedforward")):
        return "mlp"
    return "branch"


def _common_path(paths: Iterable[str]) -> str:
    split = [p.split(".") for p in paths]
    if not split:
        return ""
    common = []
    for column in zip(*split):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return ".".join(common)


def _site_owner(node: fx.Node, branches: list[Branch]) -> str:
    owner = gp.owner_path(node)
    if owner:
        return owner
    # An add written in the root's forward (``x = x + blk.attn(...)``): the layer the branches share,
    # not the branch's own sublayer (``blocks.0``, not ``blocks.0.attn``).
    common = _common_path(b.module_path for b in branches if b.module_path)
    if len(branches) == 1 and common == branches[0].module_path and "." in common \
            and not common.rsplit(".", 1)[1].isdigit():
        common = common.rsplit(".", 1)[0]
    return common


def _stream_source(stream_in: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, list[fx.Node]]:
    """Walk back from a site's input through transparent ops; returns (origin, the ops passed)."""
    passed = []
    node = stream_in
    while gp.is_transparent(node, gm) and node.all_input_nodes:
        passed.append(node)
        node = node.all_input_nodes[0]
    return node, passed


def _chain(candidates: dict[fx.Node, ResidualSite], gm, reject) -> list[ResidualStream]:
    successor: dict[fx.Node, ResidualSite] = {}
    has_predecessor: set[fx.Node] = set()
    forks: set[fx.Node] = set()
    for add, site in candidates.items():
        origin, _ = _stream_source(site.stream_in, gm)
        if origin in candidates:
            if origin in successor:
                forks.add(origin)
            successor[origin] = site
            has_predecessor.add(add)
    streams = []
    for add, site in candidates.items():
        if add in has_predecessor:
            continue
        sites = [site]
        while sites[-1].add in successor and sites[-1].add not in forks:
            sites.append(successor[sites[-1].add])
        for fork in forks & {s.add for s in sites}:
            reject(fork, "the stream forks here: two residual sites read this sum")
        streams.append(ResidualStream(start=site.stream_in, sites=sites))
    return streams


def _post_norm_sites(candidates: dict[fx.Node, ResidualSite], gm) -> set[fx.Node]:
    """Sites linked as ``h' = norm(h + f(h))`` (BERT-style post-norm), not ``h' = h + f(norm(h))``."""
    post_norm: set[fx.Node] = set()
    for add, site in candidates.items():
        origin, _ = _stream_source(site.stream_in, gm)
        if not gp.is_norm_op(origin, gm) or not origin.all_input_nodes:
            continue
        normalised, _ = _stream_source(origin.all_input_nodes[0], gm)
        if normalised in candidates:
            post_norm.update((add, normalised))
    return post_norm


def _resolve_overlaps(candidates: dict[fx.Node, ResidualSite], gm, reject) -> dict[fx.Node, ResidualSite]:
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
        region = set().union(*(b.region for b in site.branches))
        inside = [earlier for earlier in accepted if earlier in region]
        outside_starts = [stream_start[e] for e in inside if stream_start[e] not in region]
        if outside_starts:
            reject(add, "its operands are linked only through the residual stream that starts at "
                        f"{outside_starts[0].name} (e.g. an attention mask or position bias reused by "
                        "later layers)")
            continue
        for earlier in inside:
            reject(earlier, f"nested inside the branch of the residual site {add.name}")
            del accepted[earlier]
        accepted[add] = site
        origin, _ = _stream_source(site.stream_in, gm)
        stream_start[add] = stream_start.get(origin, site.stream_in)
    return accepted
