"""Converted against original folder in the same vLLM (make venv-vllm's venv): throughput of 16 concurrent
requests of 64 new tokens, and time to first token of one request, Llama with hidden 512 and 8 layers, fp32,
greedy. Each folder is served by its own engine, in its own process (original, converted, in turn, ROUNDS
times); the ratios are medians over the rounds.

    $(bash .ci/vllm-venv)/bin/python benchmarks/vllm_bench.py [--rounds N]

vLLM serves the original with its own Llama implementation on its default (compiled) path, the converted
folder with the attnres_fx plugin's class (its Transformers backend, eager)."""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=512)
REQUESTS, NEW_TOKENS, PROMPT = 16, 64, 32


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


def measure(folder: str) -> dict:
    """One engine on ``folder``: tokens/s of the batch and seconds to the first token (medians of 3)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype="float32", gpu_memory_utilization=0.1, max_model_len=256, seed=0)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 300 for j in range(PROMPT)]} for i in range(REQUESTS)]
    batch = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:2], batch, use_tqdm=False)              # warm-up
    throughput, ttft = [], []
    for repeat in range(3):
        start = time.perf_counter()
        outputs = llm.generate(prompts, batch, use_tqdm=False)
        throughput.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
        # A prompt not seen before, so the prefix cache does not answer it.
        fresh = {"prompt_token_ids": [3 + (repeat * 11 + j * 5) % 350 for j in range(PROMPT)]}
        start = time.perf_counter()
        llm.generate([fresh], first, use_tqdm=False)
        ttft.append(time.perf_counter() - start)
    return {"tokens_per_s": statistics.median(throughput), "ttft_s": statistics.median(ttft)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print("RESULT " + json.dumps(measure(args.measure)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        written = folders(Path(tmp))
        rounds = []
        for _ in range(args.rounds):
            row = {}
            for name, folder in written.items():
                run = subprocess.run([sys.executable, __file__, "--measure", str(folder)], capture_output=True,
                                     text=True, check=True)
                row[name] = json.loads(next(l for l in run.stdout.splitlines() if l.startswith("RESULT "))[7:])
            rounds.append(row)
            print(json.dumps(row))
    throughput = statistics.median(r["converted"]["tokens_per_s"] / r["original"]["tokens_per_s"] for r in rounds)
    ttft = statistics.median(r["converted"]["ttft_s"] / r["original"]["ttft_s"] for r in rounds)
    print(f"converted / original: throughput {throughput:.2f}, time to first token {ttft:.2f} "
          f"({args.rounds} rounds)")


if __name__ == "__main__":
    main()
