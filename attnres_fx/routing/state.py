"""The state of a layer-routed stream between two blocks: the completed block sums and the partial sum,
travelling with the stream's *carrier*, the tensor one block returns and the next one takes.

The code that calls the blocks (``for layer in self.layers: h = layer(h, ...)``) runs as written and only
ever sees the carrier, the plain residual sum of the AttnRes branch outputs. Everything else a block
needs rides in a :class:`StreamState` attached to the carrier tensor itself (:func:`attach`,
:func:`state_of`): the state belongs to the call that made the carrier (its thread, its autograd graph),
not to the model or the process, so several forwards may run before their backwards (gradient
accumulation, pipeline schedules) and several threads may call one model at once.

For autograd the carrier is the only edge between two blocks. A block's state tensors leave it through
:func:`bundle` (one node, the carrier's) and enter the next block through :func:`unbundle` (one node on
the carrier); their gradients go from the one to the other inside the state object, beside the carrier's
own gradient. So whatever watches a block's inputs and outputs sees everything that flows: FSDP2
all-gathers a block's parameters for backward when its output's gradient arrives and reduce-scatters
them once its input's gradient is complete; activation checkpointing recomputes a block from its
arguments; a pipeline stage's outputs carry all of their gradients. For plain tensors both nodes are C++
autograd Functions of the kernel library (``cpu.Entries.bundle`` / ``unbundle``: the same outputs, backwards
without Python, the gradients kept in a holder the state points to); :class:`_Bundle` and
:class:`_Unbundle` are the same nodes in Python, for tensor subclasses, TorchDynamo's traces and machines
where the library cannot be built.

Reentrant activation checkpointing recomputes a block on a detached copy of its input, which carries no
attribute: the input of a block called that way is remembered by its storage
(:func:`remember_for_recomputation`), the recomputation finds it there (``via="storage"``) and joins the
states of the original forward, so the gradients meet where they would have.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..compat import global_forward_pre_hooks, view_base
from ..op.kernels import cpu
from ..passes.signature import StateLayout

ATTRIBUTE = "_attnres_stream_state"


class StreamState:
    """Stream ``stream`` of the conversion ``owner`` before residual site ``position``: ``blocks``
    committed, then ``partial`` (``None`` at the stream's start, where the carrier itself is ``b_0``, and
    after a skipped block start). ``grads``: the gradients the following blocks sent back for
    ``tensors``, summed.

    The attributes below start as the class gives them and are set on the state where they change: a block
    makes a state at every call, and its construction is part of what a decoding step adds."""

    grads: list | tuple = ()
    successor: StreamState | None = None      # the state a block made from this one, kept for reentrant
                                              # checkpointing's recomputation only
    # How the carrier was when the block returned it, to tell an in-place edit (:func:`edited`): its
    # version counter, or a copy where it has none (an inference tensor) and a hook may edit it.
    version: int | None = None
    snapshot: torch.Tensor | None = None
    # Whether the state travels on a new tensor a forward hook returned in place of the block's carrier.
    replaced: bool = False
    # The zeros the next block sent back as the carrier's gradient where nothing in it read the carrier.
    unread: torch.Tensor | None = None
    # The layout the next block finds it in when the carrier is not edited (layout_of), noted by the block
    # that made it: its graph is looked up by it without making a new one at every call.
    layout: StateLayout | None = None
    # Where the C++ nodes carry this state's edges (cpu.Entries.bundle / unbundle): what keeps the gradients
    # instead of ``grads`` and ``unread`` (a capsule they made).
    holder: object | None = None

    def __init__(self, owner: object, stream: int, position: int, blocks: tuple[torch.Tensor, ...] = (),
                 partial: torch.Tensor | None = None):
        self.owner = owner
        self.stream = stream
        self.position = position
        self.blocks = blocks
        self.partial = partial

    def __getstate__(self) -> dict:
        # A carrier saved (torch.save of hidden states) takes its state along; the holder belongs to this
        # process's autograd graph, and a capsule cannot be pickled.
        return {name: value for name, value in self.__dict__.items() if name != "holder"}

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state's tensors in the order a block's graph takes them: the blocks, then the partial."""
        return self.blocks if self.partial is None else (*self.blocks, self.partial)

    def add_grads(self, grads) -> None:
        if self.holder is not None:
            cpu.Entries.add_grads(self.holder, grads)
            return
        if not self.grads:
            # The first (in a training step the only) gradients for this state: nothing to sum, no loop in
            # the backward's Python, where every line runs with cold caches.
            self.grads = list(grads)
            return
        for k, grad in enumerate(grads):
            if grad is not None:
                self.grads[k] = grad if self.grads[k] is None else self.grads[k] + grad

    def take_grads(self, count: int) -> list:
        if self.holder is not None:
            return cpu.Entries.take_grads(self.holder, count)
        grads, self.grads = (self.grads or [None] * count), []
        return grads


def layout_of(state: StreamState | None, edited: bool, as_list: bool) -> StateLayout | None:
    """The layout of the state a call brings, which picks the block's graph (``edited``: its carrier was
    changed in place, so the graph takes a partial sum restated from it; ``as_list``: the graph takes the
    blocks as one list). ``None`` at the stream's start: no state, or the one made there for reentrant
    checkpointing's recomputation, which holds nothing."""
    if state is None or not (state.position or state.blocks or state.partial is not None):
        return None
    return StateLayout(state.position, len(state.blocks), edited or state.partial is not None, as_list)


def attach(carrier: torch.Tensor, state: StreamState) -> None:
    """Make ``state`` travel with ``carrier``."""
    setattr(carrier, ATTRIBUTE, state)


@dataclass(frozen=True)
class Following:
    """Where the block that takes a carrier next sits: ``parent``'s child ``name``, ``block`` at conversion."""

    parent: nn.Module
    name: str
    block: nn.Module

    def may_edit(self) -> bool:
        """Whether code may see the carrier before the next block's router does: the block's forward
        pre-hooks, or a module that took the block's place in its parent after conversion (a wrapper such
        as ``checkpoint_wrapper``: its hooks and its own code run first)."""
        return bool(self.block._forward_pre_hooks) or self.parent._modules.get(self.name) is not self.block


def returned(carrier: torch.Tensor, state: StreamState, hooked: bool, following: Following | None = None) -> None:
    """Note how ``carrier`` is as its block returns it with ``state``, so that the next block can tell an
    in-place edit: its version counter; where it has none (an inference tensor), a copy, taken where code
    may see the carrier before the next block's router does: the block's forward hooks (``hooked``), what
    ``following`` says of the next block (:meth:`Following.may_edit`), or forward pre-hooks registered for
    every module. Without such code the note costs a few looks at dicts, no copy."""
    if not carrier.is_inference():
        state.version = carrier._version
    elif hooked or global_forward_pre_hooks() or (following is not None and following.may_edit()):
        state.snapshot = carrier.clone()


def edited(carrier: torch.Tensor, state: StreamState) -> bool:
    """Whether ``carrier`` was changed in place since its block returned it with ``state`` (a forward hook's
    ``out.add_(v)``, activation steering), or is a new tensor a forward hook returned in its place."""
    if state.replaced:
        return True
    if state.version is not None:
        return carrier._version != state.version
    return state.snapshot is not None and not torch.equal(carrier, state.snapshot)


def restated(carrier: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The partial sum of a carrier edited in place: the carrier is the sum of the completed blocks and the
    partial sum, so the edit joins the partial sum, as a branch output added to the stream would."""
    partial = carrier
    for block in blocks:
        partial = partial - block
    return partial


def state_of(tensor: torch.Tensor, owner: object, stream: int) -> tuple[StreamState | None, str]:
    """The state of ``owner``'s stream ``stream`` that ``tensor`` carries, and how it was found:
    ``"carrier"`` (the tensor itself, or an autograd alias of it such as FSDP2's view of a module's
    inputs), ``"storage"`` (a detached copy: reentrant checkpointing's recomputation), or ``""``."""
    state = getattr(tensor, ATTRIBUTE, None)
    if state is None:
        base = view_base(tensor)
        state = getattr(base, ATTRIBUTE, None) if base is not None else None
    if state is not None and state.owner is owner and state.stream == stream:
        return state, "carrier"
    if _REMEMBERED:
        original = _remembered(tensor)
        state = getattr(original, ATTRIBUTE, None) if original is not None else None
        if state is not None and state.owner is owner and state.stream == stream:
            return state, "storage"
    return None, ""


_REMEMBERED: dict[tuple, weakref.ReferenceType] = {}
_REMEMBERED_LOCK = threading.Lock()


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    if tensor.device.type == "meta":
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype, tensor.device)


def remember_for_recomputation(carrier: torch.Tensor) -> None:
    """Let a detached copy of ``carrier`` (what checkpointing recomputes a block on) find the state
    ``carrier`` carries: kept by the tensor that holds it (``carrier``, or the tensor it is a view of, which
    outlives a view made for one call)."""
    key = _storage_key(carrier)
    if key is None:
        return
    holder = carrier if getattr(carrier, ATTRIBUTE, None) is not None else view_base(carrier)
    with _REMEMBERED_LOCK:
        _REMEMBERED[key] = weakref.ref(holder if holder is not None else carrier)
        for stale in [k for k, ref in _REMEMBERED.items() if ref() is None]:
            del _REMEMBERED[stale]


def _remembered(tensor: torch.Tensor) -> torch.Tensor | None:
    key = _storage_key(tensor)
    with _REMEMBERED_LOCK:
        reference = _REMEMBERED.get(key) if key is not None else None
    original = reference() if reference is not None else None
    return original if original is not tensor else None


class _Bundle(torch.autograd.Function):
    """The carrier a block returns, taking the state's tensors as inputs too. Backward: the carrier's
    gradient (none where it is the zeros the next block sent for a carrier nothing read), and for the
    state's tensors what the following blocks sent back. The result shares the
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
        state = ctx.state
        if grad is not None and grad is state.unread:
            # Nothing read the carrier: no gradient into the block's residual adds, which would otherwise
            # add these zeros to each branch output's gradient (a pass over the stream each).
            grad = state.unread = None
        return (None, grad, *state.take_grads(ctx.count))


class _Unbundle(torch.autograd.Function):
    """A block's view of the carrier it was given and of the state's tensors, all outputs of one node on
    the carrier. Backward: the state's gradients go to the state object (the previous block's
    :class:`_Bundle` takes them), the carrier's to the carrier, zeros when nothing read it, so that
    hooks on the carrier's gradient fire."""

    @staticmethod
    def forward(ctx, state: StreamState, carrier: torch.Tensor):
        ctx.state = state
        ctx.carrier = (carrier.shape, carrier.dtype, carrier.device, type(carrier) is torch.Tensor)
        ctx.set_materialize_grads(False)
        return (carrier.view_as(carrier), *(t.view_as(t) for t in state.tensors))

    @staticmethod
    def backward(ctx, grad_carrier, *grads):
        state = ctx.state
        state.add_grads(grads)
        if grad_carrier is None:
            shape, dtype, device, plain = ctx.carrier
            # Plain tensors only: a fake or functional tensor belongs to its trace.
            grad_carrier = state.unread = (_unread_zeros(shape, dtype, device)
                                           if plain and not torch.compiler.is_compiling() else
                                           torch.zeros((), dtype=dtype, device=device).expand(shape))
        return None, grad_carrier


@functools.lru_cache(maxsize=16)
def _unread_zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The zeros :class:`_Unbundle` sends for a carrier nothing read, made once, not at every block of every
    backward: the first torch call in the backward's Python after the kernels ran took some 100 us of a
    training step's block there (caches cold), the same call again some 10 us. They cannot be edited in
    place (every element is the one zero), so one serves every call."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _recorded(carrier: torch.Tensor, tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    if carrier.requires_grad:
        return True
    for tensor in tensors:
        if tensor.requires_grad:
            return True
    return False


def _made_in_cpp(entry, state, carrier: torch.Tensor, tensors: tuple[torch.Tensor, ...]):
    """What ``entry`` (``cpu.Entries.bundle`` or ``unbundle``: _Bundle or _Unbundle as a C++ node) returns for
    this call; ``None`` where it takes none: no C++ library, a TorchDynamo trace, a tensor that is not plain."""
    if entry is None or torch.compiler.is_compiling():
        return None
    return entry(state, carrier, tensors)


def bundle(carrier: torch.Tensor, tensors: tuple[torch.Tensor, ...], grads_from: StreamState) -> torch.Tensor:
    """The carrier a block returns with its state's ``tensors`` (itself when no gradient is recorded):
    their gradients will be what the following blocks send back into ``grads_from``."""
    made = _made_in_cpp(cpu.Entries.bundle, grads_from, carrier, tensors)
    if made is not None:
        return made
    if not _recorded(carrier, tensors):
        return carrier
    return _Bundle.apply(grads_from, carrier, *tensors)


def unbundle(state: StreamState, carrier: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The carrier and the state's tensors as a block reads them (one autograd node when a gradient is
    recorded, see the module docstring)."""
    tensors = state.tensors
    made = _made_in_cpp(cpu.Entries.unbundle, state, carrier, tensors)
    if made is not None:
        return made
    if not _recorded(carrier, tensors):
        return carrier, tensors
    carrier, *tensors = _Unbundle.apply(state, carrier)
    return carrier, tuple(tensors)
