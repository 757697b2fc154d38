"""The call context: what the converted calls in progress in one thread share, in one record.

The parts of a converted call that do not call each other find each other here:

- ``interceptors``: who takes the calls of layer-routed modules (:func:`~attnres_fx.routing.router.intercepting`:
  pipeline stages, and the probe that prepares them);
- ``watched``: the calls of layer-routed streams' owners in progress, which the stream's first and last
  blocks mark (:mod:`attnres_fx.routing.watch`);
- ``compile_settings``: what a TorchDynamo compilation of one of attnres_fx's entries entered, left when
  it ends (:mod:`attnres_fx.routing.dynamo`);
- ``hooked_results``: by block, the result a layer-routed block returned to forward hooks, with its carrier
  and state, for the router's own hook after them (:meth:`~attnres_fx.routing.router.LayerRouter._after_hooks`).

One per thread and asyncio task (a ``ContextVar``, made at its first use): nothing a call in one thread
does is seen by a call in another.
"""

from __future__ import annotations

from contextvars import ContextVar


class CallContext:
    __slots__ = ("interceptors", "watched", "compile_settings", "hooked_results")

    def __init__(self):
        self.interceptors: list = []
        self.watched: list = []
        self.compile_settings: list = []
        self.hooked_results: dict = {}


_CONTEXT: ContextVar[CallContext | None] = ContextVar("attnres_fx_call_context", default=None)


def call_context() -> CallContext:
    """This thread's (or task's) call context."""
    context = _CONTEXT.get()
    if context is None:
        context = CallContext()
        _CONTEXT.set(context)
    return context
