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

import contextlib
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import api, compat, conversion, routing
from .config import AttnResConfig
from .conversion import is_converted, plan_of, sites
from .errors import AttnResWarning, CheckpointMismatchError
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
            with compat.hf_saved_under_own_names(set(_attnres_weights(self.model))):
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
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointMismatchError(f"{path} cannot be read: {type(err).__name__}: {err}. Save the converted "
                                      "model again") from err
    check_entry(config, str(path), "")
    return config


def check_entry(entry: Any, where: str, key: str) -> AttnResConfig:
    """The options of a saved conversion (``entry``: the ``config.json`` entry, ``key`` its key, or
    ``attnres_config.json``, ``key`` empty), after checking what they are made of; a malformed entry raises
    :class:`~attnres_fx.CheckpointMismatchError` naming the file and key, rather than loading the plain
    model or default options."""
    named = f"{where}, key '{key}'" if key else where
    way_out = (f"Restore it from the {CONFIG_NAME} saved beside it, or save the converted model again"
               if key else "Save the converted model again")
    if not isinstance(entry, dict):
        raise CheckpointMismatchError(f"{named}: a saved AttnRes conversion is an object with 'format', "
                                      f"'options' and 'block_sizes', got {type(entry).__name__} {entry!r:.80}. "
                                      f"{way_out}.")
    if entry.get("format") not in READABLE_FORMATS:
        raise CheckpointMismatchError(f"{named}: AttnRes format {entry.get('format')!r}, this attnres_fx reads "
                                      f"formats {READABLE_FORMATS}")
    fields = (("options", dict), ("block_sizes", list)) + ((("sites", list),) if not key else ())
    for field, kind in fields:
        if not isinstance(entry.get(field), kind):
            raise CheckpointMismatchError(f"{named}: '{field}' is {entry.get(field)!r:.80}, not a {kind.__name__} "
                                          f"({'missing' if field not in entry else 'malformed'}). {way_out}.")
    try:
        return AttnResConfig.from_dict(entry["options"])
    except (TypeError, ValueError) as err:
        raise CheckpointMismatchError(f"{named}: its 'options' are not valid: {err}. {way_out}.") from err


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
    saved = _saved_entry(model)
    if saved is not None:
        entry, options = saved[0], {"config": saved[1]}
    else:
        entry, options = None, (_POLICY[0](model) if _POLICY else None)
    if options is None or is_converted(model) or not _outermost(model):
        return
    after = options.pop("after", None)
    with _eval_mode(model):
        api.attnresify(model, **options)
    if entry is not None and list(plan_of(model).block_sizes) != list(entry["block_sizes"]):
        sizes = plan_of(model).block_sizes
        api.remove(model)
        raise CheckpointMismatchError(f"{type(model).__name__}: its config was saved with AttnRes block sizes "
                                      f"{entry.get('block_sizes')}, the model built from it converts to {list(sizes)}")
    if after is not None:
        after(model)


def _saved_entry(model: nn.Module) -> tuple[dict, AttnResConfig] | None:
    """The checked ``"attnres"`` entry of ``model``'s config and its options, or None when it has none; an
    entry that does not agree with the ``attnres_config.json`` saved beside its ``config.json`` is refused
    too."""
    config = getattr(model, "config", None)
    if config is None or CONFIG_ATTRIBUTE not in vars(config):
        return None
    directory = Path(getattr(config, "name_or_path", "") or "")
    where = str(directory / "config.json") if directory.is_dir() else f"{type(model).__name__}.config"
    entry = getattr(config, CONFIG_ATTRIBUTE)
    options = check_entry(entry, where, CONFIG_ATTRIBUTE)
    beside = directory / CONFIG_NAME
    if directory.is_dir() and beside.is_file():
        saved = read_config(directory)
        differs = [field for field in ("options", "block_sizes") if saved.get(field) != entry.get(field)]
        if differs:
            raise CheckpointMismatchError(
                f"{where}, key '{CONFIG_ATTRIBUTE}': its {' and '.join(differs)} differ from those in {beside} "
                f"({', '.join(f'{f}: {entry.get(f)!r} against {saved.get(f)!r}' for f in differs)}): the AttnRes "
                "weights saved there were made by the conversion that file records. Restore the entry from it.")
    return entry, options


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Within: ``model`` is in eval mode. A model being built is in training mode, and under
    ``from_pretrained`` its weights are still on the meta device: a conversion captures it in eval mode,
    where a training-only construct (a LayerDrop draw, HuBERT's ``requires_grad`` on its features) cannot
    stop the capture and send it to the fallback that runs the model. The modes are restored on the way
    out, the AttnRes modules taking the model's."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module in model.modules():
            module.training = modes.get(module, modes[model])


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


def _on_transformers_import(modeling_utils) -> None:
    """Once transformers is imported: its release checked against the supported range (``ImportError``
    below it, a warning above), then the construction hook installed."""
    compat.check_transformers_version(sys.modules["transformers"])
    compat.wrap_post_init(modeling_utils.PreTrainedModel, convert_on_construction)


compat.after_import("transformers.modeling_utils", _on_transformers_import)


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
        _restore_unloaded_weights(model, directory)
        return model
    model = model_or_cls
    config = check_entry(saved, str(Path(directory) / CONFIG_NAME), "")
    stored = _stored_attnres_weights(directory)
    api.attnresify(model, config=config)
    try:
        _check_sites(saved, saved_config(model), directory)
        model.load_state_dict(_fitting(model, stored, directory), strict=False)
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


def _stored_attnres_weights(directory) -> dict:
    """Every tensor of ``attnres.safetensors``; a missing or damaged file raises naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{path} not found: save the converted model with its save_pretrained")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CheckpointMismatchError(f"{path} cannot be read ({type(err).__name__}: {err}): the file is damaged "
                                      "or truncated. Save the converted model again") from err


def _fitting(model: nn.Module, stored: dict, directory) -> dict:
    """The AttnRes weights of ``model`` from ``stored``, every one present with the model's shape."""
    path = Path(directory) / WEIGHTS_NAME
    wanted = _attnres_weights(model)
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise CheckpointMismatchError(f"{path} has no weights for {', '.join(missing[:6])}"
                                      f"{'...' if len(missing) > 6 else ''}")
    shapes = [f"{key}: saved {tuple(stored[key].shape)}, the model's {tuple(value.shape)}"
              for key, value in wanted.items() if stored[key].shape != value.shape]
    if shapes:
        raise CheckpointMismatchError(f"{path} holds AttnRes weights of other shapes than the model converts to "
                                      f"({'; '.join(shapes[:4])}): it was saved from a model of another size")
    return {key: stored[key] for key in wanted}


def _restore_unloaded_weights(model: nn.Module, directory) -> None:
    """Give the AttnRes weights transformers' loader did not load the values of ``attnres.safetensors``,
    and say so: a checkpoint whose ``model.safetensors`` holds them under names the loader renames (written
    while transformers' reverted renamings applied to them, Mixtral's ``mlp_res`` as ``block_sparse_moe.res``;
    see :func:`attnres_fx.compat.hf_saved_under_own_names`) would otherwise load uninitialised ones."""
    stored = _fitting(model, _stored_attnres_weights(directory), directory)
    current = _attnres_weights(model)
    differ = [key for key, value in current.items()
              if value.device.type != "meta" and not torch.equal(value, stored[key].to(value.device, value.dtype))]
    if not differ:
        return
    with torch.no_grad():
        for key in differ:
            current[key].copy_(stored[key])
    warnings.warn(f"{directory}: model.safetensors gave other AttnRes weights than {WEIGHTS_NAME} for "
                  f"{', '.join(differ[:4])}{'...' if len(differ) > 4 else ''} (transformers' loader did not "
                  f"load them): they were taken from {WEIGHTS_NAME}. Save the model again to rewrite its "
                  "checkpoint.", AttnResWarning, stacklevel=3)
