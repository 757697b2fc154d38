"""The routes' figures for ``benchmarks/bench.py``: what users of the default route pay.

- ``llama``: transformers' ``LlamaForCausalLM`` built from a config (:data:`LLAMA`), batch 2 x 128: eager
  forward, training step (AdamW), ``attnres_fx.compile`` forward, greedy decoding at batch 1; the original,
  the default route (``converted``) and ``route="model"``, interleaved in one process.
- ``query_sizes``: the eager training step of the same Llama (batch 2 x 128) converted with pseudo-queries
  of std 0, 0.1, 1 and 3 (large ones saturate the depth softmax: the weights it flushes to zero would
  otherwise make subnormal gradients, which CPUs compute on many times slower), against the original,
  interleaved in one process, on one thread and timed in that thread's CPU time (other work on a shared
  machine does not inflate it; wall time with two threads did, many times over).
- ``startup``: ``attnresify`` and the first call (the default one: ``model(ids)``, which builds a KV
  cache) of Llamas of hidden 256 at depths 8, 16 and 32, on both routes; and an 8B-shaped Llama
  (hidden 4096, 32 layers) built on the meta device, converted in a fresh process (seconds, peak
  resident memory).
- ``load``: CPU time of ``AutoModelForCausalLM.from_pretrained`` of a converted folder against the original
  model's folder (Llamas of hidden 256 at depths 8, 16 and 32; the converted one with random
  pseudo-queries), interleaved medians in one process: what a load costs beyond the original's (the
  saved plan rebuilt, the checkpoint read and hashed once, the layer route prepared on one call).
- ``overhead``: microseconds a block call costs beyond the original's, where it shows most: a narrow
  Llama decoding one token without a cache, one thread, CPU time of this thread, interleaved medians.
- ``threads``: calls per second of one model from 1 and 4 threads (``inference_mode``), original and
  converted.
- ``demo``: the forward of the model ``make demo`` converts (the built-in TinyTransformer, d=64, 4 layers,
  batch 2 x 16).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

import attnres_fx
from attnres_fx.models import TinyConfig, TinyTransformer, example_ids
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.timing import interleaved, paired_ratios, pooled, single_thread

LLAMA = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096)
LLAMA_QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)
META_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256)
VARIANTS = ("original", "converted", "model_route")


def llama(config: dict, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def converted_variants(base) -> dict:
    """The original, the default route and the model route, with the same random pseudo-queries."""
    default = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base)))
    model_route = attnres_fx.attnresify(copy.deepcopy(base), route="model")
    model_route.load_state_dict(default.state_dict())
    return {"original": base, "converted": default, "model_route": model_route}


def llama_section(quick: bool, runs: int, warmup: int, summarise, progress) -> dict:
    config = LLAMA_QUICK if quick else LLAMA
    batch, length, new_tokens = (2, 16, 4) if quick else (2, 128, 32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config["vocab_size"], (batch, length), generator=generator)
    models = converted_variants(llama(config))
    result: dict = {"model": f"LlamaForCausalLM {config}", "batch": f"{batch} x {length}"}
    progress("llama forward, eager")
    with torch.no_grad():
        result["forward"] = summarise(interleaved({v: functools.partial(m, ids) for v, m in models.items()},
                                                  runs, warmup), "original")
    progress("llama training step, eager")
    steps = {v: _train_step(copy.deepcopy(m).train(), ids) for v, m in models.items()}
    result["train"] = summarise(interleaved(steps, runs, warmup), "original")
    progress("llama decoding, eager")
    prompt = torch.randint(1, config["vocab_size"], (1, 16), generator=generator)
    result["decode"] = _decode(models, prompt, new_tokens, max(3, runs // 3), warmup, summarise)
    progress("llama forward and decoding, compiled (Inductor compiles each variant first)")
    compiled = {"original": torch.compile(models["original"], backend="inductor", fullgraph=True),
                "converted": attnres_fx.compile(models["converted"]),
                "model_route": attnres_fx.compile(models["model_route"])}
    with torch.no_grad():
        result["compiled"] = summarise(interleaved({v: functools.partial(m, ids, use_cache=False)
                                                    for v, m in compiled.items()}, runs, warmup), "original")
    models["original"].forward = torch.compile(models["original"].forward, backend="inductor", fullgraph=True)
    result["decode_compiled"] = _decode(models, prompt, new_tokens, max(3, runs // 3), warmup, summarise)
    torch._dynamo.reset()
    for row in ("forward", "train", "compiled", "decode", "decode_compiled"):
        entries = result[row]
        converted, model_route = entries["converted"], entries["model_route"]
        entries["versus_model_route"] = {"ratio": converted["ratio"] / model_route["ratio"],
                                         "ratio_min": converted["ratio_min"] / model_route["ratio_min"]}
    return result


# A Llama written by hand (attnres_fx.testing.handwritten): the shapes, d=256 x 8 and a deep narrow
# d=128 x 24.
HANDWRITTEN = {"mid": dict(dim=256, layers=8, heads=8, vocab=512),
               "deep": dict(dim=128, layers=24, heads=4, vocab=512)}
HANDWRITTEN_QUICK = {"mid": dict(dim=32, layers=2, heads=2, vocab=128),
                     "deep": dict(dim=32, layers=4, heads=2, vocab=128)}
# How many copies of each side the hand-written rows time (see handwritten_section).
PLACEMENTS = 3
# The hand-written rows take this many times the bench's rounds: their ratios lie within 1-5% of 1, and
# the medians of 15 rounds moved by 1-2% from run to run on an idle machine, as much as the targets' margins.
ROUND_FACTOR = 3


def handwritten_section(quick: bool, runs: int, warmup: int, summarise, progress) -> dict:
    """A Llama written by hand, as people write their own (one ``Block`` class, ``start_pos`` a Python int),
    beside transformers' Llama: eager forward, training step (at both shapes), decoding with a new
    ``start_pos`` at every step, and what the conversion adds per block, in microseconds (median over
    median, divided by the layers). All on one thread, timed in its CPU time: other work on a shared
    machine does not inflate it (wall time on two threads did, tenfold). Each side is timed as
    :data:`PLACEMENTS` copies of its model, their times averaged per round (:func:`attnres_fx.timing.pooled`):
    identical copies of the original decode up to some 6% apart, by where their weights lie. The rows take
    :data:`ROUND_FACTOR` times ``runs`` rounds."""
    from attnres_fx.testing.handwritten import HandwrittenConfig, Transformer

    batch, length, new_tokens = (2, 16, 4) if quick else (2, 128, 32)
    runs *= ROUND_FACTOR
    result: dict = {"batch": f"{batch} x {length}", "copies": PLACEMENTS, "rounds": runs}
    for name, fields in (HANDWRITTEN_QUICK if quick else HANDWRITTEN).items():
        config = HandwrittenConfig(**fields, max_batch=batch, max_seq=length + new_tokens)
        torch.manual_seed(0)
        base = Transformer(config).eval()
        ids = torch.randint(1, config.vocab, (batch, length), generator=torch.Generator().manual_seed(0))
        models = {}
        for k in range(PLACEMENTS):
            models[f"original#{k}"] = copy.deepcopy(base)
            models[f"converted#{k}"] = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base), (ids,)))
        copies = {v: [f"{v}#{k}" for k in range(PLACEMENTS)] for v in ("original", "converted")}
        entry: dict = {"model": f"hand-written Llama {fields}"}
        if name == "mid":
            progress("hand-written Llama forward, eager")
            with torch.no_grad(), single_thread():
                times = interleaved({v: functools.partial(m, ids) for v, m in models.items()}, runs, warmup,
                                    clock=time.thread_time)
            entry["forward"] = summarise(pooled(times, copies), "original")
            progress("hand-written Llama decoding, eager")
            with single_thread():
                times = interleaved({v: functools.partial(_decode_by_hand, m, ids[:1], new_tokens)
                                     for v, m in models.items()}, runs, warmup, clock=time.thread_time)
            entry["decode"] = summarise(pooled(times, copies), "original", per_call=new_tokens)
            entry["decode_us_per_block"] = {"value": 1e3 * (entry["decode"]["converted"]["median_ms"] -
                                                            entry["decode"]["original"]["median_ms"])
                                            / new_tokens / config.layers}
            entry["forward_us_per_block"] = {"value": 1e3 * (entry["forward"]["converted"]["median_ms"] -
                                                             entry["forward"]["original"]["median_ms"]) / config.layers}
        progress(f"hand-written Llama training step ({name}), eager")
        entry["kept_mb"] = {v: saved_for_backward_mb(models[f"{v}#0"], ids) for v in copies}
        steps = {v: _train_step_by_hand(copy.deepcopy(m).train(), ids) for v, m in models.items()}
        with single_thread():
            entry["train"] = summarise(pooled(interleaved(steps, runs, warmup, clock=time.thread_time), copies),
                                       "original")
        result[name] = entry
    return result


def saved_for_backward_mb(model, ids) -> float:
    """Megabytes a training forward of ``model`` keeps for its backward: the distinct storages its autograd
    nodes save (``saved_tensors_hooks``), the model's parameters' aside."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    was_training = model.training
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids)
    model.train(was_training)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in storages.items() if pointer not in parameters) / 1e6


def _decode_by_hand(model, prompt, new_tokens: int) -> None:
    """Greedy decoding the way Meta's reference generates: the prompt, then one token per call at its
    ``start_pos``."""
    with torch.no_grad():
        token = model(prompt, 0)[:, -1:].argmax(-1)
        for position in range(prompt.shape[1], prompt.shape[1] + new_tokens - 1):
            token = model(token, position).argmax(-1)


def _train_step_by_hand(model, ids):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
    return step


QUERY_STDS = (0.0, 0.1, 1.0, 3.0)


def query_sizes_section(quick: bool, runs: int, warmup: int, summarise, progress) -> dict:
    config = LLAMA_QUICK if quick else LLAMA
    batch, length = (2, 16) if quick else (2, 128)
    ids = torch.randint(1, config["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(0))
    base = llama(config)
    converted = attnres_fx.attnresify(copy.deepcopy(base))
    models = {"original": base, **{f"std{std:g}": randomise_pseudo_queries(copy.deepcopy(converted), std=std)
                                   for std in QUERY_STDS}}
    progress("llama training step against the pseudo-queries' std, eager, one thread")
    with single_thread():
        steps = {v: _train_step(copy.deepcopy(m).train(), ids) for v, m in models.items()}
        times = interleaved(steps, runs, warmup, clock=time.thread_time)
    paired = paired_ratios(times, "original")
    train = summarise(times, "original")
    # Whether a saturated softmax costs more than a soft one: std 1 and 3 against std 0.1, per round.
    saturated = paired_ratios({std: times[std] for std in ("std0.1", "std1", "std3")}, "std0.1")
    versus = {std: {"ratio": saturated[std], "ratio_min": train[std]["ratio_min"] / train["std0.1"]["ratio_min"]}
              for std in ("std1", "std3")}
    return {"model": f"LlamaForCausalLM {config}", "batch": f"{batch} x {length}",
            "clock": "one thread, thread CPU time", "train": train, "paired_ratio": paired,
            "versus_std0.1": versus}


def _train_step(model, ids):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
    return step


def _decode(models: dict, prompt, new_tokens: int, runs: int, warmup: int, summarise) -> dict:
    def generate(model):
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)
    return summarise(interleaved({v: functools.partial(generate, m) for v, m in models.items()}, runs, warmup),
                     "original", per_call=new_tokens)


def startup_section(quick: bool, progress) -> dict:
    """Seconds to convert and of the first and second calls, per depth and route; the 8B-shaped meta
    conversion in a fresh process."""
    depths = (2, 4) if quick else (8, 16, 32)
    result: dict = {"hidden": 64 if quick else 256, "batch": "2 x 32", "depths": {}}
    ids = torch.randint(1, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    for depth in depths:
        config = dict(hidden_size=result["hidden"], intermediate_size=2 * result["hidden"], num_hidden_layers=depth,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
        for route in ("auto", "model"):
            progress(f"startup depth {depth} route {route}")
            result["depths"].setdefault(str(depth), {})["converted" if route == "auto" else "model_route"] = \
                time_conversion(llama(config), (ids,), route=route)
    deepest, shallowest = str(depths[-1]), str(depths[0])
    result["deepest"] = {"value": result["depths"][deepest]["converted"]["total_s"]}
    shallowest_s = result["depths"][shallowest]["converted"]["total_s"]
    result["depth_growth"] = {"value": result["deepest"]["value"] / shallowest_s}
    progress("startup: an 8B-shaped Llama on the meta device, in a fresh process")
    command = [sys.executable, os.path.abspath(__file__), "--child-meta", json.dumps(LLAMA_QUICK if quick else META_8B)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result["meta_8b"] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def load_section(quick: bool, progress) -> dict:
    """CPU seconds of from_pretrained of the converted folder and of the original's, per depth."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    depths, runs = ((2, 4), 3) if quick else ((8, 16, 32), 9)
    hidden = 64 if quick else 256
    result: dict = {"hidden": hidden, "runs": runs, "clock": "CPU time of the process", "depths": {}}
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        for depth in depths:
            progress(f"load depth {depth}")
            config = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=depth,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
            model = llama(config)
            folders = {"original": os.path.join(root, f"original{depth}"),
                       "converted": os.path.join(root, f"converted{depth}")}
            model.save_pretrained(folders["original"])
            randomise_pseudo_queries(attnres_fx.attnresify(model)).save_pretrained(folders["converted"])
            loads = {name: functools.partial(AutoModelForCausalLM.from_pretrained, folder)
                     for name, folder in folders.items()}
            times = interleaved(loads, runs, clock=time.process_time)
            original, converted = (statistics.median(times[name]) for name in ("original", "converted"))
            result["depths"][str(depth)] = {
                "original_s": original, "converted_s": converted, "ratio": converted / original,
                "ratio_min": min(times["converted"]) / min(times["original"]), "difference_s": converted - original}
    return result


def time_conversion(model, call: tuple, **options) -> dict:
    """Seconds of ``attnresify(model, **options)``, of the first call ``model(*call)`` (graphs traced and
    rewritten) and of the second, which costs what every later one does."""
    start = time.perf_counter()
    attnres_fx.attnresify(model, **options)
    convert_s = time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        model(*call)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        model(*call)
        second_s = time.perf_counter() - start
    torch._dynamo.reset()
    return {"convert_s": convert_s, "first_call_s": first_s, "second_call_s": second_s, "total_s": convert_s + first_s}


def child_meta(config: dict) -> dict:
    """Runs in a fresh process: build the model on the meta device, convert it; seconds and peak resident
    memory of the conversion (``VmHWM``)."""
    with torch.device("meta"):
        model = llama(config)
    before = _status_mb("VmRSS")
    start = time.perf_counter()
    attnres_fx.attnresify(model)
    seconds = time.perf_counter() - start
    return {"convert_s": seconds, "peak_mb": _status_mb("VmHWM"), "before_mb": before,
            "sites": len(attnres_fx.sites(model)), "config": config}


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def overhead_section(quick: bool) -> dict:
    """Microseconds per block call beyond the original's: one thread, CPU time, interleaved medians."""
    layers, runs = (2, 50) if quick else (8, 400)
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = converted_variants(llama(config))
        token = torch.tensor([[5]])
        times = {name: [] for name in models}
        with torch.inference_mode():
            for model in models.values():
                model(token, use_cache=False)
            for round_ in range(runs):
                for name in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                    start = time.thread_time_ns()
                    models[name](token, use_cache=False)
                    times[name].append(time.thread_time_ns() - start)
    finally:
        torch.set_num_threads(threads)
    medians = {name: statistics.median(t) / 1e3 for name, t in times.items()}
    result = {"layers": layers, "call": "batch 1 x 1 token, no cache, hidden 64", "runs": runs,
              "original_us": medians["original"]}
    for name in ("converted", "model_route"):
        result[name] = {"us": medians[name], "per_block_us": (medians[name] - medians["original"]) / layers,
                        "ratio": medians[name] / medians["original"]}
    return result


def threads_section(quick: bool, progress) -> dict:
    """Calls per second of one model from 1 and 4 threads, each thread its own inputs."""
    config = LLAMA_QUICK if quick else dict(LLAMA, num_hidden_layers=4)
    calls = 4 if quick else 24
    base = llama(config)
    models = {"original": base, "converted": randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base)))}
    ids = torch.randint(1, config["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    result: dict = {"model": f"LlamaForCausalLM {config}", "call": "batch 1 x 32", "calls_per_thread": calls}
    for name, model in models.items():
        with torch.inference_mode():
            model(ids)
        for count in (1, 4):
            progress(f"threads: {name}, {count} thread(s)")

            def work():
                with torch.inference_mode():
                    for _ in range(calls):
                        model(ids)
            workers = [threading.Thread(target=work) for _ in range(count)]
            start = time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            result.setdefault(name, {})[f"threads{count}"] = count * calls / (time.perf_counter() - start)
    result["versus_original"] = {f"threads{count}": result["converted"][f"threads{count}"] /
                                 result["original"][f"threads{count}"] for count in (1, 4)}
    return result


def demo_section(runs: int, warmup: int, summarise) -> dict:
    """The forward of the model ``make demo`` converts, as the demo times it."""
    torch.manual_seed(0)
    config = TinyConfig(dim=64, num_layers=4, num_heads=4)
    original = TinyTransformer(config).eval()
    ids = example_ids(config, batch=2, seq=16)
    model = attnres_fx.attnresify(copy.deepcopy(original), (ids,))
    with torch.no_grad():
        times = interleaved({"original": functools.partial(original, ids), "converted": functools.partial(model, ids)},
                            runs * 4, warmup)
    return {"model": "TinyTransformer d=64, 4 layers, batch 2 x 16", "forward": summarise(times, "original")}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-meta"]:
        print(json.dumps(child_meta(json.loads(sys.argv[2]))))
