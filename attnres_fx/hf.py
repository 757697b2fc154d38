"""Hugging Face models stay Hugging Face models: saved and loaded through transformers itself.

A converted ``PreTrainedModel`` saves as always, ``model.save_pretrained(dir)``: the safetensors weights
hold the AttnRes parameters under their module paths like any other, and ``config.json`` gains one entry,
``"attnres"``: the conversion's arguments, block sizes and format (the *registered config attribute*).
Beside them, ``attnres_config.json`` (the same, with the site list) and ``attnres.safetensors`` (the
AttnRes parameters alone, for :func:`from_pretrained` into a model instance).

In a process that has imported ``attnres_fx``, every ``PreTrainedModel`` whose config holds that entry is
converted when it is built, after transformers' own ``post_init``: so plain
``AutoModelForCausalLM.from_pretrained(dir)`` (or ``LlamaForCausalLM.from_pretrained``,
``from_config``, ``Class(config)``) gives the converted model, its AttnRes weights loaded by transformers'
loader with the others: safetensors keys, tied weights, ``ignore_mismatched_sizes``, sharded and meta-
device loading behave as for any model. Without ``attnres_fx`` imported, transformers builds the
original architecture and its load report lists the AttnRes weights it left unused (``...attn_res.proj.
weight | UNEXPECTED``). Only the outermost model of a composite is converted (a text model inside a
vision-language one belongs to the outer conversion).

``attnres_fx.from_pretrained(cls_or_model, dir)`` remains for loading into a model instance.

``transformers`` and ``safetensors`` are imported only by what needs them; the construction hook is
installed once transformers' ``modeling_utils`` is imported (:func:`attnres_fx.compat.after_import`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import nn

from . import api, compat, conversion, routing
from .config import AttnResConfig
from .conversion import is_converted, plan_of, sites
from .errors import CheckpointMismatchError
from .version import __version__

CONFIG_NAME = "attnres_config.json"
WEIGHTS_NAME = "attnres.safetensors"
CONFIG_ATTRIBUTE = "attnres"
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)


class SavePretrained:
    """``model.save_pretrained`` of a converted model: the class's own with the config entry, then
    ``attnres_config.json`` and ``attnres.safetensors``."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        config = self.model.config
        had, before = hasattr(config, CONFIG_ATTRIBUTE), getattr(config, CONFIG_ATTRIBUTE, None)
        setattr(config, CONFIG_ATTRIBUTE, config_entry(self.model))
        try:
            result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        finally:
            if had:
                setattr(config, CONFIG_ATTRIBUTE, before)
            else:
                delattr(config, CONFIG_ATTRIBUTE)
        if kwargs.get("is_main_process", True):
            write_config(self.model, save_directory)
            _write_attnres_weights(self.model, save_directory)
        return result

    def __repr__(self) -> str:
        return f"<attnres_fx save_pretrained of {type(self.model).__name__}>"


class CompiledCall:
    """``model.get_compiled_call`` of a converted model, which transformers' ``generate`` asks for the
    compiled forward of its decoding steps (a static cache, ``compile_config``): the model's own call on
    attnres_fx's route with Inductor (``compile_config.backend`` "inductor", the default) or eagerly (any
    other backend). A ``torch.compile`` of the whole call, transformers' own answer, cannot include the
    AttnRes route; ``fullgraph``, ``dynamic`` and ``mode`` have no counterpart on it."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, compile_config=None):
        backend = getattr(compile_config, "backend", "inductor")
        compiler = "inductor" if backend == "inductor" else "eager"
        model = self.model

        def call(*args, **kwargs):
            with routing.compiler_route(model, compiler):
                return model(*args, **kwargs)
        call.attnres_compiled_call = True
        compat.remember_hf_compiled_call(model, call)
        return call

    def __repr__(self) -> str:
        return f"<attnres_fx get_compiled_call of {type(self.model).__name__}>"


def attach(model: nn.Module) -> None:
    """After conversion: a Hugging Face model gets its ``save_pretrained``, and its AttnRes modules count
    as initialised for transformers (whose ``init_weights`` would otherwise draw random pseudo-queries
    over the zeros). No-op for other modules."""
    if not callable(getattr(type(model), "save_pretrained", None)):
        return
    if "save_pretrained" not in model.__dict__:
        model.save_pretrained = SavePretrained(model)
    if callable(getattr(type(model), "get_compiled_call", None)) and "get_compiled_call" not in model.__dict__:
        model.get_compiled_call = CompiledCall(model)
    for site in sites(model):
        for module in model.get_submodule(site.name).modules():
            compat.mark_hf_initialized(module)


def detach(model: nn.Module) -> None:
    if isinstance(model.__dict__.get("save_pretrained"), SavePretrained):
        del model.__dict__["save_pretrained"]
    if isinstance(model.__dict__.get("get_compiled_call"), CompiledCall):
        del model.__dict__["get_compiled_call"]
    compat.forget_hf_compiled_call(model, lambda call: getattr(call, "attnres_compiled_call", False))


conversion.on_convert(attach, detach)


def config_entry(model: nn.Module) -> dict[str, Any]:
    """The ``"attnres"`` entry of a converted model's ``config.json``: its :class:`AttnResConfig`, block
    sizes and format."""
    return {"format": FORMAT_VERSION, "attnres_fx_version": __version__,
            "options": conversion.config_of(model).to_dict(), "block_sizes": list(plan_of(model).block_sizes)}


def saved_config(model: nn.Module) -> dict[str, Any]:
    """What ``attnres_config.json`` holds for a converted model: the config entry and the site list."""
    return {**config_entry(model),
            "sites": [{key: value for key, value in asdict(site).items() if key not in ("position", "branch")}
                      for site in plan_of(model).sites]}


def write_config(model: nn.Module, directory) -> Path:
    path = Path(directory) / CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved_config(model), indent=2) + "\n")
    return path


def read_config(directory) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{directory} has no {CONFIG_NAME}: it was not saved from a model converted "
                                      "by attnres_fx (load it with the model class itself)")
    config = json.loads(path.read_text())
    _check_format(config, path)
    return config


def _check_format(entry: dict, where) -> None:
    if entry.get("format") not in READABLE_FORMATS:
        raise CheckpointMismatchError(f"{where}: AttnRes format {entry.get('format')!r}, this attnres_fx reads "
                                      f"formats {READABLE_FORMATS}")


# -- conversion when a model is built -----------------------------------------------------------------------

# Besides a config's entry, what else asks for conversion at construction: a function of the model
# returning attnresify's arguments (or None). Set by harnesses that run a library's own tests on
# converted models (:func:`construction_policy`).
_POLICY: list[Callable[[nn.Module], dict | None]] = []


def construction_policy(policy: Callable[[nn.Module], dict | None] | None) -> None:
    """Convert every outermost ``PreTrainedModel`` built from now on for which ``policy(model)`` returns
    attnresify's arguments (after a hook of ``"after"`` in them, a callable run on the converted model);
    ``None`` stops it."""
    _POLICY[:] = [policy] if policy is not None else []


def convert_on_construction(model: nn.Module) -> None:
    """What transformers' ``post_init`` does for attnres_fx (see the module docstring)."""
    entry = getattr(getattr(model, "config", None), CONFIG_ATTRIBUTE, None)
    options = None
    if isinstance(entry, dict):
        _check_format(entry, f"{type(model).__name__}.config.{CONFIG_ATTRIBUTE}")
        options = {"config": AttnResConfig.from_dict(entry.get("options") or {})}
    elif _POLICY:
        options = _POLICY[0](model)
    if options is None or is_converted(model) or not _outermost(model):
        return
    after = options.pop("after", None)
    api.attnresify(model, **options)
    if isinstance(entry, dict) and list(plan_of(model).block_sizes) != list(entry.get("block_sizes", [])):
        sizes = plan_of(model).block_sizes
        api.remove(model)
        raise CheckpointMismatchError(f"{type(model).__name__}: its config was saved with AttnRes block sizes "
                                      f"{entry.get('block_sizes')}, the model built from it converts to {list(sizes)}")
    if after is not None:
        after(model)


def _outermost(model: nn.Module) -> bool:
    """Whether ``model`` is not being built inside another model's ``__init__``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            other = frame.f_locals.get("self")
            if other is not model and isinstance(other, nn.Module) and hasattr(other, "config"):
                return False
        frame = frame.f_back
    return True


compat.after_import("transformers.modeling_utils", lambda module: compat.wrap_post_init(
    module.PreTrainedModel, convert_on_construction))


# -- attnres_fx.from_pretrained -----------------------------------------------------------------------------

def from_pretrained(model_or_cls, directory, **from_pretrained_kwargs) -> nn.Module:
    """Rebuild a converted model from a directory written by its ``save_pretrained``.

    ``model_or_cls``: a model class (``LlamaForCausalLM``, or an ``Auto*`` class): its own
    ``from_pretrained(directory, **from_pretrained_kwargs)``, which gives the converted model (see the
    module docstring); or a model instance of the same architecture (its own weights are kept), converted
    with the saved options and given the saved AttnRes weights. Either way the sites are checked against
    the saved ones: a model that converts to others raises :class:`~attnres_fx.CheckpointMismatchError`
    naming them, and an instance is left unconverted.
    """
    saved = read_config(directory)
    if isinstance(model_or_cls, type):
        model = model_or_cls.from_pretrained(directory, **from_pretrained_kwargs)
        if not is_converted(model):
            raise CheckpointMismatchError(f"{directory}: {type(model).__name__} was built without its AttnRes "
                                          f"conversion (config.json has no '{CONFIG_ATTRIBUTE}' entry?)")
        _check_sites(saved, saved_config(model), directory)
        return model
    model = model_or_cls
    api.attnresify(model, config=AttnResConfig.from_dict(saved["options"]))
    try:
        _check_sites(saved, saved_config(model), directory)
        _load_attnres_weights(model, directory)
    except BaseException:
        api.remove(model)
        raise
    return model


def _check_sites(saved: dict, now: dict, directory) -> None:
    fields = ("name", "kind", "block", "stream", "layer", "num_sources")
    before = [tuple(site[f] for f in fields) for site in saved["sites"]]
    after = [tuple(site[f] for f in fields) for site in now["sites"]]
    if before == after and saved["block_sizes"] == now["block_sizes"]:
        return
    missing = [f"{s[0]} ({s[1]}, block {s[2]}, {s[5]} sources)" for s in before if s not in after]
    extra = [f"{s[0]} ({s[1]}, block {s[2]}, {s[5]} sources)" for s in after if s not in before]
    lines = [f"the model does not convert to the sites saved in {directory}/{CONFIG_NAME}:"]
    if saved["block_sizes"] != now["block_sizes"]:
        lines.append(f"  block sizes: saved {saved['block_sizes']}, now {now['block_sizes']}")
    if missing:
        lines.append(f"  saved but not found now: {', '.join(missing)}")
    if extra:
        lines.append(f"  found now but not saved: {', '.join(extra)}")
    lines.append("Load the directory into a model of the architecture and size it was saved from.")
    raise CheckpointMismatchError("\n".join(lines))


def _attnres_weights(model: nn.Module) -> dict:
    return {f"{site.name}.{p}": tensor for site in sites(model)
            for p, tensor in model.get_submodule(site.name).state_dict().items()}


def _write_attnres_weights(model: nn.Module, directory) -> None:
    from safetensors.torch import save_file

    tensors = {key: value.detach().cpu().contiguous() for key, value in _attnres_weights(model).items()}
    save_file(tensors, str(Path(directory) / WEIGHTS_NAME))


def _load_attnres_weights(model: nn.Module, directory) -> None:
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{path} not found: save the converted model with its save_pretrained")
    wanted = set(_attnres_weights(model))
    tensors = {key: value for key, value in load_file(str(path)).items() if key in wanted}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise CheckpointMismatchError(f"{path} has no weights for {', '.join(missing[:6])}"
                                      f"{'...' if len(missing) > 6 else ''}")
    model.load_state_dict(tensors, strict=False)
