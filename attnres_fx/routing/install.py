"""Installing the routing on a converted model, and taking it off again, from one record.

:func:`install` registers the plan's ``BlockAttnRes`` modules where the plan names them, gives every
routed module its router as an instance attribute ``forward``, and puts the stream watches on the
owners of layer-routed streams; what it did is one :class:`Installed` record on the
:class:`~attnres_fx.conversion.Conversion`, hook handles included, and :func:`uninstall` undoes exactly
that. Both are all or nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ..op.module import BlockAttnRes
from ..config import AttnResConfig
from ..conversion import Conversion, attach, detach
from ..errors import RoutingError
from ..passes.plan import Plan
from .graphs import TraceCache
from .router import LayerRouter, ModelRouter, Router, WholeCallRouter
from .watch import StreamWatch


@dataclass(frozen=True)
class Installed:
    """What :func:`install` did to a model: the AttnRes modules it registered (by name), the modules it
    routed (by path), and the stream watches' hook handles."""

    modules: tuple[str, ...]
    routed: tuple[str, ...]
    handles: tuple


@dataclass(frozen=True)
class Prepared:
    """A conversion not installed yet and the layer routers it will install, by path, with what the
    conversion's trial made through them (:mod:`attnres_fx.routing.trial`)."""

    conversion: Conversion
    routers: dict[str, LayerRouter]


def prepared_routes(model: nn.Module, plan: Plan, config: AttnResConfig) -> Prepared:
    """The conversion of ``model`` to ``plan`` and its layer routers, made without touching ``model``."""
    conversion = Conversion(plan, config)
    conversion.traces = TraceCache(config.trace_cache_size, conversion.stats)
    routers = {span.owner: LayerRouter(model, model.get_submodule(span.owner), span.owner, conversion, stream.index,
                                       span, span.opened)
               for stream in plan.streams for span in stream.layers}
    return Prepared(conversion, routers)


def routers(model: nn.Module) -> list[Router]:
    """The routers installed on ``model`` and its submodules."""
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), Router)]


def install(model: nn.Module, plan: Plan, modules: dict[str, BlockAttnRes], config: AttnResConfig,
            prepared: Prepared | None = None) -> Conversion:
    """Register the AttnRes modules, the routers and the stream watches on ``model``; all or nothing.
    ``prepared``: the conversion and layer routers its trial made (new ones otherwise)."""
    model_routed = [stream.owner for stream in plan.streams if stream.route == "model"]
    routed = dict.fromkeys(([""] if model_routed else []) + model_routed)
    layers = {span.owner: (stream.index, span) for stream in plan.streams for span in stream.layers}
    routed.update(dict.fromkeys(layers))
    targets = [(path, model.get_submodule(path)) for path in routed]
    for path, module in targets:
        if "forward" in module.__dict__:
            raise RoutingError(
                f"{type(module).__name__} at '{path or '<root>'}' has an instance attribute 'forward' (a "
                f"wrapper installed by another library, e.g. accelerate's device-map hooks: "
                f"{module.__dict__['forward']!r}); attnres_fx routes calls through forward itself. Convert "
                "the model before adding such wrappers.")
    prepared = prepared or prepared_routes(model, plan, config)
    conversion = prepared.conversion
    registered: list[tuple[nn.Module, str]] = []
    handles = []
    try:
        for name, module in modules.items():
            parent, _, attribute = name.rpartition(".")
            holder = model.get_submodule(parent)
            holder.add_module(attribute, module)
            registered.append((holder, attribute))
        for path, module in targets:
            if path in layers:
                module.forward = prepared.routers[path]
                module.forward.installed()
            else:
                module.forward = ModelRouter(model, module, path, conversion)
        model_routers = [module.forward for _, module in targets if isinstance(module.forward, ModelRouter)]
        for stream in plan.streams:
            watch = StreamWatch(conversion, stream.index, model, layer_containers(model, stream))
            for router in model_routers:
                router.layer_checks = (*router.layer_checks, watch.check_layers)
            if stream.route == "layer":
                owner = model.get_submodule(stream.owner)
                handles.append(owner.register_forward_pre_hook(watch.enter))
                handles.append(owner.register_forward_hook(watch.leave, always_call=True))
        conversion.installed = Installed(tuple(modules), tuple(routed), tuple(handles))
        attach(model, conversion)
    except BaseException:
        detach(model)
        for handle in handles:
            handle.remove()
        for holder, attribute in registered:
            delattr(holder, attribute)
        for _, module in targets:
            module.__dict__.pop("forward", None)
        raise
    return conversion


def layer_containers(model: nn.Module, stream) -> dict[str, tuple]:
    """The containers (``ModuleList``, ``ModuleDict``, ``Sequential``) that hold ``stream``'s layers, by
    path -> their children as converted: what :class:`StreamWatch` checks at every call."""
    found = {}
    # The model route has no layer spans: the layers are the modules that hold its sites.
    layers = [span.owner for span in stream.layers] or [site.name.rpartition(".")[0] for site in stream.sites]
    for layer in layers:
        parent = layer.rpartition(".")[0]
        container = model.get_submodule(parent)
        if isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and parent not in found:
            found[parent] = tuple(container._modules.values())
    return found


def whole_call(model: nn.Module, conversion: Conversion, on: bool) -> None:
    """Give the root of a conversion whose root is not routed a :class:`WholeCallRouter` (``on``), or take
    it off; recorded in ``conversion.installed``. A root whose ``forward`` another library replaced keeps
    its blocks' routes only."""
    installed = conversion.installed
    has = isinstance(model.__dict__.get("forward"), WholeCallRouter)
    if on and not has and "" not in installed.routed and "forward" not in model.__dict__:
        model.forward = WholeCallRouter(model, model, "", conversion)
        conversion.installed = dataclasses.replace(installed, routed=(*installed.routed, ""))
    elif not on and has:
        del model.__dict__["forward"]
        conversion.installed = dataclasses.replace(installed, routed=tuple(p for p in installed.routed if p))


def uninstall(model: nn.Module, conversion: Conversion) -> None:
    """Undo :func:`install` from its record: the AttnRes modules, routers and watches go; nothing else was
    touched."""
    installed = conversion.installed
    for handle in installed.handles:
        handle.remove()
    for name in installed.modules:
        parent, _, attribute = name.rpartition(".")
        holder = _present(model, parent)
        if holder is not None and attribute in holder._modules:
            delattr(holder, attribute)
    for path in installed.routed:
        routed = _present(model, path)
        if routed is not None:
            _unroute(routed)
    _sweep_copies(model)
    detach(model)


def _sweep_copies(model: nn.Module) -> None:
    """What a copy of a converted layer added after conversion brought along: its routers and the AttnRes
    modules of its sites (a free ``BlockAttnRes`` of the user's, with no site, stays)."""
    for module in list(model.modules()):
        if isinstance(module.__dict__.get("forward"), Router):
            _unroute(module)
        for name, child in list(module._modules.items()):
            if isinstance(child, BlockAttnRes) and child.site is not None:
                delattr(module, name)


def _unroute(module: nn.Module) -> None:
    """``module``'s router off, with the forward hook a layer router put on it."""
    router = module.__dict__.pop("forward", None)
    if isinstance(router, LayerRouter):
        router.remove_hook()


def _present(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path``, or None where it is gone (a layer pruned after conversion: its AttnRes
    modules and router went with it)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
