"""Capture: turn a user's ``nn.Module`` into a ``torch.fx.GraphModule`` the passes can work on.

Detection and rewrite only ever see a GraphModule; they do not care which capture produced it.

- ``"dynamo"``: TorchDynamo, the route a converted model's calls take (:mod:`attnres_fx.routing`):
  torch-level ops, modules inlined, parameters as graph inputs. Here the graph is only captured, with
  fake tensors: nothing of the model runs for real (no buffer, RNG or BatchNorm statistic changes).
- ``"fx"``: ``torch.fx`` symbolic tracing, keeping normalisation modules as leaves; needs no inputs.
- ``"export"``: ``torch.export.export(..., strict=False)`` then ``.module()``; needs example inputs.
  Hugging Face models are traced with ``config.use_cache`` off: that graph has no KV cache.
- ``"auto"``: fx first, export if fx cannot trace the model.

A converted model's routed modules run their own code while any of these captures is active in the
thread (:func:`own_call`): a capture sees the model as written.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch
from torch import fx, nn

from attnres_fx import compat
from attnres_fx.passes.checkpoints import open_checkpoints
from attnres_fx.passes.dataflow import mutated_input
from attnres_fx.passes.node_kinds import is_norm_module

from ..context import call_context
from ..diagnostics import first_line, reported_user_frame, root_cause
from ..errors import TraceError
from .recording import record_graph

TRACERS = ("auto", "fx", "export")


@contextlib.contextmanager
def own_call():
    """Within, in this thread: calls are attnres_fx's own (a capture, or a routed call that runs on
    TorchDynamo), so a routed module reached inside runs its own forward, as written. In the call context
    (:mod:`attnres_fx.context`): a capture in one thread never changes what a call in another runs."""
    context = call_context()
    context.own += 1
    try:
        yield
    finally:
        context.own -= 1


def in_own_call() -> bool:
    return call_context().own > 0


@contextlib.contextmanager
def capture_settings():
    """The TorchDynamo settings of every attnres_fx capture, for the duration of one trace: float
    attributes as constants (``specialize_float``: a dropout's ``p`` or a norm's ``eps`` read from a module
    must look the same in every capture of the model, as they do without dynamic shapes), transformers'
    once-per-process logging calls as no-ops (:func:`attnres_fx.compat.once_only_logging`), and guards on
    the captured modules' hook dicts (a hook registered after a call then triggers a new capture instead
    of being silently left out)."""
    with compat.dynamo_capture_config(compat.once_only_logging()), compat.nn_module_hook_guards():
        yield


@contextlib.contextmanager
def capturing():
    """Within: a conversion's capture (see the module docstring): routed modules of converted models run
    their own forward, :func:`capture_settings` hold, torch.nn's Transformer layers take their regular
    path (their inference fast path runs a whole layer, residual adds included, as one fused op that no
    rewrite can reach into; the regular path is the same computation, in the layer's own ops), and
    transformers' output recorders read their collector in a form Dynamo can trace
    (:func:`attnres_fx.compat.output_recorders_traceable`)."""
    with own_call(), compat.mha_fast_path_off(), compat.output_recorders_traceable(), capture_settings():
        yield


@contextlib.contextmanager
def routers_set_aside(model: nn.Module):
    """Within: the modules of a converted model have no routing ``forward`` attribute (torch.fx and
    torch.export read the code and signature of ``forward`` itself); restored on the way out."""
    aside = [(module, module.__dict__.pop("forward")) for module in model.modules()
             if getattr(module.__dict__.get("forward"), "is_attnres_router", False)]
    try:
        yield
    finally:
        for module, router in aside:
            module.__dict__["forward"] = router


def as_args(example_inputs: Any) -> tuple | None:
    """Positional example inputs as a tuple: a tensor is one input, a list or tuple several; None stays."""
    if example_inputs is None or isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def copy_graph_module(graph_module: fx.GraphModule, class_name: str) -> fx.GraphModule:
    """A GraphModule with its own copy of ``graph_module``'s graph and ``meta`` and the same submodules
    and parameters: what a pass may edit while the original stays as it is (Dynamo's own graph, a
    user's explicit graph). ``meta`` dicts are copied (a pass records in them), their values shared (the
    nodes' captured example values among them)."""
    # Graph.__deepcopy__ copies the nodes (their meta one level deep) and the code generator (which
    # rebuilds the output structure of a torch.export graph).
    copied = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph), class_name=class_name)
    copied.meta = {key: dict(value) if isinstance(value, dict) else value for key, value in graph_module.meta.items()}
    return copied


def copy_training_flags(source: nn.Module, target: nn.Module) -> None:
    """Give ``target``'s modules the train/eval flags of ``source``'s modules at the same paths (the
    root's flag where ``source`` has no such path). Sets the flags directly: modules made by
    torch.export refuse ``.train()`` / ``.eval()``."""
    flags = {name: module.training for name, module in source.named_modules()}
    for name, module in target.named_modules():
        module.training = flags.get(name, source.training)


class NormLeafTracer(fx.Tracer):
    """``torch.fx.Tracer`` that keeps normalisation modules as single ``call_module`` nodes.

    fx keeps every module of ``torch.nn`` as a leaf; a ``torch.nn`` module that holds a norm
    (``TransformerEncoderLayer``, ``TransformerEncoder``) holds residual adds, so it is traced through.
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if is_norm_module(m):
            return True
        if any(is_norm_module(child) for child in m.modules()):
            return False
        return super().is_leaf_module(m, module_qualified_name)


def _recorded(function: Callable) -> Callable:
    """``function`` as one ``call_function`` node when fx traces it with a proxy argument."""
    def call(*args, **kwargs):
        proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
        if proxy is None:
            return function(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", function, args, kwargs)
    return call


def _torch_transformers_traceable():
    """Within: fx can trace torch.nn's Transformer modules. Besides their fast path (off while
    :func:`capturing`), they read the sequence length with Python control flow on the input
    (``src.is_nested``): that helper is recorded as one call."""
    module, name = compat.transformer_seq_len_helper()
    return mock.patch.object(module, name, _recorded(getattr(module, name)))


@dataclass(frozen=True)
class Traced:
    graph_module: fx.GraphModule
    frontend: str


def entry_function(forward: Callable) -> Callable:
    """``entry(module, *args, **kwargs) -> forward(module, *args, **kwargs)`` with a code object of its
    own: Dynamo keeps its compiled graphs per code object, so every converted module gets its own cache
    (and its own recompilation budget) instead of sharing its class's ``forward``."""
    def entry(module, *args, **kwargs):
        return forward(module, *args, **kwargs)
    entry.__code__ = entry.__code__.replace()
    return entry


class _Captured(Exception):
    """Raised by the capture backend to stop Dynamo once it has the graph: nothing runs."""


def capture_dynamo(model: nn.Module, args: tuple, kwargs: dict, forward: Callable | None = None
                   ) -> tuple[fx.GraphModule, list]:
    """The graph Dynamo captures for ``forward(model, *args, **kwargs)`` (the class's own forward by
    default, ``fullgraph``) and the fake tensors it traced with; the model is not run."""
    graphs: list = []

    def stop(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        raise _Captured

    entry = torch.compile(entry_function(forward or type(model).forward), backend=stop, fullgraph=True,
                          dynamic=False)
    with capturing():
        try:
            entry(model, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - Dynamo wraps the stop signal; anything else is a failure
            if not graphs:
                raise TraceError(_dynamo_message(model, err), {"dynamo": err}) from err
    gm, example_inputs = graphs[0]
    graph_module = copy_graph_module(gm, type(model).__name__)
    # Checkpointed layers are subgraphs in Dynamo's IR: open them, as the routed calls do.
    open_checkpoints(graph_module)
    return graph_module, example_inputs


DUMMY_BATCH, DUMMY_LENGTH = 2, 8


def dummy_inputs(model: nn.Module) -> tuple[tuple, dict] | None:
    """A call a Hugging Face model can be captured with when the caller gives none, built from its config
    and its ``forward``'s parameters: its main input (token ids, an image, audio features or samples),
    decoder ids for an encoder-decoder, encoder states for a decoder with cross-attention. On the model's
    device; None for a model without a config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    parameters = inspect.signature(type(model).forward).parameters
    reference = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = reference.device if reference is not None else torch.device("cpu")
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        # A model being built by from_pretrained, its weights on the meta device but for those its own
        # __init__ made on the CPU (HuBERT's masked_spec_embed): inputs there, with the layers.
        device = torch.device("meta")
    dtype = reference.dtype if reference is not None and reference.dtype.is_floating_point else torch.float32
    batch, length = DUMMY_BATCH, DUMMY_LENGTH

    def ids():
        vocab = getattr(text, "vocab_size", None) or 2
        return (torch.arange(batch * length, device=device).reshape(batch, length) % max(vocab - 1, 1)) + 1

    name = getattr(model, "main_input_name", "input_ids")
    kwargs: dict = {}
    if name == "pixel_values" and hasattr(config, "image_size"):
        size = config.image_size if isinstance(config.image_size, int) else tuple(config.image_size)[0]
        kwargs[name] = torch.zeros(batch, getattr(config, "num_channels", 3), size, size, device=device, dtype=dtype)
    elif name == "input_features" and hasattr(config, "num_mel_bins"):
        # Whisper-style encoders take exactly as many frames as their convolutions turn into positions.
        frames = 2 * config.max_source_positions if hasattr(config, "max_source_positions") else 64
        kwargs[name] = torch.zeros(batch, config.num_mel_bins, frames, device=device, dtype=dtype)
    elif name == "input_values":
        kwargs[name] = torch.zeros(batch, 1600, device=device, dtype=dtype)
    elif name == "input_ids" and "input_ids" in parameters:
        kwargs[name] = ids()
        if "attention_mask" in parameters:
            # Some models fill in a missing mask only when they run eagerly (LongT5's local attention
            # reads it while traced), so a capture without one would fail where the model works.
            kwargs["attention_mask"] = torch.ones_like(kwargs[name])
    else:
        return None
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        kwargs["decoder_input_ids"] = ids()
    elif getattr(text, "add_cross_attention", False) and "encoder_hidden_states" in parameters:
        hidden = getattr(text, "hidden_size", None) or getattr(text, "d_model")
        kwargs["encoder_hidden_states"] = torch.zeros(batch, length, hidden, device=device, dtype=dtype)
    return (), kwargs


def plan_inputs(model: nn.Module, example_inputs: tuple | None,
                example_kwargs: dict | None) -> tuple[tuple, dict] | None:
    """The call a conversion captures: the given inputs, or a Hugging Face model's dummy inputs; None
    when there are neither. A KV cache takes no part: its sites are those of a call without one, and a
    cache object holds real tensors a capture on fake ones cannot mix with (a model on the meta device
    makes an empty one inside its forward), so cache objects are left out and ``use_cache`` is off."""
    if example_inputs is not None or example_kwargs:
        inputs = example_inputs or (), dict(example_kwargs or {})
    else:
        inputs = dummy_inputs(model)
    if inputs is None:
        return None
    args, kwargs = inputs
    kwargs = {key: None if compat.is_hf_cache(value) else value for key, value in kwargs.items()}
    parameters = inspect.signature(type(model).forward).parameters
    if "use_cache" in parameters:
        # Even when the model's config says no: a submodule may read a config of its own (T5's decoder).
        kwargs.setdefault("use_cache", False)
    return args, kwargs


def default_call(model: nn.Module, example_inputs: tuple | None,
                 example_kwargs: dict | None) -> tuple[tuple, dict] | None:
    """The call the conversion's capture turns into another (:func:`plan_inputs`), as users make it: a
    Hugging Face model's key/value cache on where its config or the call turns it on (the blocks then
    receive a cache object, another call shape); ``None`` where the capture's call is that call. A cache
    object given is left out, the model making its own: the user's is not written to."""
    inputs = (example_inputs or (), dict(example_kwargs or {})) if example_inputs is not None or example_kwargs \
        else dummy_inputs(model)
    if inputs is None:
        return None
    args, kwargs = inputs
    caches = [key for key, value in kwargs.items() if compat.is_hf_cache(value)]
    kwargs.update(dict.fromkeys(caches))
    if kwargs.get("use_cache") is None:
        cache_on = any(getattr(getattr(module, "config", None), "use_cache", False) is True
                       for module in model.modules())
    else:
        cache_on = bool(kwargs["use_cache"])
    return (args, kwargs) if cache_on else None


@contextlib.contextmanager
def ready_to_capture(model: nn.Module, cache_off: bool = True):
    """What a conversion's capture needs of a Hugging Face model: its output-recording hooks installed
    (outside any trace; removed again afterwards), and ``config.use_cache`` off while it captures: a forward without a
    ``use_cache`` argument (a question-answering head passes ``**kwargs`` on) falls back to the config,
    and would build a cache of real tensors inside the capture (``cache_off=False``: the config as it
    is, for a call as users make it); and the checkpointing flags of modules transformers flags without
    checkpointing them off, as in the routes' graphs (:func:`attnres_fx.compat.hf_inner_checkpointing_flags_off`)."""
    config = getattr(model, "config", None)
    with (compat.output_recorders_installed(model),
          compat.hf_inner_checkpointing_flags_off(compat.checkpointing_flag_holders(model))):
        if not (cache_off and getattr(config, "use_cache", False)):
            yield
            return
        config.use_cache = False
        try:
            yield
        finally:
            config.use_cache = True


def capture_for_plan(model: nn.Module, example_inputs: tuple | None, example_kwargs: dict | None) -> Traced:
    """The graph a conversion is planned on, with the given inputs or a Hugging Face model's dummy inputs:
    one call recorded as it runs (:mod:`attnres_fx.capture.recording`: the model's state is left as it was), or
    TorchDynamo's capture (fake tensors: nothing runs) where the recording cannot see every op or the
    call fails run for real; without inputs, fx symbolic tracing."""
    inputs = plan_inputs(model, example_inputs, example_kwargs)
    if inputs is not None:
        try:
            with own_call(), compat.mha_fast_path_off():
                return Traced(record_graph(model, *inputs), "recorded")
        except TraceError as recorded:
            # An op the recording cannot see, or one that fails run for real where TorchDynamo's fake
            # tensors take another path (a value read on the meta device): TorchDynamo decides. Where it
            # fails too, not on an op of the model (it cannot bind the arguments), a call the model itself
            # refused is reported as the model's own error.
            recording_failure = recorded
        try:
            gm, _ = capture_dynamo(model, *inputs)
        except TraceError as err:
            if "model" in recording_failure.causes and not _failed_on_inputs(err.causes.get("dynamo")):
                recording_failure.causes.update(err.causes)
                raise recording_failure  # noqa: B904 - its cause is the model's own error, as it should be
            raise
        return Traced(gm, "dynamo")
    try:
        with capturing(), routers_set_aside(model):
            return Traced(_trace_fx(model), "fx")
    except Exception as err:  # noqa: BLE001 - any tracing failure is reported the same way
        raise TraceError(
            f"{_fx_message(model, err)}\nWithout example inputs, torch.fx symbolic tracing is the only "
            f"capture that needs none; pass example_inputs (and example_kwargs) as the model is called, "
            "e.g. attnresify(model, (input_ids,)), so that TorchDynamo can capture it.", {"fx": err}) from err


def trace(model: nn.Module, example_inputs: tuple | None, example_kwargs: dict | None, tracer: str,
          dynamic_shapes: Any = None) -> Traced:
    """An explicit, standalone graph of ``model`` (fx or torch.export; see the module docstring)."""
    if tracer not in TRACERS:
        raise ValueError(f"tracer must be one of {TRACERS}, got {tracer!r}")
    if (example_kwargs or {}).get("use_cache"):
        raise TraceError("use_cache=True is not supported by an explicit graph: it has no KV cache (it "
                         "neither returns nor takes past keys and values); pass use_cache=False, or call the "
                         "converted model itself, which keeps its cache")
    with capturing(), routers_set_aside(model):
        return _trace(model, example_inputs, example_kwargs, tracer, dynamic_shapes)


# What a module's forward may set on itself while it is traced: flags and counters, not tensors or modules.
_PLAIN = (bool, int, float, str, type(None))


@contextlib.contextmanager
def plain_attributes_kept(model: nn.Module):
    """Within: one trace; on the way out every module's plain attributes (flags, counters, strings) have
    the values they had, for the next trace and for the model. A symbolic trace runs the forward's Python
    for real but its tensor writes only on proxies or fake tensors, so a forward that updates its weights and records
    that in a flag (RWKV rescales its weights at the first call in a new mode and sets ``layers_are_rescaled``) would be
    left with the flag set and the weights as they were."""
    kept = [(module, {name: value for name, value in vars(module).items() if type(value) in _PLAIN})
            for module in model.modules()]
    try:
        yield
    finally:
        # Attributes the trace added stay: they mark work done with effects beyond the module's flags (the
        # recording hooks transformers installs, and flags, at a call asking for outputs).
        for module, attributes in kept:
            vars(module).update(attributes)


def _trace(model, example_inputs, example_kwargs, tracer, dynamic_shapes) -> Traced:
    if tracer == "fx":
        try:
            return Traced(_trace_fx(model), "fx")
        except Exception as err:  # noqa: BLE001 - any tracing failure is reported the same way
            raise TraceError(_fx_message(model, err) + _TRY_EXPORT, {"fx": err}) from err
    if tracer == "export":
        try:
            return Traced(_trace_export(model, example_inputs, example_kwargs, dynamic_shapes), "export")
        except TraceError:
            raise
        except Exception as err:  # noqa: BLE001
            raise TraceError(_export_message(model, err) + _missing_mask_hint(model, example_kwargs),
                             {"export": err}) from err
    try:
        return Traced(_trace_fx(model), "fx")
    except Exception as fx_err:  # noqa: BLE001
        if example_inputs is None and not example_kwargs:
            raise TraceError(
                _fx_message(model, fx_err) + "\ntorch.export was not tried: it needs example inputs; "
                "pass example_inputs to let tracer='auto' fall back to it.",
                {"fx": fx_err}) from fx_err
        try:
            return Traced(_trace_export(model, example_inputs, example_kwargs, dynamic_shapes), "export")
        except TraceError:
            raise
        except Exception as export_err:  # noqa: BLE001
            raise TraceError(
                f"neither tracer could trace {type(model).__name__}.\n"
                f"- fx: {type(fx_err).__name__}: {first_line(fx_err)}\n"
                f"- export: {type(export_err).__name__}: {first_line(export_err)}\n"
                "Try: make the forward free of data-dependent Python control flow, or pass example "
                "inputs that match how the model is called (positional and keyword)."
                + _missing_mask_hint(model, example_kwargs),
                {"fx": fx_err, "export": export_err}) from export_err


def _trace_fx(model: nn.Module) -> fx.GraphModule:
    tracer = NormLeafTracer()
    with _torch_transformers_traceable(), plain_attributes_kept(model):
        graph = tracer.trace(model)
    name = type(model).__name__
    gm = fx.GraphModule(tracer.root, graph, name)
    parameters = {name for name, _ in gm.named_parameters()}
    written = sorted({str(target.target) for node in gm.graph.nodes
                      if (target := mutated_input(node)) is not None and target.op == "get_attr"
                      and target.target in parameters})
    if written:
        raise TraceError(_parameter_writes_message(model, written))
    return gm


def _exported_parameter_writes(program) -> list[str]:
    """The parameters the exported graph writes into: those its signature lists, and in-place writes into
    them inside the subgraphs of higher-order ops (a ``torch.no_grad()`` region is one, and torch.export
    leaves such writes out of its signature)."""
    signature = program.graph_signature
    written = {spec.target for spec in signature.output_specs
               if spec.kind == torch.export.graph_signature.OutputKind.PARAMETER_MUTATION}
    _written_inputs(program.graph_module, dict(signature.inputs_to_parameters), written)
    return sorted(written)


def _written_inputs(gm: fx.GraphModule, parameters: dict[str, str], written: set[str]) -> None:
    """Add to ``written`` the parameters (``parameters``: placeholder name -> parameter name) that ``gm``
    writes in place, directly or in the subgraph a higher-order op calls with them (its operands after
    the subgraph, in the order of the subgraph's placeholders)."""
    for node in gm.graph.nodes:
        target = mutated_input(node)
        while (target is not None and target.op != "placeholder" and target.args
               and isinstance(target.args[0], fx.Node) and target.target in _VIEWS):
            target = target.args[0]
        if target is not None and target.op == "placeholder" and target.name in parameters:
            written.add(parameters[target.name])
        subgraphs = [i for i, arg in enumerate(node.args) if isinstance(arg, fx.Node) and arg.op == "get_attr"
                     and isinstance(getattr(gm, str(arg.target), None), fx.GraphModule)]
        if node.op == "call_function" and subgraphs:
            sub = getattr(gm, str(node.args[subgraphs[0]].target))
            operands = node.args[subgraphs[0] + 1:]
            inner = {placeholder.name: parameters[operand.name]
                     for placeholder, operand in zip(sub.graph.find_nodes(op="placeholder"), operands)
                     if isinstance(operand, fx.Node) and operand.name in parameters}
            if inner:
                _written_inputs(sub, inner, written)


# Views an in-place write may go through to reach the tensor it writes (``w.view(-1).mul_(2)``).
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.select.int, torch.ops.aten.slice.Tensor,
          torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.reshape.default}


def _parameter_writes_message(model: nn.Module, written: list[str]) -> str:
    shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    return (f"{type(model).__name__}'s forward writes into its own parameters in this call ({shown}): an explicit "
            "graph would write them again at every call. A model that updates its weights at its first call "
            "in a new mode does this (RWKV rescales its weights at the first eval call after training). Call "
            "the model once in this mode first (with torch.no_grad(): model(...)), then rewrite or export it; "
            "the model was left as it was.")


def _trace_export(model, example_inputs, example_kwargs, dynamic_shapes) -> fx.GraphModule:
    if example_inputs is None and not example_kwargs:
        raise TraceError("tracer='export' needs example inputs: pass them as the model is called, e.g. "
                         "attnres_fx.rewrite(model, (x,), tracer='export')")
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    if dynamic_shapes is None:
        dynamic_shapes = default_dynamic_shapes(model, args, kwargs)
    with _config_cache_off(model, kwargs), plain_attributes_kept(model):
        program = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    written = _exported_parameter_writes(program)
    if written:
        raise TraceError(_parameter_writes_message(model, written))
    gm = program.module()
    # torch.export's module re-checks its inputs' shapes with a guard function whose symbolic sizes a
    # second trace cannot follow (torch.distributed.pipelining.pipeline(), a further export): the graph
    # is traced again by whoever takes it, and the ops themselves still fail on shapes they cannot take.
    for node in list(gm.graph.find_nodes(op="call_module", target="_guards_fn")):
        gm.graph.erase_node(node)
    gm.recompile()
    # The graph was traced in the model's mode (dropout, batch-norm statistics are baked in): record it.
    copy_training_flags(model, gm)
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


def _fx_message(model, err) -> str:
    """What fx could not trace; the caller says what to try, as its own options allow."""
    return (f"torch.fx symbolic tracing could not trace {type(model).__name__}: "
            f"{type(err).__name__}: {first_line(err)}")


# For the callers that take a ``tracer``: attnresify has none (it captures with TorchDynamo given inputs).
_TRY_EXPORT = ("\nTry tracer='export' with example inputs (handles Python control flow on shapes and "
               "keyword-only forwards), or remove data-dependent control flow from forward().")


def _missing_mask_hint(model: nn.Module, example_kwargs: dict | None) -> str:
    """For a Hugging Face model traced without the ``attention_mask`` its forward takes: some build a
    missing one only when they run eagerly (transformers skips it while tracing), and then fail."""
    if getattr(model, "config", None) is None or (example_kwargs or {}).get("attention_mask") is not None:
        return ""
    if "attention_mask" not in inspect.signature(type(model).forward).parameters:
        return ""
    return ("\n{name} was traced without an attention_mask: Hugging Face models build a missing one only when "
            "they run eagerly (LongT5's does not while traced). Pass attention_mask=torch.ones_like(input_ids) "
            "in example_kwargs.").format(name=type(model).__name__)


def _failed_on_inputs(err: BaseException) -> bool:
    """Whether Dynamo stopped because an op of the model failed on the (fake) inputs, as it would when
    run: a dtype or shape the model does not take, rather than a construct it cannot capture."""
    while err is not None:
        if isinstance(err, compat.TorchRuntimeError):
            return True
        err = err.__cause__
    return False


def _dynamo_message(model, err) -> str:
    name = type(model).__name__
    cause = root_cause(err)
    where = reported_user_frame(err)
    at = f" at {where}" if where else ""
    if _failed_on_inputs(err):
        return (f"{name} fails on the example inputs{at}: {type(cause).__name__}: {first_line(cause)}\n"
                "attnres_fx captures the model with example inputs as it is called (on fake tensors: nothing "
                "runs); pass inputs of the dtype and shape the model takes.")
    return (f"TorchDynamo could not capture {name}.forward as one graph{at}: {type(err).__name__}: "
            f"{first_line(err)}\n"
            + (f"Cause: {type(cause).__name__}: {first_line(cause)}\n" if cause is not err else "")
            + "attnres_fx routes every call of a converted model through one Dynamo graph (fullgraph), so "
            "each residual stream is seen whole. Remove the construct named above from forward() (a graph "
            "break: data-dependent Python control flow, print, an unsupported library call), or check the "
            "example inputs match how the model is called.")


def _export_message(model, err) -> str:
    return (f"torch.export could not trace {type(model).__name__}: {type(err).__name__}: "
            f"{first_line(err)}\n"
            "Try: check the example inputs match the forward signature; pass dynamic_shapes=... to "
            "override the default (batch and sequence dynamic); for Hugging Face models pass "
            "use_cache=False.")
