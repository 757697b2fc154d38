"""Pipeline parallelism for a converted model: its layer-routed stream split into stage modules for
``torch.distributed.pipelining``.

    stages = attnres_fx.pipeline_stages(model, split_before=["layers.2"], example_inputs=(ids,))
    stage = PipelineStage(stages[rank], rank, len(stages), device)
    ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn).step(ids if rank == 0 else None, target=...)

A stage covers consecutive blocks of the stream. The first stage takes the model's inputs and returns
the stream's state where the next stage begins; every later stage takes that state and returns the next
one, and the last returns the model's output. The state is what the blocks pass along on the layer
route (:mod:`attnres_fx.routing.state`): the completed block sums ``b_0 .. b_{n-1}`` and the partial sum,
at most ``N + 1`` tensors, their number fixed by the plan (:func:`stage_boundaries` lists them).

Stages run the model's own forward, as written: the first one stops at the first block of the next
stage; a later one runs the model's forward on *placeholders* of the example inputs (only the batch size
follows the received state), lets the blocks of earlier stages return at once (their results are never
computed: the carrier the stage received stands in for them) and runs its own blocks. So what the model
computes outside its blocks from the inputs (rotary tables, causal masks, position ids) is rebuilt on
every stage from the example inputs: values that vary from batch to batch outside the stream (a padding
mask) cannot be pipelined this way, and every rank holds the modules the model's forward calls outside
its blocks.

Cross-stage caching (``ranks``): under interleaved schedules a rank runs several stages, stage ``s`` on
rank ``s % ranks``, and would receive back block sums it produced or received itself for an earlier
stage. With ``ranks`` given, a stage sends only the blocks the next stage's rank does not hold; the next
stage takes the others from its rank's own earlier stage, and their gradients go back to that stage on
the same rank. ``stage.sent_bytes`` counts what each stage returned for sending.
"""

from __future__ import annotations

import collections
import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import pytree
from .. import routing
from ..capture.tracers import as_args, dummy_inputs
from ..conversion import conversion_of
from ..errors import RoutingError
from ..passes.plan import StreamPlan
from ..routing.state import StreamState, attach, bundle, returned, state_of, unbundle


@dataclass(frozen=True)
class Boundary:
    """Where stage ``stage`` begins: residual site ``position``, with ``blocks`` completed block sums and
    a partial sum; ``cached``: how many of the blocks the stage takes from its own rank's earlier stage
    instead of receiving them."""

    stage: int
    layer: str
    position: int
    blocks: int
    cached: int

    @property
    def received(self) -> int:
        """Tensors the stage receives: the uncached blocks and the partial sum."""
        return self.blocks - self.cached + 1


def stage_boundaries(model: nn.Module, split_before: list[str], *, ranks: int | None = None) -> list[Boundary]:
    """The boundaries :func:`pipeline_stages` would make (one per stage after the first)."""
    planned, starts = _split(model, split_before)
    return _boundaries(planned, starts, ranks)


def pipeline_stages(model: nn.Module, split_before: list[str], *, example_inputs: Any = None,
                    example_kwargs: dict | None = None, ranks: int | None = None) -> list[nn.Module]:
    """Stage modules for ``torch.distributed.pipelining.PipelineStage``; see the module docstring.

    ``split_before``: the blocks that begin a new stage (their module paths, ``"layers.4"``), in order;
    ``n`` names make ``n + 1`` stages. ``example_inputs`` / ``example_kwargs``: a call of the model as the
    pipeline runs it (a Hugging Face model's dummy inputs by default); the model runs once on them to see
    which of its modules each stage calls. ``ranks``: cross-stage caching for stage ``s`` on rank
    ``s % ranks`` (interleaved schedules); ``None`` sends every block.

    The stage modules hold the model's own modules, so their parameters are the model's (a stage's
    ``parameters()`` are the ones its part of the forward uses). Raises :class:`~attnres_fx.RoutingError`
    when the model has no single layer-routed stream, a name is no block of it or out of order, a block's
    result holds tensors besides the stream, or a parameter is used by two stages (tied weights: untie
    them for pipelining).
    """
    planned, starts = _split(model, split_before)
    boundaries = _boundaries(planned, starts, ranks)
    if example_inputs is None and example_kwargs is None:
        dummy = dummy_inputs(model)
        if dummy is None:
            raise RoutingError("pipeline_stages needs example_inputs (and example_kwargs) as the model is called")
        args, kwargs = dummy
    else:
        args, kwargs = as_args(example_inputs) or (), dict(example_kwargs or {})
    probe = _Probe(model, planned, starts)
    probe.run(args, kwargs)
    cache = _RankCache()
    stages = []
    for k in range(len(starts)):
        entry = boundaries[k - 1] if k else None
        leaving = boundaries[k] if k < len(boundaries) else None
        later = boundaries[k + ranks - 1] if ranks and k + ranks - 1 < len(boundaries) else None
        stages.append(PipelineStageModule(model, planned, k, starts, entry, leaving, later, probe, cache,
                                          (args, kwargs)))
    return stages


def _split(model: nn.Module, split_before: list[str]) -> tuple[StreamPlan, list[int]]:
    conversion = conversion_of(model)
    if conversion is None:
        raise ValueError(f"model: pipeline_stages needs a model converted by attnres_fx.attnresify, got a "
                         f"{type(model).__name__} that is not converted")
    layered = [stream for stream in conversion.plan.streams if stream.route == "layer"]
    if len(conversion.plan.streams) != 1 or not layered:
        raise RoutingError(f"pipeline_stages splits one residual stream on the layer route; this model has "
                           f"{len(conversion.plan.streams)} stream(s), routes {conversion.plan.routes}")
    planned = layered[0]
    owners = [span.owner for span in planned.layers]
    starts = [0]
    for name in split_before:
        if name not in owners:
            raise RoutingError(f"split_before: {name!r} is not a block of the stream; its blocks are "
                               f"{', '.join(owners[:4])}{' ...' if len(owners) > 4 else ''}")
        index = owners.index(name)
        if index <= starts[-1]:
            raise RoutingError(f"split_before: {name!r} must come after the previous split and the first block")
        starts.append(index)
    return planned, starts


def _boundaries(planned: StreamPlan, starts: list[int], ranks: int | None) -> list[Boundary]:
    boundaries = []
    for k, index in enumerate(starts[1:], start=1):
        position = planned.layers[index].start
        blocks = planned.completed_before(position)
        # Stage k - ranks, on the same rank, left the state where stage k - ranks + 1 began: those blocks
        # are there already (boundaries[m] is where stage m + 1 begins).
        cached = boundaries[k - ranks].blocks if ranks and 0 <= k - ranks < len(boundaries) else 0
        boundaries.append(Boundary(k, planned.layers[index].owner, position, blocks, cached))
    return boundaries


class _StageExit(Exception):
    """Raised at the first block of the next stage to end a stage's run of the model's forward."""

    def __init__(self, carrier: torch.Tensor):
        super().__init__()
        self.carrier = carrier


class _Probe:
    """One call of the model (no gradients, the random state and buffers restored afterwards) that
    records what the stages need: each block's result structure, and the stage in which each module is
    called (a parameter belongs to the stage of the innermost called module holding it; a block's whole
    subtree, its AttnRes modules included, to the block's stage)."""

    def __init__(self, model: nn.Module, planned: StreamPlan, starts: list[int]):
        self.conversion = conversion_of(model)
        self.model = model
        self.planned = planned
        self.starts = starts
        self.owners = [span.owner for span in planned.layers]
        self.stage = 0
        self.blocks_done = False
        self.results: dict[str, tuple] = {}                   # block path -> (treespec, carrier index, leaves)
        self.calls: dict[str, set[int]] = collections.defaultdict(set)
        self.inside = 0

    def stage_of(self, layer_index: int) -> int:
        return max(k for k, start in enumerate(self.starts) if start <= layer_index)

    def intercept(self, router, args, kwargs, proceed):
        index = self.owners.index(router.path)
        self.stage = self.stage_of(index)
        self.inside += 1
        try:
            out = proceed(*args, **kwargs)
        finally:
            self.inside -= 1
        self.blocks_done = index + 1 == len(self.owners)
        leaves, spec = pytree.tree_flatten(out)
        carriers = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
                    and state_of(leaf, self.conversion, self.planned.index)[0] is not None]
        tensors = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not self.blocks_done and (len(carriers) != 1 or len(tensors) != 1):
            raise RoutingError(f"pipeline_stages: the result of {router.path} holds {len(tensors)} tensor(s); a "
                               "stage can stand in only for blocks whose result is the stream alone")
        self.results[router.path] = (spec, carriers[0] if carriers else None,
                                     [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
        return out

    def run(self, args: tuple, kwargs: dict) -> None:
        # Hooks only outside the blocks (a block's whole subtree is its stage's): inside, Dynamo would trace
        # them and replay their effects over what the block's own graph recorded.
        hooks = [module.register_forward_pre_hook(functools.partial(self._called, path))
                 for path, module in self.model.named_modules() if self._block_of(path) is None]
        buffers = {name: buffer.clone() for name, buffer in self.model.named_buffers()}
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), routing.intercepting(self):
                self.model(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(buffers[name])
        stages: dict[int, set[int]] = collections.defaultdict(set)
        for name, parameter in self.model.named_parameters(remove_duplicate=False):
            stages[id(parameter)].add(self.stage_of_parameter(name))
        tied = [name for name, p in self.model.named_parameters() if len(stages[id(p)]) > 1]
        if tied:
            raise RoutingError(f"pipeline_stages: {', '.join(tied[:4])} would be used by more than one stage (tied "
                               "weights); untie them (a copy per stage) for pipeline parallelism")

    def _called(self, path: str, module, args):
        self.calls[path].add(self.stage if self.inside else (len(self.starts) - 1 if self.blocks_done else 0))

    def _block_of(self, path: str) -> int | None:
        return next((index for index, owner in enumerate(self.owners)
                     if path == owner or path.startswith(owner + ".")), None)

    def stage_of_parameter(self, name: str) -> int:
        path = name.rpartition(".")[0]
        block = self._block_of(path)
        if block is not None:
            return self.stage_of(block)
        while path and path not in self.calls:
            path = path.rpartition(".")[0]
        return min(self.calls.get(path) or {0})

    def parameters_of(self, stage: int) -> list[nn.Parameter]:
        return [p for name, p in self.model.named_parameters() if self.stage_of_parameter(name) == stage]


class _RankCache:
    """Per rank: the state each stage left, by microbatch, for the rank's later stages."""

    def __init__(self):
        self.left: dict[int, collections.deque] = collections.defaultdict(collections.deque)


class PipelineStageModule(nn.Module):
    """Stage ``index`` of a converted model; see :func:`pipeline_stages`."""

    def __init__(self, model: nn.Module, planned: StreamPlan, index: int, starts: list[int], entry: Boundary | None,
                 leaving: Boundary | None, later: Boundary | None, probe: _Probe, cache: _RankCache,
                 example: tuple[tuple, dict]):
        super().__init__()
        self.index = index
        self.entry = entry
        self.leaving = leaving
        self.later = later if later is not None and later.cached else None
        self.first_layer = starts[index]
        self.stop_layer = starts[index + 1] if index + 1 < len(starts) else len(planned.layers)
        self.uses = nn.ParameterList(probe.parameters_of(index))
        # Not submodules: the model and what the stage learned about it.
        self.__dict__["model"] = model
        self.__dict__["planned"] = planned
        self.__dict__["conversion"] = conversion_of(model)
        self.__dict__["results"] = probe.results
        self.__dict__["cache"] = cache
        self.__dict__["example"] = example
        self.sent_bytes = 0
        self._carrier: torch.Tensor | None = None

    def extra_repr(self) -> str:
        layers = self.planned.layers
        return f"stage {self.index}: {layers[self.first_layer].owner} .. {layers[self.stop_layer - 1].owner}"

    def forward(self, *inputs, **kwargs):
        if self.entry is None:
            args = inputs
        else:
            self._carrier = self._received(inputs)
            args, kwargs = self._placeholders(inputs[-1].shape[0])
        try:
            with routing.intercepting(self):
                out = self.model(*args, **kwargs)
        except _StageExit as exit_:
            return self._leave(exit_.carrier)
        finally:
            self._carrier = None
        return _tensors_of(out)

    def intercept(self, router, args, kwargs, proceed):
        index = [span.owner for span in self.planned.layers].index(router.path)
        if index < self.first_layer:
            spec, carrier, leaves = self.results[router.path]
            leaves = list(leaves)
            leaves[carrier] = self._carrier
            return pytree.tree_unflatten(leaves, spec)
        if index >= self.stop_layer:
            raise _StageExit(next(leaf for leaf in pytree.tree_leaves((args, kwargs))
                                  if isinstance(leaf, torch.Tensor)
                                  and state_of(leaf, self.conversion, self.planned.index)[0]))
        return proceed(*args, **kwargs)

    def _received(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The carrier this stage's first block takes: the received state (and the cached blocks)."""
        entry = self.entry
        if len(inputs) != entry.received:
            raise RoutingError(f"stage {self.index} takes {entry.received} tensors (blocks {entry.cached}.."
                               f"{entry.blocks - 1} and the partial sum), got {len(inputs)}")
        cached: tuple[torch.Tensor, ...] = ()
        if entry.cached:
            earlier = self.cache.left[self.index].popleft()
            cached = tuple(_grad_to(earlier, k) for k in range(entry.cached))
        blocks = cached + tuple(inputs[:-1])
        partial = inputs[-1]
        state = StreamState(self.conversion, self.planned.index, entry.position, blocks, partial)
        carrier = partial
        for block in blocks:
            carrier = carrier + block.reshape_as(partial)
        carrier = bundle(carrier, state.tensors, grads_from=state)
        attach(carrier, state)
        # The earlier blocks' forward hooks and the first block's pre-hooks see it first.
        returned(carrier, state, hooked=True)
        return carrier

    def _leave(self, carrier: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state, _ = state_of(carrier, self.conversion, self.planned.index)
        _, tensors = unbundle(state, carrier)
        if self.later is not None:
            # The rank's later stage takes its first blocks from here instead of receiving them.
            self.cache.left[self.later.stage].append(state)
        sent = tensors[self.leaving.cached:]
        self.sent_bytes += sum(t.numel() * t.element_size() for t in sent)
        return tuple(sent)

    def _placeholders(self, batch: int) -> tuple[tuple, dict]:
        """The example inputs with ``batch`` rows: what the model's forward runs on in a later stage."""
        def resized(tensor: torch.Tensor) -> torch.Tensor:
            return tensor[:1].expand(batch, *tensor.shape[1:]).contiguous() if tensor.dim() else tensor
        return pytree.tree_map_only(torch.Tensor, resized, copy.copy(self.example))


def _tensors_of(output):
    """The last stage's result as pipelining takes it, tensors only: a ``ModelOutput`` or dict gives its
    tensors in order (a Hugging Face language model without labels: its logits), one tensor alone."""
    if isinstance(output, dict):
        tensors = tuple(value for value in output.values() if isinstance(value, torch.Tensor))
        return tensors[0] if len(tensors) == 1 else tensors
    return output


def _grad_to(state: StreamState, index: int) -> torch.Tensor:
    """Block ``index`` of an earlier stage's state on this rank, as a leaf whose gradient goes back into
    that state (its stage's backward then returns it through the blocks that made it)."""
    block = state.tensors[index].detach().requires_grad_(state.tensors[index].requires_grad)
    if block.requires_grad:
        count = len(state.tensors)
        block.register_hook(lambda grad: state.add_grads([grad if k == index else None for k in range(count)]))
    return block

