"""Tiny random-weight Hugging Face models for the tests: :mod:`attnres_fx.zoo`, plus test-only helpers.

The models, example inputs, losses and measurements are defined once, in the package (the CLI's
``demo --model NAME`` builds the same models); this module re-exports them and adds what only tests
need. ``transformers`` is imported lazily: tests skip when :func:`transformers_available` is False.
"""

from __future__ import annotations

from attnres_fx.zoo import *  # noqa: F403 - this module extends the zoo for the tests
from attnres_fx.zoo import spec


def site_owner_paths(name: str, stream: str | None = None) -> list[str]:
    """Module paths owning each residual add of ``stream`` (all streams when None), in execution
    order: ``["model.layers.0", "model.layers.0", "model.layers.1", ...]`` for a pre-norm LM (its two
    sites share the layer's path), one entry per layer for parallel layers (Phi, GPT-NeoX)."""
    s = spec(name)
    out = []
    for st in [stream] if stream else list(s.streams):
        patterns = (s.site_owners or {}).get(st) or (s.layer_paths[st] + ".{i}",) * s.sites_per_layer[st]
        for i in range(s.num_layers):
            out.extend(p.format(i=i) for p in patterns)
    return out
