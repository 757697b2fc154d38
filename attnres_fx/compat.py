"""Where attnres_fx reaches into other libraries' internals, in one place.

Each entry says what it relies on and why no public interface does.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch._dynamo
from torch._dynamo.exc import Unsupported as DynamoUnsupported  # noqa: F401 - errors.py builds on it


@contextlib.contextmanager
def output_recorders_traceable():
    """Within: transformers' output-recording hooks (``output_attentions=True``, MoE router logits) read
    their collector the way transformers itself arranges under ``torch.compile``, as a plain attribute,
    so that Dynamo can trace them inside a captured layer; it cannot trace the ``ContextVar`` they read
    otherwise. Relies on ``transformers.utils.output_capturing._active_collector`` (a
    ``CompileableContextVar``: ``context_var``, ``global_var``, ``compiling``); without it, nothing
    changes."""
    module = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(module, "_active_collector", None)
    if collector is None or not hasattr(collector, "context_var") or collector.compiling:
        yield
        return
    collector.global_var, collector.compiling = collector.context_var.get(), True
    try:
        yield
    finally:
        collector.global_var, collector.compiling = None, False


@torch._dynamo.assume_constant_result
def refuse_fullgraph_trace(message: str) -> bool:
    """Raise :class:`~attnres_fx.ForeignCompileError` with ``message`` while TorchDynamo traces this call
    for a ``fullgraph`` compilation; return True otherwise. ``assume_constant_result`` runs the function
    during tracing, where Dynamo's current translator says whether graph breaks are allowed
    (``InstructionTranslator.current_tx().one_graph``; no public interface says it). The error is a Dynamo
    ``Unsupported`` too, so Dynamo reports it as it is."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    from .errors import ForeignCompileError

    try:
        translator = InstructionTranslator.current_tx()
    except AttributeError:          # not inside a Dynamo trace (torch.export's non-strict tracing)
        return True
    if translator is not None and (translator.one_graph or getattr(translator, "error_on_graph_break", False)):
        raise ForeignCompileError(message)
    return True
