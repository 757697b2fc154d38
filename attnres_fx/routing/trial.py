"""Every route tried on the conversion's own call before the model is touched: a plan a route cannot
apply fails in :func:`attnres_fx.attnresify`, atomically, not at the model's first call.

- layer route: each block as that route runs it, with its sublayers as calls
  (:func:`~attnres_fx.routing.graphs.routable_trace`, one trace per kind of block), its sites matched and
  rewritten for the state it receives; where torch.fx cannot trace a block, TorchDynamo's capture of it;
- model route: TorchDynamo's capture of the whole call, rewritten.

The blocks are tried on the inputs the conversion's recording saw them called with
(:data:`attnres_fx.capture.recording.MODULE_CALLS`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import compat
from ..capture.block_tracer import call_shape
from ..capture.tracers import capture_dynamo
from ..errors import TraceError
from ..passes.pipeline import LayerTarget, rewrite_captured
from ..passes.plan import Plan, StreamPlan
from ..passes.rewrite import ModuleCalls
from .graphs import Layout, entry_of, kind_of, rewrite_block, routable_trace, variant_key


def try_layer_route(model: nn.Module, plan: Plan, modules: dict, calls: dict) -> None:
    """Rewrite every layer-routed block of ``plan`` as its route will, on its recorded call (made without
    gradients, as the recording runs: its tensors take no gradient-recording op)."""
    traces: dict = {}
    with torch.no_grad():
        for stream in plan.streams:
            if stream.route != "layer":
                continue
            for span in stream.layers:
                if span.owner in calls:
                    _try_block(model, plan, stream, span, modules, calls[span.owner], traces)


def _try_block(model, plan: Plan, stream: StreamPlan, span, modules: dict, call: tuple, traces: dict) -> None:
    block = model.get_submodule(span.owner)
    args, kwargs = call
    forward = compat.hf_checkpointed_forward(type(block)) or type(block).forward
    position = span.start
    layout = None if position == 0 else Layout(position, stream.completed_before(position), True)
    target = LayerTarget(stream, span, entry_of(layout), span.stop == stream.num_positions)
    where = f"{type(block).__name__} at '{span.owner}'"
    traced_modules = (block, *(block.get_submodule(path) for path in sorted(span.opened)))
    shape, _ = call_shape(args, kwargs, traced_modules)
    kind = kind_of(block, forward, span.opened)
    variant = variant_key(kind, shape, stream, span, span.owner, layout)    # the graphs the route shares
    try:
        if (kind, shape) not in traces:
            traces[kind, shape] = routable_trace(block, forward, args, kwargs, span.opened, shape)
        if variant not in traces:
            rewrite_block(traces[kind, shape], plan, target, span.owner, modules, where)
            traces[variant] = True
        return
    except TraceError as untraceable:
        reason = untraceable
    # The route runs such a block on TorchDynamo: its capture of the block must work.
    try:
        graph_module, _ = capture_dynamo(block, args, kwargs, forward)
    except TraceError as err:
        raise TraceError(f"{span.owner} ({type(block).__name__}) cannot be captured as one graph, which the layer "
                         f"route needs for a block whose own code torch.fx cannot trace ({reason}): {err}",
                         {**reason.causes, **err.causes}) from err
    # A Dynamo graph takes the blocks one by one, as the route's Dynamo graphs do.
    entry = target.entry and dataclasses.replace(target.entry, as_list=False)
    rewrite_captured(graph_module, plan, lambda g: ModuleCalls(g, modules), where=where,
                     layer=dataclasses.replace(target, entry=entry))


def try_model_route(model: nn.Module, plan: Plan, modules: dict, inputs: tuple[tuple, dict]) -> None:
    """Rewrite TorchDynamo's capture of the whole call, as the model route will."""
    graph_module, _ = capture_dynamo(model, *inputs)
    rewrite_captured(graph_module, plan, lambda g: ModuleCalls(g, modules), where=type(model).__name__)
