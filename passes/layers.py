"""Layers: the modules whose forwards perform a stream's residual sites, and whether the stream passes
between them untouched, as an argument of one module and a result of the one before it.

That is what the layer route needs (:mod:`attnres_fx.live`): each such module then runs its own rewritten
graph, taking and returning the completed block sums with the stream, while the code that calls the
modules (a Hugging Face ``LlamaModel.forward``, a ViT encoder loop, the built-in model's ``for block in
self.blocks``) runs as written.

Contract
    requires  a stream detected in a graph of the whole stream (one call of the model), and the model's
              module tree.
    returns   a :class:`~attnres_fx.passes.plan.LayerSpan` per module, in execution order, or a falsy
              :class:`Refusal` whose ``reason`` names the first node or module that rules the route out.
    modifies  nothing.

A stream qualifies when every residual add is performed inside a submodule (not in the root's own
forward), each module's sites are consecutive in the stream (a module called twice, weights shared across
depth, does not qualify), no such module contains another, and everything a site computes, branches and
adds, is computed inside its module. Between two modules the stream may pass through stream ops
(:func:`~attnres_fx.passes.node_kinds.is_stream_op`) only inside the next module: an op the outer code
applies between layers (a cast, a scale) would need the block sums too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx, nn

from . import node_kinds as nk
from .detect import ResidualStream

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class LayerSpan:
    """A module of a layer-routed stream: its forward performs the residual sites ``start`` to
    ``stop - 1`` of the stream."""

    owner: str
    start: int
    stop: int


@dataclass(frozen=True)
class Refusal:
    """Why a stream cannot take the layer route; falsy, so ``spans or fallback`` reads naturally."""

    reason: str

    def __bool__(self) -> bool:
        return False


def layer_spans(stream: ResidualStream, modules: Mapping[str, nn.Module]) -> tuple[LayerSpan, ...] | Refusal:
    """The modules performing ``stream``'s sites, or why the stream cannot be routed layer by layer."""
    spans: list[LayerSpan] = []
    for position, site in enumerate(stream.sites):
        if spans and spans[-1].owner == site.owner:
            spans[-1] = LayerSpan(site.owner, spans[-1].start, position + 1)
        else:
            spans.append(LayerSpan(site.owner, position, position + 1))
    owners = [span.owner for span in spans]
    for span in spans:
        site = stream.sites[span.start]
        if not span.owner:
            return Refusal(f"the residual add {site.add.name} is performed in the root module's own forward")
        if owners.count(span.owner) > 1:
            return Refusal(f"{span.owner} performs residual sites at {owners.count(span.owner)} places of the "
                           "stream (a module called more than once)")
        module = modules.get(span.owner)
        if module is None or isinstance(module, CONTAINERS):
            return Refusal(f"{span.owner} is not a module that performs its residual adds in its own forward")
        enclosing = next((other for other in owners if span.owner.startswith(other + ".")), None)
        if enclosing is not None:
            return Refusal(f"{span.owner} performs residual sites inside {enclosing}, which performs others")
    for previous, span in zip(spans, spans[1:]):
        for op in stream.sites[span.start].inbound:
            if not _inside(op, span.owner):
                return Refusal(f"between {previous.owner} and {span.owner} the stream passes through "
                               f"{op.format_node()} outside both")
    for span in spans:
        for site in stream.sites[span.start:span.stop]:
            for node in [*site.adds, *(n for branch in site.branches for n in branch.region)]:
                if node.op != "placeholder" and not _inside(node, span.owner):
                    return Refusal(f"the residual site of {span.owner} computes {node.format_node()} outside "
                                   "that module")
    return tuple(spans)


def _inside(node: fx.Node, owner: str) -> bool:
    """Whether ``node`` was created by ``owner``'s forward or a submodule of it."""
    return node.op == "get_attr" or any(path == owner for path, _ in nk.module_stack(node))
