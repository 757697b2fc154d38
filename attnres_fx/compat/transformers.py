"""Where attnres_fx reaches into transformers' internals, and what differs between the transformers releases
it supports.

Nothing here imports transformers: each entry looks up the module it needs in ``sys.modules`` (a model of
transformers exists only once transformers is imported) and does nothing without it. An entry that differs
between releases names the releases each branch covers. The supported range is
:data:`SUPPORTED_TRANSFORMERS`, checked when transformers is imported beside attnres_fx
(:func:`check_transformers_version`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import inspect
import json
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .torch import OpOverload, check_version

# [minimum, first untested) of the transformers releases attnres_fx runs on; pyproject.toml states the same,
# and `make test` (the newest 5.x) and `make test-compat` (5.17 and the newest) run the suite on them.
SUPPORTED_TRANSFORMERS = ((5, 16), (6, 0))


def check_transformers_version(module) -> None:
    """Raise ``ImportError`` for a transformers below :data:`SUPPORTED_TRANSFORMERS`, warn for one above."""
    check_version("transformers", module.__version__, SUPPORTED_TRANSFORMERS)


def mark_hf_initialized(module: nn.Module) -> None:
    """Tell transformers' ``init_weights`` that ``module`` is initialised already (its private
    ``_is_hf_initialized`` flag): it would otherwise draw random weights over the AttnRes zeros."""
    module.__dict__["_is_hf_initialized"] = True        # a plain value: nn.Module's __setattr__ has nothing to do


# What transformers' output recorders read in this thread while one of attnres_fx's own TorchDynamo calls runs:
# ``(collector,)``, the collector the code around the call set; unset outside such calls.
_HELD_COLLECTOR = threading.local()


@contextlib.contextmanager
def output_recorders_traceable():
    """Within, in this thread: transformers' output-recording hooks (``output_hidden_states``,
    ``output_attentions``, MoE router logits) read the collector the code around the call set from a
    per-thread value Dynamo can trace (it cannot trace the ``ContextVar`` they read otherwise), so that a
    captured layer records its outputs. Other threads keep reading their own ``ContextVar``: nothing
    process-wide changes per call (transformers' own switch for ``torch.compile``, ``compiling`` and
    ``global_var``, is one per process). Relies on ``transformers.utils.output_capturing._active_collector``
    (a ``CompileableContextVar``: ``context_var``, ``global_var``, ``compiling``, the same from 5.17 to
    5.25), given a class that reads the per-thread value first (:func:`_per_thread_collector`); without
    it, nothing changes."""
    collector = _per_thread_collector()
    if collector is None or getattr(_HELD_COLLECTOR, "value", None) is not None:
        yield
        return
    _HELD_COLLECTOR.value = (collector.context_var.get(),)
    try:
        yield
    finally:
        del _HELD_COLLECTOR.value


def _per_thread_collector():
    """transformers' output collector, its class made once to read :data:`_HELD_COLLECTOR` first (where a
    compiled frame set the collector itself, transformers' ``compiling`` switch, that one); ``None``
    without one."""
    module = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(module, "_active_collector", None)
    if collector is None or not hasattr(collector, "context_var"):
        return None
    cls = type(collector)
    if not getattr(cls, "reads_held_collector", False):
        collector.__class__ = type(cls.__name__, (cls,), {"get": _get_collector, "reads_held_collector": True,
                                                          "__module__": __name__})
    return collector


def _get_collector(self):
    if self.compiling:                      # set inside a frame Dynamo compiles (transformers' own rule)
        return self.global_var
    held = getattr(_HELD_COLLECTOR, "value", None)
    if held is not None:
        return held[0]
    return self.context_var.get()


def once_only_logging() -> set:
    """transformers' once-per-process logging helpers (``logger.warning_once``, ``logger.info_once``, set on
    ``logging.Logger`` when transformers is imported), for ``torch._dynamo.config.ignore_logging_functions``:
    Dynamo cannot trace a logging call into a ``fullgraph`` graph, and these log at most once anyway (a
    message logged inside a captured layer is not logged)."""
    return {getattr(logging.Logger, name) for name in ("warning_once", "info_once") if hasattr(logging.Logger, name)}


# The models' and layers' key/value cache argument, and their output's field: `past_key_values` up to 5.17 (the
# GPU machines' release), `cache` from the rename (5.24 has it and still takes `past_key_values` as a deprecated
# alias). `layer_past` is what some layers call it in every release.
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def cache_argument(forward: Callable) -> str | None:
    """The name ``forward`` takes the key/value cache under (``cache`` or ``past_key_values``), or None."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in CACHE_ARGUMENTS[:2] if name in parameters), None)


def output_cache(output):
    """The key/value cache a model's output carries (``output.cache``; ``output.past_key_values`` before 5.2x)."""
    return output["cache"] if "cache" in output else output.get("past_key_values")


def full_length_cache(key_values: list[tuple], config):
    """A ``DynamicCache`` of ``config``'s layers holding ``key_values``, in which every sliding-window (and
    chunked-attention) layer keeps all its positions, as a full-attention layer does: the models' masks then
    apply the window over absolute positions. A ``DynamicSlidingWindowLayer`` drops the positions past its
    window, a length that decides what it returns and its mask sizes by Python branches, which a trace
    fixes at the example's length. The cache's layer list and classes as transformers 5.16-5.25 have them."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    for layer, (key, value) in zip(cache.layers, key_values):
        layer.update(key, value)
    return cache


def hf_checkpointed_forward(cls: type) -> Callable | None:
    """The forward that transformers' gradient-checkpointing wrapper wraps on ``cls`` (a
    ``GradientCheckpointingLayer``: its class ``forward`` is ``forward_with_checkpointing``, once per
    subclass, such as the class FSDP2 makes), unwrapped through every such wrapper; None for any other
    class. Relies on the wrapper's name and its ``__wrapped__``."""
    forward, wrapped = cls.forward, False
    while getattr(getattr(forward, "__code__", None), "co_name", "") == "forward_with_checkpointing" \
            and hasattr(forward, "__wrapped__"):
        forward, wrapped = forward.__wrapped__, True
    return forward if wrapped else None


def hf_checkpointing_on(module: nn.Module) -> bool:
    """Whether transformers' gradient checkpointing checkpoints this call of ``module`` (the wrapper's own
    condition: ``gradient_checkpointing`` on, training, gradients enabled)."""
    return bool(getattr(module, "gradient_checkpointing", False)) and module.training and torch.is_grad_enabled()


def hf_checkpointed_call(module: nn.Module, run: Callable, args: tuple, kwargs: dict):
    """What transformers' ``forward_with_checkpointing`` does when it checkpoints a layer, with ``run``
    (the layer's route) as the function checkpointed: caching turned off as it turns it off (and said
    once, as it says it), then ``module._gradient_checkpointing_func(partial(run, **kwargs), *args)``:
    whatever checkpoint function the user enabled. Relies on the private ``_gradient_checkpointing_func``
    and ``_can_checkpoint_with_cache``."""
    kwargs = dict(kwargs)
    changed = []
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        changed.append("`use_cache=False`")
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
                changed.append(f"`{name}=None`")
    if changed:
        logger = logging.getLogger("transformers.modeling_layers")
        message = (f"Caching is incompatible with gradient checkpointing in {type(module).__name__}. Setting "
                   f"{', '.join(changed)}.")
        (getattr(logger, "warning_once", None) or logger.warning)(message)
    return module._gradient_checkpointing_func(functools.partial(run, **kwargs), *args)


def remember_hf_compiled_call(model: nn.Module, call) -> None:
    """Keep ``call`` where transformers keeps the compiled call its ``get_compiled_call`` made
    (``model._compiled_call``, private; ``generate`` and its tests look for it there)."""
    model.__dict__["_compiled_call"] = call


def forget_hf_compiled_call(model: nn.Module, call_is_ours) -> None:
    """Drop ``model._compiled_call`` when ``call_is_ours(call)``."""
    if call_is_ours(model.__dict__.get("_compiled_call")):
        del model.__dict__["_compiled_call"]


def checkpointing_flag_holders(module: nn.Module) -> tuple[nn.Module, ...]:
    """The modules inside ``module`` that transformers' ``gradient_checkpointing_enable`` may flag without
    checkpointing them: it sets ``gradient_checkpointing`` on every module that has the attribute, and
    only ``GradientCheckpointingLayer``s checkpoint. Fixed by the module tree, so callers keep it."""
    layer_class = getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None)
    return tuple(m for m in module.modules() if hasattr(m, "gradient_checkpointing")
                 and not (layer_class is not None and isinstance(m, layer_class)))


@contextlib.contextmanager
def hf_inner_checkpointing_flags_off(holders: tuple[nn.Module, ...]):
    """Within: ``gradient_checkpointing`` is off on ``holders`` (:func:`checkpointing_flag_holders`): T5's
    attention, flagged, marks a constant zero position bias ``requires_grad``, an attribute write Dynamo
    cannot trace; it matters only to a reentrant checkpoint whose inputs need no grad, and the route's
    checkpoints receive the stream's. The layers transformers does checkpoint keep their flag."""
    flagged = [m for m in holders if m.gradient_checkpointing is True]
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True


def _output_capturing():
    """transformers' output-recording module, when transformers is imported and has one."""
    module = sys.modules.get("transformers.utils.output_capturing")
    return module if hasattr(module, "maybe_install_capturing_hooks") else None


def _records_outputs(module: nn.Module, capturing) -> bool:
    """Whether ``module``'s class ``forward`` is wrapped by transformers' ``capture_outputs`` (the wrapper
    that installs the recording hooks at a call asking for outputs: its code calls
    ``maybe_install_capturing_hooks``)."""
    function = type(module).forward
    while function is not None:
        code = getattr(function, "__code__", None)
        if (code is not None and code.co_filename == capturing.__file__
                and "maybe_install_capturing_hooks" in code.co_names):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def _recordable_outputs(capturing, module: nn.Module) -> dict:
    """The outputs transformers can record for ``module`` (``hidden_states``, ``attentions``, ...): its
    private ``_CAN_RECORD_REGISTRY``, a plain dict keyed by ``str`` of the class up to 5.17, a registry
    looked up by the module itself from 5.24 (in 5.25 a ``dict`` subclass whose ``get`` takes the module)."""
    registry = capturing._CAN_RECORD_REGISTRY
    if type(registry) is dict:
        return registry.get(str(type(module))) or {}
    return registry.get(module) or {}


def _install_output_recorders(model: nn.Module, capturing) -> None:
    """Install transformers' output-recording hooks where a call asking for outputs would: on each module
    whose forward records outputs, outermost first, once (transformers' flag on the module says whether
    they are in)."""
    for module in model.modules():
        if _records_outputs(module, capturing):
            capturing.maybe_install_capturing_hooks(module)


@contextlib.contextmanager
def output_recorders_installed(model: nn.Module):
    """Within: transformers' output-recording hooks (``output_hidden_states``, ``output_attentions``, MoE
    router logits) are installed on ``model`` as its first call asking for outputs would install them:
    installing takes a ``threading.Lock``, which Dynamo cannot trace, so a capture of a call asking for
    outputs needs them in beforehand. On the way out the hooks and flags put in here are removed again
    (those an earlier call installed stay): transformers' hooks are local functions, which ``pickle``
    cannot take. Relies on ``transformers.utils.output_capturing`` (``maybe_install_capturing_hooks``,
    the ``_output_capturing_hooks_installed`` flag, hooks defined in that module); without it, nothing
    happens."""
    capturing = _output_capturing()
    if capturing is None:
        yield
        return
    modules = list(model.modules())
    flag = "_output_capturing_hooks_installed"
    flagged = {id(m) for m in modules if m.__dict__.get(flag)}
    hooks = {id(m): set(m._forward_hooks) for m in modules}
    _install_output_recorders(model, capturing)
    try:
        yield
    finally:
        for module in modules:
            for key in set(module._forward_hooks) - hooks[id(module)]:
                if getattr(module._forward_hooks[key], "__module__", None) == capturing.__name__:
                    del module._forward_hooks[key]
            if id(module) not in flagged:
                module.__dict__.pop(flag, None)


def install_output_recorders_for_call(model: nn.Module, kwargs: dict) -> None:
    """Install transformers' output-recording hooks on ``model`` (see :func:`output_recorders_installed`)
    before a call that asks for outputs (an ``output_*`` argument, or a config of the model that sets
    one), which will capture them in one Dynamo graph; they stay, as after such a call of the original."""
    capturing = _output_capturing()
    if capturing is None:
        return
    modules = list(model.modules())
    flags = {"output_attentions"} | {f"output_{key}" for m in modules for key in _recordable_outputs(capturing, m)}
    configs = {id(c): c for m in modules if (c := getattr(m, "config", None)) is not None}.values()
    if any(kwargs.get(flag) or any(getattr(c, flag, False) for c in configs) for flag in flags):
        _install_output_recorders(model, capturing)


@contextlib.contextmanager
def hf_saved_under_own_names(keys: set[str]):
    """Within: transformers' ``save_pretrained`` writes the ``state_dict`` entries ``keys`` under their own
    names (as ``save_original_format=False`` writes every entry) and reverts its checkpoint conversions on
    the others only. Those conversions are regular expressions written for the model's own weights, and
    reverted they can rename others: Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``, reverted, turns
    ``layers.0.mlp_res.norm.weight`` into ``layers.0.block_sparse_moe.res.norm.weight`` (its ``.`` matches
    the ``_``), which loads back as ``mlp.res``, a weight the model does not have. Relies on
    ``transformers.modeling_utils.revert_weight_conversion``, the function ``save_pretrained`` reverts
    with (no argument selects entries); without it, nothing changes."""
    modeling = sys.modules.get("transformers.modeling_utils")
    revert = getattr(modeling, "revert_weight_conversion", None)
    if revert is None:
        yield
        return

    def revert_others(model, state_dict):
        kept = {key: value for key, value in state_dict.items() if key in keys}
        others = {key: value for key, value in state_dict.items() if key not in keys}
        return {**revert(model, others), **kept}

    modeling.revert_weight_conversion = revert_others
    try:
        yield
    finally:
        modeling.revert_weight_conversion = revert


def hf_onnx_translations(program) -> dict:
    """The ONNX functions transformers ships for its own custom operators (``torch.ops.transformers.*``:
    the grouped matmul of its mixture-of-experts layers on the CPU, ``grouped_mm_fallback``) that the
    ``torch.export`` program ``program`` calls, as ``torch.onnx.export``'s ``custom_translation_table``.
    The ONNX exporter has no translation of these operators; transformers' own exporter passes these.
    Relies on ``transformers.exporters.exporter_onnx._ONNX_TRANSLATION_TABLE``; ``{}`` without it."""
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    ours = {t for t in targets if isinstance(t, OpOverload) and t.namespace == "transformers"}
    if not ours:
        return {}
    try:
        from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE as table
    except ImportError:
        return {}
    return {op: function for op, function in table.items() if op in ours}


_AFTER_IMPORT: dict[str, list] = {}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Runs the callbacks of :func:`after_import` once their module has executed, and leaves
    ``sys.meta_path`` when none is left to run (every import in the process asks each finder there)."""

    def find_spec(self, name, path, target=None):
        if name not in _AFTER_IMPORT:
            return None
        # The spec the finders after this one give (an editable install's own finder among them).
        others = [finder for finder in sys.meta_path if not isinstance(finder, _AfterImportFinder)]
        spec = next((found for finder in others if hasattr(finder, "find_spec")
                     and (found := finder.find_spec(name, path, target)) is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            callbacks = _AFTER_IMPORT.pop(name, ())
            if not _AFTER_IMPORT:
                _remove_finder()
            for callback in callbacks:
                callback(module)
        spec.loader.exec_module = exec_module
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterImportFinder)]


def after_import(name: str, callback) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it is, else right after its
    import (a finder on ``sys.meta_path`` until then: importing attnres_fx does not import transformers)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    _AFTER_IMPORT.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _AfterImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())


def cancel_after_import(name: str, callback) -> None:
    """Take back an :func:`after_import` callback that has not run yet."""
    waiting = _AFTER_IMPORT.get(name, [])
    if callback in waiting:
        waiting.remove(callback)
    if not waiting:
        _AFTER_IMPORT.pop(name, None)
    if not _AFTER_IMPORT:
        _remove_finder()


def hook_pretrained_model(pretrained_model: type, built: Callable, loading: Callable) -> None:
    """Make every Hugging Face model report to attnres_fx: ``built(model)`` after ``PreTrainedModel.post_init``
    (run at the end of every model's ``__init__``; no public hook runs there), and
    ``loading(cls, args, kwargs, load)`` for ``PreTrainedModel.from_pretrained`` (a public classmethod),
    where ``load()`` runs transformers' own and returns what it returns. Once; undone by
    :func:`unhook_pretrained_model`. Relies on ``post_init`` being called by every model's ``__init__``
    (transformers 5.16-5.25)."""
    if "_attnres_original" in vars(pretrained_model.post_init):
        return
    post_init_of = pretrained_model.post_init
    from_pretrained_of = pretrained_model.__dict__["from_pretrained"].__func__

    @functools.wraps(post_init_of)
    def post_init(self, *args, **kwargs):
        result = post_init_of(self, *args, **kwargs)
        built(self)
        return result

    @functools.wraps(from_pretrained_of)
    def from_pretrained(cls, *args, **kwargs):
        return loading(cls, args, kwargs, lambda: from_pretrained_of(cls, *args, **kwargs))

    post_init._attnres_original = post_init_of
    from_pretrained._attnres_original = from_pretrained_of
    pretrained_model.post_init = post_init
    pretrained_model.from_pretrained = classmethod(from_pretrained)


def unhook_pretrained_model(pretrained_model: type) -> None:
    """Undo :func:`hook_pretrained_model`."""
    post_init = vars(pretrained_model).get("post_init")
    if post_init is None or "_attnres_original" not in vars(post_init):
        return
    pretrained_model.post_init = post_init._attnres_original
    original = pretrained_model.__dict__["from_pretrained"].__func__._attnres_original
    pretrained_model.from_pretrained = classmethod(original)


def hf_model_class(model: nn.Module) -> type:
    """The model's class as transformers defines it (a model loaded through a folder's own code,
    ``trust_remote_code``, is of a subclass there)."""
    return next((cls for cls in type(model).__mro__ if cls.__module__.startswith("transformers.")), type(model))


# The weight files transformers' save_pretrained writes (one file, or shards and their index), safetensors or
# pickled (``safe_serialization=False``), as transformers 5.16-5.25 name them.
_WEIGHT_FILES = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


def hf_weight_file(name: str) -> bool:
    """Whether a file of a model folder is one of the weight files transformers' ``save_pretrained`` writes."""
    return bool(_WEIGHT_FILES.fullmatch(name))


def hf_weight_names(directory) -> set[str] | None:
    """The tensor names of a model folder's safetensors weights (``model.safetensors``, or the index of its
    shards), or None where they are in another format."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as weights:
            return set(weights.keys())
    return None


def is_hf_cache(value) -> bool:
    """Whether ``value`` is a transformers key/value cache (a ``transformers.cache_utils.Cache``)."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return cache is not None and isinstance(value, cache)


def before_file_lookups(hub, callback: Callable[[object], None]) -> None:
    """Make transformers call ``callback(path_or_repo_id)`` before it looks up a file of a folder or
    repository, once: every loader (``AutoConfig``, ``AutoModel*`` from their first step, a PEFT adapter
    look-up, a model class's ``from_pretrained``, tokenizers) asks ``transformers.utils.hub.cached_files``,
    through ``cached_file`` which finds it in that module at call time (5.16-5.25)."""
    original = hub.cached_files
    if getattr(original, "_attnres_wrapped", False):
        return

    @functools.wraps(original)
    def cached_files(path_or_repo_id, *args, **kwargs):
        callback(path_or_repo_id)
        return original(path_or_repo_id, *args, **kwargs)

    cached_files._attnres_wrapped = True
    hub.cached_files = cached_files


def hf_attention_implementation(config) -> str:
    """The attention implementation a Hugging Face config selects (``"eager"``, ``"sdpa"``...): transformers
    keeps it in the private ``config._attn_implementation`` (set through ``set_attn_implementation``)."""
    return config._attn_implementation


def hf_auto_classes(model_class: type, config_class: type) -> list[str]:
    """The names of transformers' ``AutoModel*`` classes that build ``model_class`` from a config of
    ``config_class``, read from each one's private ``_model_mapping``; the classes are those of
    ``transformers.models.auto.modeling_auto`` (the ones ``transformers`` exports; transformers
    5.16-5.25). Not ``dir(transformers)``: its lazy module lists thousands of names, half a second."""
    from transformers.models.auto import modeling_auto

    names = []
    for name, auto_class in vars(modeling_auto).items():
        mapping = getattr(auto_class, "_model_mapping", None) if name.startswith("AutoModel") else None
        if mapping is None:
            continue
        try:
            built = mapping[config_class]
        except (KeyError, ValueError, ImportError, AttributeError):
            continue
        if built is model_class or (isinstance(built, tuple) and model_class in built):
            names.append(name)
    return names


__all__ = [
    "CACHE_ARGUMENTS",
    "cache_argument",
    "output_cache",
    "full_length_cache",
    "SUPPORTED_TRANSFORMERS",
    "check_transformers_version",
    "mark_hf_initialized",
    "output_recorders_traceable",
    "once_only_logging",
    "hf_checkpointed_forward",
    "hf_checkpointing_on",
    "hf_checkpointed_call",
    "remember_hf_compiled_call",
    "forget_hf_compiled_call",
    "checkpointing_flag_holders",
    "hf_inner_checkpointing_flags_off",
    "output_recorders_installed",
    "install_output_recorders_for_call",
    "hf_saved_under_own_names",
    "hf_onnx_translations",
    "after_import",
    "before_file_lookups",
    "cancel_after_import",
    "hook_pretrained_model",
    "unhook_pretrained_model",
    "hf_model_class",
    "hf_weight_file",
    "hf_weight_names",
    "is_hf_cache",
    "hf_attention_implementation",
    "hf_auto_classes",
]
