"""Which form of a rewritten module the backends get: per-site, or the two-phase inference schedule."""

from __future__ import annotations

from torch import nn

from attnres_fx.capture.tracers import copy_graph_module, copy_training_flags
from attnres_fx.passes.two_phase import apply_two_phase, can_apply_two_phase


def inference_form(module: nn.Module, two_phase: bool) -> nn.Module:
    """``module`` itself, or, with ``two_phase``, a twin in the two-phase schedule.

    The twin has its own copy of the graph but the same submodules and parameters, so the caller's
    module is never modified and the twin follows later weight updates. Modules the pass does not
    apply to (not rewritten, or already two-phase) are returned as they are.
    """
    if not two_phase or not can_apply_two_phase(module):
        return module
    twin = copy_graph_module(module, type(module).__name__)
    copy_training_flags(module, twin)
    return apply_two_phase(twin)
