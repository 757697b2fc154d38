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

from torch import fx, nn

from attnres_fx.errors import TraceError

from . import dataflow, provenance
from . import node_kinds as nk
from .matching import SiteMatcher, stream_source
from .streams import Branch, Detection, RejectedAdd, ResidualSite, ResidualStream  # noqa: F401 - what it returns

MIN_STREAM_SITES = 2


class _Rejections:
    """The rejected adds, in the order they were seen; a later decision can withdraw one."""

    def __init__(self):
        self._by_node: dict[str, RejectedAdd] = {}

    def add(self, node: fx.Node, reason: str) -> None:
        self._by_node[node.name] = RejectedAdd(node.name, provenance.owner_path(node), reason)

    def withdraw(self, node: fx.Node) -> None:
        self._by_node.pop(node.name, None)

    def reason(self, node: fx.Node) -> str | None:
        rejected = self._by_node.get(node.name)
        return rejected.reason if rejected else None

    def result(self) -> tuple[RejectedAdd, ...]:
        return tuple(self._by_node.values())


def detect_residual_streams(gm: fx.GraphModule, *, min_sites: int = MIN_STREAM_SITES) -> Detection:
    """Find the residual streams of ``gm``; see the module docstring."""
    matcher = SiteMatcher(gm)
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
        site = matcher.match(node, operands)
        if not site:
            rejected.add(node, site.reason)
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
        found.append(RejectedAdd(node.name, provenance.owner_path(node), reason))
    listed = {add.node for add in found}
    for index, stream in enumerate(streams):
        link = None if stream.start.name in listed else _continued_from(stream.start, value_of, index)
        if link is not None:
            ops, earlier = link
            found.append(RejectedAdd(stream.start.name, provenance.owner_path(stream.start), (
                f"the residual stream that ends at {streams[earlier].end.name} continues through "
                f"{' -> '.join(op.name for op in ops)} (an op on the whole stream, such as a scaling, that is no "
                "stream op) into the stream that starts here; converted, each part would "
                "attend over its own blocks only. Remove the op from the stream if the model allows it (a "
                "rescaling that keeps values in fp16 range, such as RWKV's rescale_every, can be turned off in "
                "its config)")))
    return tuple(found)


# How many ops on the whole stream :func:`_continued_from` follows back from a stream's start.
_LINK_OPS = 4


def _continued_from(start: fx.Node, value_of: dict[fx.Node, int], index: int
                    ) -> tuple[list[fx.Node], int] | None:
    """The ops (first to last) and the stream whose value ``start`` is computed from, elementwise and alone
    (each op's one tensor input besides constants and weights, the same shape): ``h / 2`` between two
    runs of layers. None where ``start`` comes from elsewhere (an embedding, a projection)."""
    shape = nk.shape_of(start)
    ops, node = [], start
    for _ in range(_LINK_OPS):
        inputs = [i for i in dataflow.data_inputs(node) if not dataflow.is_parameter(i)]
        if len(inputs) != 1 or nk.op_name(node) in nk.NORM_OPS or nk.op_name(node) in nk.MATMUL_OPS:
            return None
        if shape is not None and nk.shape_of(node) != shape:
            return None
        ops.insert(0, node)
        node = inputs[0]
        if value_of.get(node, index) != index:
            return ops, value_of[node]
    return None


def _post_norm_sites(candidates: dict[fx.Node, ResidualSite], gm) -> list[fx.Node]:
    """Sites linked as ``h' = norm(h + f(h))`` (BERT-style post-norm), not ``h' = h + f(norm(h))``."""
    post_norm: dict[fx.Node, None] = {}
    for add, site in candidates.items():
        origin = _origin(site)
        if not nk.is_norm_op(origin, gm) or not origin.all_input_nodes:
            continue
        normalised, _ = stream_source(origin.all_input_nodes[0], gm)
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
    - *input of the branch*: an earlier add that reads the site's own stream value, feeds only the site's
      branch and continues no stream (``h + f(norm(h + g(h)))``) is part of that branch, not a site.
    """
    accepted: dict[fx.Node, ResidualSite] = {}
    stream_start: dict[fx.Node, fx.Node] = {}
    continued = {_origin(other) for other in candidates.values()}
    for add, site in candidates.items():
        region = frozenset().union(*(b.region for b in site.branches))
        inside = [earlier for earlier in accepted if earlier in region]
        for earlier in [e for e in inside if e not in continued and _input_of_branch(accepted[e], site, region)]:
            rejected.add(earlier, f"it adds a branch output to the stream value that the residual site {add.name} "
                                  "reads, as the input of that site's sublayer: part of its branch")
            del accepted[earlier]
            inside.remove(earlier)
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


def _input_of_branch(earlier: ResidualSite, site: ResidualSite, region: frozenset) -> bool:
    """Whether ``earlier`` is no step of the stream but the input ``h + g(h)`` of ``site``'s branch
    ``h' = h + f(norm(h + g(h)))`` (Zamba2's hybrid layers: a shared attention block's output added to the
    stream for the Mamba mixer that follows): it reads the stream value ``site`` reads, and only ``site``'s
    branch reads its sum (the caller checks that no site continues from it: a long skip's branch holds
    whole layers, whose sums do)."""
    return _origin(earlier) is _origin(site) and all(user in region or nk.is_shape_query(user)
                                                     for user in earlier.add.users)


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
        inputs = [i for i in dataflow.data_inputs(node) if i not in param_derived]
        node = inputs[0] if inputs else None
    return None


def require_dim(stream: ResidualStream) -> int:
    """The stream's hidden size, or a TraceError saying how to provide it."""
    if stream.dim is None:
        raise TraceError("cannot tell the hidden size of the residual stream from the graph; "
                         "pass example_inputs so that shapes can be propagated")
    return stream.dim
