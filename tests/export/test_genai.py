"""export.to_genai and ``attnres-fx genai``: the onnxruntime-genai model folder of a converted decoder LM.

A tiny Llama converted with random pseudo-queries, saved with a tiny tokenizer and written by the CLI
(which checks greedy decoding itself) is served by onnxruntime-genai: its files and names are what
``genai_config.json`` declares; a padded batch of text prompts, and a prompt processed in chunks, generate
the tokens ``model.generate`` does; its tokenizer encodes as the Hugging Face one. fp16, the execution
provider, and the refusals (nothing written) are checked here too; the other families in
test_genai_families.py.
"""

import contextlib
import gc
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import attnres_fx
from attnres_fx import ExportError, ServingLayoutError, export
from attnres_fx.cli import main as cli_main
from attnres_fx.export import genai
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.testing.serving import BOS, EOS, PAD, VOCAB, greedy_reference, serving_model, tiny_tokenizer
from genai_support import needs_genai
from hf_models import needs_hf

TEXTS = ["def decode(self, s, _w=WHITESPACE.match):", "return obj", "raise JSONDecodeError(msg, s, end)"]
LONG_TEXT = "def raw_decode(self, s, idx=0):\n    try:\n        obj, end = self.scan_once(s, idx)"
CHUNK = 16
NEW_TOKENS = 16
# fp32 logits of onnxruntime against torch: round-off of another summation order (about 1e-6 here).
FP32_LOGITS_RTOL = 1e-4
# fp16 weights, cache and activations: relative rounding 5e-4 per op over the two layers' few dozen ops.
FP16_LOGITS_RTOL = 3e-2

slow_genai = [pytest.mark.slow, needs_hf, needs_genai]


def converted_llama() -> torch.nn.Module:
    model = serving_model("llama")
    attnres_fx.attnresify(model, (torch.arange(3, 19).reshape(2, 8),), block_size=2)
    return randomise_pseudo_queries(model)


@dataclass
class Served:
    model: torch.nn.Module
    tokenizer: object
    folder: Path
    exit_code: int
    output: str


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    """The converted Llama and its tokenizer, saved, and the folder ``attnres-fx genai`` wrote from that
    directory, with what the command printed."""
    root = tmp_path_factory.mktemp("genai")
    model, tokenizer = converted_llama(), tiny_tokenizer()
    model.save_pretrained(root / "converted")
    tokenizer.save_pretrained(root / "converted")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli_main(["genai", str(root / "converted"), "--out", str(root / "served")])
    return Served(model, tokenizer, root / "served", code, printed.getvalue())


def first_step_logits(folder: Path, prompts: list[list[int]]) -> np.ndarray:
    """onnxruntime-genai's logits after the prompts (right-padded), for each row's last real token."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=max(map(len, prompts)) + 1, batch_size=len(prompts))
    generator = og.Generator(model, params)
    longest = max(map(len, prompts))
    generator.append_tokens(np.array([p + [PAD] * (longest - len(p)) for p in prompts], dtype=np.int32))
    return np.asarray(generator.get_logits()).reshape(len(prompts), -1)


def torch_logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """The model's logits for each prompt's last token, the prompts left-padded into one batch."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (longest - len(p)) + p for p in prompts])
    with torch.no_grad():
        return model(ids, attention_mask=(torch.arange(longest) >= longest - torch.tensor(
            [len(p) for p in prompts])[:, None]).long()).logits[:, -1]


def relative_error(got: np.ndarray, want: torch.Tensor) -> float:
    return float((torch.from_numpy(got).float() - want).abs().max() / want.abs().max())


@pytest.mark.slow
@needs_hf
@needs_genai
def test_cli_writes_the_folder_and_checks_it_generates_as_the_model(served):
    assert served.exit_code == 0, served.output
    assert "PASS onnxruntime-genai generates the same tokens as model.generate" in served.output
    assert "genai_config.json, model.onnx, model.onnx.data, tokenizer.json, tokenizer_config.json" in served.output


@pytest.fixture(scope="module")
def torch_served(served, tmp_path_factory) -> Path:
    """The converted Llama's folder written through torch.onnx (the path of architectures the builder does
    not take)."""
    return export.to_genai(served.model, tmp_path_factory.mktemp("genai") / "torch", tokenizer=served.tokenizer,
                           graph="torch.onnx")


@pytest.mark.slow
@needs_hf
@needs_genai
def test_builder_folder_is_recorded_and_keeps_the_builders_config(served):
    config = json.loads((served.folder / "genai_config.json").read_text())
    assert json.loads((served.folder / "written_by.json").read_text()) == {
        "graph": "builder", "precision": "fp32", "execution_provider": "cpu", "attnres_sites": 4}
    assert config["model"]["type"] == "llama" and config["search"]["past_present_share_buffer"] is True
    assert {k: config["model"][k] for k in ("context_length", "bos_token_id", "eos_token_id", "pad_token_id")} == {
        "context_length": 128, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    assert "(builder graph)" in served.output


@pytest.mark.slow
@needs_hf
@needs_genai
def test_config_declares_the_graph_the_model_and_the_search(served, torch_served):
    assert json.loads((torch_served / "written_by.json").read_text())["graph"] == "torch.onnx"
    served = Served(served.model, served.tokenizer, torch_served, 0, "")
    config = json.loads((served.folder / "genai_config.json").read_text())
    model, decoder, search = config["model"], config["model"]["decoder"], config["search"]
    assert {k: model[k] for k in ("type", "context_length", "vocab_size", "bos_token_id", "eos_token_id",
                                  "pad_token_id")} == {"type": "decoder", "context_length": 128, "vocab_size": VOCAB,
                                                       "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    assert {k: decoder[k] for k in ("filename", "head_size", "hidden_size", "num_attention_heads",
                                    "num_hidden_layers", "num_key_value_heads")} == {
        "filename": "model.onnx", "head_size": 16, "hidden_size": 32, "num_attention_heads": 2,
        "num_hidden_layers": 2, "num_key_value_heads": 1}
    assert decoder["session_options"]["provider_options"] == []
    assert search["do_sample"] is False and search["num_beams"] == 1 and search["max_length"] == 128
    assert search["past_present_share_buffer"] is False and "chunk_size" not in search

    graph = onnx.load(str(served.folder / decoder["filename"])).graph
    layers = range(decoder["num_hidden_layers"])
    names_in = [decoder["inputs"]["input_ids"], decoder["inputs"]["attention_mask"],
                *(decoder["inputs"][f"past_{kind}_names"] % i for i in layers for kind in ("key", "value"))]
    names_out = [decoder["outputs"]["logits"],
                 *(decoder["outputs"][f"present_{kind}_names"] % i for i in layers for kind in ("key", "value"))]
    assert [i.name for i in graph.input] == names_in == [
        "input_ids", "attention_mask", "past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key",
        "past_key_values.1.value"]
    assert [o.name for o in graph.output] == names_out
    types = {v.name: v.type.tensor_type for v in [*graph.input, *graph.output]}
    assert types["input_ids"].elem_type == types["attention_mask"].elem_type == onnx.TensorProto.INT64
    cache = types["past_key_values.0.key"]
    assert cache.elem_type == onnx.TensorProto.FLOAT
    # [batch, kv heads, past, head size]: batch and past dynamic, heads and head size as declared.
    assert [d.dim_value or d.dim_param for d in cache.shape.dim][1::2] == [1, 16]
    assert all(d.dim_param for d in cache.shape.dim[0::2])
    # The AttnRes aggregations are in the graph (each site's nodes, under the wrapper's "model."; a first
    # site reads one source: no node).
    groups = export.attnres_node_groups(served.folder / decoder["filename"])
    assert ({name.removeprefix("model.") for name in groups}
            >= {site.name for site in attnres_fx.sites(served.model)[1:]})


@pytest.mark.slow
@needs_hf
@needs_genai
def test_tokenizer_encodes_and_decodes_as_the_hugging_face_one(served):
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(og.Model(str(served.folder)))
    for text in [*TEXTS, LONG_TEXT]:
        ids = served.tokenizer(text)["input_ids"]
        assert tokenizer.encode(text).tolist() == ids
        assert tokenizer.decode(ids) == text


@pytest.mark.slow
@needs_hf
@needs_genai
def test_padded_batch_generates_what_generate_does(served):
    prompts = [served.tokenizer(text)["input_ids"] for text in TEXTS]
    assert len({len(p) for p in prompts}) == 3 and all(p[-1] != PAD for p in prompts)
    expected = greedy_reference(served.model, prompts, NEW_TOKENS)
    assert max(map(len, expected)) == NEW_TOKENS, "the reference should not stop at once"
    assert export.generate_genai(served.folder, prompts, NEW_TOKENS) == expected
    error = relative_error(first_step_logits(served.folder, prompts), torch_logits(served.model, prompts))
    assert error < FP32_LOGITS_RTOL


@pytest.mark.slow
@needs_hf
@needs_genai
def test_prompt_longer_than_one_chunk_generates_what_generate_does(served):
    import onnxruntime_genai as og

    prompt = served.tokenizer(LONG_TEXT)["input_ids"]
    assert len(prompt) > 2 * CHUNK
    logs: list[str] = []
    og.set_log_options(enabled=True, model_input_values=True, ansi_tags=False)
    og.set_log_callback(logs.append)
    try:
        got = export.generate_genai(served.folder, [prompt], NEW_TOKENS, chunk_size=CHUNK)
    finally:
        og.set_log_options(enabled=False)
        og.set_log_callback(None)
        gc.collect()
    # The decoder ran on the prompt in chunks of CHUNK tokens, then on one token at a time.
    lengths = [int(n) for n in re.findall(r"input_ids ShapeDims\[ 2\]Shape\[ 1 (\d+) \]", "".join(logs))]
    chunks = [CHUNK] * (len(prompt) // CHUNK) + [len(prompt) % CHUNK]
    assert lengths[:len(chunks)] == chunks and set(lengths[len(chunks):]) == {1}
    assert got == greedy_reference(served.model, [prompt], NEW_TOKENS)


@pytest.mark.slow
@needs_hf
@needs_genai
def test_fp16_folder_serves_within_fp16_rounding(tmp_path, untouched):
    model = converted_llama().train()
    check = untouched(model, torch.arange(3, 19).reshape(2, 8), use_cache=False)
    folder = export.to_genai(model, tmp_path / "fp16", precision="fp16")
    check()
    assert model.training, "to_genai left the model in eval mode"
    graph = onnx.load(str(folder / "model.onnx")).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert types["past_key_values.0.key"] == types["logits"] == types["present.1.value"] == onnx.TensorProto.FLOAT16
    assert types["input_ids"] == onnx.TensorProto.INT64
    # fp16 rounding flips near-ties between the logits of a tiny random model, so tokens are not compared.
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    error = relative_error(first_step_logits(folder, prompts), torch_logits(model.eval(), prompts))
    assert error < FP16_LOGITS_RTOL
    assert len(export.generate_genai(folder, prompts, 4)[0]) == 4


@needs_hf
def test_config_records_the_execution_provider_and_the_chunk_size():
    model = serving_model("llama")
    shape = genai.decoder_shape(model)
    cpu = genai.genai_config(model, shape)
    cuda = genai.genai_config(model, shape, execution_provider="cuda", chunk_size=64)
    assert cpu["model"]["decoder"]["session_options"]["provider_options"] == []
    assert cuda["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]
    assert cuda["search"]["chunk_size"] == 64 and "chunk_size" not in cpu["search"]
    assert genai.decoder_shape(model, context_length=64).context_length == 64


@needs_hf
@pytest.mark.parametrize("options, match", [
    ({"precision": "bf16"}, "precision must be one of 'fp32', 'fp16', 'int4'"),
    ({"graph": "tflite"}, "graph must be one of"),
    ({"precision": "int4", "graph": "torch.onnx"}, "int4.*needs the model builder"),
    ({"precision": "fp16", "graph": "builder"}, "builder writes fp16 for the cuda"),
    ({"execution_provider": "dml"}, "execution_provider must be one of"),
    ({"chunk_size": 0}, "chunk_size must be a positive int"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        export.to_genai(serving_model("llama"), tmp_path / "out", **options)
    assert list(tmp_path.iterdir()) == []


def _t5():
    import transformers
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2))


def _mamba():
    import transformers
    return transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                                  state_size=4))


def _qwen3_next():
    import transformers
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1))


@needs_hf
@pytest.mark.parametrize("build, match", [
    (_t5, "T5ForConditionalGeneration is an encoder-decoder"),
    (_mamba, "MambaForCausalLM has layers of kind linear_attention: their cache is a fixed-size state"),
    (_qwen3_next, "Qwen3NextForCausalLM has layers of kind linear_attention"),
    (lambda: torch.nn.Linear(4, 4), "Linear is not a Hugging Face model"),
], ids=["encoder-decoder", "state-space", "linear-attention", "not-hf"])
def test_unservable_models_are_refused_before_anything_is_written(tmp_path, build, match):
    with pytest.raises(ServingLayoutError, match=match):
        export.to_genai(build(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@needs_hf
@pytest.mark.parametrize("graph, stage", [("torch.onnx", "write_onnx"), ("builder", "run_builder")])
def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch, graph, stage):
    from attnres_fx.export import genai_builder

    def fail(*args, **kwargs):
        raise ExportError(f"{stage} failed: a stand-in")
    monkeypatch.setattr(genai if stage == "write_onnx" else genai_builder, stage, fail)
    with pytest.raises(ExportError, match="a stand-in"):
        export.to_genai(serving_model("llama"), tmp_path / "out", tokenizer=None, graph=graph)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@needs_hf
@needs_genai
def test_a_folder_behind_a_link_is_written_through_it(tmp_path):
    """The link stays a link and the folder it points to gets the new export, the files the export does not
    write kept (formerly the link was replaced by a real folder, the linked one left with the old export)."""
    real = tmp_path / "exports" / "v1"
    real.mkdir(parents=True)
    (real / "genai_config.json").write_text("{}")
    (real / "NOTES.md").write_text("kept")
    link = tmp_path / "served"
    link.symlink_to(real)
    export.to_genai(serving_model("llama"), link, tokenizer=None)
    assert link.is_symlink() and link.resolve() == real
    assert (real / "NOTES.md").read_text() == "kept" and json.loads((real / "genai_config.json").read_text())["model"]
    assert not [p.name for p in (*tmp_path.iterdir(), *real.parent.iterdir()) if p.name.startswith(".attnres-tmp-")]
