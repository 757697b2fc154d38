"""vLLM's plugin entry point (``vllm.general_plugins`` in pyproject.toml): with attnres_fx installed,
``vllm.LLM(model=folder)`` and ``vllm serve folder`` serve a folder written by a converted model's
``save_pretrained`` converted, with nothing imported by the user.

vLLM calls :func:`register` in each of its processes. It registers the converted models' classes
(:mod:`.vllm_native`: vLLM's own implementations, ``AttnResLlamaForCausalLM``, where vLLM has one the plugin
serves on; :mod:`.vllm_model`: vLLM's Transformers backend, the Hugging Face model converted by attnres_fx,
for every other architecture, and where vLLM's own class cannot take the folder) and routes every config
with an ``"attnres"`` entry to them (:func:`architectures_for`). What the plugin
cannot serve converted is refused there, before an engine starts, naming what to change: a folder is
never served as its plain model."""

from __future__ import annotations

from pathlib import Path

from ..errors import UnsupportedArchitectureError

# The names the converted classes are registered under, by the Transformers-backend class vLLM would
# serve the original with.
ARCHITECTURES = {
    "TransformersForCausalLM": ("AttnResForCausalLM", "attnres_fx.serving.vllm_model:AttnResForCausalLM"),
    "TransformersMoEForCausalLM": ("AttnResMoEForCausalLM", "attnres_fx.serving.vllm_model:AttnResMoEForCausalLM"),
}

# The prefix of the names the converted classes on vLLM's own implementations are registered under
# (attnres_fx.serving.vllm_native): AttnResLlamaForCausalLM.
NATIVE_PREFIX = "AttnRes"


def register() -> None:
    from vllm import ModelRegistry

    from ..compat import vllm as compat_vllm

    for name, target in [*ARCHITECTURES.values(), *_native_targets()]:
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, target)
    compat_vllm.route_model_lookups(architectures_for)


def architectures_for(architectures: list[str], model_config) -> list[str]:
    """The architecture names vLLM looks up for ``model_config``: its own for a plain config; for a
    converted one (a config with an ``"attnres"`` entry), the converted class's, after checking that the
    folder can be served converted (:func:`check_servable`)."""
    if getattr(model_config.hf_config, "attnres", None) is None or set(architectures) <= _registered_names():
        return architectures
    return [check_servable(architectures, model_config)]


def _native_targets() -> list[tuple[str, str]]:
    from ..compat import vllm as compat_vllm

    return [(NATIVE_PREFIX + name, f"attnres_fx.serving.vllm_native:{NATIVE_PREFIX}{name}")
            for name in compat_vllm.NATIVE_CLASSES]


def _registered_names() -> set[str]:
    return {name for name, _ in [*ARCHITECTURES.values(), *_native_targets()]}


def check_servable(architectures: list[str], model_config) -> str:
    """The registered name of the class that serves a converted config, or
    :class:`~attnres_fx.UnsupportedArchitectureError` saying why it cannot be served converted."""
    import transformers

    from ..integrations import hf
    from ..compat import vllm as compat_vllm

    folder = str(model_config.model)
    hf.check_entry(model_config.hf_config.attnres, f"{folder}/config.json", hf.CONFIG_ATTRIBUTE)
    if Path(folder).is_dir():
        hf.check_unit(folder)
    if model_config.model_impl != "auto":
        raise UnsupportedArchitectureError(
            f"{folder}: model_impl={model_config.model_impl!r}, but a converted model is served only by the "
            "attnres_fx plugin's own classes (vLLM's own implementation with the AttnRes rewrite where the plugin "
            "serves on it, else vLLM's Transformers backend with the AttnRes conversion), which it picks itself. "
            "Leave model_impl at 'auto'.")
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None or not (model_class.is_backend_compatible() or model_class._can_set_attn_implementation()):
        raise UnsupportedArchitectureError(
            f"{folder}: architectures {architectures} is no Hugging Face model class whose attention vLLM's "
            "Transformers backend can replace: the converted model cannot be served by vLLM.")
    backend = compat_vllm.transformers_backend_class(model_config)
    if backend not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{folder}: vLLM would serve {architectures[0]} with {backend}; the attnres_fx plugin serves converted "
            f"text generation models only ({', '.join(ARCHITECTURES)}).")
    if architectures[0] in compat_vllm.NATIVE_CLASSES:
        return NATIVE_PREFIX + architectures[0]
    return ARCHITECTURES[backend][0]
