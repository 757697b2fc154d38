"""A Hugging Face user's loop on a converted model: the Trainer (with gradient checkpointing), save and
reload, the CLI's convert and export, ONNX decoding with the KV cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnres_fx
import hf_models as H
from attnres_fx.cli import main as cli_main
from attnres_fx.testing import randomise_pseudo_queries
from conftest import cached_export
from hf_models import needs_hf

pytestmark = [needs_hf, pytest.mark.slow]

TRAIN_STEPS = 6


def _dataset(batch=4, seq=16, examples=24):
    ids = torch.randint(1, 128, (examples, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


class _LossLog:
    def __init__(self):
        self.losses = []

    def callback(self):
        from transformers import TrainerCallback

        log = self

        class Recorder(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    log.losses.append(logs["loss"])
        return Recorder()


def _train(model, tmp_path):
    from transformers import Trainer, TrainingArguments

    log = _LossLog()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=TRAIN_STEPS, per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, seed=0, data_seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[log.callback()])
    trainer.train()
    return log.losses


@pytest.mark.parametrize("checkpointing", ["off", "before", "after"])
def test_trainer_trains_a_converted_model(tmp_path, checkpointing):
    model = H.build_hf("llama")
    if checkpointing == "before":
        model.gradient_checkpointing_enable()
    attnres_fx.attnresify(model, num_blocks=2)
    if checkpointing == "after":
        model.gradient_checkpointing_enable()
    before = {s.name: model.get_submodule(s.name).proj.weight.detach().clone() for s in attnres_fx.sites(model)}
    losses = _train(model, tmp_path)
    assert len(losses) == TRAIN_STEPS and losses[-1] < losses[0], losses
    for site in attnres_fx.sites(model):
        moved = not torch.equal(model.get_submodule(site.name).proj.weight, before[site.name])
        assert moved == (site.num_sources > 1), site.name
    model.eval()
    ids = H.hf_example_inputs("llama")[0][0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)


def test_gradient_checkpointing_recomputes_and_keeps_the_gradients():
    """The same step with and without Hugging Face's gradient checkpointing: equal gradients, and the
    checkpointed model runs each layer's aggregations again in the backward pass."""
    ids = H.hf_example_inputs("llama", 2, 12)[0][0]
    runs = {}
    grads = {}
    for checkpointing in (False, True):
        model = randomise_pseudo_queries(attnres_fx.attnresify(H.build_hf("llama"), num_blocks=2)).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        calls = []
        model.model.layers[1].mlp_res.register_forward_hook(lambda *args: calls.append(1))
        model(ids, labels=ids).loss.backward()
        runs[checkpointing] = len(calls)
        grads[checkpointing] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert runs == {False: 1, True: 2}
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-6, msg=name)


# -- save and reload --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A converted Llama with random pseudo-queries, saved with save_pretrained."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(H.build_hf("llama"), num_blocks=2), seed=3, std=0.5)
    directory = tmp_path_factory.mktemp("saved")
    model.save_pretrained(directory)
    return model, directory


def test_save_pretrained_writes_the_attnres_weights_and_config(saved):
    from safetensors.torch import load_file

    model, directory = saved
    for weights in (load_file(str(directory / "model.safetensors")), load_file(str(directory / "attnres.safetensors"))):
        for site in attnres_fx.sites(model):
            torch.testing.assert_close(weights[f"{site.name}.proj.weight"], model.get_submodule(site.name).proj.weight)
    config = json.loads((directory / "attnres_config.json").read_text())
    # The options are the model's AttnResConfig, written from it and read back into it.
    assert config["options"] == {"num_blocks": 2, "block_size": None, "preserve_scale": False, "eps": 1e-6,
                                 "allow_partial": False, "route": "auto", "version": 1}
    assert attnres_fx.AttnResConfig.from_dict(config["options"]) == attnres_fx.config_of(model)
    assert config["block_sizes"] == [2] and config["attnres_fx_version"] == attnres_fx.__version__
    saved_sites = [row[0] for stream in config["streams"] for row in stream["sites"]]
    assert saved_sites == [s.name for s in attnres_fx.sites(model)]


@pytest.mark.parametrize("load", ["class", "auto_class", "instance"])
def test_from_pretrained_rebuilds_the_same_model(saved, load, caplog, capfd):
    import transformers

    model, directory = saved
    if load == "instance":
        again = attnres_fx.from_pretrained(H.build_hf("llama"), directory)
    else:
        cls = transformers.LlamaForCausalLM if load == "class" else transformers.AutoModelForCausalLM
        again = attnres_fx.from_pretrained(cls, directory, attn_implementation="eager")
        assert "UNEXPECTED" not in _load_report(caplog, capfd), "AttnRes weights are expected by from_pretrained"
    ids = H.hf_example_inputs("llama")[0][0]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    generated = [m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0) for m in (again, model)]
    assert torch.equal(*generated)


def test_a_model_saved_under_older_module_paths_reloads(tmp_path, caplog, capfd):
    """transformers saves a ViT's ``layers.0`` as ``encoder.layer.0``: the AttnRes weights come back from
    ``attnres.safetensors``, under the model's own paths, and are not reported as unexpected."""
    import transformers

    model = randomise_pseudo_queries(attnres_fx.attnresify(H.build_hf("vit")), seed=3, std=0.5)
    model.save_pretrained(tmp_path)
    again = attnres_fx.from_pretrained(transformers.ViTModel, tmp_path, attn_implementation="eager")
    assert "UNEXPECTED" not in _load_report(caplog, capfd)
    pixels = H.hf_example_inputs("vit")[0][0]
    with torch.no_grad():
        assert torch.equal(again(pixels).last_hidden_state, model(pixels).last_hidden_state)


def test_a_checkpoint_for_another_model_raises_naming_the_difference(saved, untouched):
    _, directory = saved
    other = H.build_hf("llama", num_hidden_layers=3)
    check = untouched(other)
    with pytest.raises(attnres_fx.CheckpointMismatchError, match="found now but not saved: .*model.layers.2"):
        attnres_fx.from_pretrained(other, directory)
    check()
    assert not attnres_fx.is_converted(other)
    with pytest.raises(attnres_fx.CheckpointMismatchError, match="no attnres_config.json"):
        attnres_fx.from_pretrained(H.build_hf("llama"), directory / "nowhere")


def _load_report(caplog, capfd) -> str:
    """What transformers reported while loading: its logger, or stderr when its handler printed it."""
    printed = capfd.readouterr()
    return caplog.text + printed.out + printed.err


def test_transformers_alone_loads_the_converted_model(saved):
    """No attnres_fx call: the config's "attnres" entry converts the model transformers builds, and
    transformers' own loader fills in the AttnRes weights (Auto class, the class itself, the base model)."""
    import transformers

    model, directory = saved
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    assert json.loads((directory / "config.json").read_text())["attnres"]["block_sizes"] == [2]
    assert not hasattr(model.config, "attnres"), "saving leaves the live model's config as it was"
    for load in (transformers.AutoModelForCausalLM.from_pretrained, transformers.LlamaForCausalLM.from_pretrained):
        again = load(directory)
        assert attnres_fx.is_converted(again) and type(again) is type(model)
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
    base = transformers.AutoModel.from_pretrained(directory)
    assert [s.name for s in attnres_fx.sites(base)][0] == "layers.0.attn_res"
    torch.testing.assert_close(base(ids).last_hidden_state, model.model(ids).last_hidden_state)


def test_without_attnres_fx_transformers_loads_the_original_and_reports_the_attnres_weights(saved):
    import subprocess
    import sys

    _, directory = saved
    script = ("import transformers, sys; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
              "print('attnres_fx' in sys.modules, type(m).__name__, hasattr(m.model.layers[0], 'attn_res'))")
    done = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["False", "LlamaForCausalLM", "False"]
    report = done.stdout + done.stderr
    assert "UNEXPECTED" in report and "attn_res.proj.weight" in report and "final_res" in report


def _copy(directory, tmp_path):
    import shutil

    return Path(shutil.copytree(directory, tmp_path / "copy"))


@pytest.mark.parametrize("edit", [
    lambda entry: "attnres",
    lambda entry: None,
    lambda entry: {key: value for key, value in entry.items() if key != "options"},
    lambda entry: {**entry, "options": {**entry["options"], "block_size": 0}},
    lambda entry: {**entry, "format": 99},
    lambda entry: {**entry, "options": {**entry["options"], "num_blocks": 1}, "block_sizes": [4]},
], ids=["a string", "null", "no options", "invalid options", "another format", "other than attnres_config.json"])
def test_a_malformed_config_entry_is_refused_naming_the_file_and_key(saved, tmp_path, edit):
    """Never the plain model or default options without a word: the model transformers builds from the
    edited config.json raises while it is built."""
    import transformers

    directory = _copy(saved[1], tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["attnres"] = edit(config["attnres"])
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(attnres_fx.CheckpointMismatchError, match=r"copy/config\.json, key 'attnres'"):
        transformers.LlamaForCausalLM.from_pretrained(directory)


def test_damaged_or_foreign_attnres_weights_are_refused_naming_the_file(saved, tmp_path, untouched):
    directory = _copy(saved[1], tmp_path)
    weights = directory / "attnres.safetensors"
    model = H.build_hf("llama")
    check = untouched(model)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(attnres_fx.CheckpointMismatchError, match=r"copy/attnres\.safetensors cannot be read"):
        attnres_fx.from_pretrained(model, directory)
    check()
    wider = H.build_hf("llama", hidden_size=64)
    check = untouched(wider)
    with pytest.raises(attnres_fx.CheckpointMismatchError, match=r"does not convert to the sites saved in .*\n"
                       r"  model\.layers\.0\.input_layernorm\.weight: saved \(32,\), now \(64,\)"):
        attnres_fx.from_pretrained(wider, saved[1])
    check()
    assert not attnres_fx.is_converted(wider)


def test_a_mixture_of_experts_reloads_exactly(tmp_path):
    """transformers saves Mixtral's experts in their older layout and renames ``.mlp.`` back to
    ``.block_sparse_moe.`` with a pattern that matches ``.mlp_res.`` too: the AttnRes weights are saved
    under their own names, and come back as they were; a checkpoint holding them under the renamed ones
    is repaired from ``attnres.safetensors``, with a warning."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=128, attn_implementation="eager")
    model = attnres_fx.attnresify(transformers.MixtralForCausalLM(config).eval(), preserve_scale=True)
    randomise_pseudo_queries(model, seed=3, std=0.5)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    names = [f"{site.name}.{weight}" for site in attnres_fx.sites(model) for weight in ("proj.weight", "norm.weight")]
    assert set(names) <= set(saved)
    ids = H.hf_example_inputs("llama")[0][0]
    with torch.no_grad():
        want = model(ids).logits
    again = attnres_fx.from_pretrained(transformers.MixtralForCausalLM, tmp_path)
    state = again.state_dict()
    assert list(state) == list(model.state_dict())
    assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
    # The experts' grouped matmul sums in an order that depends on memory alignment: the original Mixtral
    # reloads within 1e-7 too.
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=1e-5, atol=1e-6)
    renamed = {key.replace(".mlp_res.", ".block_sparse_moe.res."): value for key, value in saved.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(attnres_fx.AttnResWarning, match="taken from attnres.safetensors"):
        repaired = attnres_fx.from_pretrained(transformers.MixtralForCausalLM, tmp_path)
    assert all(torch.equal(repaired.state_dict()[key], value) for key, value in model.state_dict().items())


def test_an_audio_encoder_reloads(tmp_path):
    """HuBERT with its stable layer norm (pre-norm), built in training mode by from_pretrained, its weights
    on the meta device but for one its __init__ makes on the CPU: converted in eval mode, on the meta
    device, as the saved model was. Both run the encoder's fx graph: the output recorders the conversion's
    capture installs on its layers (hooks on children the graph traces through) are gone by its first call,
    which runs the graph prepared at conversion, not TorchDynamo."""
    import transformers
    from attnres_fx.conversion import conversion_of

    torch.manual_seed(0)
    config = transformers.HubertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       do_stable_layer_norm=True, feat_extract_norm="layer", conv_dim=(16, 16),
                                       conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                                       num_conv_pos_embedding_groups=2)
    model = randomise_pseudo_queries(attnres_fx.attnresify(transformers.HubertModel(config).eval()), seed=3)
    stats = conversion_of(model).stats
    prepared = (stats.traces, stats.rewrites)
    model.save_pretrained(tmp_path)
    again = transformers.HubertModel.from_pretrained(tmp_path)
    assert attnres_fx.is_converted(again) and not again.training
    audio = torch.randn(2, 1600, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(audio).last_hidden_state, model(audio).last_hidden_state)
    assert (stats.traces, stats.rewrites, stats.captures) == (*prepared, 0)
    assert conversion_of(again).stats.captures == 0


def test_accelerate_builds_and_loads_the_converted_model_on_the_meta_device(saved):
    import accelerate
    import transformers

    model, directory = saved
    with accelerate.init_empty_weights():
        empty = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(directory))
    assert attnres_fx.is_converted(empty) and empty.model.final_res.proj.weight.is_meta
    loaded = accelerate.load_checkpoint_and_dispatch(empty, str(directory / "model.safetensors"),
                                                     device_map={"": "cpu"}).eval()
    ids = H.hf_example_inputs("llama")[0][0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def _windowed_model(name: str):
    """A tiny model of ``name`` whose sliding window is 4 positions. GPT-OSS is not in attnres_fx.models'
    registry (its experts and attention sinks make it the slowest tiny model to build), so it is built here."""
    import transformers

    if name != "gpt_oss":
        return H.build_hf(name, sliding_window=4)
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)
    return transformers.GptOssForCausalLM(config).eval()


@cached_export
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_onnx_decoding_past_a_sliding_window_is_the_models(tmp_path, name):
    """A sliding window of 4 positions, shorter than the prompts (6) and the generation (10 new tokens):
    every layer of Mistral, every other one of Gemma 2 and GPT-OSS (with its attention sinks and experts).
    The graph's cache keeps every position and the masks apply the window, as the model's windowed cache
    and masks compute: the same tokens as ``generate``, and each step's logits those of the whole sequence
    run at once, within 1e-4 (onnxruntime's fp32 kernels sum in another order: about 1e-7 measured)."""
    import numpy as np

    from attnres_fx import export

    model = randomise_pseudo_queries(attnres_fx.attnresify(_windowed_model(name), block_size=2), seed=5, std=0.5)
    tokens = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=tokens)
    session = export.session(export.to_onnx(model, (ids,), tmp_path / "decoder.onnx", with_cache=True), device="cpu")
    prompt = torch.randint(0, model.config.vocab_size, (2, 6), generator=tokens)
    got = export.generate_onnx(session, prompt, max_new_tokens=10)
    want = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert (got == want.numpy()).all()
    with torch.no_grad():
        whole = model(want).logits.numpy()
    names = [i.name for i in session.get_inputs()]
    past = [np.zeros((2, i.shape[1], 0, i.shape[3]), dtype=np.float32) for i in session.get_inputs()[2:]]
    tokens, start = want.numpy(), 0
    for stop in range(prompt.shape[1], tokens.shape[1] + 1):
        feed = {"input_ids": tokens[:, start:stop], "attention_mask": np.ones((2, stop), dtype=np.int64)}
        logits, *past = session.run(None, {**feed, **dict(zip(names[2:], past))})
        np.testing.assert_allclose(logits, whole[:, start:stop], atol=1e-4, rtol=0)
        start = stop


# -- CLI --------------------------------------------------------------------------------------------------

def test_cli_convert_then_export_the_directory(tmp_path, capsys):
    out = tmp_path / "converted"
    assert cli_main(["convert", "llama", "--out", str(out), "--block-size", "1"]) == 0
    assert (out / "attnres_config.json").is_file() and (out / "model.safetensors").is_file()
    assert "model.final_res" in capsys.readouterr().out
    again = attnres_fx.from_pretrained(H.build_hf("llama"), out)
    assert attnres_fx.plan_of(again).block_sizes == (1,)
    onnx_path = tmp_path / "decoder.onnx"
    assert cli_main(["export", str(out), "--onnx", str(onnx_path), "--with-cache"]) == 0
    assert "PASS greedy decoding" in capsys.readouterr().out and onnx_path.is_file()
    with pytest.raises(SystemExit):
        cli_main(["convert", "llama"])                       # --out is required
    assert cli_main(["convert", "tiny", "--out", str(tmp_path / "x")]) == 2
    assert "no Hugging Face model" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "missing"), "--onnx", str(onnx_path)]) == 2


# -- ONNX for decoding ----------------------------------------------------------------------------------

@cached_export
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_onnx_decoding_with_the_cache_generates_the_same_tokens(tmp_path, name):
    from attnres_fx import export

    model = randomise_pseudo_queries(attnres_fx.attnresify(H.build_hf(name), block_size=2), seed=5, std=0.5)
    ids = H.hf_example_inputs(name, 2, 5)[0][0]
    path = export.to_onnx(model, (ids,), tmp_path / "decoder.onnx", with_cache=True)
    session = export.session(path, device="cpu")
    inputs = {i.name: i.shape for i in session.get_inputs()}
    layers = model.config.num_hidden_layers if name == "llama" else model.config.n_layer
    assert list(inputs)[:2] == ["input_ids", "attention_mask"]
    assert list(inputs)[2:] == [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    assert [o.name for o in session.get_outputs()][:3] == ["logits", "present.0.key", "present.0.value"]
    batch, _, past, _ = inputs["past_key_values.0.key"]
    assert all(isinstance(axis, str) for axis in (*inputs["input_ids"], batch, past)), "dynamic axes"
    for prompt in (ids, H.hf_example_inputs(name, 3, 9)[0][0]):
        got = export.generate_onnx(session, prompt, max_new_tokens=10)
        want = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert (got == want.numpy()).all()
