"""The Block AttnRes rewrite: replace each residual stream by attention over depth.

Contract
    requires  :class:`~attnres_fx.passes.residual_stream.ResidualStreams` detected on this very graph.
    ensures   every site's branches read ``BlockAttnRes(b_0, ..., b_{n-1}, partial)`` instead of the
              stream; block starts commit the partial sum; what the last site's output fed now reads a
              final aggregation; no add of the original stream is left; the graph lints.
    modifies  the graph and the module tree (one ``BlockAttnRes`` submodule per branch, one per stream
              for the final aggregation). ``preserves_computation`` is True only with
              ``preserve_scale=True`` (at zero init, where every pseudo-query is zero).

Semantics (METHOD.md section 3, at sublayer granularity), for one stream with block size ``S``::

    blocks, partial = [], b_0
    for j, site in enumerate(sites):
        for each branch k: input_k = BlockAttnRes_jk(*blocks, partial)   # read before the boundary
        if j % S == 0: blocks.append(partial); partial = sum_k f_k(input_k)
        else:          partial = partial + sum_k f_k(input_k)
    final = BlockAttnRes_final(*blocks, partial)

Worked example, two sequential sites and ``S = 1`` (Full AttnRes)::

    before:  add = emb + attn(ln1(emb));  add_1 = add + mlp(ln2(add));  out = ln_f(add_1)
    after:   a0 = attn_res(emb);   p0 = attn(ln1(a0))
             a1 = mlp_res(emb, p0);   p1 = mlp(ln2(a1))
             fin = final_res(emb, p0, p1);   out = ln_f(fin)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from attnres_fx.block_attnres import DEFAULT_EPS, BlockAttnRes
from attnres_fx.errors import TraceError

from . import graph_patterns as gp
from .residual_stream import Branch, ResidualSite, ResidualStream, ResidualStreams


@dataclass(frozen=True)
class RewrittenSite:
    """Record of one injected aggregation (what ``attnres_fx.sites`` reports)."""

    index: int
    name: str
    kind: str
    block: int | None
    stream: int
    layer: str
    num_sources: int
    normalised: bool | None
    replaced: str          # the original add node this aggregation's site replaced ('' for final)


def block_sizes(streams: ResidualStreams, num_blocks: int, block_size: int | None) -> list[int]:
    """Block size (in sites) per stream: ``block_size`` if given, else ``ceil(M / num_blocks)``."""
    if block_size is not None:
        return [block_size] * len(streams.streams)
    return [max(1, math.ceil(len(s.sites) / num_blocks)) for s in streams.streams]


class BlockAttnResRewrite(PassBase):
    """Rewrite detected streams in place on ``graph_module``; ``self.records`` lists what was injected."""

    def __init__(self, detection: ResidualStreams, block_sizes: list[int], *, preserve_scale: bool = False,
                 eps: float = DEFAULT_EPS, protected_modules: Iterable[nn.Module] = ()):
        super().__init__()
        if len(block_sizes) != len(detection.streams):
            raise ValueError("one block size per stream is needed")
        self.detection = detection
        self.block_sizes = block_sizes
        self.preserve_scale = preserve_scale
        self.eps = eps
        # Module objects shared with the user's model: new modules are never registered inside them.
        self.protected = frozenset(id(m) for m in protected_modules)
        self.records: list[RewrittenSite] = []

    @property
    def preserves_computation(self) -> bool:
        return self.preserve_scale

    def requires(self, graph_module: fx.GraphModule) -> None:
        nodes = set(graph_module.graph.nodes)
        for stream in self.detection.streams:
            if stream.start not in nodes or any(s.add not in nodes for s in stream.sites):
                raise ValueError("the detected streams do not belong to this graph")

    def ensures(self, graph_module: fx.GraphModule) -> None:
        graph_module.graph.lint()
        nodes = set(graph_module.graph.nodes)
        left = [a.name for s in self.detection.streams for site in s.sites for a in site.adds if a in nodes]
        if left:
            raise RuntimeError(f"original residual adds left on the stream: {left}")

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        factory = _AttnResFactory(graph_module, self.eps, self.preserve_scale, self.protected)
        owners = [stream.owner for stream in self.detection.streams]
        for stream_index, (stream, size) in enumerate(zip(self.detection.streams, self.block_sizes)):
            # Streams that share an owner (an encoder and a decoder list in one root) are told apart
            # by their layer lists: ``encoder.final_res``, ``decoder.final_res``.
            final_owner = stream.layers_path if owners.count(owners[stream_index]) > 1 else owners[stream_index]
            self._rewrite_stream(graph_module, factory, stream, stream_index, size, final_owner)
        graph_module.recompile()
        return PassResult(graph_module, True)

    def _record(self, factory, name, kind, block, stream_index, layer, sources, normalised, replaced):
        record = RewrittenSite(len(self.records), name, kind, block, stream_index, layer, len(sources),
                               normalised, replaced)
        factory.describe(name, record)
        self.records.append(record)

    def _rewrite_stream(self, gm, factory, stream: ResidualStream, stream_index: int, size: int,
                        final_owner: str) -> None:
        graph = gm.graph
        is_aten = isinstance(stream.end.target, torch._ops.OpOverload)
        blocks: list[fx.Node] = []
        partial = stream.start
        value_nodes = [stream.start]          # nodes carrying the stream value the next site reads
        dead: list[fx.Node] = []
        for j, site in enumerate(stream.sites):
            _separate_shared_reads(graph, site)
            sources = blocks + [partial]
            readers = _external_users(value_nodes, site)
            aggregates = []
            with graph.inserting_before(_first(graph, readers)):
                for branch in site.branches:
                    name = factory.create(site, branch, stream)
                    node = graph.call_module(name, tuple(sources))
                    _annotate(node, site.add, name, "aggregate", factory.module_class_entry(name))
                    aggregates.append(node)
                    self._record(factory, name, branch.kind, j // size + 1, stream_index, site.owner,
                                 sources, branch.normalised, site.add.name)
            for reader, value in readers:
                reader.replace_input_with(value, aggregates[_branch_of(reader, site.branches)])
            if j % size == 0:
                blocks.append(partial)
                partial = None
            anchor = site.add
            for branch in site.branches:
                if partial is None:
                    partial = branch.output
                    continue
                target = torch.ops.aten.add.Tensor if is_aten else operator.add
                with graph.inserting_after(anchor):
                    partial = graph.create_node("call_function", target, (partial, branch.output),
                                                name=f"{_identifier(site.owner)}_partial")
                _annotate(partial, site.add, site.owner, "partial", None)
                anchor = partial
            dead.extend(value_nodes[1:] if j else [])
            dead.extend(site.adds)
            value_nodes = [site.add]
            value_nodes.extend(_transparent_successors(site.add, gm, stream.sites[j + 1:j + 2]))
        sources = blocks + [partial]
        readers = _external_users(value_nodes, None)
        final_name = factory.create_final(stream, final_owner)
        with graph.inserting_before(_first(graph, readers)):
            final = graph.call_module(final_name, tuple(sources))
            _annotate(final, stream.end, final_name, "final", factory.module_class_entry(final_name))
        self._record(factory, final_name, "final", None, stream_index, stream.owner, sources, None, "")
        for reader, value in readers:
            reader.replace_input_with(value, final)
        dead.extend(value_nodes[1:])
        for node in sorted(set(dead), key=_position(graph), reverse=True):
            if not node.users:
                graph.erase_node(node)


def _branch_of(reader: fx.Node, branches: list[Branch]) -> int:
    """Which branch's aggregate a reader gets: the branch containing it (or, for a shape query such as
    ``x.dtype``, its users); readers outside every branch get the first branch's aggregate."""
    for candidates in ([reader], list(reader.users)):
        for k, branch in enumerate(branches):
            if any(c in branch.region for c in candidates):
                return k
    return 0


def _position(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__


def _first(graph: fx.Graph, readers: list[tuple[fx.Node, fx.Node]]) -> fx.Node:
    users = {reader for reader, _ in readers}
    return next(node for node in graph.nodes if node in users)


def _identifier(path: str) -> str:
    return path.replace(".", "_") or "root"


def _transparent_successors(add: fx.Node, gm, next_site: list[ResidualSite]) -> list[fx.Node]:
    """Eval-dropout / cast nodes between this site's add and the next site's input."""
    if not next_site:
        return []
    chain = []
    node = next_site[0].stream_in
    while node is not add:
        chain.append(node)
        node = node.all_input_nodes[0]
    return chain[::-1]


def _external_users(value_nodes: list[fx.Node], site: ResidualSite | None) -> list[tuple[fx.Node, fx.Node]]:
    """(user, value) pairs that read the stream value, except the site's own adds and the value chain."""
    skip = set(value_nodes) | (set(site.adds) if site is not None else set())
    return [(user, value) for value in value_nodes for user in list(value.users) if user not in skip]


def _separate_shared_reads(graph: fx.Graph, site: ResidualSite) -> None:
    """Give each branch of a parallel site its own copy of reads they share (Phi: one LayerNorm for
    attention and MLP), so that each branch can read its own aggregate."""
    first = site.branches[0]
    for branch in site.branches[1:]:
        shared = first.region & branch.region
        if not shared:
            continue
        order = _position(graph)
        copies: dict[fx.Node, fx.Node] = {}
        for node in sorted(shared, key=order):
            with graph.inserting_after(node):
                copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
        for node in branch.region - shared:
            for original, copy in copies.items():
                node.replace_input_with(original, copy)
        branch.region = (branch.region - shared) | set(copies.values())


def _annotate(node: fx.Node, origin: fx.Node, name: str, role: str, module_entry) -> None:
    """Provenance: the new node inherits its site's module stack and stack trace."""
    stack = dict(origin.meta.get("nn_module_stack") or {})
    if module_entry is not None:
        stack[name] = module_entry
    if stack:
        node.meta["nn_module_stack"] = stack
    if origin.meta.get("stack_trace"):
        node.meta["stack_trace"] = origin.meta["stack_trace"]
    node.meta["attnres"] = {"name": name, "role": role, "replaces": origin.name}


class _AttnResFactory:
    """Creates and registers BlockAttnRes modules with names that say where they sit."""

    def __init__(self, gm: fx.GraphModule, eps: float, preserve_scale: bool, protected: frozenset[int]):
        self.gm = gm
        self.protected = protected
        self.eps = eps
        self.preserve_scale = preserve_scale
        reference = next(gm.parameters(), None)
        self.factory_kwargs = {"device": reference.device if reference is not None else None,
                               "dtype": reference.dtype if reference is not None else None}
        if self.factory_kwargs["dtype"] is not None and not self.factory_kwargs["dtype"].is_floating_point:
            self.factory_kwargs["dtype"] = None
        self.class_as_string = _stack_uses_strings(gm)
        self.fallback_count = 0
        self._dims: dict[int, int] = {}          # id(stream) -> hidden size, inferred once per stream

    def module_class_entry(self, name: str):
        cls = BlockAttnRes
        return (name, f"{cls.__module__}.{cls.__qualname__}" if self.class_as_string else cls)

    def create(self, site: ResidualSite, branch: Branch, stream: ResidualStream) -> str:
        owner = site.owner
        if not owner or self._is_users_module(owner):
            self.fallback_count += 1
            return self._register(f"attnres_site_{self.fallback_count}", stream)
        return self._register(f"{owner}.{branch.kind}_res", stream)

    def create_final(self, stream: ResidualStream, owner: str) -> str:
        owner = owner if not self._is_users_module(owner) else ""
        return self._register(f"{owner}.final_res" if owner else "final_res", stream)

    def describe(self, name: str, record: RewrittenSite) -> None:
        self.gm.get_submodule(name).site = record

    def _is_users_module(self, path: str) -> bool:
        try:
            module = self.gm.get_submodule(path)
        except AttributeError:
            return False
        return id(module) in self.protected

    def _register(self, name: str, stream: ResidualStream) -> str:
        unique, suffix = name, 1
        while _exists(self.gm, unique):
            unique, suffix = f"{name}_{suffix}", suffix + 1
        if id(stream) not in self._dims:
            self._dims[id(stream)] = _infer_dim(self.gm, stream)
        dim = self._dims[id(stream)]
        module = BlockAttnRes(dim, self.eps, preserve_scale=self.preserve_scale, **self.factory_kwargs)
        module.training = self.gm.training
        self.gm.add_submodule(unique, module)
        return unique


def _exists(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_submodule(name)
    except AttributeError:
        return False
    return True


def _stack_uses_strings(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            value = next(iter(stack.values()))
            return isinstance(value[1], str) if len(value) > 1 else False
    return False


def _infer_dim(gm: fx.GraphModule, stream: ResidualStream) -> int:
    """Hidden size of the stream: from shape metadata if the frontend left it, else from weights."""
    for node in [stream.start, *(s.add for s in stream.sites)]:
        for key in ("val", "tensor_meta", "example_value"):
            meta = node.meta.get(key)
            shape = getattr(meta, "shape", None)
            if shape is not None and len(shape) and isinstance(shape[-1], int):
                return int(shape[-1])
    param_derived = gp.parameter_derived_nodes(gm.graph)
    candidates = [branch.output for site in stream.sites for branch in site.branches]
    for node in [*candidates, stream.start]:
        dim = _output_features(node, gm, param_derived)
        if dim:
            return dim
    raise TraceError("cannot tell the hidden size of the residual stream from the graph; "
                     "pass example_inputs so that shapes can be propagated")


def _output_features(node: fx.Node, gm, param_derived) -> int | None:
    """Walk back from a stream value to the Linear / embedding / conv that produced it; its width."""
    seen = set()
    while node is not None and node not in seen:
        seen.add(node)
        module = gp.submodule(gm, node)
        if isinstance(module, nn.Linear):
            return module.out_features
        if isinstance(module, nn.Embedding):
            return module.embedding_dim
        if gp.op_name(node) in {"linear", "addmm", "embedding"} and node.op == "call_function":
            weight = next((a for a in node.all_input_nodes if a.op == "get_attr"), None)
            if weight is not None:
                shape = _get_attr(gm, weight.target).shape
                return int(shape[-1] if gp.op_name(node) != "linear" else shape[0])
        inputs = [i for i in gp.data_inputs(node) if i not in param_derived]
        node = inputs[0] if inputs else None
    return None


def _get_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
