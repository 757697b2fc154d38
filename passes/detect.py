"""Detect: find the residual streams ``h_{l+1} = h_l + f_l(...)`` in a traced graph.

Contract
    requires  a GraphModule from any capture (torch.fx symbolic tracing, torch.export, TorchDynamo).
    ensures   nothing about the graph: detection only reads it.
    returns   :class:`Detection`, immutable: every stream with its sites, the nodes each site's branches
              span, the transparent ops (casts, eval dropout) the stream passes through between sites,
              its hidden size, and every add that was looked at and rejected, with the reason. The plan
              and the rewrite read it; ``print()`` shows it (a dry run).

A *residual site* is an add ``h + b`` whose operand ``b`` is computed from ``h`` (data flow; shape
queries do not count) through a branch that contains parameterised compute (a Linear, matmul or conv
with learned weights). Parallel layers ``h + f(h) + g(h)``, in either add order, are one site with two
branches. A *stream* is a maximal chain of sites, each site's output being the next one's ``h`` (eval
dropout and dtype casts in between are seen through); it starts at ``b_0``, a node that is no site.

Worked example, for ``x = emb(ids); x = x + attn(ln1(x)); x = x + mlp(ln2(x)); y = head(ln_f(x))``::

    detection = detect_residual_streams(gm)
    # one ResidualStream: start=emb, sites=(add: attn branch, add_1: mlp branch), dim=D
    print(detection)          # the table a dry run prints
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx, nn

from attnres_fx.errors import TraceError
from attnres_fx.text import format_table

from . import node_kinds as nk

MIN_STREAM_SITES = 2


@dataclass(frozen=True, eq=False)
class Branch:
    """One branch ``f(norm(h))`` of a site: its output node and the nodes between ``h`` and it."""

    output: fx.Node
    region: frozenset[fx.Node]
    kind: str                       # "attn" | "mlp" | "branch" (neither could be told)
    module_path: str
    normalised: bool                # reads the stream only through a norm


@dataclass(frozen=True, eq=False)
class ResidualSite:
    """An add (or a tree of adds, for parallel layers) that puts branch outputs onto the stream."""

    add: fx.Node                    # the add whose output is the stream after this site
    adds: tuple[fx.Node, ...]       # every add node of the site (more than one for parallel layers)
    stream_in: fx.Node              # the stream value h as this site reads it
    inbound: tuple[fx.Node, ...]    # transparent ops from the previous stream value to stream_in, in order
    branches: tuple[Branch, ...]
    owner: str                      # dotted path of the module whose forward performs the add

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
    """What detection found: the streams, every add it rejected (and why), the post-norm links."""

    streams: tuple[ResidualStream, ...]
    rejected: tuple[RejectedAdd, ...]
    post_norm: tuple[str, ...]

    @property
    def num_sites(self) -> int:
        return sum(len(s.sites) for s in self.streams)

    def table(self) -> str:
        rows = [(str(s_idx), str(j), site.owner or "<root>", site.kind, "yes" if site.normalised else "NO (raw)")
                for s_idx, stream in enumerate(self.streams) for j, site in enumerate(stream.sites)]
        return format_table(("stream", "site", "layer", "kind", "normalised"), rows)

    def __str__(self) -> str:
        owners = ", ".join(f"stream {i} in {s.owner or '<root>'}" for i, s in enumerate(self.streams))
        return f"{self.num_sites} residual sites in {len(self.streams)} stream(s) ({owners})\n{self.table()}"


class _Ancestry:
    """Data-flow reachability on one graph, bounded by topological position to stay cheap."""

    def __init__(self, graph: fx.Graph):
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self._regions: dict[tuple[fx.Node, fx.Node], frozenset[fx.Node]] = {}

    def ancestors(self, node: fx.Node, lower: fx.Node) -> set[fx.Node]:
        """Data ancestors of ``node`` (itself included) that come after ``lower`` or are ``lower``."""
        bound = self.position[lower]
        seen = {node}
        todo = [node]
        while todo:
            for parent in nk.data_inputs(todo.pop()):
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
            node = todo.pop()
            for user in node.users:
                if user in upstream and user not in region and nk.reads_value(user, node):
                    region.add(user)
                    todo.append(user)
        return frozenset(region)


class _Rejections:
    """The rejected adds, in the order they were seen; a later decision can withdraw one."""

    def __init__(self):
        self._by_node: dict[str, RejectedAdd] = {}

    def add(self, node: fx.Node, reason: str) -> None:
        self._by_node[node.name] = RejectedAdd(node.name, nk.owner_path(node), reason)

    def withdraw(self, node: fx.Node) -> None:
        self._by_node.pop(node.name, None)

    def result(self) -> tuple[RejectedAdd, ...]:
        return tuple(self._by_node.values())


def detect_residual_streams(gm: fx.GraphModule, *, min_sites: int = MIN_STREAM_SITES) -> Detection:
    """Find the residual streams of ``gm``; see the module docstring."""
    ancestry = _Ancestry(gm.graph)
    param_derived = nk.parameter_derived_nodes(gm.graph)
    rejected = _Rejections()
    candidates: dict[fx.Node, ResidualSite] = {}
    absorbed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        operands = nk.add_operands(node)
        if operands is None or node in absorbed:
            continue
        site, reason = _match_site(node, operands, gm, ancestry, param_derived)
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
    for start, sites in _chain(candidates, gm, rejected):
        if len(sites) < min_sites:
            for site in sites:
                rejected.add(site.add, f"isolated residual add (a stream needs at least {min_sites} sites)")
            continue
        streams.append(ResidualStream(start, tuple(sites), _hidden_size(gm, start, sites, param_derived)))
    return Detection(tuple(streams), rejected.result(), tuple(a.name for a in post_norm))


def _match_site(node, operands, gm, ancestry, param_derived) -> tuple[ResidualSite | None, str]:
    if nk.op_name(node).endswith("_") and not node.users:
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
        parallel = _parallel_form(a, b, ancestry)
        if parallel is None:
            return None, "operands are independent: neither is computed from the other"
        stream_in, outputs, inner = parallel
        adds.append(inner)
    outputs, split_adds = _split_parallel_branches(stream_in, outputs, ancestry, gm, param_derived)
    adds.extend(split_adds)
    branches = []
    for output in outputs:
        region = ancestry.region(stream_in, output)
        if not any(nk.is_parameterised_compute(n, gm, param_derived) for n in region):
            return None, (f"the branch {stream_in.name} -> {output.name} has no parameterised compute "
                          "(Linear, matmul or conv with weights)")
        branches.append(_describe_branch(stream_in, output, region, gm))
    _, inbound = _stream_source(stream_in, gm)
    return ResidualSite(node, tuple(adds), stream_in, inbound, tuple(branches),
                        _site_owner(node, branches)), ""


def _parallel_form(a, b, ancestry):
    """``(h + f) + g`` with ``g`` also computed from ``h``: returns (h, [f, g], inner add)."""
    for inner, other in ((a, b), (b, a)):
        inner_operands = nk.add_operands(inner)
        if inner_operands is None or len(inner.users) != 1:
            continue
        x, y = inner_operands
        for h, f in ((x, y), (y, x)):
            if ancestry.reaches(h, f) and ancestry.reaches(h, other):
                return h, [f, other], inner
    return None


def _split_parallel_branches(stream_in, outputs, ancestry, gm, param_derived):
    """``h + (f + g)``: a branch that is itself a sum of two independent branches of ``h``."""
    result, split = [], []
    for output in outputs:
        operands = nk.add_operands(output)
        if (operands is not None and len(output.users) == 1
                and not ancestry.reaches(operands[0], operands[1])
                and not ancestry.reaches(operands[1], operands[0])
                and all(ancestry.reaches(stream_in, o) and any(
                    nk.is_parameterised_compute(n, gm, param_derived)
                    for n in ancestry.region(stream_in, o)) for o in operands)):
            result.extend(operands)
            split.append(output)
        else:
            result.append(output)
    return result, split


def _describe_branch(stream_in, output, region, gm) -> Branch:
    readers = [u for u in stream_in.users if u in region]
    paths = [nk.node_module_path(n) for n in region if n.op != "get_attr"]
    return Branch(output=output, region=region, kind=_branch_kind(region, paths, gm),
                  module_path=".".join(_common_parts(p for p in paths if p)),
                  normalised=nk.reads_normalised(stream_in, readers, gm))


def _branch_kind(region, paths, gm) -> str:
    """'attn' if the branch mixes positions (softmax / SDPA), 'mlp' if it is a position-wise MLP with
    a nonlinearity. Module names are only a last resort (they name, they never detect)."""
    if any(nk.is_attention(n, gm) for n in region):
        return "attn"
    if any(nk.is_activation(n, gm) for n in region):
        return "mlp"
    names = " ".join(paths).lower()
    if any(hint in names for hint in ("self_attn", "attention", ".attn")):
        return "attn"
    if any(hint in names for hint in ("mlp", "ffn", "feed_forward", "feedforward")):
        return "mlp"
    return "branch"


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
    """Walk back from a site's input through transparent ops: (origin, the ops passed, in graph order)."""
    passed = []
    node = stream_in
    while nk.is_transparent(node, gm) and node.all_input_nodes:
        passed.append(node)
        node = node.all_input_nodes[0]
    return node, tuple(reversed(passed))


def _origin(site: ResidualSite) -> fx.Node:
    """The value the site's stream input comes from, before the transparent ops."""
    return site.inbound[0].all_input_nodes[0] if site.inbound else site.stream_in


def _chain(candidates: dict[fx.Node, ResidualSite], gm, rejected: _Rejections):
    """Link sites into streams: ``(start, sites)`` per stream, in execution order."""
    successor: dict[fx.Node, ResidualSite] = {}
    has_predecessor: set[fx.Node] = set()
    forks: set[fx.Node] = set()
    for add, site in candidates.items():
        origin = _origin(site)
        if origin in candidates:
            if origin in successor:
                forks.add(origin)
            successor[origin] = site
            has_predecessor.add(add)
    for add, site in candidates.items():
        if add in has_predecessor:
            continue
        sites = [site]
        while sites[-1].add in successor and sites[-1].add not in forks:
            sites.append(successor[sites[-1].add])
        for fork in forks & {s.add for s in sites}:
            rejected.add(fork, "the stream forks here: two residual sites read this sum")
        yield site.stream_in, sites


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
        for key in ("val", "tensor_meta", "example_value"):
            shape = getattr(node.meta.get(key), "shape", None)
            if shape is not None and len(shape) and isinstance(shape[-1], int):
                return int(shape[-1])
    for node in [*(b.output for s in sites for b in s.branches), start]:
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
