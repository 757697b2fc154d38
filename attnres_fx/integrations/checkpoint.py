"""The record of a saved conversion: :class:`SavedConversion`, one per checkpoint.

A save computes it once from the converted model (:meth:`SavedConversion.of`: options, plan, what the plan
expects of the model, the fingerprint of the AttnRes weights) and writes it as three views: the
``"attnres"`` entry of ``config.json`` and ``attnres_config.json`` (the same object,
:meth:`SavedConversion.to_json`) and the metadata of ``attnres.safetensors`` (the fingerprint). A load reads
a folder once (:func:`read`): the views checked against each other and the tensors against the
fingerprint; the record and the tensors then go to whatever checks the loaded model.

Format 4 records the plan itself, so that a model built from the config registers its AttnRes modules
and routes without capturing anything (:func:`attnres_fx.api.convert_as_planned`), and what the plan
expects of the model (``"model"``: its class, how many layers each container of a stream holds, the
shapes of the one-dimensional parameters of each stream's first layer), so that a model of another
depth or width is refused before anything is loaded into it (:func:`mismatches`). Formats 1 to 3
recorded the options and block sizes only (the sites in ``attnres_config.json``): such folders convert by
a capture, as they were saved; 1 and 2 have no fingerprint.

The fingerprint is one hash of the AttnRes tensors (names, dtypes, shapes, bytes) with the conversion that
made them (from format 4 the plan too): files of different saves, models or dtypes never pass for one
checkpoint, and neither does an edited record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import compat
from ..config import AttnResConfig
from ..conversion import config_of, plan_of, stats
from ..errors import CheckpointMismatchError
from ..passes.layers import CONTAINERS, LayerSpan
from ..op.module import BlockAttnRes
from ..passes.plan import ROUTES, Plan, Site, StreamPlan
from ..routing.install import layer_containers
from ..version import __version__

CONFIG_NAME = "attnres_config.json"
WEIGHTS_NAME = "attnres.safetensors"
CONFIG_ATTRIBUTE = "attnres"
FORMAT_VERSION = 4
READABLE_FORMATS = (1, 2, 3, 4)
FINGERPRINTED = 3          # the first format with a fingerprint
PLANNED = 4                # the first format that records the plan
FINGERPRINT_KEY = "attnres_fingerprint"
# What the site lists of formats 1-3 hold (no position or branch), and what a load compares.
_COMPARED = ("name", "kind", "block", "stream", "layer", "num_sources")


@dataclass(frozen=True)
class ModelOutline:
    """What a saved plan expects of the model it is applied to: the class it was saved from (as
    transformers defines it), the number of children of each container that holds a stream's layers (by
    path), and the shapes of the one-dimensional parameters (norm weights, biases: their size is the
    stream's width, and quantizers leave them as they are) of each stream's first layer."""

    model_class: str
    containers: dict[str, int]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, model: nn.Module, plan: Plan) -> ModelOutline:
        containers: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for stream in plan.streams:
            containers.update({path: len(children) for path, children in layer_containers(model, stream).items()})
            first = stream.sites[0].layer
            layer = model.get_submodule(first)
            attnres = {id(p) for m in layer.modules() if isinstance(m, BlockAttnRes) for p in m.parameters()}
            # A stream whose sites the root performs: the root's own parameters only.
            for name, parameter in layer.named_parameters(recurse=bool(first)):
                if parameter.dim() == 1 and id(parameter) not in attnres:
                    shapes[_join(first, name)] = tuple(parameter.shape)
        return cls(compat.hf_model_class(model).__name__, containers, shapes)

    def to_json(self) -> dict[str, Any]:
        return {"class": self.model_class, "containers": dict(self.containers),
                "shapes": {name: list(shape) for name, shape in self.shapes.items()}}

    def relocated(self, prefix: str) -> ModelOutline:
        return ModelOutline(self.model_class, {_strip(p, prefix): n for p, n in self.containers.items()},
                            {_strip(p, prefix): s for p, s in self.shapes.items()})


@dataclass(frozen=True)
class SavedConversion:
    """One saved conversion (see the module docstring). ``plan`` and ``outline``: format 4 on; ``sites``:
    the rows a load compares sites by (``name, kind, block, stream, layer, num_sources``), where the view
    read holds a site list; ``fingerprint``: format 3 on."""

    format: int
    config: AttnResConfig
    block_sizes: tuple[int, ...]
    fingerprint: str | None = None
    plan: Plan | None = None
    outline: ModelOutline | None = None
    sites: tuple[tuple, ...] | None = None
    version: str | None = None
    # What the fingerprint covers besides the tensors, as written (:meth:`hashed`).
    described: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, model: nn.Module) -> tuple[SavedConversion, dict[str, torch.Tensor]]:
        """The record of the converted ``model`` and its AttnRes tensors (on the CPU, as they are written),
        fingerprinted once."""
        plan = plan_of(model)
        tensors = {key: value.detach().cpu().contiguous() for key, value in attnres_weights(model).items()}
        outline = ModelOutline.of(model, plan)
        described = {"options": config_of(model).to_dict(), "block_sizes": list(plan.block_sizes),
                     "model": outline.to_json(), **_plan_json(plan)}
        record = cls(FORMAT_VERSION, config_of(model), plan.block_sizes, fingerprint(tensors, described), plan, outline,
                     tuple(_row(vars(site)) for site in plan.sites), __version__, described)
        return record, tensors

    def hashed(self) -> dict[str, Any]:
        """What the fingerprint covers besides the tensors: the options and block sizes, from format 4 the
        plan and its outline of the model, as written."""
        return self.described

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` entry and ``attnres_config.json`` (format 4)."""
        return {"format": self.format, "attnres_fx_version": self.version, **self.hashed(),
                "fingerprint": self.fingerprint}

    def metadata(self) -> dict[str, str]:
        """The metadata of ``attnres.safetensors``."""
        return {"format": "pt", FINGERPRINT_KEY: self.fingerprint}

    @classmethod
    def from_json(cls, entry: Any, where: str, key: str = "") -> SavedConversion:
        """A record from one of its JSON views (``entry``: the ``config.json`` entry, ``key`` its key, or
        ``attnres_config.json``, ``key`` empty), after checking what it is made of; a malformed one raises
        :class:`~attnres_fx.CheckpointMismatchError` naming the file and key, rather than loading the plain
        model or default options."""
        named = f"{where}, key '{key}'" if key else where
        way_out = (f"Restore it from the {CONFIG_NAME} saved beside it, or save the converted model again"
                   if key else "Save the converted model again")
        if not isinstance(entry, dict):
            raise CheckpointMismatchError(f"{named}: a saved AttnRes conversion is an object with 'format', "
                                          f"'options' and 'block_sizes', got {type(entry).__name__} {entry!r:.80}. "
                                          f"{way_out}.")
        version = entry.get("format")
        if version not in READABLE_FORMATS:
            raise CheckpointMismatchError(f"{named}: AttnRes format {version!r}, this attnres_fx reads "
                                          f"formats {READABLE_FORMATS}")
        wanted = [("options", dict), ("block_sizes", list)]
        if version >= FINGERPRINTED:
            wanted.append(("fingerprint", str))
        if version >= PLANNED:
            wanted += [("model", dict), ("streams", list)]
        elif not key:
            wanted.append(("sites", list))
        for wanted_key, kind in wanted:
            if not isinstance(entry.get(wanted_key), kind):
                how = "missing" if wanted_key not in entry else "malformed"
                raise CheckpointMismatchError(f"{named}: '{wanted_key}' is {entry.get(wanted_key)!r:.80}, not a "
                                              f"{kind.__name__} ({how}). {way_out}.")
        try:
            config = AttnResConfig.from_dict(entry["options"])
        except (TypeError, ValueError) as err:
            raise CheckpointMismatchError(f"{named}: its 'options' are not valid: {err}. {way_out}.") from err
        try:
            plan = _plan(entry["streams"], config) if version >= PLANNED else None
            outline = _outline(entry["model"]) if version >= PLANNED else None
            rows = tuple(_row(vars(site)) for site in plan.sites) if plan is not None else \
                tuple(_row(site) for site in entry["sites"]) if "sites" in entry else None
            if plan is not None and list(plan.block_sizes) != entry["block_sizes"]:
                raise ValueError(f"block sizes {entry['block_sizes']} are not the streams' {list(plan.block_sizes)}")
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointMismatchError(f"{named}: its plan ('model', 'streams') is malformed: "
                                          f"{type(err).__name__}: {err}. {way_out}.") from err
        covered = ("options", "block_sizes") + (("model", "streams") if version >= PLANNED else ())
        return cls(version, config, tuple(entry["block_sizes"]), entry.get("fingerprint"), plan, outline, rows,
                   entry.get("attnres_fx_version"), {name: entry[name] for name in covered})

    def differences(self, other: SavedConversion) -> list[str]:
        """The fields in which two views of one checkpoint differ (sites only where both hold them)."""
        compared = {"options": lambda r: r.config, "block_sizes": lambda r: r.block_sizes,
                    "fingerprint": lambda r: r.fingerprint, "plan": lambda r: r.plan, "model": lambda r: r.outline}
        if self.sites is not None and other.sites is not None:
            compared["sites"] = lambda r: r.sites
        return [name for name, value in compared.items() if value(self) != value(other)]

    def relocated(self, prefix: str) -> SavedConversion:
        """The record as seen from the base model at ``prefix`` (``"model."``) of the saved one: every path
        without the prefix (an ``AutoModel`` loaded from a ``...ForCausalLM`` folder)."""
        if not prefix:
            return self
        return dataclasses.replace(
            self, plan=self.plan and _relocated_plan(self.plan, prefix),
            outline=self.outline and self.outline.relocated(prefix),
            sites=self.sites and tuple((_strip(r[0], prefix), *r[1:4], _strip(r[4], prefix), r[5]) for r in self.sites))


def _row(site: dict) -> tuple:
    return tuple(site[field] for field in _COMPARED)


def _plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as the record writes it: per stream its owner, block size, width, route, layer spans
    (``[owner, start, stop, opened]``) and sites in order (``[name, kind, layer, position, branch,
    normalised]``; a site's index, block and number of sources follow from its place, as the plan made
    them). Rows, not objects: transformers copies and prints a model's config several times per load."""
    return {"streams": [{"owner": stream.owner, "block_size": stream.block_size, "dim": stream.dim,
                         "route": stream.route,
                         "layers": [[span.owner, span.start, span.stop, sorted(span.opened)] for span in stream.layers],
                         "sites": [[s.name, s.kind, s.layer, s.position, s.branch, s.normalised] for s in stream.sites]}
                        for stream in plan.streams]}


def _plan(streams: list, config: AttnResConfig) -> Plan:
    """The plan of a format-4 record; ``ValueError`` (or a ``KeyError``, ``TypeError``) where it is not one."""
    planned, index = [], 0
    for number, stream in enumerate(streams):
        size, rows = int(stream["block_size"]), stream["sites"]
        if size < 1 or not rows or rows[-1][1] != "final" or any(row[1] == "final" for row in rows[:-1]):
            raise ValueError(f"stream {number}: block size {size}, or no final site last")
        positions = [int(row[3]) for row in rows[:-1]]
        if positions != sorted(positions) or sorted(set(positions)) != list(range(len(set(positions)))):
            raise ValueError(f"stream {number}: its residual sites are not in order from 0")
        count = len(set(positions))
        sites = []
        for row in rows[:-1]:
            name, kind, layer, position, branch, normalised = row
            sites.append(Site(index, str(name), str(kind), position // size + 1, number, str(layer),
                              -(-position // size) + 1, bool(normalised), int(position), int(branch)))
            index += 1
        name, _, layer, *_ = rows[-1]
        sites.append(Site(index, str(name), "final", None, number, str(layer), -(-count // size) + 1, None))
        index += 1
        if stream["route"] not in ROUTES[1:] or (stream["route"] == "layer") != bool(stream["layers"]):
            raise ValueError(f"stream {number}: route {stream['route']!r} with {len(stream['layers'])} layers")
        signature = tuple((next(s.layer for s in sites if s.position == p), positions.count(p)) for p in range(count))
        layers = tuple(LayerSpan(str(owner), int(start), int(stop), frozenset(map(str, opened)))
                       for owner, start, stop, opened in stream["layers"])
        planned.append(StreamPlan(number, str(stream["owner"]), size, int(stream["dim"]), signature, tuple(sites),
                                  stream["route"], layers))
    return Plan(tuple(planned), config.preserve_scale, config.eps)


def _outline(model: dict) -> ModelOutline:
    return ModelOutline(str(model["class"]), {str(p): int(n) for p, n in model["containers"].items()},
                        {str(p): tuple(int(d) for d in s) for p, s in model["shapes"].items()})


def _relocated_plan(plan: Plan, prefix: str) -> Plan:
    def site(s: Site) -> Site:
        return Site(**{**asdict(s), "name": _strip(s.name, prefix), "layer": _strip(s.layer, prefix)})

    streams = tuple(StreamPlan(
        stream.index, _strip(stream.owner, prefix), stream.block_size, stream.dim,
        tuple((_strip(layer, prefix), n) for layer, n in stream.signature), tuple(site(s) for s in stream.sites),
        stream.route, tuple(LayerSpan(_strip(span.owner, prefix), span.start, span.stop, span.opened)
                            for span in stream.layers)) for stream in plan.streams)
    return Plan(streams, plan.preserve_scale, plan.eps)


def _strip(path: str, prefix: str) -> str:
    """``path`` without ``prefix`` (``"model."``); the prefix's own module is the root (``""``)."""
    if path == prefix[:-1]:
        return ""
    return path[len(prefix):] if path.startswith(prefix) else path


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def base_prefix(model: nn.Module, record: SavedConversion) -> str:
    """``"model."`` where ``model`` is the base model of the one ``record`` was saved from (transformers'
    ``base_model_prefix``; its paths then lack it), else ``""``."""
    prefix = f"{getattr(model, 'base_model_prefix', '') or ''}."
    names = [row[0] for row in record.sites or ()]
    if prefix == "." or not names or not all(name.startswith(prefix) for name in names):
        return ""
    return prefix if not _has(model, prefix[:-1]) else ""


def mismatches(model: nn.Module, record: SavedConversion) -> list[str]:
    """How ``model`` differs from what the format-4 ``record``'s plan expects (its paths as ``model``
    sees them: :meth:`SavedConversion.relocated`): the lines of an error, or ``[]``."""
    modules = dict(model.named_modules(remove_duplicate=False))
    lines = []
    holders = [(site.name, *site.name.rpartition(".")[::2]) for site in record.plan.sites]
    missing = [name for name, holder, _ in holders if holder not in modules]
    taken = [name for name, holder, attribute in holders if holder in modules and hasattr(modules[holder], attribute)]
    for path, count in record.outline.containers.items():
        if path not in modules:
            lines.append(f"  saved but not found now: {path} (a container of {count} layers)")
            continue
        children = list(modules[path]._modules)
        if len(children) > count:
            lines.append(f"  found now but not saved: {', '.join(_join(path, c) for c in children[count:])} ({path} "
                         f"held {count} layers when saved)")
        elif len(children) < count:
            lines.append(f"  saved but not found now: {count - len(children)} layers of {path} ({path} held {count} "
                         f"layers when saved, {len(children)} now)")
    if missing:
        lines.append(f"  saved but not found now: {', '.join(missing[:6])}{'...' if len(missing) > 6 else ''}")
    if taken:
        lines.append(f"  taken by modules of the model's own: {', '.join(taken[:6])}")
    for path, shape in record.outline.shapes.items():
        owner, _, name = path.rpartition(".")
        parameter = getattr(modules[owner], name, None) if owner in modules else None
        now = None if parameter is None else tuple(parameter.shape)
        if now != shape:
            lines.append(f"  {path}: saved {shape}, now {'missing' if now is None else now}")
    owners = [stream.owner for stream in record.plan.streams] + [span.owner for stream in record.plan.streams
                                                                 for span in stream.layers]
    absent = [owner for owner in owners if owner not in modules]
    if absent and not missing:
        lines.append(f"  saved but not found now: {', '.join(absent[:6])}")
    containers = [span.owner for stream in record.plan.streams for span in stream.layers
                  if isinstance(modules.get(span.owner), CONTAINERS)]
    if containers:
        lines.append(f"  containers where the saved model had layers: {', '.join(containers[:6])}")
    return lines


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def attnres_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The AttnRes parameters of a converted model under their ``state_dict`` names."""
    return {f"{site.name}.{name}": tensor for site in plan_of(model).sites
            for name, tensor in model.get_submodule(site.name).named_parameters()}


def fingerprint(tensors: dict[str, torch.Tensor], described: dict[str, Any]) -> str:
    """One hash of the AttnRes ``tensors`` (names, dtypes, shapes, bytes) and ``described``
    (:meth:`SavedConversion.hashed`)."""
    stats.fingerprints += 1
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode())
    for key in sorted(tensors):
        tensor = tensors[key].detach().cpu().contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


# -- writing and reading a folder ---------------------------------------------------------------------------

def write(directory: Path, record: SavedConversion, tensors: dict[str, torch.Tensor]) -> None:
    """``attnres_config.json`` and ``attnres.safetensors`` of ``record`` (the ``config.json`` entry is
    transformers' to write)."""
    from safetensors.torch import save_file

    (directory / CONFIG_NAME).write_text(json.dumps(record.to_json(), indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata=record.metadata())


def check_written(directory: Path, record: SavedConversion, where: Path) -> None:
    """The three views a save wrote into ``directory`` hold ``record``: what a load will find (``where``: the
    folder to name). The tensors were fingerprinted as they were written."""
    stats.checkpoint_reads += 1
    written = _record_file(directory, where)
    entry = _config_json_record(directory, where)
    recorded = _weights_metadata(directory, where)
    problems = [f"{where / CONFIG_NAME}: {', '.join(written.differences(record))}"
                if written.differences(record) else "",
                f"{where / 'config.json'}: {', '.join(entry.differences(record))}" if entry.differences(record) else "",
                f"{where / WEIGHTS_NAME}: fingerprint {recorded!r}" if recorded != record.fingerprint else ""]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointMismatchError(f"{where}: the saved AttnRes checkpoint differs from the model's "
                                      f"conversion ({'; '.join(problems)}). Save the converted model again.")


def exists(directory: Path) -> bool:
    return (Path(directory) / CONFIG_NAME).is_file()


def read(directory, *, entry: SavedConversion | None = None, where=None) -> tuple[SavedConversion, dict]:
    """The checkpoint of the converted model saved in ``directory``, read once: ``attnres_config.json``,
    ``attnres.safetensors`` and the ``config.json`` entry (``entry``: as read already; else from
    ``config.json`` when there is one) checked as one: the same record in both JSON views, the fingerprint
    in the weights' metadata, tensors that hash to it. Returns the record and the AttnRes tensors; a
    mismatch raises :class:`~attnres_fx.CheckpointMismatchError` naming the file and key (``where``: the
    folder to name)."""
    stats.checkpoint_reads += 1
    directory = Path(directory)
    shown = Path(where or directory)
    saved = _record_file(directory, shown, entry)
    if entry is None and (directory / "config.json").is_file():
        entry = _config_json_record(directory, shown)
    if entry is not None:
        differs = saved.differences(entry)
        if differs:
            shown_values = {"options": lambda r: r.config.to_dict(), "block_sizes": lambda r: list(r.block_sizes),
                            "fingerprint": lambda r: r.fingerprint}
            detail = ", ".join(f"{f}: {shown_values[f](entry)!r} against {shown_values[f](saved)!r}"
                               if f in shown_values else f"{f}: other" for f in differs)
            raise CheckpointMismatchError(
                f"{shown / 'config.json'}, key '{CONFIG_ATTRIBUTE}': its {' and '.join(differs)} differ from those in "
                f"{shown / CONFIG_NAME} ({detail}): the two were written by different saves. Save the converted model "
                f"again (or restore the entry from {CONFIG_NAME} if only the entry was edited).")
    stored, recorded = _stored_attnres_weights(directory, shown)
    if saved.format >= FINGERPRINTED:
        path = shown / WEIGHTS_NAME
        if recorded != saved.fingerprint:
            raise CheckpointMismatchError(
                f"{path}: its metadata '{FINGERPRINT_KEY}' is {recorded!r}, {shown / CONFIG_NAME} records "
                f"{saved.fingerprint!r}: the AttnRes weights come from another save. Save the converted model again.")
        if fingerprint(stored, saved.hashed()) != saved.fingerprint:
            raise CheckpointMismatchError(
                f"{path}: its tensors do not hash to the fingerprint {saved.fingerprint!r} they were saved with, "
                f"with the conversion {CONFIG_NAME} records (changed after saving: another model's weights, another "
                "dtype, edited values or sites). Save the converted model again.")
    return saved, stored


def _record_file(directory: Path, shown: Path, entry: SavedConversion | None = None) -> SavedConversion:
    """The record ``attnres_config.json`` holds: ``entry`` where the file holds the same JSON (the common
    case, no second parse of the plan)."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{shown} has no {CONFIG_NAME}: it was not saved from a model converted "
                                      "by attnres_fx (load it with the model class itself)")
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointMismatchError(f"{shown / CONFIG_NAME} cannot be read: {type(err).__name__}: {err}. Save the "
                                      "converted model again") from err
    if (entry is not None and entry.format >= PLANNED and isinstance(saved, dict)
            and saved.get("format") == entry.format and saved.get("fingerprint") == entry.fingerprint
            and all(saved.get(k) == v for k, v in entry.described.items())):
        return entry
    return SavedConversion.from_json(saved, str(shown / CONFIG_NAME))


def _config_json_record(directory: Path, shown: Path) -> SavedConversion:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointMismatchError(f"{shown / 'config.json'} cannot be read: {type(err).__name__}: {err}") from err
    if not isinstance(config, dict) or CONFIG_ATTRIBUTE not in config:
        raise CheckpointMismatchError(no_entry(shown))
    return SavedConversion.from_json(config[CONFIG_ATTRIBUTE], str(shown / "config.json"), CONFIG_ATTRIBUTE)


def no_entry(directory: Path) -> str:
    return (f"{directory / 'config.json'} has no '{CONFIG_ATTRIBUTE}' entry, but {CONFIG_NAME} lies beside it: the "
            "folder's config and weights were written by a model that is not converted (saved over a converted "
            "one), or the entry was deleted, so transformers would build the original model. Restore the entry "
            f"from {CONFIG_NAME} (and its fingerprint), or delete {CONFIG_NAME} and {WEIGHTS_NAME} to load the "
            "original model")


def _weights_metadata(directory: Path, shown: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(directory / WEIGHTS_NAME), "pt") as weights:
            return (weights.metadata() or {}).get(FINGERPRINT_KEY)
    except (SafetensorError, OSError) as err:
        raise CheckpointMismatchError(f"{shown / WEIGHTS_NAME} cannot be read ({type(err).__name__}: {err})") from err


def _stored_attnres_weights(directory: Path, shown: Path) -> tuple[dict, str | None]:
    """Every tensor of ``attnres.safetensors`` and the fingerprint its metadata records (the file read
    whole and taken apart at once: the header is 8 bytes of its length, then JSON); a missing or damaged
    file raises naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = directory / WEIGHTS_NAME
    named = shown / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointMismatchError(f"{named} not found: the AttnRes weights are missing. Save the converted "
                                      "model with its save_pretrained")
    try:
        data = path.read_bytes()
        tensors = load(data)
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointMismatchError(f"{named} cannot be read ({type(err).__name__}: {err}): the file is damaged "
                                      "or truncated. Save the converted model again") from err
    return tensors, (header.get("__metadata__") or {}).get(FINGERPRINT_KEY)
