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
import functools
import hashlib
import json
import os
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import api, atomic, compat, conversion, routing
from ..config import AttnResConfig
from ..conversion import is_converted, plan_of, sites
from ..errors import AttnResWarning, CheckpointMismatchError
from ..version import __version__

CONFIG_NAME = "attnres_config.json"
WEIGHTS_NAME = "attnres.safetensors"
CODE_NAME = "modeling_attnres.py"
CONFIG_ATTRIBUTE = "attnres"
# Format 3 adds the fingerprint that ties the config entry, attnres_config.json and attnres.safetensors
# together; folders of formats 1 and 2 load without that check.
FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
FINGERPRINTED = 3
FINGERPRINT_KEY = "attnres_fingerprint"


class SavePretrained:
    """``model.save_pretrained`` of a converted model: the class's own with the config entry, then
    ``attnres_config.json``, ``attnres.safetensors`` and the loading code for ``trust_remote_code``, all
    written into a temporary folder beside the target, checked there, and moved in at once
    (:func:`attnres_fx.atomic.replaced_folder`): a failure or an interrupt leaves the target as it was,
    and the files of an earlier save (weights, AttnRes files) never stay beside new ones."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        if not kwargs.get("is_main_process", True):
            # Another process writes the folder; this one only takes part in gathering the weights.
            return type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        target = Path(save_directory)
        if kwargs.get("push_to_hub"):
            kwargs.setdefault("repo_id", target.name)
        with atomic.replaced_folder(target, drop=_written_by_a_save) as staging:
            with atomic.writing(target, "writing the weights and config.json"):
                result = self._save_model(staging, *args, **kwargs)
            with atomic.writing(target, f"writing {CONFIG_NAME}, {WEIGHTS_NAME} and {CODE_NAME}"):
                write_config(self.model, staging)
                _write_attnres_weights(self.model, staging)
                (staging / CODE_NAME).write_text(loading_code(self.model))
            check_unit(staging, where=target)
        return result

    def _save_model(self, directory: Path, *args, **kwargs):
        config = self.model.config
        saved = {name: (hasattr(config, name), getattr(config, name, None)) for name in (CONFIG_ATTRIBUTE, "auto_map")}
        setattr(config, CONFIG_ATTRIBUTE, config_entry(self.model))
        mapped = auto_map(self.model)
        if mapped:
            config.auto_map = {**(getattr(config, "auto_map", None) or {}), **mapped}
        try:
            with compat.hf_saved_under_own_names(set(_attnres_weights(self.model))):
                return type(self.model).save_pretrained(self.model, directory, *args, **kwargs)
        finally:
            for name, (had, before) in saved.items():
                if had:
                    setattr(config, name, before)
                elif hasattr(config, name):
                    delattr(config, name)

    def __repr__(self) -> str:
        return f"<attnres_fx save_pretrained of {type(self.model).__name__}>"


# Files of a model folder that a save writes anew: an older save's are not carried over beside a new one
# (a shard of a larger model, the AttnRes files of a converted one).
_SAVED_FILES = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


def _written_by_a_save(name: str) -> bool:
    return bool(_SAVED_FILES.fullmatch(name)) or name in (CONFIG_NAME, WEIGHTS_NAME, CODE_NAME)


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
    """Undo :func:`attach`, and take from the model's config what a saved conversion put there (the
    ``"attnres"`` entry, the ``auto_map`` entries naming the folder's loading code): a model saved after
    :func:`attnres_fx.remove` is the original model."""
    config = getattr(model, "config", None)
    if config is not None and CONFIG_ATTRIBUTE in vars(config):
        delattr(config, CONFIG_ATTRIBUTE)
    auto = getattr(config, "auto_map", None)
    if isinstance(auto, dict) and any(_ours(ref) for ref in auto.values()):
        kept = {name: ref for name, ref in auto.items() if not _ours(ref)}
        if kept:
            config.auto_map = kept
        else:
            delattr(config, "auto_map")
    if isinstance(model.__dict__.get("save_pretrained"), SavePretrained):
        del model.__dict__["save_pretrained"]
    if isinstance(model.__dict__.get("get_compiled_call"), CompiledCall):
        del model.__dict__["get_compiled_call"]
    compat.forget_hf_compiled_call(model, lambda call: getattr(call, "attnres_compiled_call", False))


conversion.on_convert(attach, detach)


def _ours(reference: Any) -> bool:
    return isinstance(reference, str) and reference.startswith(f"{Path(CODE_NAME).stem}.")


def config_entry(model: nn.Module) -> dict[str, Any]:
    """The ``"attnres"`` entry of a converted model's ``config.json``: its :class:`AttnResConfig`, block
    sizes, format and the fingerprint of its AttnRes weights with them (:func:`fingerprint`)."""
    entry = {"format": FORMAT_VERSION, "attnres_fx_version": __version__,
             "options": conversion.config_of(model).to_dict(), "block_sizes": list(plan_of(model).block_sizes)}
    return {**entry, "fingerprint": fingerprint(_attnres_weights(model), entry)}


def fingerprint(tensors: dict[str, torch.Tensor], entry: dict[str, Any]) -> str:
    """One hash of the AttnRes tensors (names, dtypes, shapes, bytes) and the conversion that made them
    (the entry's options and block sizes): recorded in the config entry, ``attnres_config.json`` and the
    metadata of ``attnres.safetensors``, so that files of different saves, models or dtypes never pass for
    one checkpoint."""
    digest = hashlib.sha256(json.dumps({"options": entry["options"], "block_sizes": entry["block_sizes"]},
                                       sort_keys=True).encode())
    for key in sorted(tensors):
        tensor = tensors[key].detach().cpu().contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def _site_list(model: nn.Module) -> list[dict[str, Any]]:
    return [{key: value for key, value in asdict(site).items() if key not in ("position", "branch")}
            for site in plan_of(model).sites]


def saved_config(model: nn.Module) -> dict[str, Any]:
    """What ``attnres_config.json`` holds for a converted model: the config entry and the site list."""
    return {**config_entry(model), "sites": _site_list(model)}


def write_config(model: nn.Module, directory) -> Path:
    path = Path(directory) / CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved_config(model), indent=2) + "\n")
    return path


def read_config(directory, shown=None) -> dict[str, Any]:
    """``attnres_config.json`` of ``directory``, checked (``shown``: the folder to name in errors)."""
    shown = Path(shown or directory)
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{shown} has no {CONFIG_NAME}: it was not saved from a model converted "
                                      "by attnres_fx (load it with the model class itself)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointMismatchError(f"{shown / CONFIG_NAME} cannot be read: {type(err).__name__}: {err}. Save the "
                                      "converted model again") from err
    check_entry(config, str(shown / CONFIG_NAME), "")
    return config


def auto_map(model: nn.Module) -> dict[str, str]:
    """The ``auto_map`` entries of a saved converted model's ``config.json``: each ``AutoModel*`` class
    that builds its class names the class in the folder's loading code (:func:`loading_code`)."""
    cls = _saved_class(model)
    classes = compat.hf_auto_classes(cls, type(model.config))
    return {name: f"{Path(CODE_NAME).stem}.{cls.__name__}" for name in classes}


def _saved_class(model: nn.Module) -> type:
    """The model's class as transformers defines it (a model loaded through the folder's loading code is
    of its subclass there)."""
    return next((cls for cls in type(model).__mro__ if cls.__module__.startswith("transformers.")), type(model))


def loading_code(model: nn.Module) -> str:
    """``modeling_attnres.py``: what transformers runs for ``Auto*.from_pretrained(folder,
    trust_remote_code=True)`` in a process that has not imported attnres_fx. It imports attnres_fx (so
    the model built from the folder's config is converted, its weights checked) and names a subclass of
    the saved class; where attnres_fx is not installed, transformers refuses the folder naming it."""
    cls = _saved_class(model)
    return (f'''"""The converted {cls.__name__} of this folder, for transformers alone:
``AutoModel...from_pretrained(folder, trust_remote_code=True)``. Written by attnres_fx {__version__}:
importing it converts every model built from a config with an "attnres" entry (pip install attnres-fx)."""

import attnres_fx  # noqa: F401 - converts the model built from this folder's config, checks its weights
from {cls.__module__} import {cls.__name__} as _Saved


class {cls.__name__}(_Saved):
    """{cls.__name__} as transformers defines it; converted when it is built."""
''')


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
    fields = (("options", dict), ("block_sizes", list)) + ((("sites", list),) if not key else ()) + \
        ((("fingerprint", str),) if entry["format"] >= FINGERPRINTED else ())
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
    try:
        if entry is not None and list(plan_of(model).block_sizes) != list(entry["block_sizes"]):
            raise CheckpointMismatchError(f"{type(model).__name__}: its config was saved with AttnRes block sizes "
                                          f"{entry.get('block_sizes')}, the model built from it converts to "
                                          f"{list(plan_of(model).block_sizes)}")
        if entry is not None and saved[2] is not None and (saved[2] / CONFIG_NAME).is_file():
            # As attnres_fx.from_pretrained checks: a config.json edited since (num_hidden_layers) is refused.
            _check_sites(*_without_base_prefix(model, read_config(saved[2]), {
                "sites": _site_list(model), "block_sizes": list(plan_of(model).block_sizes)}), saved[2])
    except CheckpointMismatchError:
        api.remove(model)
        raise
    if entry is not None and saved[2] is not None:
        _LOAD_CHECKS[model] = functools.partial(check_loaded, directory=saved[2], entry=entry)
    if after is not None:
        after(model)


def _without_base_prefix(model: nn.Module, saved: dict, now: dict) -> tuple[dict, dict]:
    """The saved and the current site lists without the base model's prefix that one of them has and the
    other lacks (an ``AutoModel`` loaded from a ``...ForCausalLM`` folder, or the reverse)."""
    def names(sites):
        return {site["name"] for site in sites["sites"]}

    def stripped(sites, prefix):
        def path(value):   # a module path: the base model's own ("model") becomes the root's ("")
            if value == prefix[:-1]:
                return ""
            return value[len(prefix):] if isinstance(value, str) and value.startswith(prefix) else value
        return {**sites, "sites": [{key: path(value) for key, value in site.items()} for site in sites["sites"]]}
    prefix = _saved_prefix(model, dict.fromkeys(names(now)), names(saved))
    if prefix:
        return stripped(saved, prefix), now
    prefix = _saved_prefix(model, dict.fromkeys(names(saved)), names(now))
    return saved, stripped(now, prefix) if prefix else now


# How many of transformers' from_pretrained calls this thread is in.
_LOADING = threading.local()

# Models built by transformers' from_pretrained from a converted folder -> the check of the weights its
# loader gave them, run once from_pretrained returns (:func:`check_loaded`).
_LOAD_CHECKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _saved_entry(model: nn.Module) -> tuple[dict, AttnResConfig, Path | None] | None:
    """The checked ``"attnres"`` entry of ``model``'s config, its options and the folder it was read
    from (None when not from a folder), or None when it has none. The entry is checked with the files
    beside its ``config.json`` as one checkpoint (:func:`check_unit`); a config without an entry read from
    a folder that holds AttnRes files is refused (transformers would build the original model beside the
    converted one's weights)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    directory = Path(getattr(config, "name_or_path", "") or "")
    from_folder = directory.is_dir() and (directory / "config.json").is_file()
    if CONFIG_ATTRIBUTE not in vars(config):
        # Only a load reads the folder: a model built from a config whose conversion was removed is plain.
        if getattr(_LOADING, "depth", 0) and from_folder and (directory / CONFIG_NAME).is_file() and _outermost(model):
            raise CheckpointMismatchError(_no_entry(directory))
        return None
    where = str(directory / "config.json") if from_folder else f"{type(model).__name__}.config"
    entry = getattr(config, CONFIG_ATTRIBUTE)
    options = check_entry(entry, where, CONFIG_ATTRIBUTE)
    if from_folder and (directory / CONFIG_NAME).is_file():
        check_unit(directory, entry=entry)
    return entry, options, directory if from_folder else None


def _no_entry(directory: Path) -> str:
    return (f"{directory / 'config.json'} has no '{CONFIG_ATTRIBUTE}' entry, but {CONFIG_NAME} lies beside it: the "
            "folder's config and weights were written by a model that is not converted (saved over a converted "
            "one), or the entry was deleted, so transformers would build the original model. Restore the entry "
            f"from {CONFIG_NAME} (and its fingerprint), or delete {CONFIG_NAME} and {WEIGHTS_NAME} to load the "
            "original model")


def check_unit(directory, *, entry: dict | None = None, where=None) -> tuple[dict, dict]:
    """``attnres_config.json``, ``attnres.safetensors`` and the ``config.json`` entry of a saved converted
    model (``entry``: as read already; else from ``config.json`` when there is one) checked as one
    checkpoint: the same options, block sizes and fingerprint in all three, and tensors that hash to it.
    Returns the saved config and the AttnRes tensors; a mismatch raises
    :class:`~attnres_fx.CheckpointMismatchError` naming the file and key (``where``: the folder to name)."""
    directory = Path(directory)
    shown = Path(where or directory)
    saved = read_config(directory, shown)
    if entry is None and (directory / "config.json").is_file():
        entry = _config_json_entry(directory, shown)
    if entry is not None:
        fields = ("options", "block_sizes") + (("fingerprint",) if saved["format"] >= FINGERPRINTED else ())
        differs = [field for field in fields if saved.get(field) != entry.get(field)]
        if differs:
            raise CheckpointMismatchError(
                f"{shown / 'config.json'}, key '{CONFIG_ATTRIBUTE}': its {' and '.join(differs)} differ from those in "
                f"{shown / CONFIG_NAME} ({', '.join(f'{f}: {entry.get(f)!r} against {saved.get(f)!r}' for f in differs)})"
                f": the two were written by different saves. Save the converted model again (or restore the entry "
                f"from {CONFIG_NAME} if only the entry was edited).")
    stored, recorded = _stored_attnres_weights(directory, shown)
    if saved["format"] >= FINGERPRINTED:
        path = shown / WEIGHTS_NAME
        if recorded != saved["fingerprint"]:
            raise CheckpointMismatchError(
                f"{path}: its metadata '{FINGERPRINT_KEY}' is {recorded!r}, {shown / CONFIG_NAME} records "
                f"{saved['fingerprint']!r}: the AttnRes weights come from another save. Save the converted model again.")
        if fingerprint(stored, saved) != saved["fingerprint"]:
            raise CheckpointMismatchError(
                f"{path}: its tensors do not hash to the fingerprint {saved['fingerprint']!r} they were saved with "
                "(changed after saving: another model's weights, another dtype, edited values). Save the converted "
                "model again.")
    return saved, stored


def _config_json_entry(directory: Path, shown: Path) -> dict:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointMismatchError(f"{shown / 'config.json'} cannot be read: {type(err).__name__}: {err}") from err
    if not isinstance(config, dict) or CONFIG_ATTRIBUTE not in config:
        raise CheckpointMismatchError(_no_entry(shown))
    check_entry(config[CONFIG_ATTRIBUTE], str(shown / "config.json"), CONFIG_ATTRIBUTE)
    return config[CONFIG_ATTRIBUTE]


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


def _wrap_from_pretrained(pretrained_model: type) -> None:
    """Make ``PreTrainedModel.from_pretrained`` (a public classmethod) check the AttnRes weights its loader
    gave a converted model (:func:`check_loaded`) before returning it, once."""
    original = pretrained_model.__dict__["from_pretrained"].__func__
    if getattr(original, "_attnres_wrapped", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        _LOADING.depth = getattr(_LOADING, "depth", 0) + 1
        try:
            result = original(cls, *args, **kwargs)
        finally:
            _LOADING.depth -= 1
        model = result[0] if isinstance(result, tuple) else result
        check = _LOAD_CHECKS.pop(model, None)
        if check is not None:
            check(model)
        return result

    from_pretrained._attnres_wrapped = True
    pretrained_model.from_pretrained = classmethod(from_pretrained)


def _on_transformers_import(modeling_utils) -> None:
    """Once transformers is imported: its release checked against the supported range (``ImportError``
    below it, a warning above), then the construction hook and the check after loading installed."""
    compat.check_transformers_version(sys.modules["transformers"])
    compat.wrap_post_init(modeling_utils.PreTrainedModel, convert_on_construction)
    _wrap_from_pretrained(modeling_utils.PreTrainedModel)


compat.after_import("transformers.modeling_utils", _on_transformers_import)


def _recover_folder(path_or_repo_id) -> None:
    """Finish a save of the folder that was killed part-way (:func:`attnres_fx.atomic.recover`)."""
    if isinstance(path_or_repo_id, (str, os.PathLike)):
        atomic.recover(path_or_repo_id)


# Every loader of transformers first finishes a save of its folder that was killed part-way.
compat.after_import("transformers.utils.hub", lambda hub: compat.before_file_lookups(hub, _recover_folder))


# -- attnres_fx.from_pretrained -----------------------------------------------------------------------------

def from_pretrained(model_or_cls, directory, **from_pretrained_kwargs) -> nn.Module:
    """Rebuild a converted model from a directory written by its ``save_pretrained``.

    ``model_or_cls``: a model class (``LlamaForCausalLM``, or an ``Auto*`` class): its own
    ``from_pretrained(directory, **from_pretrained_kwargs)``, which gives the converted model (see the
    module docstring); or a model instance of the same architecture (its own weights are kept), converted
    with the saved options and given the saved AttnRes weights. Either way the folder's AttnRes files and
    config entry are checked as one checkpoint (:func:`check_unit`) and the sites against the saved ones:
    a model that converts to others raises :class:`~attnres_fx.CheckpointMismatchError` naming them, and
    an instance is left unconverted.
    """
    atomic.recover(directory)
    saved, stored = check_unit(directory)
    if isinstance(model_or_cls, type):
        model = model_or_cls.from_pretrained(directory, **from_pretrained_kwargs)
        if not is_converted(model):
            raise CheckpointMismatchError(f"{directory}: {type(model).__name__} was built without its AttnRes "
                                          f"conversion (config.json has no '{CONFIG_ATTRIBUTE}' entry?)")
        _check_sites(saved, {"sites": _site_list(model), "block_sizes": list(plan_of(model).block_sizes)}, directory)
        return model
    model = model_or_cls
    config = check_entry(saved, str(Path(directory) / CONFIG_NAME), "")
    api.attnresify(model, config=config)
    try:
        _check_sites(saved, {"sites": _site_list(model), "block_sizes": list(plan_of(model).block_sizes)}, directory)
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
    save_file(tensors, str(Path(directory) / WEIGHTS_NAME),
              metadata={"format": "pt", FINGERPRINT_KEY: config_entry(model)["fingerprint"]})


def _stored_attnres_weights(directory, shown=None) -> tuple[dict, str | None]:
    """Every tensor of ``attnres.safetensors`` and the fingerprint its metadata records; a missing or
    damaged file raises naming it."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / WEIGHTS_NAME
    named = Path(shown or directory) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{named} not found: the AttnRes weights are missing. Save the converted "
                                      "model with its save_pretrained")
    try:
        with safe_open(str(path), "pt") as weights:
            return {key: weights.get_tensor(key) for key in weights.keys()}, (weights.metadata() or {}).get(FINGERPRINT_KEY)
    except (SafetensorError, OSError) as err:
        raise CheckpointMismatchError(f"{named} cannot be read ({type(err).__name__}: {err}): the file is damaged "
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


def check_loaded(model: nn.Module, directory: Path, entry: dict) -> None:
    """After transformers' loader filled a converted model built from ``directory``: its AttnRes weights
    are those of ``attnres.safetensors``. Those the main weights lack (or hold under names the loader
    renames: written while transformers' reverted renamings applied to them, Mixtral's ``mlp_res`` as
    ``block_sparse_moe.res``; see :func:`attnres_fx.compat.hf_saved_under_own_names`) would keep
    uninitialised memory: they are taken from ``attnres.safetensors``, with a warning. Main weights that
    hold other AttnRes values under their own names come from another save: refused, naming them."""
    current = _attnres_weights(model)
    prefix = _saved_prefix(model, current, _main_weight_names(directory) or set())
    in_main = _main_weight_names(directory)
    if in_main is not None:
        in_main = {key[len(prefix):] for key in in_main if key.startswith(prefix)}
    if not (directory / CONFIG_NAME).is_file():
        stored = None
    else:
        saved = check_unit(directory, entry=entry)[1]
        prefix = _saved_prefix(model, current, set(saved))
        stored = _fitting(model, {key[len(prefix):]: value for key, value in saved.items() if key.startswith(prefix)},
                          directory)
    if stored is None:
        missing = sorted(key for key in current if in_main is None or key not in in_main)
        if missing:
            raise CheckpointMismatchError(
                f"{directory}: the main weights hold no AttnRes weights for {', '.join(missing[:4])}"
                f"{'...' if len(missing) > 4 else ''}, and {WEIGHTS_NAME} is missing: the AttnRes weights are lost. "
                "Save the converted model again")
        return
    differ = [key for key, value in current.items()
              if value.device.type != "meta" and not torch.equal(value, stored[key].to(value.device, value.dtype))]
    conflicting = [key for key in differ if in_main is not None and key in in_main]
    if conflicting:
        raise CheckpointMismatchError(
            f"{directory}: the main weights and {WEIGHTS_NAME} hold different AttnRes weights for "
            f"{', '.join(conflicting[:4])}{'...' if len(conflicting) > 4 else ''}: they come from different saves. "
            "Save the converted model again")
    if not differ:
        return
    with torch.no_grad():
        for key in differ:
            current[key].copy_(stored[key])
    warnings.warn(f"{directory}: the main weights gave no AttnRes weights for {', '.join(differ[:4])}"
                  f"{'...' if len(differ) > 4 else ''} (missing, or under names transformers' loader did not load): "
                  f"they were taken from {WEIGHTS_NAME}. Save the model again to rewrite its checkpoint.",
                  AttnResWarning, stacklevel=4)


def _saved_prefix(model: nn.Module, current: dict, saved: set[str]) -> str:
    """``"model."`` where the folder holds the model ``model`` is the base of (an ``AutoModel`` built from
    a ``...ForCausalLM`` folder: transformers drops the prefix when it loads), else ``""``."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    if prefix != "." and current and not set(current) & saved and {prefix + key for key in current} & saved:
        return prefix
    return ""


def _main_weight_names(directory: Path) -> set[str] | None:
    """The tensor names of the folder's safetensors weights (one file or a sharded index), or None where
    they are in another format."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as weights:
            return set(weights.keys())
    return None
