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

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from attnres_fx.errors import StreamMismatchError
from attnres_fx.text import format_table

from .detect import Detection, ResidualStream, require_dim

DEFAULT_NUM_BLOCKS = 8
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)

StreamSignature = tuple[tuple[str, str], ...]


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
    """The plan of one stream: ``sites`` are its aggregations in execution order, the final one last."""

    index: int
    owner: str
    block_size: int
    dim: int
    signature: StreamSignature
    sites: tuple[Site, ...]

    @property
    def final(self) -> Site:
        return self.sites[-1]

    def branch_sites(self, position: int) -> tuple[Site, ...]:
        """The aggregations of residual site ``position``, one per branch."""
        return tuple(s for s in self.sites if s.position == position)


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

    def table(self, indent: str = "") -> str:
        rows = [(str(s.index), s.name, s.layer or "<root>", s.kind, "-" if s.block is None else str(s.block),
                 str(s.num_sources), "-" if s.normalised is None else ("yes" if s.normalised else "NO (raw)"))
                for s in self.sites]
        return format_table(("site", "name", "layer", "kind", "block", "sources", "normalised"), rows, indent)


def signature(stream: ResidualStream, prefix: str = "", within: str = "") -> StreamSignature:
    """What identifies a stream across captures of one model: (layer, branch kinds) per residual site,
    layers as paths from the converted model's root. ``prefix``: the captured module's path in that
    model (a routed submodule); ``within``: the converted model's path in the captured module (a wrapper
    around it)."""
    return tuple((_relocate(site.owner, prefix, within), site.kind) for site in stream.sites)


def _relocate(path: str, prefix: str, within: str) -> str:
    if within:
        path = path[len(within) + 1:] if path.startswith(within + ".") else ("" if path == within else path)
    return _join(prefix, path)


def match_streams(detection: Detection, plan: Plan, *, prefix: str = "", within: str = "",
                  where: str = "the model") -> tuple[StreamPlan, ...]:
    """The planned stream of each stream detected in another capture of the same model (a decode step, a
    train-mode call, the encoder called alone). ``prefix``: the captured module's path in the model.

    Raises :class:`~attnres_fx.StreamMismatchError`, naming the difference, when a detected stream is
    not one of the plan's, or when the capture holds no stream at all: rewriting part of a stream, or
    running the original computation, would be silently wrong. ``prefix`` and ``within``: see
    :func:`signature`.
    """
    planned = {stream.signature: stream for stream in plan.streams}
    matched = []
    for stream in detection.streams:
        found = signature(stream, prefix, within)
        if found not in planned:
            raise StreamMismatchError(_mismatch(found, plan, where))
        matched.append(planned[found])
    if not matched:
        rejected = "\n".join(f"  - {r}" for r in detection.rejected[:12]) or "  (the graph has no tensor adds)"
        raise StreamMismatchError(
            f"the graph captured for this call of {where} has no residual stream, but the model was converted "
            f"with {len(plan.streams)} stream(s) ({', '.join(_describe(s.signature) for s in plan.streams)}). "
            f"Adds seen and why each was rejected:\n{rejected}")
    return tuple(matched)


def _describe(signature: StreamSignature) -> str:
    return f"{len(signature)} sites from {signature[0][0] or '<root>'} to {signature[-1][0] or '<root>'}"


def _mismatch(found: StreamSignature, plan: Plan, where: str) -> str:
    """Name the planned stream closest to ``found`` and the sites that differ."""
    layers = {layer for layer, _ in found}
    closest = max(plan.streams, key=lambda s: len(layers & {layer for layer, _ in s.signature}))
    expected = closest.signature
    missing = [f"{layer} ({kind})" for layer, kind in expected if (layer, kind) not in found]
    extra = [f"{layer} ({kind})" for layer, kind in found if (layer, kind) not in expected]
    lines = [f"a residual stream captured in this call of {where} differs from the one the model was "
             f"converted with (stream {closest.index}, {_describe(expected)}):"]
    if missing:
        lines.append(f"  planned but not found now: {', '.join(missing)}")
    if extra:
        lines.append(f"  found now but not planned: {', '.join(extra)}")
    if not missing and not extra:
        lines.append("  the same sites in another order")
    lines.append("The rewrite would cover part of the stream, or the wrong sites. This happens when a call "
                 "takes a code path the conversion did not see (convert with example inputs that take it), "
                 "or when the model's structure changed after conversion (attnres_fx.remove, then convert "
                 "again).")
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
              block_size: int | None = None, preserve_scale: bool = False, eps: float) -> Plan:
    """Plan the rewrite of every stream of ``detection``; ``modules`` maps paths to the modules the
    aggregations will be registered on (``dict(model.named_modules())``)."""
    sizes = resolve_block_sizes(detection, num_blocks, block_size)
    namer = _Namer(modules)
    owners = [stream.owner for stream in detection.streams]
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
        streams.append(StreamPlan(stream_index, stream.owner, size, require_dim(stream), signature(stream),
                                  tuple(sites)))
    return Plan(tuple(streams), preserve_scale, eps)


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
