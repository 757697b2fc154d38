"""Plan: decide block sizes and names for the streams detection found; the rewrite only reads the plan.

Contract
    requires  a :class:`~attnres_fx.passes.detect.Detection` with at least one stream, and the module
              tree the aggregations will be registered in (to place and name them).
    returns   a frozen :class:`Plan`: per stream its block size, hidden size, the signature that
              identifies it in any later capture of the same model, and one :class:`Site` per injected
              aggregation (every branch of every residual site, then the stream's final aggregation),
              with its module name, block and number of sources.

Block sizes: ``block_size`` (sites per block) if given, else ``ceil(M / num_blocks)`` for the ``M``
residual sites of each stream, ``num_blocks`` defaulting to 8 (the paper's N). Both may be given only
when they agree for every stream.

Names say where an aggregation sits: ``<owner>.<kind>_res`` on the module whose forward performs the
residual add (``model.layers.3.attn_res``, ``model.layers.3.mlp_res``), ``<stream owner>.final_res``
for a stream's final aggregation (``model.final_res``, ``encoder.final_res``). Containers
(``ModuleList``, ``Sequential``, ``ModuleDict``) iterate over their children, so nothing is registered
in one: the aggregation goes on the nearest other ancestor, its name carrying the rest of the path
(``encoder_final_res`` on the root when ``encoder`` is a ``ModuleList``). A name already taken gets a
suffix (``attn_res_1``).

Worked example: 2 layers of attention + MLP (4 sites), ``block_size=2``::

    site 0  layers.0.attn_res  block 1  sources 1   (b_0)
    site 1  layers.0.mlp_res   block 1  sources 2   (b_0, partial)
    site 2  layers.1.attn_res  block 2  sources 2   (b_0, b_1)
    site 3  layers.1.mlp_res   block 2  sources 3   (b_0, b_1, partial)
    site 4  final_res          -        sources 3
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from attnres_fx.errors import StreamMismatchError, UnsupportedArchitectureError
from attnres_fx.text import format_table

from . import node_kinds as nk
from .detect import Detection, ResidualStream, require_dim
from .layers import CONTAINERS, LayerSpan, Refusal, layer_spans
from . import provenance
from .provenance import owner_path

DEFAULT_NUM_BLOCKS = 8

# What identifies a stream across captures of one model: per residual site, the module performing it and
# its number of branches. Branch kinds are labels for names and reports only: a capture with other shapes
# or another mode may tell a kind differently, and must still match.
StreamSignature = tuple[tuple[str, int], ...]
ROUTES = ("auto", "layer", "model")


@dataclass(frozen=True)
class Site:
    """One injected aggregation, a ``BlockAttnRes``.

    ``index``: execution order over the whole model (a stream's final aggregation comes after its
    sites). ``name``: dotted path of the ``BlockAttnRes`` module. ``kind``: ``"attn"``, ``"mixer"`` (token
    mixing other than attention: a scan, linear attention), ``"mlp"``, ``"branch"`` (none could be told)
    or ``"final"``. ``block``: the block the site's own output goes into (block 0 is the embedding
    ``b_0``; ``None`` for ``"final"``). ``stream``: which residual stream (encoder-decoder models have
    two). ``layer``: the module that performs the residual add (the
    stream's owner for ``"final"``). ``num_sources``: how many sources it attends over. ``normalised``:
    whether the branch reads the stream through a norm (``None`` for ``"final"``). ``position``: the
    residual site of the stream it belongs to (``None`` for ``"final"``); ``branch``: which branch of a
    parallel site.
    """

    index: int
    name: str
    kind: str
    block: int | None
    stream: int
    layer: str
    num_sources: int
    normalised: bool | None
    position: int | None = None
    branch: int | None = None

    def __str__(self) -> str:
        block = "-" if self.block is None else str(self.block)
        return (f"Site({self.index}: {self.name}, kind={self.kind}, block={block}, "
                f"stream={self.stream}, sources={self.num_sources})")


@dataclass(frozen=True)
class StreamPlan:
    """The plan of one stream: ``sites`` are its aggregations in execution order, the final one last.

    ``route``: ``"layer"`` (every module of ``layers`` runs its own rewritten graph, the block sums
    passed along with the stream; the stream owner's code runs as written) or ``"model"`` (the stream
    is rewritten whole, in the graph of one call of the model).
    """

    index: int
    owner: str
    block_size: int
    dim: int
    signature: StreamSignature
    sites: tuple[Site, ...]
    route: str = "model"
    layers: tuple[LayerSpan, ...] = ()

    @property
    def final(self) -> Site:
        return self.sites[-1]

    @property
    def num_positions(self) -> int:
        """The number of residual sites of the stream."""
        return len(self.signature)

    def branch_sites(self, position: int) -> tuple[Site, ...]:
        """The aggregations of residual site ``position``, one per branch."""
        return tuple(s for s in self.sites if s.position == position)

    def completed_before(self, position: int) -> int:
        """Blocks committed before residual site ``position`` reads its sources (``b_0`` included)."""
        return -(-position // self.block_size)

    def layer(self, owner: str) -> LayerSpan:
        return next(span for span in self.layers if span.owner == owner)


@dataclass(frozen=True)
class Plan:
    streams: tuple[StreamPlan, ...]
    preserve_scale: bool
    eps: float

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(sorted((s for stream in self.streams for s in stream.sites), key=lambda s: s.index))

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(stream.block_size for stream in self.streams)

    @property
    def routes(self) -> tuple[str, ...]:
        return tuple(stream.route for stream in self.streams)

    def table(self, indent: str = "") -> str:
        route = {s.index: stream.route for stream in self.streams for s in stream.sites}
        rows = [(str(s.index), s.name, s.layer or "<root>", s.kind, "-" if s.block is None else str(s.block),
                 str(s.num_sources), "-" if s.normalised is None else ("yes" if s.normalised else "NO (raw)"),
                 route[s.index]) for s in self.sites]
        return format_table(("site", "name", "layer", "kind", "block", "sources", "normalised", "route"), rows,
                            indent)


def signature(stream: ResidualStream, prefix: str = "", within: str = "") -> StreamSignature:
    """What identifies a stream across captures of one model (see :data:`StreamSignature`), layers as
    paths from the converted model's root. ``prefix``: the captured module's path in that model (a
    routed submodule); ``within``: the converted model's path in the captured module (a wrapper around
    it)."""
    return tuple((_relocate(site.owner, prefix, within), len(site.branches)) for site in stream.sites)


def _relocate(path: str, prefix: str, within: str) -> str:
    if within:
        path = path[len(within) + 1:] if path.startswith(within + ".") else ("" if path == within else path)
    return _join(prefix, path)


@dataclass(frozen=True)
class MatchedStream:
    """A stream detected in some capture, and where its sites are in the planned stream: ``positions[k]``
    is the planned residual site that detected site ``k`` is. A call may leave out planned sites (an
    optional sublayer it does not run); those are skipped, block boundaries included."""

    planned: StreamPlan
    positions: tuple[int, ...]
    stream: ResidualStream | None = None        # the detected stream


def match_streams(detection: Detection, plan: Plan, *, prefix: str = "", within: str = "",
                  where: str = "the model") -> tuple[MatchedStream, ...]:
    """The planned stream of each stream detected in another capture of the same model (a decode step, a
    train-mode call, the encoder called alone), and the planned position of each of its sites. A stream
    computed by modules apart from every planned site (a part of the model the conversion's call did not
    run) is left out: it stays plain, as it does on the layer route.

    Raises :class:`~attnres_fx.StreamMismatchError`, naming the difference, when a detected stream is
    not one of the plan's (a site it does not know, sites in another order, a stream that ends before its
    planned last site), or when the capture holds no stream at all: rewriting part of a stream, or running
    the original computation, would be silently wrong. ``prefix`` and ``within``: see :func:`signature`.
    """
    matched = []
    planned_layers = {site.layer for site in plan.sites}
    for stream in detection.streams:
        found = signature(stream, prefix, within)
        kinds = _kinds(stream)
        match = next((m for m in (_subsequence(found, kinds, p) for p in plan.streams) if m is not None), None)
        if match is None and _apart(found, planned_layers):
            # In modules the conversion's call did not run (attnresify warned): plain, as on the eager route.
            continue
        if match is None:
            edit = _edited_in_place(stream)
            if edit is not None:
                raise nk.in_place_edit_error(edit)
            raise StreamMismatchError(_mismatch(found, plan, where))
        matched.append(dataclasses.replace(match, stream=stream))
    if not matched:
        rejected = "\n".join(f"  - {r}" for r in detection.rejected[:12]) or "  (the graph has no tensor adds)"
        raise StreamMismatchError(
            f"the graph captured for this call of {where} has no residual stream, but the model was converted "
            f"with {len(plan.streams)} stream(s) ({', '.join(_describe(s.signature) for s in plan.streams)}). "
            f"Adds seen and why each was rejected:\n{rejected}")
    return tuple(matched)


def _apart(found: StreamSignature, planned_layers: set[str]) -> bool:
    """Whether the detected stream ``found`` is computed by modules that hold no planned site and lie in
    none that does."""
    return all(owner and not any(provenance.within(owner, layer) or provenance.within(layer, owner)
                                 for layer in planned_layers) for owner, _ in found)


def match_in_order(detection: Detection, plan: Plan, *, where: str) -> tuple[MatchedStream, ...]:
    """The planned stream of the one stream detected in a capture of another implementation of the converted
    model (an inference engine's own classes), matched site by site in order: the engine's modules are not
    the converted model's (vLLM's Llama performs a sublayer's residual add in the next layer's input norm,
    ``model.layers.4.input_layernorm``, not in ``model.layers.3``), so its sites are told by their order,
    their number of branches and their kinds. :class:`~attnres_fx.StreamMismatchError` names the
    difference otherwise."""
    if len(plan.streams) != 1 or len(detection.streams) != 1:
        raise StreamMismatchError(
            f"{where}: the graph holds {len(detection.streams)} residual stream(s), the model was converted with "
            f"{len(plan.streams)}; another implementation's graph is matched to the plan when both have one")
    (planned,), (stream,) = plan.streams, detection.streams
    found = [tuple(branch.kind for branch in site.branches) for site in stream.sites]
    expected = _planned_kinds(planned)
    if found != expected:
        differs = next((k for k, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected)))
        now = found[differs] if differs < len(found) else "no site"
        planned_there = (f"{expected[differs]} at {_listed(planned, [differs])}" if differs < len(expected)
                         else "no site")
        raise StreamMismatchError(
            f"{where}: the residual stream of the graph differs from the one the model was converted with: "
            f"{len(found)} sites, planned {len(expected)}; first difference at site {differs} (found {now}, "
            f"planned {planned_there})")
    return (MatchedStream(planned, tuple(range(len(found))), stream),)


def match_layer(detection: Detection, planned: StreamPlan, span: LayerSpan, *, where: str) -> tuple:
    """The stream of a layer-routed module's own graph (its sites are those of ``span``) and the planned
    position of each of its sites; :class:`~attnres_fx.StreamMismatchError` naming the difference
    otherwise. Returns ``(stream, positions)``."""
    expected = planned.signature[span.start:span.stop]
    for stream in detection.streams:
        # The module performing each add, as a path in the model (an add in the captured module's own
        # forward has no module of its own in that capture).
        found = tuple((_join(span.owner, owner_path(site.add)), len(site.branches)) for site in stream.sites)
        if all(layer == span.owner or layer.startswith(span.owner + ".") for layer, _ in found):
            offsets = _positions(found, _kinds(stream), expected, _planned_kinds(planned)[span.start:span.stop])
            if offsets is None:
                break
            return stream, tuple(span.start + k for k in offsets)
    else:
        found = ()
    lines = [f"the graph captured for this call of {where} does not hold the residual sites the model was "
             f"converted with there ({_listed(planned, range(span.start, span.stop))})."]
    if found:
        lines.append(f"  found now: {len(found)} site(s) with {', '.join(str(n) for _, n in found)} branch(es)")
    lines.append("This happens when a call takes a code path the conversion did not see (convert with example "
                 "inputs that take it), or when the module changed after conversion (attnres_fx.remove, then "
                 "convert again).")
    raise StreamMismatchError("\n".join(lines))


def _positions(found: StreamSignature, found_kinds: list[tuple[str, ...]], expected: StreamSignature,
               expected_kinds: list[tuple[str, ...]]) -> list[int] | None:
    """Where each of ``found`` is in ``expected``, in order (planned sites may be missing in between);
    None if ``found`` is no such subsequence. Where several placements fit (a call that leaves out one of
    a layer's sublayers), the one whose branch kinds agree with the plan's most often wins: kinds break
    ties only, as they may be told differently by another capture."""
    n, m = len(found), len(expected)
    impossible = n + 1
    # cost[i][j]: the fewest kind disagreements placing found[:i] within expected[:j].
    cost = [[0] * (m + 1)] + [[impossible] * (m + 1) for _ in range(n)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            cost[i][j] = cost[i][j - 1]
            if found[i - 1] == expected[j - 1] and cost[i - 1][j - 1] < impossible:
                cost[i][j] = min(cost[i][j], cost[i - 1][j - 1] + (found_kinds[i - 1] != expected_kinds[j - 1]))
    if cost[n][m] >= impossible:
        return None
    offsets, j = [], m
    for i in range(n, 0, -1):
        while cost[i][j] == cost[i][j - 1]:
            j -= 1
        offsets.append(j - 1)
        j -= 1
    return offsets[::-1]


def _edited_in_place(stream: ResidualStream):
    """An op changing the stream in place after one of its sites (where such an edit ends the stream as
    detected: a forward hook returning ``out.add_(v)``), or ``None``."""
    return next((user for site in stream.sites for user in site.add.users
                 if user.args and user.args[0] is site.add and nk.writes_first_argument(user)), None)


def _kinds(stream: ResidualStream) -> list[tuple[str, ...]]:
    return [tuple(branch.kind for branch in site.branches) for site in stream.sites]


def _planned_kinds(planned: StreamPlan) -> list[tuple[str, ...]]:
    return [tuple(site.kind for site in planned.branch_sites(p)) for p in range(planned.num_positions)]


def _subsequence(found: StreamSignature, kinds: list[tuple[str, ...]], planned: StreamPlan) -> MatchedStream | None:
    positions = _positions(found, kinds, planned.signature, _planned_kinds(planned))
    # The stream must end where it was planned to: a call that stops early would skip the final
    # aggregation's own inputs without anything saying so.
    if not positions or positions[-1] != planned.num_positions - 1:
        return None
    return MatchedStream(planned, tuple(positions))


def _describe(signature: StreamSignature) -> str:
    return f"{len(signature)} sites from {signature[0][0] or '<root>'} to {signature[-1][0] or '<root>'}"


def _listed(planned: StreamPlan, positions) -> str:
    return ", ".join(f"{site.layer or '<root>'} ({site.kind})"
                     for p in positions for site in planned.branch_sites(p)[:1])


def _mismatch(found: StreamSignature, plan: Plan, where: str) -> str:
    """Name the planned stream closest to ``found`` and the sites that differ."""
    layers = {layer for layer, _ in found}
    closest = max(plan.streams, key=lambda s: len(layers & {layer for layer, _ in s.signature}))
    expected = closest.signature
    missing = [p for p, item in enumerate(expected) if item not in found]
    extra = [f"{layer} ({n} branch{'es' if n > 1 else ''})" for layer, n in found if (layer, n) not in expected]
    lines = [f"a residual stream captured in this call of {where} differs from the one the model was "
             f"converted with (stream {closest.index}, {_describe(expected)}):"]
    if missing:
        lines.append(f"  planned but not found now: {_listed(closest, missing)}")
    if extra:
        lines.append(f"  found now but not planned: {', '.join(extra)}")
    if not missing and not extra:
        lines.append("  the same sites in another order")
    lines.append("The rewrite would cover part of the stream, or the wrong sites. This happens when a call "
                 "takes a code path the conversion did not see (convert with example inputs that take it, and "
                 "in the mode, train or eval, the model runs in: a model may scale or cut its stream in one "
                 "mode only, and a conversion in that mode names the op), or when the model's structure "
                 "changed after conversion (attnres_fx.remove, then convert again).")
    return "\n".join(lines)


def resolve_block_sizes(detection: Detection, num_blocks: int | None, block_size: int | None) -> list[int]:
    """Sites per block for each stream; ``ValueError`` if ``num_blocks`` and ``block_size`` disagree."""
    if block_size is None:
        count = num_blocks or DEFAULT_NUM_BLOCKS
        return [max(1, math.ceil(len(s.sites) / count)) for s in detection.streams]
    if num_blocks is not None:
        for index, stream in enumerate(detection.streams):
            implied = math.ceil(len(stream.sites) / block_size)
            if implied != num_blocks:
                raise ValueError(
                    f"block_size={block_size} and num_blocks={num_blocks} disagree: stream {index} has "
                    f"{len(stream.sites)} residual sites, so block_size={block_size} makes {implied} blocks. "
                    "Pass only one of them.")
    return [block_size] * len(detection.streams)


def make_plan(detection: Detection, modules: Mapping[str, nn.Module], *, num_blocks: int | None = None,
              block_size: int | None = None, preserve_scale: bool = False, eps: float, route: str = "auto",
              spans: Sequence[tuple[LayerSpan, ...]] | None = None) -> Plan:
    """Plan the rewrite of every stream of ``detection``; ``modules`` maps paths to the modules the
    aggregations will be registered on (``dict(model.named_modules())``).

    ``route``: ``"layer"`` routes every stream layer by layer (:mod:`attnres_fx.passes.layers`; a stream
    that does not allow it raises :class:`~attnres_fx.UnsupportedArchitectureError` saying why),
    ``"model"`` rewrites every stream whole, ``"auto"`` takes the layer route wherever a stream allows it.
    ``spans``: the layers of each stream when they are known already (detection ran on each layer's
    own graph, not on one graph of the whole model).
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    sizes = resolve_block_sizes(detection, num_blocks, block_size)
    namer = _Namer(modules)
    owners = [stream.owner for stream in detection.streams]
    routable = _layer_spans(detection, modules, route, spans)
    index = 0
    streams = []
    for stream_index, (stream, size) in enumerate(zip(detection.streams, sizes)):
        sites = []
        completed = 0                       # blocks committed before the current site, b_0 included
        for position, residual in enumerate(stream.sites):
            for branch_index, branch in enumerate(residual.branches):
                sites.append(Site(index, namer.name(residual.owner, f"{branch.kind}_res"), branch.kind,
                                  position // size + 1, stream_index, residual.owner, completed + 1,
                                  branch.normalised, position, branch_index))
                index += 1
            if position % size == 0:
                completed += 1
        # Streams that share an owner (an encoder and a decoder list in one root) are told apart by
        # their layer lists: ``encoder.final_res``, ``decoder.final_res``.
        owner = stream.layers_path if owners.count(stream.owner) > 1 else stream.owner
        sites.append(Site(index, namer.name(owner, "final_res"), "final", None, stream_index, stream.owner,
                          completed + 1, None))
        index += 1
        layers = _route(stream_index, route, routable[stream_index])
        streams.append(StreamPlan(stream_index, stream.owner, size, require_dim(stream), signature(stream),
                                  tuple(sites), "layer" if layers else "model", layers))
    return Plan(tuple(streams), preserve_scale, eps)


def _layer_spans(detection: Detection, modules, route: str, known: Sequence[tuple[LayerSpan, ...]] | None
                 ) -> list[tuple[LayerSpan, ...] | Refusal | None]:
    """Per stream, its layer spans, or why it cannot be routed layer by layer; ``None`` for route='model'.
    ``known``: see :func:`make_plan`.

    An add that continues a stream but is no site (``allow_partial``) inside a routed layer sends every
    stream to the model route: a layer's own graph holds no next layer to tell such an add apart (a
    post-norm add at a layer's end, normalised before the next layer reads it), so the layer route would
    take it for a site there; one graph of the whole model keeps it as planned."""
    if route == "model":
        if known is not None:
            raise UnsupportedArchitectureError(
                "route='model' needs one graph of the whole model, and its capture failed (see the conversion "
                "log); convert with route='layer' or 'auto'")
        return [None] * len(detection.streams)
    found = [known[k] if known is not None else layer_spans(stream, modules)
             for k, stream in enumerate(detection.streams)]
    for add in detection.unconverted:
        span = next((span for spans in found if not isinstance(spans, Refusal) for span in spans
                     if provenance.within(add.owner, span.owner)), None)
        if span is not None:
            refusal = Refusal(f"{add.node} in {add.owner} continues the stream inside the layer {span.owner} but "
                              f"is no residual site ({add.reason})")
            return [refusal] * len(found)
    return found


def _route(index: int, route: str, spans: tuple[LayerSpan, ...] | Refusal | None) -> tuple[LayerSpan, ...]:
    """The layer spans of a stream on the layer route, or ``()`` for the model route."""
    if spans is None:
        return ()
    if isinstance(spans, Refusal):
        if route == "layer":
            raise UnsupportedArchitectureError(f"route='layer': stream {index} cannot be routed layer by layer: "
                                               f"{spans.reason}. Convert with route='auto' or 'model'.")
        return ()
    return spans


class _Namer:
    """Unique module names on non-container modules; see the module docstring."""

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules = modules
        self.taken: set[str] = set()

    def name(self, owner: str, leaf: str) -> str:
        parent, rest = owner, []
        while parent and (parent not in self.modules or isinstance(self.modules[parent], CONTAINERS)):
            parent, _, part = parent.rpartition(".")
            rest.insert(0, part)
        module = self.modules.get(parent)
        base = "_".join([*rest, leaf])
        attribute, suffix = base, 1
        while _join(parent, attribute) in self.taken or (module is not None and hasattr(module, attribute)):
            attribute, suffix = f"{base}_{suffix}", suffix + 1
        name = _join(parent, attribute)
        self.taken.add(name)
        return name


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path
