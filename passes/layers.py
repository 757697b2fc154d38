"""Layers: the modules whose forwards perform a stream's residual sites, and whether the stream passes
between them untouched, as an argument of one module and a result of the one before it.

That is what the layer route needs (:mod:`attnres_fx.routing`): each such module then runs its own rewritten
graph, taking and returning the completed block sums with the stream, while the code that calls the
modules (a Hugging Face ``LlamaModel.forward``, a ViT encoder loop, the built-in model's ``for block in
self.blocks``) runs as written.

Contract
    requires  a stream detected in a graph of the whole stream (one call of the model), and the model's
              module tree.
    returns   a :class:`~attnres_fx.passes.plan.LayerSpan` per module, in execution order, or a falsy
              :class:`Refusal` whose ``reason`` names the first node or module that rules the route out.
    modifies  nothing.

Each site belongs to the innermost module that computes all of it, branches and adds (the module
performing the add, or an ancestor where the block computes a sublayer's norm); neighbouring sites of
nested modules belong to the outer one. A stream qualifies when no site belongs to the root, each
module's sites are consecutive in the stream (a module called twice, weights shared across depth, does
not qualify) and no such module contains another. Between two modules the stream may pass through stream
ops (:func:`~attnres_fx.passes.node_kinds.is_stream_op`) only inside them, at the end of the one or the
start of the other: an op the outer code applies between layers (a cast, a scale) would need the block
sums too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx, nn

from . import provenance
from .detect import ResidualStream

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class LayerSpan:
    """A module of a layer-routed stream: its forward performs the residual sites ``start`` to
    ``stop - 1`` of the stream. ``opened``: its submodules (paths relative to it) whose forwards hold part
    of the stream (an add, an op the stream passes through), which the route traces through; every other
    submodule is a sublayer the route calls as a module."""

    owner: str
    start: int
    stop: int
    opened: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Refusal:
    """Why a stream cannot take the layer route; falsy, so ``spans or fallback`` reads naturally."""

    reason: str

    def __bool__(self) -> bool:
        return False


def layer_spans(stream: ResidualStream, modules: Mapping[str, nn.Module]) -> tuple[LayerSpan, ...] | Refusal:
    """The modules performing ``stream``'s sites, or why the stream cannot be routed layer by layer."""
    homes = [_home(site) for site in stream.sites]
    if "" in homes:
        site = stream.sites[homes.index("")]
        return Refusal(f"the residual site {site.add.name} is computed in the root module's own forward")
    # Neighbouring sites whose modules nest are one module's: a block whose sublayers add their own
    # residuals while the block computes their norms (Bloom) is routed as the block.
    for k in range(1, len(homes)):
        if provenance.within(homes[k], homes[k - 1]):
            homes[k] = homes[k - 1]
        elif provenance.within(homes[k - 1], homes[k]):
            j = k - 1
            while j >= 0 and provenance.within(homes[j], homes[k]):
                homes[j] = homes[k]
                j -= 1
    spans = with_opened(stream, spans_of(homes))
    owners = [span.owner for span in spans]
    for span in spans:
        if owners.count(span.owner) > 1:
            return Refusal(f"{span.owner} performs residual sites at {owners.count(span.owner)} places of the "
                           "stream (a module called more than once)")
        module = modules.get(span.owner)
        if module is None or isinstance(module, CONTAINERS):
            return Refusal(f"{span.owner} is not a module whose forward computes its residual sites")
        enclosing = next((other for other in owners
                          if other != span.owner and provenance.within(span.owner, other)), None)
        if enclosing is not None:
            return Refusal(f"{span.owner} computes residual sites inside {enclosing}, which computes others")
    for previous, span in zip(spans, spans[1:]):
        # The ops between two blocks belong to the end of the one (a view back to the batch's shape) or
        # to the start of the other (a dropout on its input).
        inside_next = False
        for op in stream.sites[span.start].inbound:
            if _inside(op, span.owner):
                inside_next = True
            elif inside_next or not _inside(op, previous.owner):
                return Refusal(f"between {previous.owner} and {span.owner} the stream passes through "
                               f"{op.format_node()} outside both")
    return tuple(spans)


def spans_of(owners: list[str]) -> list[LayerSpan]:
    """One span per run of consecutive sites with the same owner (``owners[k]``: site k's)."""
    spans: list[LayerSpan] = []
    for position, owner in enumerate(owners):
        if spans and spans[-1].owner == owner:
            spans[-1] = LayerSpan(owner, spans[-1].start, position + 1)
        else:
            spans.append(LayerSpan(owner, position, position + 1))
    return spans


def with_opened(stream: ResidualStream, spans: list[LayerSpan]) -> list[LayerSpan]:
    """``spans`` with their opened submodules: the modules, inside each span's owner, that created a node
    the stream itself passes through (a site's adds, the ops between sites), from the nodes' module
    stacks."""
    result = []
    for span in spans:
        prefix = span.owner + "." if span.owner else ""
        opened = set()
        for site in stream.sites[span.start:span.stop]:
            for node in (*site.adds, *site.inbound):
                for path, _ in provenance.module_stack(node):
                    if path.startswith(prefix) and path != span.owner:
                        opened.add(path[len(prefix):])
        result.append(LayerSpan(span.owner, span.start, span.stop, frozenset(opened)))
    return result


def _home(site) -> str:
    """The innermost module that computes all of a site (its adds and branches)."""
    nodes = [n for n in [*site.adds, *(n for branch in site.branches for n in branch.region)]
             if n.op not in ("placeholder", "get_attr")]
    home = site.owner
    while home and not all(_inside(node, home) for node in nodes):
        home = home.rpartition(".")[0]
    return home


def _inside(node: fx.Node, owner: str) -> bool:
    """Whether ``node`` was created by ``owner``'s forward or a submodule of it."""
    return node.op == "get_attr" or any(path == owner for path, _ in provenance.module_stack(node))
