"""Where attnres_fx reaches into torch's internals, and what differs between the torch releases it supports.

Each entry says what it relies on and why no public interface does; an entry that differs between releases
names the releases each branch covers. The supported range is :data:`SUPPORTED_TORCH`; importing this
module checks it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import warnings
from typing import Callable

import torch
import torch._dynamo
from torch import nn

# [minimum, first untested) of the torch releases attnres_fx runs on; pyproject.toml states the same, and
# `make test` (2.13) and `make test-compat` (2.11 and 2.14) run the suite on them.
SUPPORTED_TORCH = ((2, 11), (2, 15))


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"2.11.0+cu130"`` or ``"5.17.0.dev0"``."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def check_version(library: str, version: str, supported: tuple[tuple[int, int], tuple[int, int]]) -> None:
    """Raise ``ImportError`` for a release of ``library`` below ``supported`` (naming the range and the pip
    command); warn for one at or above its first untested release."""
    low, high = supported
    text = f"{library}>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if release(version) < low:
        raise ImportError(f"attnres_fx needs {text}; this is {library} {version} "
                          f"(pip install '{library}>={low[0]}.{low[1]},<{high[0]}.{high[1]}')")
    if release(version) >= high:
        warnings.warn(f"attnres_fx is tested on {text}; {library} {version} is newer: the internals listed in "
                      f"attnres_fx.compat may have moved", UserWarning, stacklevel=4)


check_version("torch", torch.__version__, SUPPORTED_TORCH)

# torch internals with no public equivalent: Dynamo's exception types (a graph break, a failed run on fake
# tensors, a backend failure), FakeTensor (what a capture's example values are), the op overload types
# of aten graphs, Inductor's graph compiler, fake-mode discovery. Each is at the same place in 2.11-2.14.
from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException, TorchRuntimeError  # noqa: E402, F401
from torch._dynamo.exc import ObservedException  # noqa: E402, F401
# What a fullgraph compilation raises at its code object's recompile limit.
from torch._dynamo.exc import FailOnRecompileLimitHit  # noqa: E402, F401
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

# Run a function while Dynamo traces, its result taken as a constant (``torch._dynamo``'s decorator).
assume_constant_result = torch._dynamo.assume_constant_result


def dynamo_argument(placeholder) -> tuple | None:
    """Which argument of the compiled function a placeholder of a TorchDynamo graph is: ``(name, key)`` for
    ``L['args'][0]`` (``("args", 0)``) or ``L['kwargs']['x']`` (``("kwargs", "x")``); ``None`` for anything
    else (a parameter, a size, an attribute). Dynamo keeps the source in ``node.meta["grapharg"]``: an item
    source (``GetItemSource``, ``DictGetItemSource``) on a ``LocalSource`` in 2.11-2.14; no public
    interface says where a graph input came from."""
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    base = getattr(source, "base", None)
    if base is None or not hasattr(source, "index") or not hasattr(base, "local_name") or hasattr(base, "base"):
        return None
    return base.local_name, source.index


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


def graph_break_release_hint(err: Exception) -> str | None:
    """What to do about a graph break that only this torch release has, or None. torch 2.11 and 2.12 cannot
    trace ``copy.deepcopy`` of a Python object (2.13 traces it); transformers' encoder-decoder configs
    (T5's) deepcopy themselves when a decoder makes its key/value cache."""
    if release(torch.__version__) < (2, 13) and "copy.deepcopy" in str(err):
        return (f"torch {torch.__version__} cannot trace copy.deepcopy (torch 2.13 can); where a decoder makes its "
                "cache inside the graph (transformers' encoder-decoders), pass use_cache=False or a cache made "
                "before the call, or upgrade torch.")
    return None


@functools.cache
def _metrics_without_unsortable_config() -> None:
    """torch 2.11 and 2.12 sort every set of Dynamo's config into each compilation's metrics record
    (``torch._dynamo.utils._get_dynamo_config_for_logging``), ``ignore_logging_functions`` included, whose
    functions do not sort: the record fails and Dynamo logs the failure as an error, with a traceback, at
    every capture. From 2.13 that set is left out of the record; here the record goes without the config."""
    from torch._dynamo import utils

    config_for_logging = utils._get_dynamo_config_for_logging

    @functools.wraps(config_for_logging)
    def without_unsortable():
        try:
            return config_for_logging()
        except TypeError:
            return None

    utils._get_dynamo_config_for_logging = without_unsortable


@contextlib.contextmanager
def dynamo_capture_config(ignore_logging: set):
    """Dynamo settings of every capture: float attributes as constants (``specialize_float``) and the
    logging functions ``ignore_logging`` as no-ops (``ignore_logging_functions``)."""
    if release(torch.__version__) < (2, 13):
        _metrics_without_unsortable_config()
    ignored = torch._dynamo.config.ignore_logging_functions | ignore_logging
    with torch._dynamo.config.patch(specialize_float=True, ignore_logging_functions=ignored):
        yield


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from (``Tensor._base``), or None: how a stream value that a layer
    returns as a view of its computed output is found again."""
    return tensor._base


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


# The hook dicts module_hooks reads, also for a check written in C (attnres_fx/op/kernels/cpu.cpp's run_site): the
# instance attributes of a module's own hooks, and the process-wide dicts, which torch 2.11-2.14 fill and empty in
# place (the register_module_* functions and handles), never rebinding them, so holding the dicts is enough.
MODULE_HOOK_ATTRIBUTES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def global_module_hook_dicts() -> tuple[dict, ...]:
    return (_modules_module._global_forward_hooks, _modules_module._global_forward_pre_hooks,
            _modules_module._global_backward_hooks, _modules_module._global_backward_pre_hooks)


def module_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` does more than its class's forward: forward or backward hooks of its own
    (:data:`MODULE_HOOK_ATTRIBUTES`), global ones (:func:`global_module_hook_dicts`; private dicts of
    ``nn.Module`` and ``torch.nn.modules.module``, no public accessor), or a wrapper another library set as its
    instance ``forward`` (accelerate's device hooks). Read as attributes, which TorchDynamo guards."""
    return bool("forward" in module.__dict__ or any(getattr(module, name) for name in MODULE_HOOK_ATTRIBUTES)
                or any(global_module_hook_dicts()))


# What torch.fx's symbolic tracing patches for the duration of a trace (torch.fx._symbolic_trace: ``Tracer.trace``
# patches ``nn.Module.__call__`` and ``__getattr__``, the functions registered with ``torch.fx.wrap``
# (``_wrapped_fns_to_patch``, ``_wrapped_methods_to_patch``) and ``math`` functions found in the globals of
# the code it runs (autowrap), each patch a function that wraps the original (``__wrapped__``) and carries
# ``_Patcher__fx_already_patched``, the name ``_Patcher.patch`` sets, mangled); ``CURRENT_PATCHER`` and
# the tracing flag say a trace is in progress: the module global ``_is_fx_tracing_flag`` up to torch 2.13, a
# thread-local behind ``_get_is_fx_tracing`` / ``_set_is_fx_tracing`` in 2.14). The rest the same from 2.11 to 2.14.
_MODULE_CALL = nn.Module.__dict__["__call__"]
_MODULE_GETATTR = nn.Module.__dict__["__getattr__"]
_FX_PATCH_MARK = "_Patcher__fx_already_patched"


def _fx_tracing():
    from torch.fx import _symbolic_trace

    return _symbolic_trace


@contextlib.contextmanager
def fx_trace_undone(globals_dicts: tuple[dict, ...] = ()):
    """Within: a ``torch.fx`` symbolic trace. However it ends, an interrupt included (one inside
    torch.fx's own revert of its patches, which leaves every module of the process patched), nothing of
    it stays: ``nn.Module``'s methods, the wrapped functions (``torch.fx.wrap``'s, and autowrapped ``math``
    functions in ``globals_dicts``: the globals of the code traced), torch.fx's tracing flags and the torch
    function modes pushed within are as they were. An interrupt while undoing is taken and undoing
    resumes (it is idempotent); the interrupt is raised after."""
    fx_tracing = _fx_tracing()
    before = (fx_tracing.CURRENT_PATCHER, _fx_tracing_flag(fx_tracing), torch._C._len_torch_function_stack())
    try:
        yield
    finally:
        interrupted = None
        for _ in range(8):
            try:
                _undo_fx_trace(fx_tracing, before, globals_dicts)
                break
            except BaseException as err:  # noqa: BLE001 - an interrupt while undoing: undo again, raise it after
                interrupted = interrupted or err
        if interrupted is not None:
            raise interrupted


def _undo_fx_trace(fx_tracing, before: tuple, globals_dicts: tuple[dict, ...]) -> None:
    patcher, tracing, modes = before
    type.__setattr__(nn.Module, "__call__", _MODULE_CALL)
    type.__setattr__(nn.Module, "__getattr__", _MODULE_GETATTR)
    frames = [frame for _, frame in fx_tracing._wrapped_fns_to_patch.items()]
    for frame in (*frames, *globals_dicts, math.__dict__):
        for name, value in list(frame.items()):
            if hasattr(value, _FX_PATCH_MARK) and hasattr(value, "__wrapped__"):
                frame[name] = value.__wrapped__
    for cls, name in fx_tracing._wrapped_methods_to_patch:
        value = cls.__dict__.get(name)
        if hasattr(value, _FX_PATCH_MARK) and hasattr(value, "__wrapped__"):
            setattr(cls, name, value.__wrapped__)
    while torch._C._len_torch_function_stack() > modes:
        torch._C._pop_torch_function_stack()
    fx_tracing.CURRENT_PATCHER = patcher
    if hasattr(fx_tracing, "_set_is_fx_tracing"):
        fx_tracing._set_is_fx_tracing(tracing)
    else:
        fx_tracing._is_fx_tracing_flag = tracing


def _fx_tracing_flag(fx_tracing) -> bool:
    if hasattr(fx_tracing, "_get_is_fx_tracing"):
        return fx_tracing._get_is_fx_tracing()
    return fx_tracing._is_fx_tracing_flag


def fx_trace_left_behind() -> bool:
    """Whether ``nn.Module`` is left patched by a torch.fx trace no longer in progress (interrupted where
    :func:`fx_trace_undone` could not act): every module call of the process would go to that trace."""
    left = (nn.Module.__dict__["__call__"] is not _MODULE_CALL
            or nn.Module.__dict__["__getattr__"] is not _MODULE_GETATTR)
    return left and _fx_tracing().CURRENT_PATCHER is None


def undo_fx_trace_left_behind() -> None:
    """Put back what :func:`fx_trace_left_behind` found patched."""
    _undo_fx_trace(_fx_tracing(), (None, False, torch._C._len_torch_function_stack()), ())


def global_forward_hooks() -> bool:
    """Whether forward hooks registered for every module are in place
    (``torch.nn.modules.module.register_module_forward_hook``; its private dict, no public accessor)."""
    return bool(_modules_module._global_forward_hooks)


def global_forward_pre_hooks() -> bool:
    """Whether forward pre-hooks registered for every module are in place
    (``torch.nn.modules.module.register_module_forward_pre_hook``; its private dict, no public accessor)."""
    return bool(_modules_module._global_forward_pre_hooks)


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


_CALLBACKS_LOCK = threading.Lock()


def on_dynamo_compile(start, end) -> None:
    """Call ``start(args)`` / ``end(args)`` when TorchDynamo starts / ends a compilation, in the compiling
    thread, under its compilation lock (``torch._dynamo.callback_handler``); once, however often this is
    called: ``torch.compiler.reset()`` clears Dynamo's callbacks, so it is called before every compilation
    that needs them. Relies on the handler's ``start_callbacks`` list (torch 2.11 to 2.14)."""
    handler = torch._dynamo.callback_handler
    if start in handler.start_callbacks:
        return
    with _CALLBACKS_LOCK:
        if start not in handler.start_callbacks:
            handler.register_start_callback(start)
            handler.register_end_callback(end)


def is_dynamo_frame_compile(args) -> bool:
    """Whether a compilation callback's ``args`` are those of a frame Dynamo traces (not a deferred
    backward compilation)."""
    from torch._dynamo.callback import CallbackTrigger

    return args.callback_trigger == CallbackTrigger.DYNAMO


def wrappers(module: nn.Module) -> list[nn.Module]:
    """``module`` and the modules inside the wrappers users put around one, outermost first, the model
    last: ``torch.compile``'s ``OptimizedModule`` (which keeps it as the private ``_orig_mod``), PEFT's
    ``PeftModel`` (``get_base_model()``), ``nn.DataParallel`` and ``DistributedDataParallel``
    (``.module``), in any nesting."""
    chain = [module]
    while True:
        children = module.__dict__.get("_modules")
        # A TorchScript module keeps its children in a mapping of its own kind: no wrapper.
        inner = children.get("_orig_mod") if isinstance(children, dict) else None
        if inner is None and type(module).__module__.startswith("peft.") and callable(
                getattr(module, "get_base_model", None)):
            inner = module.get_base_model()
        if inner is None and isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = module.module
        if inner is None or inner is module:
            return chain
        chain.append(inner)
        module = inner


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside the wrappers around ``module`` (:func:`wrappers`); ``module`` itself when it is no
    wrapper."""
    return wrappers(module)[-1]


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


def _compile_takes_recompile_limit() -> bool:
    return "recompile_limit" in inspect.signature(torch.compile).parameters


class _RaisedRecompileLimit:
    """Within: ``torch._dynamo.config.recompile_limit`` is at least ``limit`` while any such context is open
    in any thread (a count under a lock: the first in raises it, the last out restores the user's value)."""

    _lock = threading.Lock()
    _open = 0
    _before: int | None = None

    def __init__(self, limit: int):
        self.limit = limit

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._open == 0:
                cls._before = torch._dynamo.config.recompile_limit
                torch._dynamo.config.recompile_limit = max(cls._before, self.limit)
            cls._open += 1

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._open -= 1
            if cls._open == 0:
                torch._dynamo.config.recompile_limit = cls._before


def compile_with_recompile_limit(function: Callable, recompile_limit: int, **compile_kwargs) -> Callable:
    """``torch.compile(function, **compile_kwargs)`` allowed ``recompile_limit`` graphs per code object.
    torch 2.13 and 2.14 take the limit as ``torch.compile``'s own ``recompile_limit`` keyword (per region).
    torch 2.11 and 2.12 have only the process-wide ``torch._dynamo.config.recompile_limit``, read when a
    frame compiles, which happens inside a call: there each call of the compiled function runs with the
    setting raised to at least ``recompile_limit``, and the user's value comes back once no such call is in
    progress in any thread."""
    if _compile_takes_recompile_limit():
        return torch.compile(function, recompile_limit=recompile_limit, **compile_kwargs)
    compiled = torch.compile(function, **compile_kwargs)

    @functools.wraps(function)
    def with_recompile_limit(*args, **kwargs):
        with _RaisedRecompileLimit(recompile_limit):
            return compiled(*args, **kwargs)

    return with_recompile_limit


# torch 2.13 and 2.14: the eager implementation of ``torch.ops.higher_order.tag_activation_checkpoint`` (what
# TorchDynamo captures ``torch.utils.checkpoint.checkpoint`` as) checkpoints its body. torch 2.11 and 2.12 run
# the body as a plain call there (only AOTAutograd honours the tag): a captured graph run eagerly keeps
# every activation.
_EAGER_HOP_CHECKPOINTS = release(torch.__version__) >= (2, 13)


def _checkpointed_body(body, *args, **kwargs):
    """What the tag's eager implementation does from torch 2.13: the body under non-reentrant checkpointing."""
    from torch.utils.checkpoint import checkpoint

    kwargs = {key: value for key, value in kwargs.items() if key not in ("use_reentrant", "context_fn")}
    return checkpoint(body, *args, use_reentrant=False, **kwargs)


def checkpoint_regions_when_run_eagerly(graph_module) -> None:
    """Make the checkpointed regions of a TorchDynamo graph that runs eagerly (not through AOTAutograd)
    recompute in the backward pass on every supported release: on torch 2.11 and 2.12 each
    ``tag_activation_checkpoint`` call becomes a call of ``torch.utils.checkpoint.checkpoint`` on its body,
    what later releases run for the tag; in place, nothing to do from 2.13."""
    if _EAGER_HOP_CHECKPOINTS:
        return
    tag = torch.ops.higher_order.tag_activation_checkpoint
    calls = graph_module.graph.find_nodes(op="call_function", target=tag)
    for node in calls:
        node.target = _checkpointed_body
    if calls:
        graph_module.recompile()


def dynamo_module_state(node) -> bool:
    """Whether a node of a TorchDynamo graph is an input that holds the traced module's own state (a parameter,
    a buffer, or a tensor kept in one of its attributes, such as an inference engine's packed weight) rather
    than an argument of the call. Dynamo names a graph input after where it found it, ``L_self_...`` for what
    the forward's ``self`` reaches (``L_x_``, ``L_kwargs_...`` for arguments), on 2.11-2.14; no public
    record of an input's origin reaches a backend."""
    return node.op == "placeholder" and str(node.target).startswith("L_self_")


__all__ = [
    "graph_break_release_hint",
    "checkpoint_regions_when_run_eagerly",
    "global_forward_hooks",
    "global_forward_pre_hooks",
    "fx_trace_undone",
    "fx_trace_left_behind",
    "undo_fx_trace_left_behind",
    "compile_with_recompile_limit",
    "SUPPORTED_TORCH",
    "release",
    "check_version",
    "BackendCompilerFailed",
    "TorchDynamoException",
    "TorchRuntimeError",
    "ObservedException",
    "FailOnRecompileLimitHit",
    "DynamoUnsupported",
    "detect_fake_mode",
    "OpOverload",
    "OpOverloadPacket",
    "FakeTensor",
    "is_fake",
    "pytree",
    "DropoutBase",
    "NormBase",
    "ConvBase",
    "assume_constant_result",
    "dynamo_argument",
    "transformer_seq_len_helper",
    "dynamo_compile_lock",
    "lazy_graph_modules",
    "inductor_compile",
    "dynamo_capture_config",
    "view_base",
    "compiling_despite_force_eager",
    "saved_tensor_hooks_active",
    "module_hooks",
    "MODULE_HOOK_ATTRIBUTES",
    "global_module_hook_dicts",
    "nn_module_hook_guards",
    "mha_fast_path_off",
    "on_dynamo_compile",
    "is_dynamo_frame_compile",
    "unwrapped",
    "wrappers",
    "tracing_for_one_graph",
    "dynamo_module_state",
]
