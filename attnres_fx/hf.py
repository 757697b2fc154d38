"""Hugging Face models stay Hugging Face models: ``save_pretrained`` and :func:`from_pretrained`.

A converted ``PreTrainedModel`` saves as always: ``model.save_pretrained(dir)`` writes the config and
the safetensors weights (the AttnRes parameters included), plus ``attnres_config.json``, what
conversion needs to rebuild the model: the arguments it was converted with, the resulting block sizes
and the site list, and the package version; and ``attnres.safetensors``, the AttnRes parameters under
the model's own module paths (transformers may save a model's weights under older names, e.g. a ViT's
``layers.0`` as ``encoder.layer.0``, which a rebuilt model's names would not find)::

    attnres_fx.attnresify(model, num_blocks=4)
    model.save_pretrained("out")
    again = attnres_fx.from_pretrained(LlamaForCausalLM, "out")      # or AutoModelForCausalLM
    again = attnres_fx.from_pretrained(existing_llama, "out")         # converts it, loads AttnRes weights

Loading ``out`` with plain ``AutoModelForCausalLM.from_pretrained`` gives the original architecture;
transformers' load report lists the AttnRes weights it left unused (``... _res.proj.weight |
UNEXPECTED``).

``transformers`` and ``safetensors`` are imported only by the functions that read or write a directory.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import nn

from .errors import CheckpointMismatchError

CONFIG_NAME = "attnres_config.json"
WEIGHTS_NAME = "attnres.safetensors"
FORMAT_VERSION = 1


class SavePretrained:
    """``model.save_pretrained`` of a converted model: the class's own, then ``attnres_config.json``."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_config(self.model, save_directory)
            _write_attnres_weights(self.model, save_directory)
        return result

    def __repr__(self) -> str:
        return f"<attnres_fx save_pretrained of {type(self.model).__name__}>"


def attach(model: nn.Module) -> None:
    """Give a converted Hugging Face model its ``save_pretrained`` (no-op for other modules)."""
    if callable(getattr(type(model), "save_pretrained", None)) and "save_pretrained" not in model.__dict__:
        model.save_pretrained = SavePretrained(model)


def detach(model: nn.Module) -> None:
    if isinstance(model.__dict__.get("save_pretrained"), SavePretrained):
        del model.__dict__["save_pretrained"]


def config_of(model: nn.Module) -> dict[str, Any]:
    """What ``attnres_config.json`` holds for a converted model."""
    from . import __version__, api

    plan = api.plan_of(model)
    return {"format": FORMAT_VERSION, "attnres_fx_version": __version__,
            "options": dict(api.conversion_options(model)), "block_sizes": list(plan.block_sizes),
            "sites": [{key: value for key, value in asdict(site).items() if key not in ("position", "branch")}
                      for site in plan.sites]}


def write_config(model: nn.Module, directory) -> Path:
    path = Path(directory) / CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config_of(model), indent=2) + "\n")
    return path


def read_config(directory) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{directory} has no {CONFIG_NAME}: it was not saved from a model converted "
                                      "by attnres_fx (load it with the model class itself)")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT_VERSION:
        raise CheckpointMismatchError(f"{path}: format {config.get('format')!r}, this attnres_fx reads format "
                                      f"{FORMAT_VERSION}")
    return config


def from_pretrained(model_or_cls, directory, **from_pretrained_kwargs) -> nn.Module:
    """Rebuild a converted model from a directory written by its ``save_pretrained``.

    ``model_or_cls``: a model class (``LlamaForCausalLM``, or an ``Auto*`` class), whose
    ``from_pretrained(directory, **from_pretrained_kwargs)`` loads the base weights, or a model instance
    of the same architecture (its own weights are kept). Either is then converted with the saved options
    and given the saved AttnRes weights. A model whose conversion finds other sites than the saved ones
    raises :class:`~attnres_fx.CheckpointMismatchError` naming them, and is left unconverted.
    """
    from . import api

    saved = read_config(directory)
    if isinstance(model_or_cls, type):
        with _attnres_keys_expected(directory, saved):
            model = model_or_cls.from_pretrained(directory, **from_pretrained_kwargs)
    else:
        model = model_or_cls
    api.attnresify(model, **saved["options"])
    try:
        _check_sites(saved, config_of(model), directory)
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
    from . import api

    return {f"{site.name}.{p}": tensor for site in api.sites(model)
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


@contextlib.contextmanager
def _attnres_keys_expected(directory, saved: dict):
    """While loading base weights: the AttnRes weights in the checkpoint are not reported as unexpected
    (they are loaded right after conversion)."""
    import transformers

    # The checkpoint may hold them under older module paths (see the module docstring): match the
    # aggregations' own names at any path.
    leaves = "|".join(sorted({re.escape(site["name"].rsplit(".", 1)[-1]) for site in saved["sites"]}))
    pattern = rf"(^|\.)({leaves})\.(proj|norm)\.weight$"

    architectures = json.loads((Path(directory) / "config.json").read_text()).get("architectures") or []
    classes = [getattr(transformers, name) for name in architectures if hasattr(transformers, name)]
    saved = [(cls, cls.__dict__.get("_keys_to_ignore_on_load_unexpected")) for cls in classes]
    for cls, patterns in saved:
        cls._keys_to_ignore_on_load_unexpected = [*(patterns or []), pattern]
    try:
        yield
    finally:
        for cls, patterns in saved:
            if patterns is None:
                del cls._keys_to_ignore_on_load_unexpected
            else:
                cls._keys_to_ignore_on_load_unexpected = patterns
