"""The state of a layer-routed stream between two layers: the completed block sums and the partial sum,
travelling with the stream's *carrier*, the tensor one layer returns and the next one takes.

The code that calls the layers (``for layer in self.layers: h = layer(h, ...)``) runs as written and only
ever sees the carrier, the plain residual sum of the AttnRes branch outputs. Everything else a layer
needs rides in a :class:`StreamState` registered on the carrier object (:func:`register`,
:func:`state_of`): the state belongs to the call, not to the model, so several forwards may run before
their backwards (gradient accumulation, pipeline schedules).

For autograd the carrier is the only edge between two layers. A layer's state tensors leave it through
:func:`bundle` (one node, the carrier's) and enter the next layer through :func:`unbundle` (one node on
the carrier); their gradients go from the one to the other inside the state object, beside the carrier's
own gradient. So whatever watches a layer's inputs and outputs sees everything that flows: FSDP2
all-gathers a layer's parameters for backward when its output's gradient arrives and reduce-scatters
them once its input's gradient is complete; activation checkpointing recomputes a layer from its
arguments; a pipeline stage's outputs carry all of their gradients.

Reentrant activation checkpointing recomputes a layer on a detached copy of its input: the copy is
found by its storage (:func:`state_of`, ``via="storage"``), and the recomputation joins the states of
the original forward, so the gradients meet where they would have.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .compat import view_base


@dataclass(eq=False)
class StreamState:
    """The stream ``stream`` before residual site ``position``: ``blocks`` committed, then ``partial``
    (``None`` at the stream's start, where the carrier itself is ``b_0``, and after a skipped block
    start). ``grads``: the gradients the following layers sent back for ``tensors``, summed."""

    stream: int
    position: int
    blocks: tuple[torch.Tensor, ...] = ()
    partial: torch.Tensor | None = None
    grads: list = field(default_factory=list)
    successor: StreamState | None = None      # the state a layer made from this one, kept for reentrant
                                              # checkpointing's recomputation only

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state's tensors in the order a layer's graph takes them: the blocks, then the partial."""
        return self.blocks + (() if self.partial is None else (self.partial,))

    def add_grads(self, grads) -> None:
        if not self.grads:
            self.grads = [None] * len(grads)
        for k, grad in enumerate(grads):
            if grad is not None:
                self.grads[k] = grad if self.grads[k] is None else self.grads[k] + grad

    def take_grads(self, count: int) -> list:
        grads, self.grads = (self.grads or [None] * count), []
        return grads


_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_BY_STORAGE: dict[tuple, weakref.ReferenceType] = {}


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    if tensor.device.type == "meta":
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype, tensor.device)


def register(carrier: torch.Tensor, state: StreamState) -> None:
    _STATES[carrier] = state
    key = _storage_key(carrier)
    if key is not None:
        _BY_STORAGE[key] = weakref.ref(carrier)
        if len(_BY_STORAGE) > 4 * len(_STATES) + 64:
            for stale in [k for k, ref in _BY_STORAGE.items() if ref() is None]:
                del _BY_STORAGE[stale]


def state_of(tensor: torch.Tensor, stream: int) -> tuple[StreamState | None, str]:
    """The state registered on ``tensor`` for ``stream``, and how it was found: ``"carrier"`` (the
    tensor itself, or an autograd alias of it such as FSDP2's view of a module's inputs), ``"storage"``
    (a detached copy: reentrant checkpointing's recomputation), or ``""`` (none)."""
    for candidate in (tensor, view_base(tensor)):
        if candidate is not None:
            state = _STATES.get(candidate)
            if state is not None and state.stream == stream:
                return state, "carrier"
    key = _storage_key(tensor)
    reference = _BY_STORAGE.get(key) if key is not None else None
    original = reference() if reference is not None else None
    if original is not None and original is not tensor:
        state = _STATES.get(original)
        if state is not None and state.stream == stream:
            return state, "storage"
    return None, ""


class _Bundle(torch.autograd.Function):
    """The carrier a layer returns, taking the state's tensors as inputs too. Backward: the carrier's
    gradient, and for the state's tensors what the following layers sent back. The result shares the
    carrier's storage but is no view of it: hooks that watch a module's results (FSDP2's) treat views as
    fragile."""

    @staticmethod
    def forward(ctx, state: StreamState, carrier: torch.Tensor, *tensors: torch.Tensor):
        ctx.state = state
        ctx.count = len(tensors)
        ctx.set_materialize_grads(False)
        return carrier.detach()

    @staticmethod
    def backward(ctx, grad):
        return (None, grad, *ctx.state.take_grads(ctx.count))


class _Unbundle(torch.autograd.Function):
    """A layer's view of the carrier it was given and of the state's tensors, all outputs of one node on
    the carrier. Backward: the state's gradients go to the state object (the previous layer's
    :class:`_Bundle` takes them), the carrier's to the carrier, zeros when nothing read it, so that
    hooks on the carrier's gradient fire."""

    @staticmethod
    def forward(ctx, state: StreamState, carrier: torch.Tensor):
        ctx.state = state
        ctx.carrier = (carrier.shape, carrier.dtype, carrier.device)
        ctx.set_materialize_grads(False)
        return (carrier.view_as(carrier), *(t.view_as(t) for t in state.tensors))

    @staticmethod
    def backward(ctx, grad_carrier, *grads):
        ctx.state.add_grads(grads)
        if grad_carrier is None:
            shape, dtype, device = ctx.carrier
            grad_carrier = torch.zeros((), dtype=dtype, device=device).expand(shape)
        return None, grad_carrier


def _recorded(carrier: torch.Tensor, tensors) -> bool:
    return torch.is_grad_enabled() and (carrier.requires_grad or any(t.requires_grad for t in tensors))


def bundle(carrier: torch.Tensor, tensors: tuple[torch.Tensor, ...], grads_from: StreamState) -> torch.Tensor:
    """The carrier a layer returns with its state's ``tensors`` (itself when no gradient is recorded):
    their gradients will be what the following layers send back into ``grads_from``."""
    if not _recorded(carrier, tensors):
        return carrier
    return _Bundle.apply(grads_from, carrier, *tensors)


def unbundle(state: StreamState, carrier: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The carrier and the state's tensors as a layer reads them (one autograd node when a gradient is
    recorded, see the module docstring)."""
    if not _recorded(carrier, state.tensors):
        return carrier, state.tensors
    carrier, *tensors = _Unbundle.apply(state, carrier)
    return carrier, tuple(tensors)
