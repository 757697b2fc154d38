"""Where attnres_fx reaches into vLLM's internals (vLLM 0.32; imported only by :mod:`attnres_fx.serving`).

vLLM picks a model's class from ``config.json``'s ``architectures`` alone: ``ModelRegistry`` (public) maps
the names to classes, and a plugin may add names, but no public hook lets it choose the class from the rest
of the config. Every lookup goes through the registry's ``inspect_model_cls`` and ``resolve_model_cls``
(``architectures, model_config``), in the engine's front end and in each worker, so the plugin wraps those
two on the registry to substitute the names a converted config is served under.

vLLM compiles a decoder decorated with ``@support_torch_compile`` with the backend its compilation config
makes (``CompilationConfig.init_backend``, called when the decoder is built); no public hook lets a model
rewrite the graph that backend gets, so the plugin's classes replace ``init_backend`` on their own config
while they are built (:func:`backends_wrapped`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

_LOOKUPS = ("inspect_model_cls", "resolve_model_cls")


def route_model_lookups(choose: Callable[[list[str], object], list[str]]) -> None:
    """Make vLLM's model registry look up ``choose(architectures, model_config)`` in place of a config's
    ``architectures`` (vLLM 0.32: ``ModelRegistry.inspect_model_cls`` and ``resolve_model_cls``); once
    per process."""
    from vllm import ModelRegistry

    for name in _LOOKUPS:
        lookup = getattr(ModelRegistry, name)
        if getattr(lookup, "_attnres_routed", False):
            continue

        @functools.wraps(lookup)
        def routed(architectures, model_config, *args, _lookup=lookup, **kwargs):
            names = [architectures] if isinstance(architectures, str) else list(architectures or [])
            return _lookup(choose(names, model_config), model_config, *args, **kwargs)

        routed._attnres_routed = True
        setattr(ModelRegistry, name, routed)


def transformers_backend_class(model_config) -> str:
    """The name of vLLM's Transformers-backend class that would serve ``model_config``
    (``TransformersForCausalLM``, ``TransformersMoEForCausalLM``, ...; vLLM 0.32's
    ``ModelConfig._get_transformers_backend_cls``)."""
    return model_config._get_transformers_backend_cls()


def compiles_whole_model(vllm_config) -> bool:
    """Whether vLLM compiles the whole model with ``torch.compile`` itself, outside the decorated modules
    (vLLM 0.32: compilation mode ``STOCK_TORCH_COMPILE``; its default is ``VLLM_COMPILE``, which the CPU build
    turns into ``DYNAMO_TRACE_ONCE``: both compile the decorated decoder)."""
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE


@contextlib.contextmanager
def backends_wrapped(vllm_config, wrap: Callable[[Callable], Callable]):
    """Within: every backend vLLM makes for a module it compiles is ``wrap(backend)``, as a callable (vLLM 0.32:
    ``CompilationConfig.init_backend``, which a module decorated with ``@support_torch_compile`` calls when it
    is built; its result is a callable, or the name of a torch backend: ``"inductor"``, whose options are the
    config's ``inductor_compile_config``, or ``"eager"``)."""
    config = vllm_config.compilation_config
    made = config.init_backend

    def init_backend(*args, **kwargs):
        return wrap(_as_callable(made(*args, **kwargs), config))

    config.init_backend = init_backend
    try:
        yield
    finally:
        del config.init_backend


def _as_callable(backend, config) -> Callable:
    if callable(backend):
        return backend
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        options = dict(config.inductor_compile_config)
        return lambda graph, example_inputs: compile_fx(graph, example_inputs, config_patches=options)
    from torch._dynamo import lookup_backend

    return lookup_backend(backend)


def never_compile(module) -> bool:
    """Make a module whose class vLLM's ``@support_torch_compile`` decorated run its forward eagerly (vLLM 0.32
    reads the instance's ``do_not_compile`` at every call); whether it would have compiled."""
    if getattr(module, "do_not_compile", True) is False:
        module.do_not_compile = True
        return True
    return False


def intermediate_tensors_factory(keys: list[str], hidden_size: int):
    """What vLLM 0.32 calls ``model.make_empty_intermediate_tensors`` (``batch_size, dtype, device``): the
    tensors a pipeline stage receives, ``[batch_size, hidden_size]`` each, by key."""
    from vllm.model_executor.models.utils import make_empty_intermediate_tensors_factory

    return make_empty_intermediate_tensors_factory(keys, hidden_size)


# vLLM's own implementations the plugin serves converted folders on, by the architecture name of a folder's
# config.json: vLLM 0.32's module under vllm.model_executor.models and class name (its registry's
# _TEXT_GENERATION_MODELS entries). Each is one whose graph holds the residual stream as plain adds on the
# CPU build: its RMSNorm's fused add and norm runs as the IR op's native implementation, plain ops, where
# the compiled path takes it (ir_enable_torch_wrap off, custom op "none").
NATIVE_CLASSES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def native_class(architecture: str):
    """vLLM's own class for ``architecture`` (a key of :data:`NATIVE_CLASSES`)."""
    import importlib

    module, name = NATIVE_CLASSES[architecture]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)


def runs_compiled(vllm_config) -> bool:
    """Whether vLLM captures the decorated decoder with TorchDynamo (vLLM 0.32: any compilation mode but
    ``NONE``, which ``enforce_eager=True`` sets)."""
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode != CompilationMode.NONE
