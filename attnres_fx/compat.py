"""Where attnres_fx reaches into other libraries' internals, in one place.

Each entry says what it relies on and why no public interface does. Importing it checks the torch
version: the supported range is the one the tests run on (:data:`SUPPORTED_TORCH`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import logging
import sys

import warnings
from typing import Callable

import torch
import torch._dynamo
from torch import nn

# [minimum, first untested) of the torch releases attnres_fx runs on; pyproject.toml states the same.
SUPPORTED_TORCH = ((2, 13), (2, 14))


def _check_torch_version(version: str) -> None:
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_TORCH
    supported = f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if release < low:
        raise ImportError(f"attnres_fx needs {supported}; this is torch {version} (pip install 'torch=={low[0]}.{low[1]}.*')")
    if release >= high:
        warnings.warn(f"attnres_fx is tested on {supported}; torch {version} is newer: the internals listed in "
                      "attnres_fx.compat may have moved", UserWarning, stacklevel=3)


_check_torch_version(torch.__version__)

# torch internals with no public equivalent: Dynamo's exception types (a graph break, a failed run on fake
# tensors, a backend failure), FakeTensor (what a capture's example values are), the op overload types
# of aten graphs, Inductor's graph compiler, fake-mode discovery.
from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException, TorchRuntimeError  # noqa: E402, F401
from torch._dynamo.exc import ObservedException  # noqa: E402, F401
from torch._dynamo.exc import Unsupported as DynamoUnsupported  # noqa: E402, F401
from torch._guards import detect_fake_mode  # noqa: E402, F401
from torch._ops import OpOverload, OpOverloadPacket  # noqa: E402, F401
from torch._subclasses.fake_tensor import FakeTensor, is_fake  # noqa: E402, F401
# torch.utils._pytree: the flattening torch.export and Dynamo apply to inputs and outputs (no public module).
import torch.utils._pytree as pytree  # noqa: E402, F401

# nn.Module's global hook dicts live in its module.
from torch.nn.modules import module as _modules_module  # noqa: E402

# torch.nn's private base classes: what every dropout, batch/instance norm and convolution derives from.
DropoutBase = nn.modules.dropout._DropoutNd
NormBase = nn.modules.batchnorm._NormBase
ConvBase = nn.modules.conv._ConvNd


def transformer_seq_len_helper() -> tuple[object, str]:
    """Where torch.nn's Transformer layers read the sequence length with Python control flow on the
    input (``torch.nn.modules.transformer._get_seq_len``): (module, attribute), for fx to record as one call."""
    from torch.nn.modules import transformer

    return transformer, "_get_seq_len"


def dynamo_compile_lock():
    """TorchDynamo's compilation lock (``torch._dynamo.convert_frame.compile_lock``, a re-entrant lock; no
    public name): held while something else patches process-wide state for a trace, so that no
    compilation in another thread traces while it is patched."""
    from torch._dynamo import convert_frame

    return convert_frame.compile_lock


def lazy_graph_modules():
    """Within: ``fx.GraphModule`` generates its Python code when first called, not at every edit
    (``torch.fx._lazy_graph_module``): for graphs whose code is generated elsewhere."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def inductor_compile(graph_module, example_inputs, config_patches=None):
    """Inductor on an fx graph inside a Dynamo backend (``torch._inductor.compile_fx.compile_fx``, what
    ``torch.compile``'s default backend calls)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph_module, example_inputs, config_patches=config_patches)


@contextlib.contextmanager
def dynamo_capture_config(ignore_logging: set):
    """Dynamo settings of every capture: float attributes as constants (``specialize_float``) and the
    logging functions ``ignore_logging`` as no-ops (``ignore_logging_functions``)."""
    ignored = torch._dynamo.config.ignore_logging_functions | ignore_logging
    with torch._dynamo.config.patch(specialize_float=True, ignore_logging_functions=ignored):
        yield


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from (``Tensor._base``), or None: how a stream value that a layer
    returns as a view of its computed output is found again."""
    return tensor._base


def mark_hf_initialized(module: nn.Module) -> None:
    """Tell transformers' ``init_weights`` that ``module`` is initialised already (its private
    ``_is_hf_initialized`` flag): it would otherwise draw random weights over the AttnRes zeros."""
    module._is_hf_initialized = True


@contextlib.contextmanager
def compiling_despite_force_eager():
    """Within: ``torch.compile``'d functions compile even under the user's
    ``torch.compiler.set_stance("force_eager")``: a converted model's routes run its AttnRes rewrite
    through Dynamo, and without it they would run the unrewritten layers. Other stances are kept. Reads
    the current stance from ``torch._dynamo.eval_frame._stance`` (no public getter)."""
    from torch._dynamo import eval_frame

    current = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    if current != "force_eager":
        yield
        return
    with torch.compiler.set_stance("default"):
        yield


def saved_tensor_hooks_active() -> bool:
    """Whether ``torch.autograd.graph.saved_tensors_hooks`` are in place (non-reentrant activation
    checkpointing, activation offloading): ``torch._C._autograd._top_saved_tensors_default_hooks``, no public
    accessor."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def module_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` does more than its class's forward: forward or backward hooks of its own,
    global ones (the private hook dicts of ``nn.Module`` and ``torch.nn.modules.module``; no public
    accessor), or a wrapper another library set as its instance ``forward`` (accelerate's device hooks)."""
    return bool("forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _modules_module._global_forward_hooks
                or _modules_module._global_forward_pre_hooks or _modules_module._global_backward_hooks
                or _modules_module._global_backward_pre_hooks)


def nn_module_hook_guards():
    """Within: TorchDynamo guards the hook dicts of the modules it traces
    (``torch._dynamo.config.skip_nnmodule_hook_guards`` off; read when a trace builds its guards), so that
    a hook registered after a capture triggers a new one."""
    return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)


@contextlib.contextmanager
def mha_fast_path_off():
    """Within: ``torch.nn``'s Transformer layers take their regular path, not the inference fast path
    that runs a whole layer as one fused op (``torch.backends.mha``; TorchDynamo guards on the flag)."""
    before = torch.backends.mha.get_fastpath_enabled()
    if not before:
        yield
        return
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def on_dynamo_compile(start, end) -> None:
    """Call ``start(args)`` / ``end(args)`` when TorchDynamo starts / ends a compilation, in the compiling
    thread, under its compilation lock (``torch._dynamo.callback_handler``)."""
    torch._dynamo.callback_handler.register_start_callback(start)
    torch._dynamo.callback_handler.register_end_callback(end)


def is_dynamo_frame_compile(args) -> bool:
    """Whether a compilation callback's ``args`` are those of a frame Dynamo traces (not a deferred
    backward compilation)."""
    from torch._dynamo.callback import CallbackTrigger

    return args.callback_trigger == CallbackTrigger.DYNAMO


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


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside the wrappers users put around one: ``torch.compile``'s ``OptimizedModule`` (which
    keeps it as the private ``_orig_mod``) and PEFT's ``PeftModel`` (``get_base_model()``), in any
    nesting; ``module`` itself when it is no wrapper."""
    while True:
        inner = module.__dict__.get("_modules", {}).get("_orig_mod")
        if inner is None and type(module).__module__.startswith("peft.") and callable(
                getattr(module, "get_base_model", None)):
            inner = module.get_base_model()
        if inner is None or inner is module:
            return module
        module = inner


def once_only_logging() -> set:
    """transformers' once-per-process logging helpers (``logger.warning_once``, ``logger.info_once``, set on
    ``logging.Logger`` when transformers is imported), for ``torch._dynamo.config.ignore_logging_functions``:
    Dynamo cannot trace a logging call into a ``fullgraph`` graph, and these log at most once anyway (a
    message logged inside a captured layer is not logged)."""
    return {getattr(logging.Logger, name) for name in ("warning_once", "info_once") if hasattr(logging.Logger, name)}


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
        for name in ("cache", "layer_past"):
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
        if code is not None and code.co_filename == capturing.__file__ and "maybe_install_capturing_hooks" in code.co_names:
            return True
        function = getattr(function, "__wrapped__", None)
    return False


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
    flags = {"output_attentions"} | {f"output_{key}" for m in modules for key in capturing._CAN_RECORD_REGISTRY.get(m)}
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


# Run a function while Dynamo traces, its result taken as a constant (``torch._dynamo``'s decorator).
assume_constant_result = torch._dynamo.assume_constant_result


def tracing_for_one_graph() -> bool:
    """Whether the TorchDynamo trace in progress must make one graph (``fullgraph``, or graph breaks made
    errors): ``InstructionTranslator.current_tx().one_graph``; no public interface says it. False outside
    a Dynamo trace (torch.export's non-strict tracing has no translator)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        translator = InstructionTranslator.current_tx()
    except AttributeError:
        return False
    return translator is not None and bool(translator.one_graph or getattr(translator, "error_on_graph_break", False))


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


def hf_attention_implementation(config) -> str:
    """The attention implementation a Hugging Face config selects (``"eager"``, ``"sdpa"``...): transformers
    keeps it in the private ``config._attn_implementation`` (set through ``set_attn_implementation``)."""
    return config._attn_implementation


def hf_auto_classes(model_class: type, config_class: type) -> list[str]:
    """The names of transformers' ``AutoModel*`` classes that build ``model_class`` from a config of
    ``config_class``, read from each one's private ``_model_mapping`` (transformers 5.x)."""
    import transformers

    names = []
    for name in dir(transformers):
        mapping = getattr(getattr(transformers, name, None), "_model_mapping", None) if name.startswith("AutoModel") else None
        if mapping is None:
            continue
        try:
            built = mapping[config_class]
        except (KeyError, ValueError, ImportError, AttributeError):
            continue
        if built is model_class or (isinstance(built, tuple) and model_class in built):
            names.append(name)
    return names
