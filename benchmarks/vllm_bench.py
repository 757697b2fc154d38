"""Converted against original folder in the same vLLM (make venv-vllm's venv): throughput of 16 concurrent
requests of 64 new tokens, and time to first token of one request, Llama with hidden 512 and 8 layers, fp32,
greedy, every engine on vLLM's default (compiled) path.

    $(bash .ci/vllm-venv)/bin/python benchmarks/vllm_bench.py [--repeats N]

Variants, each an engine of its own (``vllm.LLM``, its engine core in a process of its own), all started
first, then measured in turn (each repeat starting with the next engine), REPEATS times: ``original``, the
original folder as vLLM serves it by default (its own Llama implementation); ``original_transformers``, the
same folder on vLLM's Transformers backend (``model_impl="transformers"``), which serves converted folders of
the architectures vLLM's own classes do not take; ``converted``, the converted folder on its default route
(the attnres_fx plugin's ``AttnResLlamaForCausalLM``: vLLM's own Llama, its graph rewritten by the saved
plan). The ratios are medians of each repeat's ratios: converted / original is what a user gets and what
AttnRes itself costs, converted / original_transformers compares with the Transformers backend."""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SIZE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=512)
REQUESTS, NEW_TOKENS, PROMPT = 16, 64, 32
VARIANTS = {"original": ("original", {}), "original_transformers": ("original", {"model_impl": "transformers"}),
            "converted": ("converted", {})}


def folders(root: Path) -> dict[str, Path]:
    import attnres_fx
    from attnres_fx.testing import randomise_pseudo_queries
    from attnres_fx.testing.serving import serving_model, tiny_tokenizer

    written = {}
    for name in ("original", "converted"):
        model = serving_model("llama", **SIZE)
        if name == "converted":
            randomise_pseudo_queries(attnres_fx.attnresify(model))
        model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
        written[name] = root / name
    return written


def measure(llm, repeat: int) -> dict:
    """Tokens/s of the batch, then seconds to the first token of a prompt no engine has seen."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 300 for j in range(PROMPT)]} for i in range(REQUESTS)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    tokens_per_s = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    # A new prompt at each repeat, so that the prefix cache does not answer it.
    fresh = {"prompt_token_ids": [3 + (repeat * 11 + j * 5) % 350 for j in range(PROMPT)]}
    start = time.perf_counter()
    llm.generate([fresh], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return {"tokens_per_s": tokens_per_s, "ttft_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    # Three engines side by side: each keeps a KV cache of 1 GiB on the CPU build.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        written = folders(Path(tmp))
        engines = {name: LLM(model=str(written[folder]), dtype="float32", gpu_memory_utilization=0.1,
                              max_model_len=256, seed=0, **engine)
                   for name, (folder, engine) in VARIANTS.items()}
        for llm in engines.values():
            measure(llm, -1)                                             # warm-up
        rows = []
        names = list(engines)
        for repeat in range(args.repeats):
            # Each repeat starts with another engine, so that none is always measured first or last.
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            measured = {name: measure(engines[name], repeat) for name in order}
            rows.append({name: measured[name] for name in names})
            print(json.dumps(rows[-1]), flush=True)
    for name in VARIANTS:
        print(f"{name}: {statistics.median(r[name]['tokens_per_s'] for r in rows):.0f} tokens/s, time to first "
              f"token {1000 * statistics.median(r[name]['ttft_s'] for r in rows):.1f} ms (medians)")
    for baseline in ("original", "original_transformers"):
        throughput = statistics.median(r["converted"]["tokens_per_s"] / r[baseline]["tokens_per_s"] for r in rows)
        ttft = statistics.median(r["converted"]["ttft_s"] / r[baseline]["ttft_s"] for r in rows)
        print(f"converted / {baseline}: throughput {throughput:.3f}, time to first token {ttft:.3f} "
              f"(medians of {args.repeats} repeats' ratios)")


if __name__ == "__main__":
    main()
