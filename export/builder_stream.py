"""The ONNX pass on onnxruntime-genai's model-builder graph: its residual stream rewritten into Block AttnRes.

The builder (``onnxruntime_genai.models.builder``) writes the fastest graph onnxruntime has for a stock
architecture: packed QKV, ``GroupQueryAttention`` with the rotary inside and a preallocated cache,
``MatMulNBits`` for int4, and each residual add fused with the norm that follows it into one
``SkipSimplifiedLayerNormalization`` (``SkipLayerNormalization`` for LayerNorm models). Built from the
base weights of a converted model, that graph lacks only the AttnRes aggregations; this pass puts them in
and keeps everything else the builder's.

Finding the stream, by data flow only: it starts at the input of the first norm (the embedding); a
*site* is a node that adds to the stream value a *branch* (its other operand) computed from the stream
through a ``MatMul`` (or ``MatMulNBits``): the skip input of a ``Skip*LayerNormalization`` (the stream goes
on as its fourth output) or a plain ``Add`` (the stream goes on as its output, read by the next norm). A
branch that reaches an attention op (``GroupQueryAttention``, ``Attention``, ``MultiHeadAttention``) is
``attn``, any other ``mlp``. The last site has no stream output: its norm feeds the head.

The sites must be the converted model's plan (:func:`attnres_fx.plan_of`) exactly: one stream, sequential
sites (one branch each) of the same kinds in the same order, then the final aggregation. Any difference
raises :class:`attnres_fx.StreamMismatchError` naming the node, before anything is written.

The rewrite, per site ``j`` (branch output ``f_j``): the partial sum of the current block (``f_j`` itself
at a block start, the completed block joining the stacked ones), then the aggregation read by the next
sublayer (or by the final norm) over the completed blocks and the partial, then that norm without the
skip. The sources are kept stacked ``[batch, sequence, sources, hidden]`` (a block is stacked once, when
its last partial is): each aggregation is one ``Concat``, the key RMSNorm, a ``MatMul`` with the
pseudo-query, a ``Softmax`` over sources (weights below ``NEGLIGIBLE_WEIGHT`` of the largest zeroed, as
in every implementation: Note [negligible weights] in :mod:`attnres_fx.op.aggregation`) and the weighted sum (``Mul``, ``ReduceSum``). The sources are
scored afresh at every site rather than in the two-phase schedule: a decoding step's few sources cost
onnxruntime less in arithmetic than the extra nodes the schedule's merge would add (each node costs a
kernel launch). Softmax and sums run in fp32; an fp16 graph casts each branch output up and each
aggregate down.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attnres_fx.op.aggregation import NEGLIGIBLE_WEIGHT
from attnres_fx.errors import StreamMismatchError
from attnres_fx.passes.plan import Plan, Site

SKIP_NORMS = {"SkipSimplifiedLayerNormalization": "SimplifiedLayerNormalization",
              "SkipLayerNormalization": "LayerNormalization"}
NORMS = {"SimplifiedLayerNormalization", "LayerNormalization"}
MATMULS = {"MatMul", "MatMulNBits", "Gemm"}
ATTENTIONS = {"GroupQueryAttention", "Attention", "MultiHeadAttention", "PagedAttention"}
SKIP_STREAM_OUTPUT = 3      # Skip*LayerNormalization's input + skip (+ bias) output


@dataclass(frozen=True)
class GraphSite:
    """One residual add of the builder's graph: ``node`` (its name) adds ``branch`` to ``stream``; the
    sum goes on as ``stream_out`` (``""`` for the last site) and is normalised into ``norm_out``."""

    node: str
    op: str
    kind: str
    stream: str
    branch: str
    stream_out: str
    norm_out: str


@dataclass(frozen=True)
class GraphStream:
    """The residual stream of a builder graph: ``start`` (the embedding) and its sites in order."""

    start: str
    sites: tuple[GraphSite, ...]


def find_stream(graph: onnx.GraphProto) -> GraphStream:
    """The residual stream of ``graph`` by data flow (see the module's docstring); StreamMismatchError
    naming the node where it is not one."""
    producers = {out: node for node in graph.node for out in node.output if out}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    first_norm = next((node for node in graph.node if node.op_type in NORMS), None)
    if first_norm is None:
        raise StreamMismatchError("the graph has no SimplifiedLayerNormalization or LayerNormalization reading the "
                                  "embedding: it is not a pre-norm decoder written by onnxruntime-genai's builder")
    stream = start = first_norm.input[0]
    sites: list[GraphSite] = []
    while True:
        site = _site_reading(stream, consumers.get(stream, []), producers, consumers)
        if site is None:
            break
        sites.append(site)
        if not site.stream_out:
            break
        stream = site.stream_out
    if not sites or sites[-1].stream_out:
        where = f"after node {sites[-1].node}" if sites else f"at {start}"
        raise StreamMismatchError(f"the residual stream {where} reaches no final norm through a residual add: the "
                                  "graph is not a pre-norm decoder this pass can rewrite")
    return GraphStream(start, tuple(sites))


def _site_reading(stream: str, readers: list[onnx.NodeProto], producers: dict, consumers: dict) -> GraphSite | None:
    found = []
    for node in readers:
        if node.op_type in SKIP_NORMS and stream in node.input[:2]:
            branch = node.input[1] if node.input[0] == stream else node.input[0]
            stream_out = node.output[SKIP_STREAM_OUTPUT] if len(node.output) > SKIP_STREAM_OUTPUT else ""
            norm_out = node.output[0]
        elif node.op_type == "Add" and stream in node.input:
            branch = node.input[1] if node.input[0] == stream else node.input[0]
            stream_out = node.output[0]
            norm_out = ""
        else:
            continue
        if not _through_matmul(branch, stream, producers):
            continue
        if node.op_type == "Add":
            norms = [n for n in consumers.get(stream_out, []) if n.op_type in NORMS]
            if len(norms) != 1:
                raise StreamMismatchError(f"the residual add {node.name} is read by {len(norms)} norms, not the one "
                                          "norm of the next sublayer: the pass cannot tell where the stream goes")
            norm_out = norms[0].output[0]
            # The stream goes on unless only the final norm reads it.
            if len(consumers.get(stream_out, [])) == 1:
                stream_out = ""
        kind = "attn" if _reaches(branch, stream, producers, ATTENTIONS) else "mlp"
        found.append(GraphSite(node.name, node.op_type, kind, stream, branch, stream_out, norm_out))
    if len(found) > 1:
        raise StreamMismatchError(f"the stream value {stream} is added to by {', '.join(s.node for s in found)}: a "
                                  "parallel residual, which the pass does not rewrite")
    return found[0] if found else None


def _upstream(value: str, stream: str, producers: dict):
    """The nodes ``value`` is computed from, back to (not beyond) ``stream``, and whether it reached it:
    the stream value itself, or the fused node that writes it (a Skip*LayerNormalization's normalised
    output is what the next sublayer reads)."""
    seen, stack, nodes, reached = set(), [value], [], False
    writer = producers.get(stream)
    while stack:
        name = stack.pop()
        node = producers.get(name)
        if name == stream or (writer is not None and node is writer):
            reached = True
            continue
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        nodes.append(node)
        stack.extend(i for i in node.input if i)
    return nodes, reached


def _through_matmul(branch: str, stream: str, producers: dict) -> bool:
    nodes, reached = _upstream(branch, stream, producers)
    return reached and any(node.op_type in MATMULS for node in nodes)


def _reaches(branch: str, stream: str, producers: dict, ops: set[str]) -> bool:
    return any(node.op_type in ops for node in _upstream(branch, stream, producers)[0])


def check_against_plan(stream: GraphStream, plan: Plan) -> None:
    """Refuse (StreamMismatchError, naming the node) a graph stream that is not ``plan``'s."""
    if len(plan.streams) != 1:
        raise StreamMismatchError(f"the converted model has {len(plan.streams)} residual streams; the builder's "
                                  "decoder graph has one")
    planned = plan.streams[0]
    residual = [s for s in planned.sites if s.kind != "final"]
    parallel = [s.name for s in residual if s.branch not in (None, 0)]
    if parallel:
        raise StreamMismatchError(f"the plan has parallel branches ({parallel[0]}); the builder's graph found "
                                  "sequential sites")
    if len(residual) != len(stream.sites):
        extra = stream.sites[len(residual)].node if len(stream.sites) > len(residual) else stream.sites[-1].node
        raise StreamMismatchError(f"the builder's graph has {len(stream.sites)} residual sites and the converted "
                                  f"model's plan {len(residual)} (the difference shows at node {extra}): the graph "
                                  "is not of the converted model's architecture")
    for planned_site, found in zip(residual, stream.sites):
        if planned_site.kind != found.kind:
            raise StreamMismatchError(f"node {found.node} adds an {found.kind} branch to the stream where the plan "
                                      f"has {planned_site.name} ({planned_site.kind}): the graph's sublayers are not "
                                      "the converted model's")


@dataclass(frozen=True)
class Aggregation:
    """What an aggregation reads from the converted model: its pseudo-query ``[1, D]``, key norm ``[D]``."""

    site: Site
    query: np.ndarray
    key_norm: np.ndarray
    eps: float
    preserve_scale: bool


def rewrite(model: onnx.ModelProto, plan: Plan, aggregations: list[Aggregation]) -> tuple[onnx.ModelProto, int]:
    """``model`` (the builder's graph, external data not loaded) with Block AttnRes in place of its residual
    adds, and the number of sites rewritten; ``aggregations`` in plan order (``plan.sites``)."""
    graph = model.graph
    stream = find_stream(graph)
    check_against_plan(stream, plan)
    block_size = plan.streams[0].block_size
    by_name = {node.name: node for node in graph.node}
    stream_type = _stream_type(graph, stream)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    builder = _Builder(stream_type, opset)
    builder.begin("/attnres")
    partial = builder.to_fp32(stream.start, "embedding")
    committed = stacked = None
    replacements: dict[str, list[onnx.NodeProto]] = {}
    for position, found in enumerate(stream.sites):
        aggregation = aggregations[position + 1]
        site = aggregation.site
        builder.begin(f"/attnres/{site.name}")
        branch = builder.to_fp32(found.branch, "branch")
        if position % block_size == 0:
            committed = stacked if stacked is not None else builder.node("Unsqueeze", [partial, builder.axes()],
                                                                         "embedding_stacked")
            partial = branch
        else:
            partial = builder.node("Add", [partial, branch], "partial")
        partial_stacked = builder.node("Unsqueeze", [partial, builder.axes()], "partial_stacked")
        stacked = builder.node("Concat", [committed, partial_stacked], "sources", axis=2)
        sources = _sources(position + 1, block_size)
        if sources != site.num_sources:
            raise StreamMismatchError(f"{site.name} attends over {site.num_sources} sources in the plan, over "
                                      f"{sources} at node {found.node} with block size {block_size}")
        keys = builder.node("SimplifiedLayerNormalization", [stacked, builder.constant(aggregation.key_norm, "key_norm")],
                            "keys", axis=-1, epsilon=aggregation.eps)
        logits = builder.node("MatMul", [keys, builder.constant(aggregation.query.reshape(-1, 1), "query")], "logits")
        weights = builder.negligible_to_zero(builder.node("Softmax", [logits], "softmax", axis=2))
        weighted = builder.node("Mul", [stacked, weights], "weighted")
        total = builder.node("ReduceSum", [weighted, builder.axes()], "aggregate", keepdims=0)
        if aggregation.preserve_scale:
            total = builder.node("Mul", [total, builder.constant(np.array(sources, np.float32), "count")], "scaled")
        node = by_name[found.node]
        if node.op_type == "Add":
            # The norm after the add (and nothing else the rewrite keeps) reads its output: now the aggregate.
            builder.from_fp32(total, "aggregate_cast", output=node.output[0])
            replacements[found.node] = builder.end()
        else:
            total = builder.from_fp32(total, "aggregate_cast")
            replacements[found.node] = builder.end() + [_norm_without_skip(node, total, found)]
    nodes = []
    for node in graph.node:
        nodes.extend(replacements.get(node.name, [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(builder.initializers)
    return model, len(stream.sites)


def _sources(site: int, block_size: int) -> int:
    """How many sources the aggregation read before sublayer ``site`` (the final one: site = M) has: the
    completed blocks, the embedding included, and the partial sum of the current one."""
    return -(-site // block_size) + 1


def _norm_without_skip(node: onnx.NodeProto, aggregate: str, found: GraphSite) -> onnx.NodeProto:
    """The norm the site's fused node applied, now to the aggregate."""
    op = SKIP_NORMS[node.op_type]
    scale = list(node.input[2:4]) if op == "LayerNormalization" else [node.input[2]]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"}
    return helper.make_node(op, [aggregate, *scale], [found.norm_out], name=f"{node.name}/without_skip", axis=-1,
                            **attributes)


def _stream_type(graph: onnx.GraphProto, stream: GraphStream) -> int:
    """The element type of the stream: the embedding table's (a Gather of an initializer)."""
    producer = next((n for n in graph.node if stream.start in n.output), None)
    tables = {i.name: i.data_type for i in graph.initializer}
    while producer is not None:
        typed = [tables[name] for name in producer.input if name in tables]
        if typed:
            return typed[0]
        producer = next((n for n in graph.node if producer.input and producer.input[0] in n.output), None)
    return TensorProto.FLOAT


class _Builder:
    """New nodes and initializers, named under a prefix."""

    def __init__(self, stream_type: int, opset: int):
        self.stream_type = stream_type
        self.opset = opset
        self.initializers: list[onnx.TensorProto] = []
        self.prefix = ""
        self.pending: list[onnx.NodeProto] = []
        self._axes = None

    def begin(self, prefix: str) -> None:
        self.prefix = prefix

    def end(self) -> list[onnx.NodeProto]:
        nodes, self.pending = self.pending, []
        return nodes

    def node(self, op: str, inputs: list[str], name: str, output: str | None = None, **attributes) -> str:
        output = output or f"{self.prefix}/{name}"
        self.pending.append(helper.make_node(op, inputs, [output], name=f"{self.prefix}/{name}", **attributes))
        return output

    def constant(self, value: np.ndarray, name: str) -> str:
        tensor = numpy_helper.from_array(np.asarray(value, dtype=np.float32), f"{self.prefix}/{name}")
        self.initializers.append(tensor)
        return tensor.name

    def axes(self) -> str:
        if self._axes is None:
            self._axes = "/attnres/source_axis"
            self.initializers.append(numpy_helper.from_array(np.array([2], np.int64), self._axes))
        return self._axes

    def negligible_to_zero(self, weights: str) -> str:
        """``weights`` (a softmax over the source axis) with those below ``NEGLIGIBLE_WEIGHT`` of their largest
        exactly zero: ``exp(z - max)`` below it, as the other implementations flush."""
        if self.opset >= 18:
            top = self.node("ReduceMax", [weights, self.axes()], "top_weight", keepdims=1)
        else:
            top = self.node("ReduceMax", [weights], "top_weight", axes=[2], keepdims=1)
        threshold = self.node("Mul", [top, self.constant(np.array(NEGLIGIBLE_WEIGHT), "negligible_weight")],
                              "negligible_threshold")
        negligible = self.node("Less", [weights, threshold], "negligible")
        return self.node("Where", [negligible, self.constant(np.array(0.0), "zero"), weights], "weights")

    def to_fp32(self, value: str, name: str) -> str:
        if self.stream_type == TensorProto.FLOAT:
            return value
        return self.node("Cast", [value], name + "_fp32", to=TensorProto.FLOAT)

    def from_fp32(self, value: str, name: str, output: str | None = None) -> str:
        if self.stream_type != TensorProto.FLOAT:
            return self.node("Cast", [value], name, output=output, to=self.stream_type)
        if output is not None:
            return self.node("Identity", [value], name, output=output)
        return value
