"""Where attnres_fx reaches into vLLM's internals (vLLM 0.32; imported only by :mod:`attnres_fx.serving`).

vLLM picks a model's class from ``config.json``'s ``architectures`` alone: ``ModelRegistry`` (public) maps
the names to classes, and a plugin may add names, but no public hook lets it choose the class from the rest
of the config. Every lookup goes through the registry's ``inspect_model_cls`` and ``resolve_model_cls``
(``architectures, model_config``), in the engine's front end and in each worker, so the plugin wraps those
two on the registry to substitute the names a converted config is served under."""

from __future__ import annotations

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


def compiles(vllm_config) -> bool:
    """Whether vLLM asks to capture the model with ``torch.compile`` (vLLM 0.32: any compilation mode but
    ``NONE``, which ``enforce_eager=True`` sets; the CPU build's default is ``DYNAMO_TRACE_ONCE``)."""
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode != CompilationMode.NONE


def never_compile(module) -> None:
    """Make a module whose class vLLM's ``@support_torch_compile`` decorated run its forward eagerly
    (vLLM 0.32 reads the instance's ``do_not_compile`` at every call); nothing for an undecorated one."""
    if getattr(module, "do_not_compile", True) is False:
        module.do_not_compile = True
