"""Activation checkpointing across the rewrite: open checkpointed regions before detection, close them after.

TorchDynamo captures ``torch.utils.checkpoint.checkpoint(layer, x)`` (and Hugging Face's gradient
checkpointing) as a ``tag_activation_checkpoint`` higher-order op whose body is a subgraph: the residual
adds of a checkpointed layer are inside it, out of detection's sight, and the layer's interface (one
stream in, one out) is not the one AttnRes needs (completed blocks and the partial sum in, the partial
sum out). So:

- :func:`open_checkpoints` inlines every body into the graph, tagging the inlined nodes with their
  region (``node.meta["attnres_checkpoint"]``), and returns the regions;
- detection, plan and rewrite run on the flat graph (the rewrite's new nodes inherit the region of the
  residual add they stand for, the stream's final aggregation none);
- :func:`close_checkpoints` outlines each region again, now with the inputs and outputs the rewrite
  gave it, as the same higher-order op with the same options. Eagerly it runs
  ``torch.utils.checkpoint.checkpoint`` (the forward of the region is recomputed in the backward pass);
  Inductor gives it the same recompute treatment as Dynamo's own.

Contract: ``open_checkpoints`` changes the graph only if it has checkpointed regions and preserves the
computation (not the memory savings, until ``close_checkpoints`` restores them); ``close_checkpoints``
requires every region's nodes to form a convex set (no path leaves the region and comes back) and
preserves the computation. :class:`OpenCheckpoints` and :class:`CloseCheckpoints` are the two as
``torch.fx`` passes (:class:`~torch.fx.passes.infra.pass_base.PassBase`), for the pipeline.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from attnres_fx.errors import PassContractError, UnsupportedArchitectureError

REGION = "attnres_checkpoint"
_HOP = torch.ops.higher_order.tag_activation_checkpoint


@dataclass(frozen=True)
class CheckpointRegion:
    index: int
    name: str               # the body's attribute name in the captured graph (``wrap_body_0``)
    kwargs: dict            # the op's options (``use_reentrant``, ``context_fn``, ...)


def open_checkpoints(gm: fx.GraphModule) -> tuple[CheckpointRegion, ...]:
    """Inline every checkpointed body of ``gm``, in place; see the module docstring. Returns every region
    open in ``gm`` (opened now or by an earlier call, as ``gm.meta`` records). Nested checkpoints raise
    :class:`~attnres_fx.AttnResError`."""
    regions: list[CheckpointRegion] = list(gm.meta.get(REGION, ()))
    graph = gm.graph
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is _HOP):
            continue
        body_attr = node.args[0]
        body = getattr(gm, body_attr.target)
        region = CheckpointRegion(len(regions), body_attr.target, dict(node.kwargs))
        regions.append(region)
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        env = dict(zip(placeholders, node.args[1:]))
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op in ("placeholder", "output"):
                    continue
                if inner.op == "call_function" and inner.target is _HOP:
                    raise UnsupportedArchitectureError(
                        f"nested activation checkpointing (a checkpointed call inside the checkpointed region "
                        f"{region.name}) is not supported")
                copy = graph.node_copy(inner, lambda n: env[n])
                if inner.op == "get_attr":
                    copy.target = _adopt(gm, body, inner.target)
                copy.meta[REGION] = region.index
                env[inner] = copy
        (results,) = body.graph.find_nodes(op="output")[0].args
        results = results if isinstance(results, (tuple, list)) else (results,)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise UnsupportedArchitectureError(
                    f"unexpected use of a checkpointed region's result: {user.format_node()}")
            result = results[user.args[1]]
            user.replace_all_uses_with(env.get(result, result))
            graph.erase_node(user)
        graph.erase_node(node)
        if not body_attr.users:
            graph.erase_node(body_attr)
    if regions:
        gm.meta[REGION] = tuple(regions)
        gm.recompile()
    return tuple(regions)


def close_checkpoints(gm: fx.GraphModule, regions: tuple[CheckpointRegion, ...]) -> None:
    """Outline each region of ``gm`` again as a checkpointed body, in place."""
    gm.meta.pop(REGION, None)
    graph = gm.graph
    for region in regions:
        nodes = [n for n in graph.nodes if n.meta.get(REGION) == region.index]
        if nodes:
            _outline(gm, nodes, region)
    graph.lint()
    gm.recompile()


class OpenCheckpoints(PassBase):
    """:func:`open_checkpoints` as a pass; ``regions`` holds what is open, for :class:`CloseCheckpoints`:
    what it opened, and what a capture opened before (:func:`open_checkpoints` records those in the
    graph's ``meta``, so that a graph opened for detection closes again after its rewrite).

    ensures: no checkpointed body is left (every region's nodes are in the graph, tagged)."""

    def __init__(self):
        super().__init__()
        self.regions: tuple[CheckpointRegion, ...] = ()

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        opened_before = len(graph_module.meta.get(REGION, ()))
        self.regions = open_checkpoints(graph_module)
        return PassResult(graph_module, len(self.regions) > opened_before)

    def ensures(self, graph_module: fx.GraphModule) -> None:
        if graph_module.graph.find_nodes(op="call_function", target=_HOP):
            raise PassContractError("OpenCheckpoints left a checkpointed body closed")


class CloseCheckpoints(PassBase):
    """:func:`close_checkpoints` of the regions an :class:`OpenCheckpoints` pass opened.

    ensures: one checkpointed body per region that still has nodes, none of them left in the graph."""

    def __init__(self, opened: OpenCheckpoints):
        super().__init__()
        self.opened = opened

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        close_checkpoints(graph_module, self.opened.regions)
        return PassResult(graph_module, bool(self.opened.regions))

    def ensures(self, graph_module: fx.GraphModule) -> None:
        if any(REGION in node.meta for node in graph_module.graph.nodes):
            raise PassContractError("CloseCheckpoints left nodes of a checkpointed region outside its body")


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], region: CheckpointRegion) -> None:
    graph = gm.graph
    inside = set(nodes)
    inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(order[n] for n in nodes)
    early = [u for n in outputs for u in n.users if u not in inside and order[u] < last]
    if early:
        raise UnsupportedArchitectureError(
            f"cannot checkpoint the rewritten region {region.name} again: {early[0].format_node()} reads "
            "it before it ends. Convert without activation checkpointing, or checkpoint whole layers.")
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, value in enumerate(inputs):
        env[value] = body.placeholder(f"input_{k}")
        env[value].meta.update({key: value.meta[key] for key in ("example_value", "val") if key in value.meta})
    for node in nodes:
        env[node] = body.node_copy(node, env.__getitem__)
        env[node].meta.pop(REGION, None)
    body.output(tuple(env[n] for n in outputs))
    name = _free_name(gm, f"attnres_{region.name}")
    gm.add_submodule(name, fx.GraphModule(gm, body, class_name="CheckpointedRegion"))
    with graph.inserting_after(nodes[-1]):
        body_attr = graph.get_attr(name)
    with graph.inserting_after(body_attr):
        call = graph.call_function(_HOP, (body_attr, *inputs), dict(region.kwargs))
    anchor = call
    for k, output in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, k))
        anchor.meta.update({key: output.meta[key] for key in ("example_value", "val") if key in output.meta})
        output.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        graph.erase_node(node)


def _adopt(gm: fx.GraphModule, body: fx.GraphModule, target: str) -> str:
    """Register ``body``'s attribute ``target`` on ``gm``; its name there."""
    value = body
    for part in target.split("."):
        value = getattr(value, part)
    name = _free_name(gm, target.replace(".", "_"))
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    return name


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, suffix = base, 1
    while hasattr(gm, name):
        name, suffix = f"{base}_{suffix}", suffix + 1
    return name
