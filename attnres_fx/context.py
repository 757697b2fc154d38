"""The call context: what the converted calls in progress in one thread share, in one record.

The parts of a converted call that do not call each other find each other here:

- ``own``: how deep this thread is in attnres_fx's own calls (a capture, a routed call that runs on
  TorchDynamo), inside which a routed module runs its own forward, as written
  (:func:`~attnres_fx.capture.tracers.own_call`);
- ``interceptors``: who takes the calls of layer-routed modules (:func:`~attnres_fx.routing.router.intercepting`:
  pipeline stages, and the probe that prepares them);
- ``watched``: the calls of layer-routed streams' owners in progress, which the stream's first and last
  blocks mark (:mod:`attnres_fx.routing.watch`);
- ``compile_settings``: what a TorchDynamo compilation of one of attnres_fx's entries entered, left when
  it ends (:mod:`attnres_fx.routing.dynamo`);
- ``hooked_results``: by block, the result a layer-routed block returned to forward hooks, with its carrier
  and state, for the router's own hook after them (:meth:`~attnres_fx.routing.router.LayerRouter._after_hooks`).

One per thread and asyncio task (a ``ContextVar``, made at its first use): nothing a call in one thread
does is seen by a call in another. Not here: the collector transformers' output recorders read during one of
attnres_fx's TorchDynamo calls (:func:`attnres_fx.compat.output_recorders_traceable`), a ``threading.local``
because Dynamo reads it inside the graph it captures and cannot trace a ``ContextVar``.
"""

from __future__ import annotations

from contextvars import ContextVar


class CallContext:
    __slots__ = ("own", "interceptors", "watched", "compile_settings", "hooked_results")

    def __init__(self):
        self.own = 0
        self.interceptors: list = []
        self.watched: list = []
        self.compile_settings: list = []
        self.hooked_results: dict = {}


_CONTEXT: ContextVar[CallContext | None] = ContextVar("attnres_fx_call_context", default=None)


# This thread's call context where it has one yet, else None: ContextVar.get itself, no Python frame (every block
# call of the layer route reads it).
existing_call_context = _CONTEXT.get


def call_context() -> CallContext:
    """This thread's (or task's) call context."""
    context = _CONTEXT.get()
    if context is None:
        context = CallContext()
        _CONTEXT.set(context)
    return context
