"""The typed options of a conversion: :class:`AttnResConfig`, validated when it is made.

``attnresify(model, config=AttnResConfig(block_size=2))`` and ``attnresify(model, block_size=2)`` are the
same call; a converted model keeps its config (:func:`attnres_fx.conversion_options` gives it as a dict),
and ``attnres_config.json`` and a Hugging Face ``config.json``'s ``"attnres"`` entry are written from it
and read back into it.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

from attnres_fx.op.module import DEFAULT_EPS, check_eps
from attnres_fx.passes.plan import ROUTES

# The version of the option set: a saved config of another version is read by its own rules.
CONFIG_VERSION = 1
# Block traces and rewritten block graphs a converted model keeps (attnres_fx.routing.graphs.TraceCache).
DEFAULT_TRACE_CACHE_SIZE = 256


@dataclass(frozen=True)
class AttnResConfig:
    """How to convert a model (see :func:`attnres_fx.attnresify` for each field's meaning).

    num_blocks: target blocks per stream (``None``: the default, 8); block_size: sites per block, wins over
    ``num_blocks``; preserve_scale: aggregates as sums (exact conversion) rather than averages; eps: the
    key norm's epsilon; allow_partial: convert a stream that continues through adds that are no site;
    route: ``"auto"``, ``"model"`` or ``"layer"``; trace_cache_size: how many block traces and rewritten
    block graphs the layer route keeps (the least recently used go first; saved only when not the
    default); version: of this option set.
    """

    num_blocks: int | None = None
    block_size: int | None = None
    preserve_scale: bool = False
    eps: float = DEFAULT_EPS
    allow_partial: bool = False
    route: str = "auto"
    trace_cache_size: int = DEFAULT_TRACE_CACHE_SIZE
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "trace_cache_size"):
            value = getattr(self, name)
            if value is None and name == "trace_cache_size":
                raise ValueError("trace_cache_size must be a positive int, got None")
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            if value is not None:
                # A numpy integer counts as the int it is (and is saved as one in config.json).
                object.__setattr__(self, name, int(value))
        for name in ("preserve_scale", "allow_partial"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "eps", check_eps(self.eps))
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {self.route!r}")
        if self.version != CONFIG_VERSION:
            raise ValueError(f"version: this attnres_fx reads option set version {CONFIG_VERSION}, "
                             f"got {self.version!r}")

    def options(self) -> dict[str, Any]:
        """The ``attnresify`` keyword arguments this config stands for (``version`` is none of them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "version"}

    def to_dict(self) -> dict[str, Any]:
        saved = dataclasses.asdict(self)
        if self.trace_cache_size == DEFAULT_TRACE_CACHE_SIZE:
            del saved["trace_cache_size"]           # a file of the default reads in earlier releases too
        return saved

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> AttnResConfig:
        """Read a saved config; unknown keys are an error (a file of a newer attnres_fx names them)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(saved) - known)
        if unknown:
            raise ValueError(f"unknown AttnRes options {unknown}: saved by a newer attnres_fx?")
        return cls(**{"version": CONFIG_VERSION, **saved})
