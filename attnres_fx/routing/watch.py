"""Whether a call of a layer-routed stream's owner ran the stream to its end.

On the layer route the owner's code (``LlamaModel.forward``) runs as written and calls the blocks; a call
that runs the stream's first blocks but not its last (fewer layers than converted) never takes the final
aggregation. Forward hooks on the owner (:class:`StreamWatch`) keep a record of each of its calls in the
call context (:mod:`attnres_fx.context`: one per thread); the first and last blocks mark it
(:func:`note_stream_start`, :func:`note_stream_end`), and a call that started the stream without ending it
raises :class:`~attnres_fx.StreamMismatchError`, as the model route does for the same call.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..errors import StreamMismatchError, refuse_fullgraph_trace
from ..context import call_context

class _Record:
    __slots__ = ("conversion", "stream", "started", "finished")

    def __init__(self, conversion, stream: int):
        self.conversion, self.stream, self.started, self.finished = conversion, stream, False, False


class StreamWatch:
    """The hooks on the owner of stream ``stream`` of ``conversion``. ``layers``: the containers that hold
    the stream's routed layers (a ``ModuleList``, by path in ``root``) -> their children as converted; a
    call that finds one changed (a layer pruned, added or replaced after conversion, or the container
    replaced by one of other layers) raises :class:`~attnres_fx.StreamMismatchError` naming it, before
    anything runs. A child that wraps its converted layer (``checkpoint_wrapper``, which holds the layer
    as a submodule) is that layer."""

    def __init__(self, conversion, stream: int, root: nn.Module, layers: dict[str, tuple]):
        self.conversion = conversion
        self.stream = stream
        self.root = root
        self.layers = layers
        # Per path, the container and children last seen and found to be the converted layers.
        self._accepted = {path: (root.get_submodule(path), children) for path, children in layers.items()}

    def enter(self, module, args):
        if torch.compiler.is_dynamo_compiling():
            from .dynamo import inside_own_capture

            # A host's capture (attnres_fx.routing.host) rewrites the whole stream in its graph.
            if not inside_own_capture() and not self.conversion.host:
                refuse_foreign_fullgraph(f"{type(module).__name__} (the owner of residual stream {self.stream})")
            return None
        self._enter()
        return None

    @torch.compiler.disable
    def _enter(self):
        self.check_layers()
        call_context().watched.append(_Record(self.conversion, self.stream))

    def check_layers(self) -> None:
        """Raise :class:`~attnres_fx.StreamMismatchError` where a container holds other layers than when
        the model was converted (the model route checks this before each call, which it runs as one
        graph, hooks inlined)."""
        for path, children in self.layers.items():
            container = _present(self.root, path)
            now = tuple(container._modules.values()) if container is not None else ()
            if (container, now) != self._accepted[path]:
                if tuple(_converted_layer(child, children) for child in now) != children:
                    raise layers_changed(self.conversion, path, container or nn.ModuleList(), children)
                self._accepted[path] = (container, now)

    def leave(self, module, args, output):
        if torch.compiler.is_dynamo_compiling():
            return None            # in attnres_fx's own capture or a host's (enter refused others)
        return self._leave(module)

    @torch.compiler.disable
    def _leave(self, module):
        record = _current(self.conversion, self.stream)
        if record is None:
            return None
        call_context().watched.remove(record)
        if record.started and not record.finished and sys.exc_info()[0] is None:
            raise stream_ended_early(self.conversion, self.stream, module)
        return None


def _present(root: nn.Module, path: str) -> nn.Module | None:
    """The module at ``path`` in ``root`` now, or None where something on the way was deleted."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _current(conversion, stream: int) -> _Record | None:
    for record in reversed(call_context().watched):
        if record.conversion is conversion and record.stream == stream:
            return record
    return None


def note_stream_start(conversion, stream: int) -> None:
    record = _current(conversion, stream)
    if record is not None:
        record.started = True


def note_stream_end(conversion, stream: int) -> None:
    record = _current(conversion, stream)
    if record is not None:
        record.finished = True


def stream_ended_early(conversion, stream: int, owner: nn.Module) -> StreamMismatchError:
    planned = conversion.plan.streams[stream]
    return StreamMismatchError(
        f"this call of {type(owner).__name__} ran the first modules of residual stream {stream} but not its last "
        f"one ({planned.layers[-1].owner}), so the stream ended early and its final aggregation was never "
        "taken. This happens when a call takes a code path the conversion did not see (fewer layers), or when "
        "the model changed after conversion (attnres_fx.remove, then convert again).")


def _converted_layer(child: nn.Module, children: tuple) -> nn.Module:
    """``child`` itself, or the converted layer it wraps (the first of ``children`` among its submodules)."""
    if any(child is layer for layer in children):
        return child
    return next((module for module in child.modules() if any(module is layer for layer in children)), child)


def layers_changed(conversion, path: str, container: nn.Module, children: tuple) -> StreamMismatchError:
    converted = [name for name, child in container._modules.items()]
    planned = {id(child) for child in children}
    unwrapped = {name: _converted_layer(child, children) for name, child in container._modules.items()}
    now = {id(child) for child in unwrapped.values()}
    gone = len(planned - now)
    added = [f"{path}.{name}" for name, child in unwrapped.items() if id(child) not in planned]
    sites = [site.name for site in conversion.plan.sites if site.name.startswith(f"{path}.")]
    what = "; ".join(part for part in (
        f"{gone} of the {len(children)} layers converted are gone (pruned)" if gone else "",
        f"{', '.join(added)} {'was' if len(added) == 1 else 'were'} added after conversion" if added else "",
        "" if gone or added else "its layers were reordered") if part)
    return StreamMismatchError(
        f"{path or '<root>'} holds other layers than when the model was converted ({len(children)} then, "
        f"{len(converted)} now: {what}), so its AttnRes plan ({len(sites)} sites, {sites[0] if sites else ''}...) no "
        "longer fits. Convert the model again for its new layers: attnres_fx.remove(model) (which takes the changed "
        "model), then attnres_fx.attnresify(model).")


def refuse_foreign_fullgraph(where: str) -> None:
    """Raise :class:`~attnres_fx.ForeignCompileError` while another ``torch.compile(..., fullgraph=True)``
    traces ``where`` (a routed module or a stream's owner): nothing of a converted model's route can be
    part of its single graph."""
    refuse_fullgraph_trace(
        f"torch.compile(..., fullgraph=True) reached {where}, which runs the AttnRes rewrite through "
        "attnres_fx's own route and cannot be part of another compilation's single graph. Use "
        "attnres_fx.compile(model) for Inductor (it compiles each block's rewritten graph), or drop "
        "fullgraph=True (this call then runs the AttnRes route between the compiled graphs).")
