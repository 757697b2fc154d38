"""What a conversion is, and where it lives: the one owner of a converted model's AttnRes state.

:func:`~attnres_fx.attnresify` leaves a :class:`Conversion` on the model it converted (an ordinary
instance attribute: it follows ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the model and never
enters its ``state_dict``); every accessor of the public API reads it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from attnres_fx.passes.plan import Plan

ATTRIBUTE = "_attnres_conversion"


@dataclass
class Conversion:
    """What ``attnresify`` did to a model: the plan, the routed modules, the compiler the routes use."""

    plan: Plan
    routed: tuple[str, ...]                                    # modules whose forward is routed
    options: dict[str, Any] = field(default_factory=dict)     # the attnresify arguments that made the plan
    compiler: str = "eager"
    compile_options: dict[str, Any] = field(default_factory=dict)
    watched: tuple[str, ...] = ()                              # stream owners of the layer route


def conversion_of(model: nn.Module) -> Conversion | None:
    """The conversion of a converted model (``None`` for any other module, a submodule of a converted
    model included)."""
    conversion = getattr(model, "_orig_mod", model).__dict__.get(ATTRIBUTE)
    return conversion if isinstance(conversion, Conversion) else None


def attach(model: nn.Module, conversion: Conversion) -> None:
    model.__dict__[ATTRIBUTE] = conversion


def detach(model: nn.Module) -> None:
    model.__dict__.pop(ATTRIBUTE, None)
