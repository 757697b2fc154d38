"""Loading a converted checkpoint costs what loading the original costs, plus one read of its AttnRes
files: no capture, one read and one fingerprint per load and one fingerprint per save
(``attnres_fx.conversion.stats``), on every load path; the saved plan rebuilt as it was saved, checked
against the model's structure before its weights are loaded and by the routes' own graphs at the first
call. The construction hook's ``enable``/``disable``, and the import finder that leaves
``sys.meta_path`` once it has done its work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import attnres_fx
from attnres_fx import compat, conversion
from attnres_fx.conversion import Stats
from attnres_fx.integrations import autoload, checkpoint
from attnres_fx.testing import randomise_pseudo_queries
from hf_models import build_hf, needs_hf

ONE_LOAD = Stats(captures=0, fingerprints=1, checkpoint_reads=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A converted Llama with random pseudo-queries, saved (the save's work counted); its logits."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(build_hf("llama"), num_blocks=2), seed=3, std=0.5)
    directory = tmp_path_factory.mktemp("saved") / "llama"
    before = conversion.stats.copy()
    model.save_pretrained(directory)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(ids).logits
    return {"model": model, "directory": directory, "ids": ids, "logits": logits,
            "save": conversion.stats - before}


def _transformers(name: str):
    import transformers

    return getattr(transformers, name)


# The saved model runs transformers' eager attention (build_hf): its loads too, for logits equal to the bit.
EAGER = {"attn_implementation": "eager"}
LOADS = {
    "AutoModelForCausalLM": lambda d: _transformers("AutoModelForCausalLM").from_pretrained(d, **EAGER),
    "LlamaForCausalLM": lambda d: _transformers("LlamaForCausalLM").from_pretrained(d, **EAGER),
    "device_map": lambda d: _transformers("AutoModelForCausalLM").from_pretrained(d, device_map="auto", **EAGER),
    "attnres_fx, a class": lambda d: attnres_fx.from_pretrained(_transformers("AutoModelForCausalLM"), d, **EAGER),
    "attnres_fx, an instance": lambda d: attnres_fx.from_pretrained(build_hf("llama"), d),
}


@pytest.mark.slow
@needs_hf
def test_a_save_fingerprints_once(saved):
    assert saved["save"] == ONE_LOAD, "one fingerprint, and one read of the written views to check them"


@pytest.mark.slow
@needs_hf
@pytest.mark.parametrize("load", LOADS)
def test_a_load_captures_nothing_and_reads_and_hashes_its_checkpoint_once(saved, load):
    before = conversion.stats.copy()
    model = LOADS[load](saved["directory"]).eval()
    assert conversion.stats - before == ONE_LOAD
    assert attnres_fx.plan_of(model) == attnres_fx.plan_of(saved["model"]), "the plan is the saved one"
    with torch.no_grad():
        assert torch.equal(model(saved["ids"]).logits, saved["logits"])


@pytest.mark.slow
@needs_hf
def test_the_base_model_of_a_folder_with_a_head_takes_the_plan_under_its_own_paths(saved):
    before = conversion.stats.copy()
    base = _transformers("AutoModel").from_pretrained(saved["directory"], **EAGER)
    assert conversion.stats - before == ONE_LOAD
    assert ([s.name for s in attnres_fx.sites(base)]
            == [s.name[len("model."):] for s in attnres_fx.sites(saved["model"])])
    with torch.no_grad():
        assert torch.equal(base(saved["ids"]).last_hidden_state, saved["model"].model(saved["ids"]).last_hidden_state)


@pytest.mark.slow
@needs_hf
def test_a_model_built_from_the_config_on_the_meta_device_captures_and_reads_nothing(saved):
    import accelerate

    before = conversion.stats.copy()
    with accelerate.init_empty_weights():
        empty = _transformers("LlamaForCausalLM")(_transformers("AutoConfig").from_pretrained(saved["directory"]))
    assert conversion.stats - before == Stats()
    assert attnres_fx.plan_of(empty) == attnres_fx.plan_of(saved["model"])
    assert all(p.is_meta for p in empty.parameters())


@pytest.mark.slow
@needs_hf
def test_a_layer_that_differs_from_the_saved_plan_is_refused_by_the_routes_check(saved):
    """Same depth and widths, but the second layer performs a third residual site: the model's structure
    passes, the route's own graph of that layer at the first call does not."""
    model = build_hf("llama")

    class ExtraSite(type(model.model.layers[1])):
        def forward(self, hidden_states, *args, **kwargs):
            hidden_states = super().forward(hidden_states, *args, **kwargs)
            return hidden_states + torch.tanh(self.post_attention_layernorm(hidden_states))

    model.model.layers[1].__class__ = ExtraSite
    attnres_fx.from_pretrained(model, saved["directory"])
    with pytest.raises(attnres_fx.StreamMismatchError, match=r"ExtraSite at 'model\.layers\.1' does not hold the "
                       r"residual sites the model was converted with there"):
        with torch.no_grad():
            model(saved["ids"])


def _as_format_3(model, directory: Path, into: Path) -> Path:
    """The folder as attnres_fx wrote it before the plan was recorded: options, block sizes and the
    fingerprint in the config entry, the site list (without positions) in attnres_config.json."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(shutil.copytree(directory, into))
    record = json.loads((folder / checkpoint.CONFIG_NAME).read_text())
    with safe_open(str(folder / checkpoint.WEIGHTS_NAME), "pt") as weights:
        tensors = {key: weights.get_tensor(key) for key in weights.keys()}
    covered = {"options": record["options"], "block_sizes": record["block_sizes"]}
    entry = {"format": 3, "attnres_fx_version": "0.2.0", **covered,
             "fingerprint": checkpoint.fingerprint(tensors, covered)}
    sites = [{key: getattr(site, key) for key in ("index", "name", "kind", "block", "stream", "layer", "num_sources",
                                                  "normalised")} for site in attnres_fx.plan_of(model).sites]
    (folder / checkpoint.CONFIG_NAME).write_text(json.dumps({**entry, "sites": sites}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attnres": entry}))
    save_file(tensors, str(folder / checkpoint.WEIGHTS_NAME), metadata={"format": "pt", **{
        checkpoint.FINGERPRINT_KEY: entry["fingerprint"]}})
    return folder


@pytest.mark.slow
@needs_hf
def test_a_folder_saved_before_the_plan_was_recorded_loads_by_a_capture(saved, tmp_path):
    folder = _as_format_3(saved["model"], saved["directory"], tmp_path / "format3")
    for load in (LOADS["AutoModelForCausalLM"], LOADS["attnres_fx, an instance"]):
        before = conversion.stats.copy()
        model = load(folder).eval()
        assert conversion.stats - before == Stats(captures=1, fingerprints=1, checkpoint_reads=1)
        with torch.no_grad():
            torch.testing.assert_close(model(saved["ids"]).logits, saved["logits"], rtol=1e-5, atol=1e-6)
    other = build_hf("llama", num_hidden_layers=3)
    with pytest.raises(attnres_fx.CheckpointMismatchError,
                       match=r"found now but not saved: .*model\.layers\.2\.attn_res"):
        attnres_fx.from_pretrained(other, folder)
    assert not attnres_fx.is_converted(other)


@pytest.mark.slow
@needs_hf
def test_disable_builds_models_as_written_and_enable_converts_them_again(saved):
    config = _transformers("AutoConfig").from_pretrained(saved["directory"])
    build = _transformers("LlamaForCausalLM")
    autoload.disable()
    try:
        assert not attnres_fx.is_converted(build(config))
    finally:
        autoload.enable()
    assert attnres_fx.is_converted(build(config))


def test_the_import_finder_runs_its_callbacks_once_and_leaves(tmp_path, monkeypatch):
    from attnres_fx.compat.transformers import _AfterImportFinder

    for name in ("attnres_probe_a", "attnres_probe_b"):
        (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    compat.after_import("attnres_probe_a", lambda module: seen.append(module.VALUE))
    compat.after_import("attnres_probe_b", seen.append)
    assert sum(isinstance(f, _AfterImportFinder) for f in sys.meta_path) == 1
    compat.cancel_after_import("attnres_probe_b", seen.append)
    import attnres_probe_a  # noqa: F401
    import attnres_probe_b  # noqa: F401
    assert seen == [1]
    assert not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path), "the finder stays after its work"
    for name in ("attnres_probe_a", "attnres_probe_b"):
        monkeypatch.delitem(sys.modules, name)
