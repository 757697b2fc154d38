"""Live routing: every call of a converted model runs the Block AttnRes rewrite of its graphs.

A converted model keeps its class, submodules and methods. What changes:

- the ``BlockAttnRes`` modules of the plan are registered where the plan names them
  (``model.layers.3.attn_res``, ``model.final_res``): ordinary parameters for optimizers, ``state_dict``,
  ``.to()``, DDP, FSDP2;
- some modules get a router as their instance attribute ``forward``, by route
  (:class:`~attnres_fx.passes.plan.StreamPlan`):

  - **layer route** (the default wherever a stream allows it, :mod:`attnres_fx.passes.layers`): every
    module that performs residual sites (a transformer block, ``model.layers.3``) gets a
    :class:`~attnres_fx.routing.router.LayerRouter`; the code calling the blocks runs as written. A
    block's call runs a rewritten graph of the block with its sublayers as calls
    (:mod:`attnres_fx.capture.block_tracer`, :mod:`attnres_fx.routing.graphs`), the stream's state entering as
    extra inputs and leaving as extra outputs, travelling with the block's result
    (:mod:`attnres_fx.routing.state`). Per-block ``fully_shard``, activation checkpointing, pipeline
    stages and per-block compilation see one block at a time, as they do in the original model.
  - **model route**: the root and every module that owns such a stream (an encoder ``generate`` calls on
    its own) get a :class:`~attnres_fx.routing.router.ModelRouter`: the whole call is captured by
    TorchDynamo as one graph and every stream in it is rewritten together
    (:mod:`attnres_fx.routing.dynamo`).

Files: :mod:`~attnres_fx.routing.install` (installing the routers and undoing it),
:mod:`~attnres_fx.routing.router` (one call), :mod:`~attnres_fx.routing.graphs` (the graphs and their
cache), :mod:`~attnres_fx.routing.dynamo` (TorchDynamo entries), :mod:`~attnres_fx.routing.state` (the
stream's state between blocks), :mod:`~attnres_fx.routing.watch` (whether a call ran a stream to its end),
:mod:`~attnres_fx.routing.trial` (each route prepared on the conversion's own call).
Pickling keeps the routing: a router pickles without its graphs and builds them again at its first call.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from ..conversion import Conversion, conversion_of
from .install import install, routers, uninstall, whole_call
from .router import COMPILERS, LayerRouter, ModelRouter, Router, WholeCallRouter, intercepting
from .state import StreamState, attach, returned, state_of

__all__ = ["COMPILERS", "LayerRouter", "ModelRouter", "Router", "WholeCallRouter", "compiler_route", "eager_route",
           "enter_stream", "is_routed", "stream_state",
           "install", "intercepting", "routers", "set_compiler", "uninstall"]


@contextlib.contextmanager
def eager_route(model: nn.Module):
    """Within: the calls of the converted ``model`` take the eager route, whatever its compiler, so that
    its ``BlockAttnRes`` modules run as modules (their hooks fire). The compiled route's graphs are
    kept: after the block the model runs them again without recompiling."""
    with compiler_route(model, "eager"):
        yield model


@contextlib.contextmanager
def compiler_route(model: nn.Module, compiler: str):
    """Within: the calls of the converted ``model`` run their rewritten graphs with ``compiler``
    (``"eager"`` or ``"inductor"``); each compiler's graphs are kept for the next time."""
    conversion = conversion_of(model)
    if conversion is None:
        raise ValueError(f"model: compiler_route needs a converted model, got a {type(model).__name__}")
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    before = conversion.compiler
    conversion.compiler = compiler
    try:
        yield model
    finally:
        conversion.compiler = before


def set_compiler(model: nn.Module, conversion: Conversion, compiler: str, options: dict[str, Any]) -> None:
    """Run ``model``'s routes with ``compiler``; under Inductor a conversion whose root is not routed gets
    a :class:`~attnres_fx.routing.router.WholeCallRouter`, so that a call of the model compiles whole."""
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    conversion.compiler = compiler
    conversion.compile_options = dict(options)
    whole_call(model, conversion, compiler == "inductor")
    for router in routers(model):
        router.reset()


def is_routed(module: nn.Module) -> bool:
    """Whether ``module`` runs a route of its converted model (a block on the layer route, a stream owner on
    the model route)."""
    return isinstance(module.__dict__.get("forward"), Router)


def enter_stream(model: nn.Module, stream: int, carrier, position: int, blocks, partial) -> None:
    """Make the layer-routed ``stream`` of the converted ``model`` continue from ``carrier`` before residual site
    ``position``, with the completed block sums ``blocks`` and the partial sum ``partial`` (what
    :func:`stream_state` gave where another process left the stream: a pipeline stage's). An edit of
    ``carrier`` in place before the stream's next module reads it joins the stream."""
    state = StreamState(conversion_of(model), stream, position, tuple(blocks), partial)
    attach(carrier, state)
    returned(carrier, state, hooked=True)


def stream_state(model: nn.Module, stream: int, carrier) -> tuple[tuple, Any]:
    """The completed block sums and the partial sum that ``carrier`` (what a block of ``stream`` returned, or a
    view of it) carries on; :class:`~attnres_fx.RoutingError` where it carries none."""
    from ..errors import RoutingError

    state, _ = state_of(carrier, conversion_of(model), stream)
    if state is None:
        raise RoutingError(f"stream {stream} of {type(model).__name__}: the tensor carries no AttnRes state; it must "
                           "be what a block of the stream returned, before its last")
    return state.blocks, state.partial
