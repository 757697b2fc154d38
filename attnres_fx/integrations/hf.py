"""Hugging Face models stay Hugging Face models: saved and loaded through transformers itself.

A converted ``PreTrainedModel`` saves as always, ``model.save_pretrained(dir)`` (:class:`SavePretrained`): the
safetensors weights hold the AttnRes parameters under their module paths like any other, and the conversion's
record (:class:`~attnres_fx.integrations.checkpoint.SavedConversion`: options, plan, fingerprint) is written as
``config.json``'s ``"attnres"`` entry, as ``attnres_config.json`` and in the metadata of ``attnres.safetensors``
(the AttnRes parameters alone). ``modeling_attnres.py`` beside them serves ``trust_remote_code``.

Loading: in a process that has imported ``attnres_fx`` (:mod:`attnres_fx.integrations.autoload`), a model
whose config holds the entry is converted from the saved plan as transformers builds it (:func:`convert_saved`):
checked against the saved model's structure, its AttnRes modules registered and its calls routed, nothing
captured, so that transformers' loader fills the AttnRes weights with the others (safetensors keys, tied
weights, sharded and meta-device loading). Within ``from_pretrained`` (:func:`load_pretrained`) the folder's
checkpoint is read and checked once, and once the weights are in, the model's AttnRes weights are checked
against it (:func:`check_loaded`). What needs the weights and a call, the routes' graphs and their check
against the plan, the routes make at the model's first call, on that call's own graphs (a layer that holds
other sites than the saved plan says raises :class:`~attnres_fx.StreamMismatchError` naming it then).
``attnres_fx.from_pretrained(cls_or_model, dir)`` takes the same path for a class, and converts a model
instance from the saved plan.

``transformers`` and ``safetensors`` are imported only by what needs them.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import api, atomic, compat, conversion, routing
from ..config import AttnResConfig
from ..conversion import plan_of
from ..errors import AttnResWarning, CheckpointMismatchError
from ..version import __version__
from . import checkpoint
from .checkpoint import CONFIG_ATTRIBUTE, CONFIG_NAME, WEIGHTS_NAME, SavedConversion, attnres_weights

CODE_NAME = "modeling_attnres.py"


class SavePretrained:
    """``model.save_pretrained`` of a converted model: the class's own with the config entry, then
    ``attnres_config.json``, ``attnres.safetensors`` and the loading code for ``trust_remote_code``, all
    written into a temporary folder beside the target, checked there, and moved in at once
    (:func:`attnres_fx.atomic.replaced_folder`): a failure or an interrupt leaves the target as it was,
    and the files of an earlier save (weights, AttnRes files) never stay beside new ones. The record is
    made once per save (one fingerprint of the AttnRes weights)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        if not kwargs.get("is_main_process", True):
            # Another process writes the folder; this one only takes part in gathering the weights.
            return type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        target = Path(save_directory)
        if kwargs.get("push_to_hub"):
            kwargs.setdefault("repo_id", target.name)
        record, tensors = SavedConversion.of(self.model)
        with atomic.replaced_folder(target, drop=_written_by_a_save) as staging:
            with atomic.writing(target, "writing the weights and config.json"):
                result = self._save_model(staging, record, *args, **kwargs)
            with atomic.writing(target, f"writing {CONFIG_NAME}, {WEIGHTS_NAME} and {CODE_NAME}"):
                checkpoint.write(staging, record, tensors)
                (staging / CODE_NAME).write_text(loading_code(self.model))
            checkpoint.check_written(staging, record, where=target)
        return result

    def _save_model(self, directory: Path, record: SavedConversion, *args, **kwargs):
        config = self.model.config
        saved = {name: (hasattr(config, name), getattr(config, name, None)) for name in (CONFIG_ATTRIBUTE, "auto_map")}
        setattr(config, CONFIG_ATTRIBUTE, record.to_json())
        mapped = auto_map(self.model)
        if mapped:
            config.auto_map = {**(getattr(config, "auto_map", None) or {}), **mapped}
        try:
            with compat.hf_saved_under_own_names(set(attnres_weights(self.model))):
                return type(self.model).save_pretrained(self.model, directory, *args, **kwargs)
        finally:
            for name, (had, before) in saved.items():
                if had:
                    setattr(config, name, before)
                elif hasattr(config, name):
                    delattr(config, name)

    def __repr__(self) -> str:
        return f"<attnres_fx save_pretrained of {type(self.model).__name__}>"


def _written_by_a_save(name: str) -> bool:
    """Files of a model folder that a save writes anew: an older save's are not carried over beside a new
    one (a shard of a larger model, the AttnRes files of a converted one)."""
    return compat.hf_weight_file(name) or name in (CONFIG_NAME, WEIGHTS_NAME, CODE_NAME)


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
    for site in plan_of(model).sites:
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


def auto_map(model: nn.Module) -> dict[str, str]:
    """The ``auto_map`` entries of a saved converted model's ``config.json``: each ``AutoModel*`` class
    that builds its class names the class in the folder's loading code (:func:`loading_code`)."""
    cls = compat.hf_model_class(model)
    classes = compat.hf_auto_classes(cls, type(model.config))
    return {name: f"{Path(CODE_NAME).stem}.{cls.__name__}" for name in classes}


def loading_code(model: nn.Module) -> str:
    """``modeling_attnres.py``: what transformers runs for ``Auto*.from_pretrained(folder,
    trust_remote_code=True)`` in a process that has not imported attnres_fx. It imports attnres_fx (so
    the model built from the folder's config is converted, its weights checked) and names a subclass of
    the saved class; where attnres_fx is not installed, transformers refuses the folder naming it."""
    cls = compat.hf_model_class(model)
    return (f'''"""The converted {cls.__name__} of this folder, for transformers alone:
``AutoModel...from_pretrained(folder, trust_remote_code=True)``. Written by attnres_fx {__version__}:
importing it converts every model built from a config with an "attnres" entry (pip install attnres-fx,
from a checkout or a wheel built from one)."""

import attnres_fx  # noqa: F401 - converts the model built from this folder's config, checks its weights
from {cls.__module__} import {cls.__name__} as _Saved


class {cls.__name__}(_Saved):
    """{cls.__name__} as transformers defines it; converted when it is built."""
''')



# -- loading ------------------------------------------------------------------------------------------------

@dataclass
class _Load:
    """One ``from_pretrained`` call of transformers in this context: the class it builds, the local folder
    (None for a Hub name), the folder's checkpoint once read, and the models converted from it (each with
    the prefix its paths lack, see :meth:`SavedConversion.relocated`)."""

    cls: type
    folder: Path | None
    unit: tuple[SavedConversion, dict] | None = None
    converted: list[tuple[nn.Module, str]] = field(default_factory=list)

    def checkpoint(self, entry: SavedConversion) -> tuple[SavedConversion, dict] | None:
        """The folder's checkpoint, read and checked with ``entry`` the first time it is asked for; None
        where the folder has no AttnRes files."""
        if self.unit is None and self.folder is not None and checkpoint.exists(self.folder):
            self.unit = checkpoint.read(self.folder, entry=entry)
        return self.unit


_LOADS: contextvars.ContextVar[tuple[_Load, ...]] = contextvars.ContextVar("attnres_fx_loads", default=())


def load_pretrained(cls: type, args: tuple, kwargs: dict, load):
    """What transformers' ``PreTrainedModel.from_pretrained`` does for attnres_fx (``load()`` runs its own):
    a save of the folder killed part-way is finished first (:func:`attnres_fx.atomic.recover`); the models
    built meanwhile find the load (:func:`convert_saved`); once it returns, every model converted from the
    folder has its AttnRes weights checked against the checkpoint (:func:`check_loaded`)."""
    name = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    folder = None
    if isinstance(name, (str, Path)):
        atomic.recover(name)
        local = Path(name) / kwargs.get("subfolder", "")
        folder = local if local.is_dir() else None
    this = _Load(cls, folder)
    token = _LOADS.set((*_LOADS.get(), this))
    try:
        result = load()
    finally:
        _LOADS.reset(token)
    model = result[0] if isinstance(result, tuple) else result
    for converted, prefix in this.converted:
        if folder is not None and _within(model, converted):
            check_loaded(converted, folder, this.unit[1] if this.unit else None, prefix)
    return result


def _within(model, module: nn.Module) -> bool:
    """Whether ``module`` is ``model`` (the usual case, checked first: a walk of a large model's modules
    costs milliseconds of every load) or one of its modules."""
    return module is model or (isinstance(model, nn.Module) and any(m is module for m in model.modules()))


def convert_saved(model: nn.Module) -> bool:
    """What the construction hook does for a model built from a config that records a saved conversion:
    convert it from the saved plan (:func:`attnres_fx.api.convert_as_planned`), when it is the model that
    was saved (its class as transformers defines it) or the one a ``from_pretrained`` call builds (a base
    model from a folder with a head takes the plan without the base model's prefix); a model built inside
    another (a base model inside the saved head model) is left to the outer one. A model of another depth
    or width than the saved one raises :class:`~attnres_fx.CheckpointMismatchError` naming the difference.
    Formats before the plan was recorded convert by a capture, as they were saved. Returns whether the
    model's config records a conversion; a config without one, built by ``from_pretrained`` from a folder
    with AttnRes files, is refused."""
    config = getattr(model, "config", None)
    loads = _LOADS.get()
    load = loads[-1] if loads else None
    built_by_load = load is not None and isinstance(model, load.cls)
    folder = load.folder if built_by_load else None
    if config is None or CONFIG_ATTRIBUTE not in vars(config):
        if folder is not None and checkpoint.exists(folder):
            raise CheckpointMismatchError(checkpoint.no_entry(folder))
        return False
    entry = vars(config)[CONFIG_ATTRIBUTE]
    if not built_by_load and compat.hf_model_class(model).__name__ != _saved_class(entry, config):
        return True
    if conversion.converted_within(model):
        return True
    where = str(load.folder / "config.json") if load is not None and load.folder is not None \
        else f"{type(model).__name__}.config"
    record = SavedConversion.from_json(entry, where, CONFIG_ATTRIBUTE)
    unit = load.checkpoint(record) if folder is not None else None
    if unit is not None:
        record = unit[0]
    prefix = checkpoint.base_prefix(model, record) if built_by_load else ""
    seen = record.relocated(prefix)
    if record.plan is not None:
        problems = checkpoint.mismatches(model, seen)
        if problems:
            raise CheckpointMismatchError(_mismatch(folder, type(model).__name__, problems))
        api.convert_as_planned(model, seen.plan, record.config)
    else:
        _convert_by_capture(model, seen, folder)
    if load is not None:
        load.converted.append((model, prefix))
    return True


def _saved_class(entry: Any, config) -> str | None:
    """The name of the class a config's entry was saved from (format 4 records it; before, the config's
    ``architectures``). Read without checking the entry: a model of another class built from the config
    (the saved model's base model, built inside it) leaves it to the saved one, which checks it."""
    model = entry.get("model") if isinstance(entry, dict) else None
    if isinstance(model, dict):
        return model.get("class")
    return (getattr(config, "architectures", None) or [None])[0]


def _convert_by_capture(model: nn.Module, saved: SavedConversion, folder: Path | None) -> None:
    """A checkpoint of format 1 to 3 (no plan recorded): the model converted with the saved options by a
    capture, in eval mode (under ``from_pretrained`` its weights are still on the meta device: a
    training-only construct, a LayerDrop draw, would send the capture to its fallback), its sites checked
    against the saved ones."""
    with eval_mode(model):
        api.attnresify(model, config=saved.config)
    try:
        if list(plan_of(model).block_sizes) != list(saved.block_sizes):
            raise CheckpointMismatchError(f"{type(model).__name__}: its config was saved with AttnRes block sizes "
                                          f"{list(saved.block_sizes)}, the model built from it converts to "
                                          f"{list(plan_of(model).block_sizes)}")
        if saved.sites is not None:
            _check_sites(model, saved.sites, folder)
    except CheckpointMismatchError:
        api.remove(model)
        raise


@contextlib.contextmanager
def eval_mode(model: nn.Module):
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


def _check_sites(model: nn.Module, saved: tuple[tuple, ...], folder) -> None:
    now = [(s.name, s.kind, s.block, s.stream, s.layer, s.num_sources) for s in plan_of(model).sites]
    if list(saved) == now:
        return
    missing = [f"{s[0]} ({s[1]}, block {s[2]}, {s[5]} sources)" for s in saved if s not in now]
    extra = [f"{s[0]} ({s[1]}, block {s[2]}, {s[5]} sources)" for s in now if s not in saved]
    lines = [line for line in (f"  saved but not found now: {', '.join(missing)}" if missing else "",
                               f"  found now but not saved: {', '.join(extra)}" if extra else "") if line]
    raise CheckpointMismatchError(_mismatch(folder, type(model).__name__,
                                            lines or ["  the same sites in another order"]))


def _mismatch(folder: Path | None, name: str, lines: list[str]) -> str:
    saved = f"{folder}/{CONFIG_NAME}" if folder is not None else f"{name}.config"
    return "\n".join([f"the model does not convert to the sites saved in {saved}:", *lines,
                      "Load the directory into a model of the architecture and size it was saved from."])


def check_loaded(model: nn.Module, directory: Path, stored: dict | None, prefix: str = "") -> None:
    """After transformers' loader filled a converted model built from ``directory``: its AttnRes weights
    are those of ``attnres.safetensors`` (``stored``, as the load read them; paths with ``prefix``). Those
    the main weights lack (or hold under names the loader renames: written while transformers' reverted
    renamings applied to them, Mixtral's ``mlp_res`` as ``block_sparse_moe.res``; see
    :func:`attnres_fx.compat.hf_saved_under_own_names`) would keep uninitialised memory: they are taken
    from ``attnres.safetensors``, with a warning. Main weights that hold other AttnRes values under their
    own names come from another save: refused, naming them."""
    current = attnres_weights(model)

    def main_weights() -> set[str] | None:
        names = compat.hf_weight_names(directory)
        return None if names is None else {key[len(prefix):] for key in names if key.startswith(prefix)}
    if stored is None:
        in_main = main_weights()
        missing = sorted(key for key in current if in_main is None or key not in in_main)
        if missing:
            raise CheckpointMismatchError(
                f"{directory}: the main weights hold no AttnRes weights for {', '.join(missing[:4])}"
                f"{'...' if len(missing) > 4 else ''}, and {WEIGHTS_NAME} is missing: the AttnRes weights are lost. "
                "Save the converted model again")
        return
    stored = _fitting(model, {key[len(prefix):]: value for key, value in stored.items() if key.startswith(prefix)},
                      directory, current)
    differ = [key for key, value in current.items()
              if value.device.type != "meta" and not torch.equal(value, stored[key].to(value.device, value.dtype))]
    if not differ:
        return
    in_main = main_weights()
    conflicting = [key for key in differ if in_main is not None and key in in_main]
    if conflicting:
        raise CheckpointMismatchError(
            f"{directory}: the main weights and {WEIGHTS_NAME} hold different AttnRes weights for "
            f"{', '.join(conflicting[:4])}{'...' if len(conflicting) > 4 else ''}: they come from different saves. "
            "Save the converted model again")
    with torch.no_grad():
        for key in differ:
            current[key].copy_(stored[key])
    warnings.warn(f"{directory}: the main weights gave no AttnRes weights for {', '.join(differ[:4])}"
                  f"{'...' if len(differ) > 4 else ''} (missing, or under names transformers' loader did not load): "
                  f"they were taken from {WEIGHTS_NAME}. Save the model again to rewrite its checkpoint.",
                  AttnResWarning, stacklevel=4)


def _fitting(model: nn.Module, stored: dict, directory, wanted: dict | None = None) -> dict:
    """The AttnRes weights of ``model`` from ``stored``, every one present with the model's shape
    (``wanted``: the model's AttnRes weights, where the caller has them)."""
    path = Path(directory) / WEIGHTS_NAME
    wanted = attnres_weights(model) if wanted is None else wanted
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


def _recover_folder(path_or_repo_id) -> None:
    """Finish a save of the folder that was killed part-way (:func:`attnres_fx.atomic.recover`)."""
    if isinstance(path_or_repo_id, (str, os.PathLike)):
        atomic.recover(path_or_repo_id)


# Every loader of transformers (AutoConfig, AutoModel* looking up a PEFT adapter first, tokenizers) first
# finishes a save of its folder that was killed part-way.
compat.after_import("transformers.utils.hub", lambda hub: compat.before_file_lookups(hub, _recover_folder))
# transformers' release is checked against the supported range (``ImportError`` below it, a warning above)
# as it is imported (or now, if it is): ``import transformers`` imports no model yet.
compat.after_import("transformers", compat.check_transformers_version)


# -- attnres_fx.from_pretrained -----------------------------------------------------------------------------

def from_pretrained(model_or_cls, directory, **from_pretrained_kwargs) -> nn.Module:
    """Rebuild a converted model from a directory written by its ``save_pretrained``.

    ``model_or_cls``: a model class (``LlamaForCausalLM``, or an ``Auto*`` class): its own
    ``from_pretrained(directory, **from_pretrained_kwargs)``, which gives the converted model (see the
    module docstring); or a model instance of the same architecture and size (its own weights are kept),
    converted from the saved plan and given the saved AttnRes weights. Either way the folder's checkpoint is
    read and checked once (:func:`attnres_fx.integrations.checkpoint.read`): a damaged or mismatched one, or a
    model that differs from the saved one, raises :class:`~attnres_fx.CheckpointMismatchError` naming the
    difference, and an instance is left unconverted.
    """
    atomic.recover(directory)
    if isinstance(model_or_cls, type):
        model = model_or_cls.from_pretrained(directory, **from_pretrained_kwargs)
        if not conversion.converted_within(model):
            raise CheckpointMismatchError(f"{directory}: {type(model).__name__} was built without its AttnRes "
                                          f"conversion (config.json has no '{CONFIG_ATTRIBUTE}' entry?)")
        return model
    model = model_or_cls
    record, stored = checkpoint.read(directory)
    prefix = checkpoint.base_prefix(model, record)
    seen = record.relocated(prefix)
    if record.plan is not None:
        problems = checkpoint.mismatches(model, seen)
        if problems:
            raise CheckpointMismatchError(_mismatch(Path(directory), type(model).__name__, problems))
        api.convert_as_planned(model, seen.plan, record.config)
    else:
        api.attnresify(model, config=record.config)
    try:
        if record.plan is None and seen.sites is not None:
            _check_sites(model, seen.sites, directory)
        model.load_state_dict(_fitting(model, {key[len(prefix):]: value for key, value in stored.items()
                                               if key.startswith(prefix)}, directory), strict=False)
    except BaseException:
        api.remove(model)
        raise
    return model


# -- for other integrations (vLLM serving) ------------------------------------------------------------------

def check_entry(entry: Any, where: str, key: str) -> AttnResConfig:
    """The options of a saved conversion's JSON view (``entry``: the ``config.json`` entry, ``key`` its key,
    or ``attnres_config.json``, ``key`` empty), after checking what it is made of
    (:meth:`SavedConversion.from_json`)."""
    return SavedConversion.from_json(entry, where, key).config


def check_unit(directory, *, entry: dict | None = None, where=None) -> tuple[SavedConversion, dict]:
    """The checkpoint of a folder, read and checked as one (:func:`attnres_fx.integrations.checkpoint.read`;
    ``entry``: the ``config.json`` entry as read already). Returns the record and the AttnRes tensors."""
    read = (None if entry is None
            else SavedConversion.from_json(entry, f"{where or directory}/config.json", CONFIG_ATTRIBUTE))
    return checkpoint.read(directory, entry=read, where=where)
