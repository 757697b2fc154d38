"""torch.compile (Inductor) of an explicit AttnRes graph, with compile failures reported as ExportError."""

from __future__ import annotations

import functools

import torch
from torch import nn

from attnres_fx import compat
from attnres_fx.api import compile as compile_converted
from attnres_fx.conversion import is_converted

from .failures import export_error
from .schedule import inference_form


def compile(module: nn.Module, *, two_phase: bool | None = None,  # noqa: A001 - mirrors torch.compile
            **torch_compile_kwargs) -> nn.Module:
    """``torch.compile(module, backend="inductor", fullgraph=True, **torch_compile_kwargs)`` for an
    explicit graph (:func:`attnres_fx.rewrite`); a model converted in place is handed to
    :func:`attnres_fx.compile` instead (its routes then use Inductor; ``torch_compile_kwargs`` are
    Inductor options there).

    ``two_phase``: compile the two-phase inference schedule (:mod:`attnres_fx.passes.two_phase`), built
    on a twin of ``module`` that shares its parameters (``module`` itself is not changed). ``None`` (the
    default) means: for a module in eval mode, i.e. for inference; a module in training mode keeps the
    per-site form, which needs less activation memory in the backward pass.

    ``fullgraph=True`` makes a graph break an error instead of a silent fallback to eager Python for
    part of the model; the caller's keyword arguments override both defaults.

    Compilation happens at the first call (and again when new input shapes need it); a failure there
    raises :class:`attnres_fx.ExportError` with the compiler's root cause and a hint instead of a
    Dynamo traceback (the original exception is its ``__cause__``). The result is torch's
    ``OptimizedModule``: ``attnres_fx.sites()`` and ``state_dict()`` see the original module through it.
    """
    if is_converted(module):
        # A live converted model compiles through its own routing (in place).
        return compile_converted(module, **torch_compile_kwargs)
    options = {"backend": "inductor", "fullgraph": True, **torch_compile_kwargs}
    module = inference_form(module, not module.training if two_phase is None else two_phase)
    compiled = torch.compile(module, **options)
    if compiled is module:
        # disable=True: torch.compile hands back the caller's module, which must not be patched.
        return compiled
    # OptimizedModule keeps its compiled entry point in the instance attribute ``forward``; wrapping
    # it (rather than the module) leaves the type, state_dict keys and ``_orig_mod`` untouched.
    compiled.forward = _reporting_failures(compiled.forward)
    return compiled


def _reporting_failures(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except compat.TorchDynamoException as err:
            raise export_error("torch.compile", err) from err
    return run
