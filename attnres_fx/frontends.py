"""Frontends: turn a user's ``nn.Module`` into a ``torch.fx.GraphModule`` the passes can work on.

Detection and rewrite only ever see a GraphModule; they do not care which frontend produced it.

- ``"fx"``: ``torch.fx`` symbolic tracing, keeping normalisation modules as leaves.
- ``"export"``: ``torch.export.export(..., strict=False)`` then ``.module()``; needs example inputs.
  Hugging Face models are traced with ``config.use_cache`` off: the rewritten graph has no KV cache.
- ``"auto"``: fx first, export if fx cannot trace the model.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from .errors import TraceError

TRACERS = ("auto", "fx", "export")


class NormLeafTracer(fx.Tracer):
    """``torch.fx.Tracer`` that keeps normalisation modules as single ``call_module`` nodes."""

    norm_types = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.norm_types) or super().is_leaf_module(m, module_qualified_name)


@dataclass
class Traced:
    graph_module: fx.GraphModule
    frontend: str


def trace(model: nn.Module, example_inputs: tuple | None, example_kwargs: dict | None, tracer: str,
          dynamic_shapes: Any = None) -> Traced:
    if tracer not in TRACERS:
        raise ValueError(f"tracer must be one of {TRACERS}, got {tracer!r}")
    if (example_kwargs or {}).get("use_cache"):
        raise TraceError("use_cache=True is not supported: the rewritten graph has no KV cache (it neither "
                         "returns nor takes past keys and values); pass use_cache=False")
    if tracer == "fx":
        try:
            return Traced(_trace_fx(model), "fx")
        except Exception as err:  # noqa: BLE001 - any tracing failure is reported the same way
            raise TraceError(_fx_message(model, err), {"fx": err}) from err
    if tracer == "export":
        try:
            return Traced(_trace_export(model, example_inputs, example_kwargs, dynamic_shapes), "export")
        except TraceError:
            raise
        except Exception as err:  # noqa: BLE001
            raise TraceError(_export_message(model, err), {"export": err}) from err
    try:
        return Traced(_trace_fx(model), "fx")
    except Exception as fx_err:  # noqa: BLE001
        if example_inputs is None and not example_kwargs:
            raise TraceError(
                _fx_message(model, fx_err) + "\ntorch.export was not tried: it needs example inputs; "
                "call attnresify(model, example_inputs) to let tracer='auto' fall back to it.",
                {"fx": fx_err}) from fx_err
        try:
            return Traced(_trace_export(model, example_inputs, example_kwargs, dynamic_shapes), "export")
        except Exception as export_err:  # noqa: BLE001
            raise TraceError(
                f"neither tracer could trace {type(model).__name__}.\n"
                f"- fx: {type(fx_err).__name__}: {_first_line(fx_err)}\n"
                f"- export: {type(export_err).__name__}: {_first_line(export_err)}\n"
                "Try: make the forward free of data-dependent Python control flow, or pass example "
                "inputs that match how the model is called (positional and keyword).",
                {"fx": fx_err, "export": export_err}) from export_err


def _trace_fx(model: nn.Module) -> fx.GraphModule:
    tracer = NormLeafTracer()
    graph = tracer.trace(model)
    name = type(model).__name__
    return fx.GraphModule(tracer.root, graph, name)


def _trace_export(model, example_inputs, example_kwargs, dynamic_shapes) -> fx.GraphModule:
    if example_inputs is None and not example_kwargs:
        raise TraceError("tracer='export' needs example inputs: attnresify(model, (x,), ...)")
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    if dynamic_shapes is None:
        dynamic_shapes = default_dynamic_shapes(model, args, kwargs)
    with _config_cache_off(model, kwargs):
        program = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    gm = program.module()
    # The graph was traced in the model's mode (dropout, batch-norm statistics are baked in), and
    # export's module refuses .train()/.eval(): record that mode on the flags directly.
    for module in gm.modules():
        module.training = model.training
    return gm


@contextlib.contextmanager
def _config_cache_off(model: nn.Module, kwargs: dict):
    """Trace with every ``config.use_cache`` of the model off when the call leaves ``use_cache`` unset.

    Hugging Face models then read the config, and with ``use_cache=True`` (the default of most
    configs) return a KV cache, which torch.export cannot output and the rewritten graph could not take
    back. Turning it off for the trace, rather than tracing with a ``use_cache=False`` input, keeps the
    rewritten module's call signature the user's. The configs are restored; the rewritten module
    returns no cache.
    """
    configs = [] if "use_cache" in kwargs else list({
        id(config): config for module in model.modules()
        if getattr(config := getattr(module, "config", None), "use_cache", None) is True}.values())
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True


def default_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict):
    """Batch and sequence dimensions (the first two) of every tensor input are dynamic.

    The spec is keyed by ``forward``'s parameter names, as ``torch.export`` expects when keyword
    inputs are present (a ``**kwargs`` parameter gets a nested dict).
    """
    def spec(value):
        if isinstance(value, torch.Tensor):
            return {i: torch.export.Dim.AUTO for i in range(min(2, value.dim()))}
        if isinstance(value, (list, tuple)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        return None
    if not kwargs:
        return spec(args)
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: spec(value) for name, value in bound.arguments.items()}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else repr(err)


def _fx_message(model, err) -> str:
    return (f"torch.fx symbolic tracing could not trace {type(model).__name__}: "
            f"{type(err).__name__}: {_first_line(err)}\n"
            "Try tracer='export' with example inputs (handles Python control flow on shapes and "
            "keyword-only forwards), or remove data-dependent control flow from forward().")


def _export_message(model, err) -> str:
    return (f"torch.export could not trace {type(model).__name__}: {type(err).__name__}: "
            f"{_first_line(err)}\n"
            "Try: check the example inputs match the forward signature; pass dynamic_shapes=... to "
            "override the default (batch and sequence dynamic); for Hugging Face models pass "
            "use_cache=False.")
