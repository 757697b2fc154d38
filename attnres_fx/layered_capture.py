"""Capture of a model whose forward TorchDynamo cannot take as one graph (a warning, a data-dependent
branch, a cache utility outside every block): one graph per block instead, and the blocks' order from a
real call.

1. one call of the model on the example inputs, for real: no gradients, the random state and every
   buffer restored afterwards, recording each module call's inputs and result (:func:`record_calls`);
2. the calls of sibling modules that pass one tensor from each to the next, by identity (``h =
   layer(h)``), are a chain of blocks; each block of the longest chain is captured on its own recorded
   inputs (fake tensors, as for the whole model) and its residual sites detected in its own graph;
3. the stream is the blocks' sites in order; its layer spans (:class:`~attnres_fx.passes.layers.LayerSpan`)
   are the modules that perform them, and consecutive ones must pass the stream on by identity in the
   recorded call, as the layer route needs.

A block whose forward cannot be captured raises :class:`~attnres_fx.TraceError` naming the block and
the construct. The result is a :class:`~attnres_fx.passes.detect.Detection` like that of one graph
(its sites' nodes belong to several graphs), with the spans for the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from attnres_fx.passes.detect import Detection, ResidualStream, detect_residual_streams
from attnres_fx.passes.layers import LayerSpan
from attnres_fx.passes.provenance import owner_path

from .compat import pytree
from .capture import capture_dynamo, capturing
from .errors import NoResidualStreamError, TraceError


@dataclass
class Call:
    """One recorded call of a module: its path, inputs and result."""

    path: str
    args: tuple
    kwargs: dict
    output: object = None

    def tensors_in(self) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)]

    def tensors_out(self) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves(self.output) if isinstance(t, torch.Tensor)]


def record_calls(model: nn.Module, args: tuple, kwargs: dict) -> list[Call]:
    """Run ``model(*args, **kwargs)`` once, changing nothing (see the module docstring), and return its
    module calls in the order they began."""
    calls: list[Call] = []
    open_calls: dict[int, list[Call]] = {}
    handles = []

    def enter(path, module, call_args, call_kwargs):
        call = Call(path, call_args, call_kwargs)
        calls.append(call)
        open_calls.setdefault(id(module), []).append(call)

    def leave(module, call_args, call_kwargs, output):
        open_calls[id(module)].pop().output = output

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k, path=path: enter(path, m, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True))
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), capturing():
            model(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the model's own failure, reported as such
        raise TraceError(f"{type(model).__name__} fails on the example inputs as they are given: "
                         f"{type(err).__name__}: {err}\nPass example inputs that make a valid call of the model "
                         "(positional as example_inputs, keyword as example_kwargs).", {"model": err}) from err
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
    return calls


def capture_by_blocks(model: nn.Module, args: tuple, kwargs: dict, whole: TraceError
                      ) -> tuple[Detection, list[tuple[LayerSpan, ...]]]:
    """Detection and layer spans of ``model``'s streams from its blocks' own graphs; ``whole``: why the
    whole model could not be captured (raised again, with a word on the blocks, if no chain of blocks
    holds residual sites)."""
    calls = record_calls(model, args, kwargs)
    streams, spans, taken = [], [], []
    for chain in sorted(_chains(calls), key=len, reverse=True):
        paths = [call.path for call in chain]
        if any(_related(path, other) for path in paths for other in taken):
            continue
        found = _stream(model, chain, calls)
        if found is not None:
            streams.append(found[0])
            spans.append(found[1])
            taken.extend(paths)
    if streams:
        order = sorted(range(len(streams)), key=lambda k: [c.path for c in calls].index(spans[k][0].owner))
        return Detection(tuple(streams[k] for k in order), (), (), ()), [spans[k] for k in order]
    raise TraceError(f"{whole}\nNo chain of blocks (modules called in turn, each taking the tensor the one before "
                     "returned) holds residual sites either, so the layer route cannot go around it.",
                     whole.causes) from whole


def _chains(calls: list[Call]) -> list[list[Call]]:
    """Runs of calls of sibling modules, each taking a tensor the previous one returned (by identity)."""
    by_parent: dict[str, list[Call]] = {}
    for call in calls:
        if call.path:
            by_parent.setdefault(call.path.rpartition(".")[0], []).append(call)
    chains = []
    for siblings in by_parent.values():
        chain: list[Call] = []
        for call in siblings:
            if chain and _passes(chain[-1], call):
                chain.append(call)
                continue
            if len(chain) > 1:
                chains.append(chain)
            chain = [call]
        if len(chain) > 1:
            chains.append(chain)
    return chains


def _passes(before: Call, after: Call) -> bool:
    results = {id(t) for t in before.tensors_out()}
    return any(id(t) in results for t in after.tensors_in())


def _stream(model: nn.Module, chain: list[Call], calls: list[Call]):
    """The stream through ``chain``'s blocks, or None if they hold no residual sites."""
    sites, dim, start, layout = [], None, None, None
    for call in chain:
        module = model.get_submodule(call.path)
        try:
            graph, _ = capture_dynamo(module, call.args, call.kwargs)
        except TraceError as err:
            raise TraceError(f"{call.path} ({type(module).__name__}) cannot be captured as one graph, which the "
                             f"layer route needs for every block: {err}", err.causes) from err
        detection = detect_residual_streams(graph, min_sites=1)
        if len(detection.streams) != 1:
            return None
        (found,) = detection.streams
        sites.extend(dataclasses.replace(site, owner=_absolute(call.path, site)) for site in found.sites)
        if start is None:
            start, layout = found.start, found.layout
        dim = dim or found.dim
    if len(sites) < 2:
        return None
    spans: list[LayerSpan] = []
    for position, site in enumerate(sites):
        if spans and spans[-1].owner == site.owner:
            spans[-1] = LayerSpan(site.owner, spans[-1].start, position + 1)
        else:
            spans.append(LayerSpan(site.owner, position, position + 1))
    owner_calls = {call.path: call for call in calls}
    for before, after in zip(spans, spans[1:]):
        if not _passes(owner_calls[before.owner], owner_calls[after.owner]):
            raise NoResidualStreamError(
                f"{before.owner} and {after.owner} perform consecutive residual sites, but the stream does not "
                "pass from one to the other as a tensor one returns and the other takes; the layer route needs "
                "that where the whole model cannot be captured as one graph")
    return ResidualStream(start, tuple(sites), dim, layout), tuple(spans)


def _related(path: str, other: str) -> bool:
    return path == other or path.startswith(other + ".") or other.startswith(path + ".")


def _absolute(block: str, site) -> str:
    """The site's owner as a path in the model: the block itself when the add is in its own forward."""
    inner = owner_path(site.add)
    return f"{block}.{inner}" if inner else block

