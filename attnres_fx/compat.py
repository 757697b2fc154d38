"""Where attnres_fx reaches into other libraries' internals, in one place.

Each entry says what it relies on and why no public interface does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import logging
import sys

import torch
import torch._dynamo
from torch import nn
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


def once_only_logging() -> set:
    """transformers' once-per-process logging helpers (``logger.warning_once``, ``logger.info_once``, set on
    ``logging.Logger`` when transformers is imported), for ``torch._dynamo.config.ignore_logging_functions``:
    Dynamo cannot trace a logging call into a ``fullgraph`` graph, and these log at most once anyway (a
    message logged inside a captured layer is not logged)."""
    return {getattr(logging.Logger, name) for name in ("warning_once", "info_once") if hasattr(logging.Logger, name)}


def install_output_recorders(model: nn.Module) -> None:
    """Install transformers' output-recording hooks on every model inside ``model`` now, as its first call
    asking for attentions or hidden states would: installing them takes a ``threading.Lock``, which
    Dynamo cannot trace. Relies on ``transformers.utils.output_capturing.maybe_install_capturing_hooks``
    and ``_CAN_RECORD_REGISTRY``; without them, nothing happens."""
    module = sys.modules.get("transformers.utils.output_capturing")
    install = getattr(module, "maybe_install_capturing_hooks", None)
    registry = getattr(module, "_CAN_RECORD_REGISTRY", None)
    if install is None or registry is None:
        return
    for submodule in model.modules():
        if registry.get(submodule):
            install(submodule)


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


# -- transformers ---------------------------------------------------------------------------------------

_AFTER_IMPORT: dict[str, list] = {}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Runs the callbacks of :func:`after_import` once their module has executed."""

    def find_spec(self, name, path, target=None):
        if name not in _AFTER_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for callback in _AFTER_IMPORT.pop(name, ()):
                callback(module)
        spec.loader.exec_module = exec_module
        return spec


def after_import(name: str, callback) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it is, else right after its
    import (a finder on ``sys.meta_path``: importing attnres_fx does not import transformers)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    _AFTER_IMPORT.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _AfterImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())


def wrap_post_init(pretrained_model: type, then) -> None:
    """Make ``PreTrainedModel.post_init`` (run at the end of every Hugging Face model's ``__init__``;
    no public hook runs there) call ``then(model)`` after its own work, once."""
    original = pretrained_model.post_init
    if getattr(original, "_attnres_wrapped", False):
        return

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        then(self)
        return result

    post_init._attnres_wrapped = True
    pretrained_model.post_init = post_init
