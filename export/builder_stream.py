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
at a block start), the aggregation read by the next sublayer (or by the final norm) over the completed
blocks and the partial, then that norm without the skip. Two forms (``rewrite(form=...)``):

- ``"per_site"`` (the default; any precision): the sources in one buffer ``[slots, batch, sequence,
  hidden]`` of a slot per source of the final aggregation (the embedding, then one per block), made once
  (``Pad`` of the embedding with zeros); each site adds its branch into its block's slot (one
  ``ScatterND`` with ``reduction="add"``: the slot holds the block's partial sum, with no ``Add`` of its
  own and no partial tensor beside the buffer; onnxruntime 1.32 copies the whole buffer there, a copy
  that is part of the peak),
  then the key RMSNorm over all slots, the logits of each token ``[batch, sequence, 1, slots]`` (a
  ``FusedMatMul`` of the pseudo-query with the keys, the slot axis read as each token's columns), the
  slots of blocks not begun masked out (an ``Add``), a ``Softmax`` over the last axis and the weighted sum
  as one product per token (``FusedMatMul`` of the weights with the buffer, then a ``Reshape`` to
  ``[batch, sequence, hidden]``): 7-8 nodes per site with the norm after it. The same nodes with a
  ``MatMul`` for the logits ``[slots, batch, sequence, 1]``, a ``Softmax`` over the first axis (which
  onnxruntime runs by transposing) and ``Mul`` and ``ReduceSum`` for the weighted sum decoded at 0.77 /
  0.83 (int4, batch 1 / 8) and 0.88 / 0.88 (fp32) of the builder's original where this takes 0.79 /
  0.90 and 0.91 / 0.95 (Llama hidden 256 x 8, a decoding step in one thread, docs/bench.md); the peak
  memory is the same, set by ``ScatterND``'s copy of the buffer (below). Measured against it (hidden 1024
  x 16, int4, batch 8, 128-token prompts, peak memory over the builder's original; hidden 256 x 8 for the
  nodes): a buffer that grows
  by a slot as each block begins, with no slot to mask (200 nodes against 209 for Llama), 1.13x where
  this takes 1.08x (its buffers of four sizes are not reused); writing the partial sum, kept beside the
  buffer, into the slot (``Add``, ``Unsqueeze``, ``ScatterND``: 237 nodes), 1.10x; stacking the sources
  afresh at each site (a ``Concat`` of the completed blocks and the partial), 1.13x. The 4 nodes per site
  that zeroed the weights below ``NEGLIGIBLE_WEIGHT`` cost 5-10% of the decoding speed at hidden 256
  (see the end of this docstring); an ``Einsum`` for the weighted sum decoded slower than ``Mul`` and
  ``ReduceSum``.
  Softmax and sums run in fp32; an fp16 graph casts each branch output up and each aggregate down. The
  sources are scored afresh at every site: at a decoding step's few sources the two-phase schedule's
  merge would add more nodes than it saves arithmetic.
- ``"attention"`` (fp32 activations: fp32 and int4 graphs): the aggregation is one default-domain
  ``Attention`` (opset 23) per site, each token a batch row of one head: its query the site's
  pseudo-query (times the key norm's gain), its new key and value the partial sum's RMSNorm and the
  partial sum, its past keys and values the completed blocks' (a completed block's key normalised once
  and shared, as in the two-phase schedule). Each attention's past is the one before's ``present`` (its
  past with its partial appended), the block's earlier partials masked out, and a block starts from the
  completed blocks gathered out of the last ``present`` of the block before: every ``present`` is read,
  so onnxruntime frees it (one it never reads it holds through the step). Adding the branch to the partial and
  normalising it is one ``SkipSimplifiedLayerNormalization``. The op needs ``[tokens, 1, hidden]`` rows:
  a sublayer of row-by-row ops (an MLP) runs on them as they are, others (attention) read the norm
  reshaped back to ``[batch, sequence, hidden]`` and give their branch reshaped to rows. 4-5 nodes per
  site, and onnxruntime 1.32's CPU decodes faster with it (six families of hidden 256, 8 layers, int4,
  batch 1 / 8: 0.86-0.91 / 0.83-0.94 of the builder's original tokens/s, the per-site form 0.73-0.80 /
  0.76-0.83, one thread in its CPU time: docs/bench.md), but takes more memory through a prompt: batch
  8 after 128-token prompts at hidden 1024 x 16 layers, int4, 1.47x the builder's original's peak over
  the process (1.17x after 32-token prompts), the per-site form 1.08x (1.04x).

Neither form zeroes the softmax weights below ``NEGLIGIBLE_WEIGHT`` (2^-32) of the largest, which the other
implementations do (Note [negligible weights] in :mod:`attnres_fx.op.aggregation`): their terms are below
fp32's round-off of the sum, and inference has no backward they slow.

Both compute Block AttnRes to fp32 round-off (tests/export/test_genai_builder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attnres_fx.errors import StreamMismatchError
from attnres_fx.passes.plan import Plan, Site

SKIP_NORMS = {"SkipSimplifiedLayerNormalization": "SimplifiedLayerNormalization",
              "SkipLayerNormalization": "LayerNormalization"}
NORMS = {"SimplifiedLayerNormalization", "LayerNormalization"}
MATMULS = {"MatMul", "MatMulNBits", "Gemm"}
ATTENTIONS = {"GroupQueryAttention", "Attention", "MultiHeadAttention", "PagedAttention"}
SKIP_STREAM_OUTPUT = 3      # Skip*LayerNormalization's input + skip (+ bias) output
# The default domain's Attention (softmax(q k^T * scale) v over a past and new keys) arrived in opset 23, with IR 11.
ATTENTION_OPSET = 23
ATTENTION_IR_VERSION = 11
# Ops that compute each row (the last axis) from the same row of their inputs: a sublayer made of them runs
# on the aggregate's [tokens, 1, hidden] layout as on [batch, sequence, hidden].
ROW_OPS = MATMULS - {"Gemm"} | NORMS | set(SKIP_NORMS) | {
    "Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "Gelu", "FastGelu", "QuickGelu", "BiasGelu", "Erf",
    "Softplus", "Neg", "Cast", "Identity", "Pow", "Sqrt", "Clip"}


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
    final = sites[-1]
    if not consumers.get(final.norm_out):
        head = next((node for node in graph.node if graph.output and graph.output[0].name in node.output), None)
        reads = f"node {head.name} computes {graph.output[0].name} from {head.input[0]}" if head is not None else \
            "nothing reads it"
        raise StreamMismatchError(
            f"the final norm {final.node} feeds no head ({reads}): the graph's head does not read its residual "
            "stream. onnxruntime-genai 0.18's builder takes the first linear layer with vocab_size outputs for "
            "the head, so a model whose intermediate_size equals its vocab_size gets a head on its first MLP")
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


FORMS = ("attention", "per_site")


def rewrite(model: onnx.ModelProto, plan: Plan, aggregations: list[Aggregation], *,
            form: str = "per_site") -> tuple[onnx.ModelProto, int]:
    """``model`` (the builder's graph, external data not loaded) with Block AttnRes in place of its residual
    adds, and the number of sites rewritten; ``aggregations`` in plan order (``plan.sites``). ``form``:
    ``"per_site"`` (any precision) or ``"attention"`` (fp32 activations; see the module's docstring).
    Everything is checked before the graph is changed."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    graph = model.graph
    stream = find_stream(graph)
    check_against_plan(stream, plan)
    block_size = plan.streams[0].block_size
    for position, found in enumerate(stream.sites):
        site = aggregations[position + 1].site
        if _sources(position + 1, block_size) != site.num_sources:
            raise StreamMismatchError(f"{site.name} attends over {site.num_sources} sources in the plan, over "
                                      f"{_sources(position + 1, block_size)} at node {found.node} with block size "
                                      f"{block_size}")
    stream_type = _stream_type(graph, stream)
    if form == "attention":
        if stream_type != TensorProto.FLOAT:
            raise ValueError("form='attention' rewrites graphs of fp32 activations (fp32 and int4 weights); "
                             f"this one's stream is {TensorProto.DataType.Name(stream_type)}: use form='per_site'")
        if len({a.eps for a in aggregations}) != 1:
            raise ValueError("form='attention' normalises each source's key once, so every aggregation must have "
                             f"the same key-norm eps, not {sorted({a.eps for a in aggregations})}: use "
                             "form='per_site'")
        replacements, initializers = _depth_attention(graph, stream, block_size, aggregations)
        _require_opset(model, ATTENTION_OPSET)
    else:
        replacements, initializers = _per_site(graph, stream, block_size, aggregations, _Builder(stream_type))
    nodes = []
    for node in graph.node:
        nodes.extend(replacements.get(node.name, [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(initializers)
    return model, len(stream.sites)


def _depth_attention(graph: onnx.GraphProto, stream: GraphStream, block_size: int,
                     aggregations: list[Aggregation]) -> tuple[dict, list]:
    """The replacements of the attention form (see the module's docstring), keyed by site node name, and
    the new initializers."""
    by_name = {node.name: node for node in graph.node}
    producers = {out: node for node in graph.node for out in node.output if out}
    rows = _row_sublayers(graph, stream, producers, _consumers(graph))
    builder = _Builder(TensorProto.FLOAT)
    eps = aggregations[0].eps
    hidden = aggregations[0].query.size
    # Each pseudo-query carries its key norm's gain: w . (g * k) = (w * g) . k, so a source's normalised key
    # serves every later aggregation.
    queries = np.stack([(a.query.reshape(-1) * a.key_norm).astype(np.float32) for a in aggregations[1:]])
    builder.begin("/attnres")
    unit = builder.constant(np.ones(hidden, np.float32), "unit_gain")
    row_shape = builder.shape([-1, 1, hidden], "row_shape")
    # The embedding is the first completed block: the attention's past, [tokens, 1 head, 1 source, hidden].
    past_values = builder.node("Reshape", [stream.start, builder.shape([-1, 1, 1, hidden], "past_shape")],
                               "embedding_past")
    past_keys = builder.node("SimplifiedLayerNormalization", [past_values, unit], "embedding_key", axis=-1,
                             epsilon=eps)
    query_shape = builder.node("Shape", [past_values], "tokens_shape", end=3)
    stream_shape = builder.node("Shape", [stream.start], "stream_shape")
    replacements = {stream.sites[0].node: builder.end()}
    partial = None
    blocks = 1
    for position, found in enumerate(stream.sites):
        aggregation = aggregations[position + 1]
        builder.begin(f"/attnres/{aggregation.site.name}")
        branch = found.branch if position > 0 and rows[position - 1] else \
            builder.node("Reshape", [found.branch, row_shape], "branch_rows")
        in_block = position % block_size
        if in_block == 0:
            if partial is not None:
                # The completed blocks and the block just completed (the last partial): the stale
                # partials before it dropped.
                kept = builder.shape([*range(blocks), blocks + block_size - 1], "completed")
                past_keys = builder.node("Gather", [past_keys, kept], "completed_keys", axis=2)
                past_values = builder.node("Gather", [past_values, kept], "completed_values", axis=2)
                blocks += 1
            partial = branch
            key = builder.node("SimplifiedLayerNormalization", [partial, unit], "partial_key", axis=-1, epsilon=eps)
        else:
            # The partial sum and its key in one node: the input + skip sum is its fourth output.
            key, _, _, partial = builder.node_outputs("SkipSimplifiedLayerNormalization", [partial, branch, unit],
                                                      "partial_key", 4, unused=(1, 2), domain="com.microsoft",
                                                      epsilon=eps)
        # The past holds this block's earlier partials after the completed blocks: masked out.
        mask = np.zeros((1, blocks + in_block + 1), np.float32)
        mask[0, blocks:blocks + in_block] = np.finfo(np.float32).min
        query = builder.node("Expand", [builder.constant(queries[position][None, None], "query"), query_shape],
                             "query_rows")
        total, past_keys, past_values = builder.node_outputs(
            "Attention", [query, key, partial, builder.constant(mask, "stale_partials") if in_block else "",
                          past_keys, past_values], "aggregate", 3, scale=1.0, q_num_heads=1, kv_num_heads=1)
        if aggregation.preserve_scale:
            count = builder.constant(np.array(aggregation.site.num_sources, np.float32), "count")
            total = builder.node("Mul", [total, count], "scaled")
        node = by_name[found.node]
        if node.op_type == "Add":
            # The norm after the add (and nothing else the rewrite keeps) reads its output: now the aggregate.
            builder.node("Reshape", [total, stream_shape], "aggregate_stream", output=node.output[0])
            nodes = builder.end()
        elif position < len(rows) and rows[position]:
            nodes = builder.end() + [_norm_without_skip(node, total, found.norm_out)]
        else:
            normed = f"/attnres/{aggregation.site.name}/normed_rows"
            nodes = builder.end() + [_norm_without_skip(node, total, normed)]
            builder.begin(f"/attnres/{aggregation.site.name}")
            builder.node("Reshape", [normed, stream_shape], "normed", output=found.norm_out)
            nodes += builder.end()
        replacements[found.node] = replacements.get(found.node, []) + nodes
    _forget_shapes(graph, {out for position, found in enumerate(stream.sites[:-1]) if rows[position]
                           for node in _sublayer(stream, position, producers)
                           for out in [*node.output, found.norm_out]})
    return replacements, builder.initializers


def _row_sublayers(graph: onnx.GraphProto, stream: GraphStream, producers: dict, consumers: dict) -> list[bool]:
    """Per site but the last: whether the sublayer reading its norm (the next site's branch) computes row by
    row, so that it runs unchanged on the aggregate's ``[tokens, 1, hidden]`` layout and gives its
    branch in it (no reshape on either side): only ops of ``ROW_OPS``, norms over the last axis, every
    input the norm's output, another node of the sublayer or an initializer (a weight), nothing of it read
    elsewhere."""
    initializers = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    found = []
    for position, site in enumerate(stream.sites[:-1]):
        nodes = _sublayer(stream, position, producers)
        names = {node.name for node in nodes}
        inside = {out for node in nodes for out in node.output if out}
        following = stream.sites[position + 1]

        def kept_inside(node: onnx.NodeProto) -> bool:
            return node.op_type == "Constant" or all(
                reader.name in names or (out == following.branch and reader.name == following.node)
                for out in node.output if out for reader in consumers.get(out, []))

        found.append(site.op != "Add" and bool(nodes) and not inside & outputs and all(
            _row_op(node, inside | {site.norm_out}, initializers) and kept_inside(node) for node in nodes))
    return found


def _sublayer(stream: GraphStream, position: int, producers: dict) -> list[onnx.NodeProto]:
    """The nodes of the sublayer between site ``position``'s norm and the next site's branch."""
    following = stream.sites[position + 1]
    return _upstream(following.branch, following.stream, producers)[0]


def _row_op(node: onnx.NodeProto, inside: set[str], initializers: dict) -> bool:
    if node.op_type == "Constant":
        return all(len(a.t.dims) <= 1 for a in node.attribute if a.name == "value")
    if node.op_type not in ROW_OPS:
        return False
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), -1)
    if node.op_type in NORMS | set(SKIP_NORMS) and axis != -1:
        return False
    for index, name in enumerate(node.input):
        if not name or name in inside:
            continue
        weight = initializers.get(name)
        # A matmul's weights are any initializer; an elementwise operand broadcasts over rows only when it
        # has at most one axis.
        if weight is None or (index == 0 or node.op_type not in MATMULS) and len(weight.dims) > 1:
            return False
    return True


def _forget_shapes(graph: onnx.GraphProto, names: set[str]) -> None:
    """Drop the declared shapes of ``names`` (now of another rank)."""
    kept = [info for info in graph.value_info if info.name not in names]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def _require_opset(model: onnx.ModelProto, version: int) -> None:
    """Import the default domain at ``version`` at least (the ops the builder writes keep their meaning
    from opset 22 to 23; 23 adds ``Attention``), with the IR version that opset needs."""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, version)
    model.ir_version = max(model.ir_version, ATTENTION_IR_VERSION)


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def _per_site(graph: onnx.GraphProto, stream: GraphStream, block_size: int, aggregations: list[Aggregation],
              builder: "_Builder") -> tuple[dict, list]:
    """The replacements of the per-site form (see the module's docstring) and the new initializers."""
    by_name = {node.name: node for node in graph.node}
    slots = _sources(len(stream.sites), block_size)
    builder.begin("/attnres")
    first = builder.shape([0], "slot_axis")
    embedding = builder.node("Unsqueeze", [builder.to_fp32(stream.start, "embedding"), first], "embedding_slot")
    # [slots, batch, sequence, hidden], the embedding in slot 0 and zeros after it: one size throughout
    # (a buffer grown by a slot per block took more memory through a prompt, its sizes not reused).
    sources = builder.node("Pad", [embedding, builder.shape([0, 0, 0, 0, slots - 1, 0, 0, 0], "empty_slots")],
                           "sources")
    to_stream = builder.shape([0, 0, -1], "stream_shape")
    replacements: dict[str, list[onnx.NodeProto]] = {}
    for position, found in enumerate(stream.sites):
        aggregation = aggregations[position + 1]
        site = aggregation.site
        builder.begin(f"/attnres/{site.name}")
        # The branch added into its block's slot, which so holds the block's partial sum (an index of one
        # axis addresses a whole [batch, sequence, hidden] slot: the branch is the update as it is).
        slot = position // block_size + 1
        sources = builder.node("ScatterND", [sources, builder.shape([slot], "slot"),
                                             builder.to_fp32(found.branch, "branch")], "sources", reduction="add")
        key_norm = builder.constant(aggregation.key_norm, "key_norm")
        keys = builder.node("SimplifiedLayerNormalization", [sources, key_norm], "keys", axis=-1,
                            epsilon=aggregation.eps)
        # [batch, sequence, 1, slots]: one product per token, the slots last for the softmax.
        logits = builder.node("FusedMatMul", [builder.constant(aggregation.query.reshape(1, 1, 1, -1), "query"), keys],
                              "logits", domain="com.microsoft", transB=1, transBatchB=1)
        if slot + 1 < slots:
            # The slots of blocks not begun yet (zeros) get no weight.
            mask = np.zeros(slots, np.float32)
            mask[slot + 1:] = np.finfo(np.float32).min
            logits = builder.node("Add", [logits, builder.constant(mask, "later_blocks")], "masked")
        weights = builder.node("Softmax", [logits], "softmax", axis=-1)
        # The weighted sum as one product per token, [batch, sequence, 1, hidden], the slot axis taken as
        # the rows of each token's matrix: no [slots, batch, sequence, hidden] product to sum.
        count = float(site.num_sources) if aggregation.preserve_scale else 1.0
        total = builder.node("FusedMatMul", [weights, sources], "aggregate_rows", domain="com.microsoft", alpha=count,
                             transBatchB=1)
        total = builder.node("Reshape", [total, to_stream], "aggregate")
        node = by_name[found.node]
        if node.op_type == "Add":
            # The norm after the add (and nothing else the rewrite keeps) reads its output: now the aggregate.
            builder.from_fp32(total, "aggregate_cast", output=node.output[0])
            replacements[found.node] = builder.end()
        else:
            total = builder.from_fp32(total, "aggregate_cast")
            replacements[found.node] = builder.end() + [_norm_without_skip(node, total, found.norm_out)]
    return replacements, builder.initializers


def _sources(site: int, block_size: int) -> int:
    """How many sources the aggregation read before sublayer ``site`` (the final one: site = M) has: the
    completed blocks, the embedding included, and the partial sum of the current one."""
    return -(-site // block_size) + 1


def _norm_without_skip(node: onnx.NodeProto, aggregate: str, output: str) -> onnx.NodeProto:
    """The norm the site's fused node applied, now to the aggregate, written to ``output``."""
    op = SKIP_NORMS[node.op_type]
    scale = list(node.input[2:4]) if op == "LayerNormalization" else [node.input[2]]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"}
    return helper.make_node(op, [aggregate, *scale], [output], name=f"{node.name}/without_skip", axis=-1,
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

    def __init__(self, stream_type: int):
        self.stream_type = stream_type
        self.initializers: list[onnx.TensorProto] = []
        self.prefix = ""
        self.pending: list[onnx.NodeProto] = []

    def begin(self, prefix: str) -> None:
        self.prefix = prefix

    def end(self) -> list[onnx.NodeProto]:
        nodes, self.pending = self.pending, []
        return nodes

    def node(self, op: str, inputs: list[str], name: str, output: str | None = None, **attributes) -> str:
        output = output or f"{self.prefix}/{name}"
        self.pending.append(helper.make_node(op, inputs, [output], name=f"{self.prefix}/{name}", **attributes))
        return output

    def node_outputs(self, op: str, inputs: list[str], name: str, count: int, unused: tuple[int, ...] = (),
                     **attributes) -> list[str]:
        """The ``count`` outputs of a new node, those at ``unused`` not computed (``""``)."""
        outputs = ["" if index in unused else f"{self.prefix}/{name}_{index}" for index in range(count)]
        self.pending.append(helper.make_node(op, inputs, outputs, name=f"{self.prefix}/{name}", **attributes))
        return outputs

    def shape(self, dims: list[int], name: str) -> str:
        tensor = numpy_helper.from_array(np.array(dims, np.int64), f"{self.prefix}/{name}")
        self.initializers.append(tensor)
        return tensor.name

    def constant(self, value: np.ndarray, name: str) -> str:
        tensor = numpy_helper.from_array(np.asarray(value, dtype=np.float32), f"{self.prefix}/{name}")
        self.initializers.append(tensor)
        return tensor.name

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
