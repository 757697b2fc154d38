"""Every route tried on the conversion's own call before the model is touched: a plan a route cannot
apply fails in :func:`attnres_fx.attnresify`, atomically, not at the model's first call.

- layer route: each block prepared by the router the conversion installs on it
  (:meth:`~attnres_fx.routing.router.LayerRouter.prepare`: its trace, one per kind of block, and its
  rewritten graph, for the state it receives), kept: a first call like the recorded one traces and
  rewrites nothing. Where torch.fx cannot trace a block, TorchDynamo's capture of it is rewritten (a
  check only: the route compiles its own entry at the first call);
- model route: TorchDynamo's capture of the whole call, rewritten (a check only, as above).

The blocks are tried on the inputs the conversion's recording saw them called with
(:data:`attnres_fx.capture.recording.MODULE_CALLS`), and on those of the conversion's call as users make
it where the capture's call is another (a Hugging Face model's key/value cache on: the blocks receive a
cache object), recorded on a run of the model (:func:`try_default_call`); then both calls in the other
mode, train or eval (:func:`try_other_mode`: a model converted in eval mode is trained next).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .. import compat
from ..capture.recording import record_calls
from ..capture.tracers import capture_dynamo, ready_to_capture
from ..config import AttnResConfig
from ..diagnostics import first_line
from ..errors import TraceError
from ..passes.pipeline import LayerTarget, rewrite_captured
from ..passes.plan import Plan, StreamPlan
from ..passes.rewrite import ModuleCalls
from ..passes.signature import StateLayout
from .install import Prepared, prepared_routes

LOG = logging.getLogger("attnres_fx")


def try_layer_route(model: nn.Module, plan: Plan, modules: dict, calls: dict, config: AttnResConfig) -> Prepared:
    """Prepare every layer-routed block of ``plan`` as its route will, on its recorded call (made without
    gradients, as the recording runs: its tensors take no gradient-recording op); what the routers made,
    to install."""
    prepared = prepared_routes(model, plan, config)
    _try_blocks(prepared, plan, modules, calls)
    return prepared


def try_default_call(model: nn.Module, plan: Plan, modules: dict, prepared: Prepared, call: tuple[tuple, dict]) -> None:
    """Prepare the layer-routed blocks of ``plan`` through ``prepared``'s routers for ``call`` too, the
    conversion's call as users make it (:func:`~attnres_fx.capture.tracers.default_call`: a Hugging Face
    model's key/value cache on, where the capture's is off), its blocks' calls recorded on a real run of
    the model: a first call with the model's default arguments (and ``generate()``, whose calls have the
    same shape) traces and rewrites nothing either."""
    _try_call(model, plan, modules, prepared, call, cache_off=False)


def try_other_mode(model: nn.Module, plan: Plan, modules: dict, prepared: Prepared,
                   calls: list[tuple[tuple[tuple, dict], bool]]) -> None:
    """Prepare the layer-routed blocks of ``plan`` through ``prepared``'s routers for ``calls`` (each with
    whether the capture turns the cache off for it) in the mode the model is not in now, train or eval
    (a block's trace holds its code's ``self.training`` branches: another call shape), each recorded on a
    run of the model in that mode: a model converted in eval mode and trained next makes nothing at its
    first training call either. Every module's flag is set back afterwards (directly: a module may refuse
    ``.train()``)."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        model.train(not model.training)
        for call, cache_off in calls:
            _try_call(model, plan, modules, prepared, call, cache_off)
    finally:
        for module, flag in flags:
            module.training = flag


def _try_call(model: nn.Module, plan: Plan, modules: dict, prepared: Prepared, call: tuple[tuple, dict],
              cache_off: bool) -> None:
    owners = [span.owner for stream in plan.streams if stream.route == "layer" for span in stream.layers]
    if not owners:
        return
    try:
        with ready_to_capture(model, cache_off=cache_off), compat.mha_fast_path_off():
            calls = record_calls(model, *call, owners)
        _try_blocks(prepared, plan, modules, calls)
    except Exception as err:  # noqa: BLE001 - the conversion's own call was tried above; this one may fail alone
        # (a cache the model cannot make for these inputs, a call the model refuses in the other mode): such a
        # call raises the same at its first call, as written or on the route, which prepares it then.
        LOG.info("%s: the call with %s in %s mode is prepared at its first call (%s: %s)", type(model).__name__,
                 "the default arguments" if not cache_off else "the conversion's inputs",
                 "train" if model.training else "eval", type(err).__name__, first_line(err))


def _try_blocks(prepared: Prepared, plan: Plan, modules: dict, calls: dict) -> None:
    with torch.no_grad():
        for stream in plan.streams:
            if stream.route != "layer":
                continue
            for span in stream.layers:
                if span.owner in calls:
                    _try_block(prepared, plan, stream, span, modules, calls[span.owner])


def _try_block(prepared: Prepared, plan: Plan, stream: StreamPlan, span, modules: dict, call: tuple) -> None:
    router = prepared.routers[span.owner]
    args, kwargs = call
    position = span.start
    layout = None if position == 0 else StateLayout(position, stream.completed_before(position), True, as_list=True)
    routes = router.prepare(args, kwargs, layout, modules)
    if routes.traced is not None:
        return
    # The route runs such a block on TorchDynamo: its capture of the block must work.
    reason = routes.refusal or TraceError("an opened sublayer has hooks, which only TorchDynamo traces")
    try:
        graph_module, _ = capture_dynamo(router.module, args, kwargs, router.forward_function)
    except TraceError as err:
        raise TraceError(f"{span.owner} ({type(router.module).__name__}) cannot be captured as one graph, which "
                         "the layer route needs for a block whose own code torch.fx cannot trace "
                         f"({reason}): {err}", {**reason.causes, **err.causes}) from err
    # A Dynamo graph takes the blocks one by one, as the route's Dynamo graphs do.
    entry = layout and layout._replace(as_list=False)
    target = LayerTarget(stream, span, entry, span.stop == stream.num_positions)
    rewrite_captured(graph_module, plan, lambda g: ModuleCalls(g, modules), where=router.where, layer=target)


def try_model_route(model: nn.Module, plan: Plan, modules: dict, inputs: tuple[tuple, dict]) -> None:
    """Rewrite TorchDynamo's capture of the whole call, as the model route will."""
    with ready_to_capture(model):
        graph_module, _ = capture_dynamo(model, *inputs)
    rewrite_captured(graph_module, plan, lambda g: ModuleCalls(g, modules), where=type(model).__name__)
