"""What a conversion is, and where it lives: the one owner of a converted model's AttnRes state and of
every accessor of it.

:func:`~attnres_fx.attnresify` leaves a :class:`Conversion` on the model it converted (an ordinary
instance attribute: it follows ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the model and never
enters its ``state_dict``). :func:`sites`, :func:`plan_of`, :func:`conversion_options` and
:func:`is_converted` read it here; integrations that act when a model is converted or restored (the
Hugging Face one gives the model its ``save_pretrained``) register with :func:`on_convert`. :data:`stats`
counts the costly work conversions and checkpoints did in this process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from attnres_fx.op.module import BlockAttnRes
from attnres_fx.passes.plan import Plan, Site

from .compat import unwrapped
from .config import AttnResConfig

ATTRIBUTE = "_attnres_conversion"


@dataclass
class Stats:
    """Work done in this process, for what must not be repeated (a load captures nothing, reads and hashes
    its checkpoint once): ``captures``, graphs a conversion planned on (:func:`attnres_fx.attnresify`,
    :func:`attnres_fx.detect`); ``fingerprints``, hashes of a model's or a folder's AttnRes weights;
    ``checkpoint_reads``, reads of a saved conversion's files. ``stats - earlier`` is the work since a
    :meth:`copy`."""

    captures: int = 0
    fingerprints: int = 0
    checkpoint_reads: int = 0

    def copy(self) -> Stats:
        return dataclasses.replace(self)

    def __sub__(self, other: Stats) -> Stats:
        return Stats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})


stats = Stats()


@dataclass
class RouteStats:
    """The work one converted model's routes did, counted (``Conversion.stats``): block traces made, block
    graphs rewritten, TorchDynamo graphs rewritten (``captures``), cache entries dropped to stay within
    ``trace_cache_size`` (``evictions``), aggregations fused with the norm that reads them in the block
    graphs' eager code (``fused_norms``). What tests assert "zero re-traces" with."""

    traces: int = 0
    rewrites: int = 0
    captures: int = 0
    evictions: int = 0
    fused_norms: int = 0


@dataclass
class Conversion:
    """What ``attnresify`` did to a model: the plan, the options that made it, the compiler the routes
    use, what installing the routing did (``installed``, the record :func:`attnres_fx.remove` undoes),
    the graphs the routes traced so far (``traces``: empty in a copy, traced again) and the work counted
    (``stats``)."""

    plan: Plan
    config: AttnResConfig = field(default_factory=AttnResConfig)
    compiler: str = "eager"
    compile_options: dict[str, Any] = field(default_factory=dict)
    installed: Any = None
    traces: Any = None
    host: str = ""            # a host compiler that captures the model's calls whole (attnres_fx.routing.host)
    host_graphs: int = 0      # the host's graphs rewritten so far
    stats: RouteStats = field(default_factory=RouteStats)
    captured_training: bool | None = None   # the mode of the call the plan was captured from (None: a saved plan)


def conversion_of(model: nn.Module) -> Conversion | None:
    """The conversion of a converted model (``None`` for any other module, a submodule of a converted
    model included)."""
    if not isinstance(model, nn.Module):
        return None
    conversion = unwrapped(model).__dict__.get(ATTRIBUTE)
    return conversion if isinstance(conversion, Conversion) else None


def require(model: nn.Module, caller: str) -> Conversion:
    """The conversion of ``model``, or the error ``attnres_fx.<caller>`` raises for a model not converted."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: attnres_fx.{caller} takes a model converted by attnres_fx.attnresify (a "
                        f"torch.nn.Module), got {type(model).__name__}")
    conversion = conversion_of(model)
    if conversion is None:
        raise ValueError(f"model: attnres_fx.{caller} needs a model converted by attnres_fx.attnresify "
                         f"(got a {type(model).__name__} that is not converted)")
    return conversion


_OBSERVERS: list[tuple[Callable[[nn.Module], None], Callable[[nn.Module], None]]] = []


def on_convert(converted: Callable[[nn.Module], None], restored: Callable[[nn.Module], None]) -> None:
    """Call ``converted(model)`` after every conversion is attached, ``restored(model)`` after it is undone."""
    _OBSERVERS.append((converted, restored))


def attach(model: nn.Module, conversion: Conversion) -> None:
    model.__dict__[ATTRIBUTE] = conversion
    for converted, _ in _OBSERVERS:
        converted(model)


def detach(model: nn.Module) -> None:
    model.__dict__.pop(ATTRIBUTE, None)
    for _, restored in _OBSERVERS:
        restored(model)


def is_converted(model: nn.Module) -> bool:
    return conversion_of(model) is not None


def converted_within(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it is converted."""
    return any(isinstance(module.__dict__.get(ATTRIBUTE), Conversion) for module in model.modules())


def sites(module: nn.Module) -> list[Site]:
    """Every injected aggregation of a converted model (or of a :func:`~attnres_fx.rewrite` graph), in
    execution order, each stream's final one after its sites. ``module.get_submodule(site.name)`` is its
    ``BlockAttnRes``."""
    module = unwrapped(module)
    found = [m.site for m in module.modules() if isinstance(m, BlockAttnRes) and m.site is not None]
    return sorted(found, key=lambda site: site.index)


def conversion_options(model: nn.Module) -> dict[str, Any]:
    """The ``attnresify`` arguments a converted model was converted with (its :class:`AttnResConfig` as
    keyword arguments)."""
    return require(model, "conversion_options").config.options()


def config_of(model: nn.Module) -> AttnResConfig:
    """The :class:`AttnResConfig` a converted model was converted with."""
    return require(model, "config_of").config


def plan_of(model: nn.Module) -> Plan:
    """The plan a converted model was converted with (block sizes, names, sources per site)."""
    return require(model, "plan_of").plan
