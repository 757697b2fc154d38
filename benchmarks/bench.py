"""What conversion costs: latency, training step, decoding, first call, peak memory, the op's bandwidth.

    python benchmarks/bench.py                 # the full run (about half an hour on 2 CPU cores)
    python benchmarks/bench.py --quick         # tiny models, few runs: checks that every path works
    python benchmarks/bench.py --sections forward,decode --backends eager

Every figure is a ratio to the original model measured in the same process, the variants interleaved
(the order reversed every other round) so that drift and neighbours hit all alike: medians, and minima.

Models: the built-in pre-norm TinyTransformer at three shapes (``bench``: d=512, 12 layers, batch 4 x
256, N=8; ``mid``: d=256, 8 layers, batch 4 x 128, N=4; ``deep``: d=128, 24 layers, batch 4 x 128, N=8)
and, for decoding, a Llama-style Hugging Face model built from its config (8 layers, hidden 256).
Variants: ``original``; ``converted`` (``attnresify(num_blocks=N)``, the live layer route: eager, or
``attnres_fx.compile``); ``model_route`` (the same on the model route, ``route="model"``); ``graph`` (the
explicit GraphModule of ``attnres_fx.rewrite``, eager or ``export.compile``, for comparison with the live
route); ``full`` (``block_size=1``).

Sections:

1. ``forward``: inference latency, eager, compiled (Inductor, fullgraph) and onnxruntime (CPU, its default
   graph optimisations, the benchmark's thread count).
2. ``train``: one step (forward, cross-entropy, backward, AdamW), eager and compiled.
3. ``first_call``: seconds to convert, and of the first call (captures and rewrites), at the ``bench``
   shape, on each route.
4. ``decode``: tokens/s of ``generate`` with the KV cache (greedy), batch 1 and 8, eager and compiled, on
   each route.
4b. ``genai``: decoding tokens/s of onnxruntime-genai generating from model folders (greedy, batch 1 and
   8, after the prompt), per family onnxruntime-genai serves (six at hidden 256 x 8 layers, Llama at
   1024 x 16 too; ``--genai-entries`` picks some) and per precision (fp32; int4 where the builder takes
   the family): ``builder``, onnxruntime-genai's own model builder on the original model (the baseline
   users have; ``export.to_genai(graph="torch.onnx")`` of the original where the builder fails on the
   family), ``converted`` (``export.to_genai`` of the converted model: the builder's graph with the
   AttnRes pass in its default per-site form where it applies), ``attention`` (the pass's attention form)
   and, at fp32 and hidden 256, ``torch_onnx`` (``export.to_genai(graph="torch.onnx")`` of the converted
   model); each folder's node count and peak resident memory while loading and generating a batch of 8,
   in a fresh process. Every folder's session runs on one onnxruntime thread, timed in that thread's
   CPU time (as the one-thread sections below: load on the machine does not inflate it).
5. ``stages``: bytes a microbatch sends across pipeline stage boundaries (``attnres_fx.pipeline_stages``,
   four stages of the ``deep`` shape), with and without cross-stage caching over two ranks, and the state
   held between two blocks of a forward against the N + 1 stream tensors it should be.
6. ``memory``: peak resident memory of a training step and of a forward, each in a fresh process.
7. ``op``: one aggregation, the kernel (eager) and compiled, against a compiled streaming sum of the same
   sources (the bandwidth bound), and the two-phase schedule of one block against its per-site form.
7b. ``op_train``: one aggregation's forward and backward (what eager calls run: on the CPU the C++
   operator with its C++ autograd; beside it the operator whose autograd is registered in Python, and the
   two kernels called directly) against a copy that reads and writes as many bytes as forward and
   backward together (3K + 2 stream tensors for K sources), at [2, 128, 512] and [1, 1, 2048].
7c. ``deep_train``: the eager training step of the ``deep`` shape (d=128, 24 layers, where the
   aggregations are the largest share of the work), original and converted, three copies a side (as
   the hand-written rows).

``query_sizes``, ``deep_train`` and, on the CPU, ``op_train`` run torch on one thread and time each call
in that thread's CPU time: on a machine shared with other work, wall time with two threads inflated a
step many times over (threads waiting for each other), CPU time of one thread does not move with the
load.
8. ``choices``: the measurements behind the implementation choices: eager candidates per shape (decoding
   and prefill), fused backward against autograd, Inductor's plain-op form against the opaque operator,
   and onnxruntime per ONNX form. ``--device cuda`` runs this section and ``op`` on a GPU.

Writes ``bench.json`` and ``bench.md`` to ``--out`` (default ``benchmarks/results/``) and prints the
latter; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import attnres_fx
from attnres_fx.models import TinyConfig, TinyTransformer, example_ids
from attnres_fx.passes.two_phase import phase1, phase2
from attnres_fx.timing import interleaved, paired_ratios, pooled, single_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))
import routes  # noqa: E402 - the routes' own sections, beside this script
import traffic  # noqa: E402 - the memory-traffic model beside this script

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SECTIONS = ("llama", "handwritten", "query_sizes", "deep_train", "startup", "load", "overhead", "threads", "demo",
            "forward", "train", "first_call", "decode", "genai", "stages", "memory", "op", "op_train", "choices")
BACKENDS = ("eager", "compiled", "onnx")


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    layers: int
    heads: int
    batch: int
    seq: int
    num_blocks: int

    @property
    def sites(self) -> int:
        return 2 * self.layers

    @property
    def block_size(self) -> int:
        return -(-self.sites // self.num_blocks)

    @property
    def stream_bytes(self) -> int:
        return self.batch * self.seq * self.dim * 4

    def config(self) -> TinyConfig:
        return TinyConfig(dim=self.dim, num_layers=self.layers, num_heads=self.heads, max_seq_len=self.seq)

    def describe(self) -> str:
        return (f"{self.name}: d={self.dim}, {self.layers} layers, batch {self.batch} x {self.seq}, "
                f"N={self.num_blocks} (block size {self.block_size})")


@dataclass(frozen=True)
class Settings:
    shapes: dict[str, Shape]
    forward_shapes: tuple[str, ...]
    train_shapes: tuple[str, ...]
    runs: int
    warmup: int
    op_runs: int
    op_sources: tuple[int, ...]
    op_train_shapes: tuple[tuple[int, ...], ...]
    choice_shapes: tuple[tuple[int, ...], ...]
    decode: dict
    decode_tokens: int


FULL = Settings(
    shapes={"bench": Shape("bench", 512, 12, 8, 4, 256, 8), "mid": Shape("mid", 256, 8, 4, 4, 128, 4),
            "deep": Shape("deep", 128, 24, 2, 4, 128, 8)},
    forward_shapes=("bench", "mid"), train_shapes=("bench", "mid", "deep"), runs=15, warmup=2, op_runs=100,
    op_sources=(2, 5, 9), op_train_shapes=((2, 128, 512), (1, 1, 2048)),
    choice_shapes=((1, 1, 256), (8, 1, 256), (1, 1, 2048), (8, 1, 2048), (4, 256, 512), (1, 512, 2048)),
    decode=dict(num_hidden_layers=8, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                num_key_value_heads=4, head_dim=64, vocab_size=1024),
    decode_tokens=48)
QUICK = Settings(
    shapes={"bench": Shape("bench", 64, 2, 2, 2, 16, 8), "mid": Shape("mid", 32, 2, 2, 2, 16, 2),
            "deep": Shape("deep", 32, 4, 2, 2, 16, 4)},
    forward_shapes=("bench",), train_shapes=("bench",), runs=3, warmup=1, op_runs=5, op_sources=(2, 3),
    op_train_shapes=((2, 16, 64), (1, 1, 64)),
    choice_shapes=((1, 1, 32), (2, 16, 64)),
    decode=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, vocab_size=128),
    decode_tokens=4)


def _genai_targets(entry: str, label: str, precisions: tuple[str, ...]) -> dict:
    """The genai section's targets for one of its entries: decoding at batch 1 and 8, then peak memory."""
    prefix = "converted folder / builder's original"
    decoding = {f"decode tokens/s, onnxruntime-genai, {prefix}, {label} {precision} batch {n}": (
        f"genai/{entry}/{precision}/batch{n}", "converted", 0.95, ">=") for precision in precisions for n in (1, 8)}
    memory = {f"onnxruntime-genai peak memory, {prefix}, {label} {precision}": (
        f"genai/{entry}/{precision}/memory", "converted", 1.05, "<=") for precision in precisions}
    return {**decoding, **memory}


TARGETS = {   # (section path, entry, bound, sense): the targets the README's performance section reports
    "Llama eager forward": ("llama/forward", "converted", 1.03, "<="),
    "Llama eager training step": ("llama/train", "converted", 1.05, "<="),
    "Llama compiled forward": ("llama/compiled", "converted", 1.02, "<="),
    "Llama decode tokens/s, eager, batch 1": ("llama/decode", "converted", 0.95, ">="),
    "Llama decode tokens/s, compiled, batch 1": ("llama/decode_compiled", "converted", 0.97, ">="),
    "Hand-written Llama eager forward": ("handwritten/mid/forward", "converted", 1.03, "<="),
    "Hand-written Llama eager training step": ("handwritten/mid/train", "converted", 1.05, "<="),
    "Hand-written Llama eager training step, deep narrow": ("handwritten/deep/train", "converted", 1.10, "<="),
    "Hand-written Llama decode tokens/s, eager, one thread": ("handwritten/mid/decode", "converted", 0.95, ">="),
    "Llama eager forward, default / model route": ("llama/forward", "versus_model_route", 1.02, "<="),
    "Llama training step, default / model route": ("llama/train", "versus_model_route", 1.02, "<="),
    "Llama compiled forward, default / model route": ("llama/compiled", "versus_model_route", 1.02, "<="),
    "Llama decode tokens/s, default / model route": ("llama/decode", "versus_model_route", 0.98, ">="),
    "Llama training step, pseudo-queries of std 0 (one thread, CPU time)": ("query_sizes/train", "std0", 1.05, "<="),
    "Llama training step, pseudo-queries of std 0.1 (one thread, CPU time)": ("query_sizes/train", "std0.1", 1.05,
                                                                               "<="),
    "Llama training step, pseudo-queries of std 1 (one thread, CPU time)": ("query_sizes/train", "std1", 1.05, "<="),
    "Llama training step, pseudo-queries of std 3 (one thread, CPU time)": ("query_sizes/train", "std3", 1.05, "<="),
    "Llama training step, std 1 / std 0.1 (median of round ratios)": ("query_sizes/versus_std0.1", "std1", 1.02,
                                                                       "<="),
    "deep narrow training step (d=128, 24 layers; one thread, CPU time)": ("deep_train/train", "converted", 1.12,
                                                                            "<="),
    "op forward+backward / same-bytes copy at [2, 128, 512] (fewest of its source counts)": (
        "op_train", "eager_worst", 0.8, ">="),
    "32-layer Llama: attnresify + first call, s": ("startup", "deepest", 5.0, "<="),
    "32-layer Llama: attnresify + first call / 8-layer": ("startup", "depth_growth", 1.5, "<="),
    "8B-shaped Llama on meta: attnresify, s": ("startup", "meta_8b", 20.0, "<=", "convert_s"),
    "8B-shaped Llama on meta: peak memory, MB": ("startup", "meta_8b", 2048.0, "<=", "peak_mb"),
    "16-layer Llama from_pretrained: converted folder - original's, CPU s": ("load/depths", "16", 1.0, "<=",
                                                                              "difference_s"),
    "32-layer Llama from_pretrained: converted folder / original's, CPU time": ("load/depths", "32", 1.5, "<="),
    "demo model forward": ("demo/forward", "converted", 1.25, "<="),
    "eager forward, bench": ("forward/bench/eager", "converted", 1.03, "<="),
    "eager forward, mid": ("forward/mid/eager", "converted", 1.05, "<="),
    "eager training step, bench": ("train/bench/eager", "converted", 1.05, "<="),
    "eager training step, deep": ("train/deep/eager", "converted", 1.12, "<="),
    "compiled forward, bench": ("forward/bench/compiled", "converted", 1.02, "<="),
    "compiled training step, bench": ("train/bench/compiled", "converted", 1.03, "<="),
    "onnxruntime forward, bench": ("forward/bench/onnx", "converted", 1.05, "<="),
    "decode tokens/s, eager, batch 1": ("decode/eager/batch1", "converted", 0.95, ">="),
    "decode tokens/s, eager, batch 8": ("decode/eager/batch8", "converted", 0.95, ">="),
    "decode tokens/s, compiled, batch 1": ("decode/compiled/batch1", "converted", 0.95, ">="),
    "decode tokens/s, compiled, batch 8": ("decode/compiled/batch8", "converted", 0.95, ">="),
    **_genai_targets("llama", "Llama", ("fp32", "int4")),
    **_genai_targets("llama_1024x16", "Llama 1024x16", ("int4",)),
    "op / streaming bound, C++ kernel (fewest of its source counts)": ("op", "kernel_worst", 0.8, ">="),
    "op / streaming bound, compiled (fewest of its source counts)": ("op", "compiled_worst", 0.8, ">="),
    "training peak memory, bench": ("memory/train", "converted", 1.08, "<="),
    "inference peak memory: extra over original / N + 1 block sums": ("memory/inference", "extra_vs_model", 1.10, "<="),
}


# --------------------------------------------------------------------------------------------- models
def original(shape: Shape) -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(shape.config()).eval()


def inputs(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = shape.config()
    return example_ids(cfg, shape.batch, shape.seq), example_ids(cfg, shape.batch, shape.seq, seed=1)


def converted(shape: Shape, model: nn.Module, **options) -> nn.Module:
    """A converted copy of ``model`` with random pseudo-queries (zero ones would let nothing but the
    plain mean show)."""
    from attnres_fx.testing import randomise_pseudo_queries

    options = {"num_blocks": shape.num_blocks, **options} if "block_size" not in options else options
    return randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(model), (inputs(shape)[0],), **options))


def variants(shape: Shape, names: tuple[str, ...]) -> dict[str, nn.Module]:
    base = original(shape)
    made = {"original": base}
    if {"converted", "graph"} & set(names):
        made["converted"] = converted(shape, base)
    if "graph" in names:
        made["graph"] = attnres_fx.rewrite(copy.deepcopy(made["converted"]), (inputs(shape)[0],))
    if "model_route" in names:
        made["model_route"] = converted(shape, base, route="model")
    if "full" in names:
        made["full"] = converted(shape, base, block_size=1)
    return {name: made[name] for name in names}


def compiled(model: nn.Module) -> nn.Module:
    """Inductor, fullgraph, for each kind of variant: the live route's own for a converted model."""
    if attnres_fx.is_converted(model):
        return attnres_fx.compile(model)
    if isinstance(model, torch.fx.GraphModule):
        from attnres_fx import export

        return export.compile(model)
    return torch.compile(model, backend="inductor", fullgraph=True)


# --------------------------------------------------------------------------------------------- timing
def summarise(times: dict[str, list[float]], reference: str, per_call: float = 1.0) -> dict[str, dict]:
    """Median and minimum ms per call of each entry, and their ratios to ``reference``'s.

    ``per_call`` > 1 turns the figures into a rate (e.g. tokens per call): ``rate``, and ratios of rates.
    """
    base, base_min = statistics.median(times[reference]), min(times[reference])
    out = {}
    for name, t in times.items():
        entry = {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "runs": len(t)}
        if per_call == 1.0:
            entry.update(ratio=statistics.median(t) / base, ratio_min=min(t) / base_min)
        else:
            entry.update(rate=per_call / statistics.median(t), ratio=base / statistics.median(t),
                         ratio_min=base_min / min(t))
        out[name] = entry
    return out


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- sections
def forward_section(settings: Settings, backends: list[str]) -> dict:
    result: dict = {}
    for name in settings.forward_shapes:
        shape = settings.shapes[name]
        ids, _ = inputs(shape)
        models = variants(shape, ("original", "converted", "model_route", "graph", "full"))
        result[name] = rows = {"shape": shape.describe()}
        with torch.no_grad():
            if "eager" in backends:
                progress(f"forward {name} eager")
                rows["eager"] = summarise(interleaved({v: functools.partial(m, ids) for v, m in models.items()},
                                                      settings.runs, settings.warmup), "original")
            if "compiled" in backends:
                progress(f"forward {name} compiled (Inductor compiles each variant first)")
                chosen = {v: compiled(models[v]) for v in ("original", "converted", "model_route", "graph")}
                rows["compiled"] = summarise(interleaved({v: functools.partial(m, ids) for v, m in chosen.items()},
                                                         settings.runs, settings.warmup), "original")
                torch._dynamo.reset()
        if "onnx" in backends:
            progress(f"forward {name} onnxruntime (export first)")
            rows["onnx"] = summarise(interleaved(onnx_runners({v: models[v] for v in ("original", "converted")}, ids),
                                                 settings.runs, settings.warmup), "original")
    return result


def onnx_runners(models: dict[str, nn.Module], ids: torch.Tensor) -> dict[str, Callable[[], object]]:
    from attnres_fx import export

    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, model in models.items():
            path = export.to_onnx(model, (ids,), Path(tmp) / f"{variant}.onnx")
            session = export.session(path, device="cpu")
            feed = {session.get_inputs()[0].name: ids.numpy()}
            runners[variant] = functools.partial(session.run, None, feed)
    return runners


def train_section(settings: Settings, backends: list[str]) -> dict:
    result: dict = {}
    for name in settings.train_shapes:
        shape = settings.shapes[name]
        ids, targets = inputs(shape)
        result[name] = rows = {"shape": shape.describe()}
        for backend in (b for b in ("eager", "compiled") if b in backends):
            progress(f"train {name} {backend}")
            names = ("original", "converted", "model_route", "full") if backend == "eager" else \
                ("original", "converted", "model_route")
            steps = {v: train_step(m.train(), ids, targets, backend == "compiled")
                     for v, m in variants(shape, names).items()}
            rows[backend] = summarise(interleaved(steps, settings.runs, settings.warmup), "original")
            torch._dynamo.reset()
    return result


def train_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, compile_it: bool) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = compiled(model) if compile_it else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(forward(ids).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
    return step


def deep_train_section(settings: Settings) -> dict:
    """The eager training step of the deep, narrow shape, original and converted, interleaved on one
    thread, in that thread's CPU time (module docstring). As the hand-written rows (``routes``): each side
    timed as :data:`routes.PLACEMENTS` copies averaged per round, :data:`routes.ROUND_FACTOR` times the
    bench's rounds: with one model a side and 15 rounds, the ratio moved 1.10-1.13 from run to run at the
    same code, as much as the target's margin."""
    shape = settings.shapes["deep"]
    ids, targets_ = inputs(shape)
    progress(f"deep training step, eager, one thread ({shape.describe()})")
    made = variants(shape, ("original", "converted"))
    models = {f"{v}#{k}": copy.deepcopy(m).train() for k in range(routes.PLACEMENTS) for v, m in made.items()}
    copies = {v: [f"{v}#{k}" for k in range(routes.PLACEMENTS)] for v in made}
    rounds = settings.runs * routes.ROUND_FACTOR
    with single_thread():
        steps = {v: train_step(m, ids, targets_, False) for v, m in models.items()}
        times = pooled(interleaved(steps, rounds, settings.warmup, clock=time.thread_time), copies)
    return {"shape": shape.describe(), "clock": "one thread, thread CPU time", "copies": routes.PLACEMENTS,
            "rounds": rounds, "train": summarise(times, "original"), "paired_ratio": paired_ratios(times, "original")}


def first_call_section(settings: Settings) -> dict:
    """Seconds to convert, of the first call (captures and rewrites) and of the second, per route."""
    shape = settings.shapes["bench"]
    ids, _ = inputs(shape)
    result: dict = {"shape": shape.describe()}
    for route in ("layer", "model"):
        result[route] = routes.time_conversion(original(shape), (ids,), example_inputs=(ids,),
                                               num_blocks=shape.num_blocks, route=route)
    return result


def decode_section(settings: Settings, backends: list[str]) -> dict:
    from attnres_fx.models import build_hf
    from attnres_fx.testing import randomise_pseudo_queries

    result: dict = {"model": f"LlamaForCausalLM {settings.decode}", "new_tokens": settings.decode_tokens}
    for backend in (b for b in ("eager", "compiled") if b in backends):
        base = build_hf("llama", use_cache=True, **settings.decode)
        models = {"original": base,
                  "converted": randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base), num_blocks=4)),
                  "model_route": randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base), num_blocks=4,
                                                                                route="model"))}
        if backend == "compiled":
            base.forward = torch.compile(base.forward, backend="inductor", fullgraph=True)
            attnres_fx.compile(models["converted"])
            attnres_fx.compile(models["model_route"])
        result[backend] = {}
        for batch in (1, 8):
            progress(f"decode {backend} batch {batch}")
            prompt = torch.randint(1, settings.decode["vocab_size"], (batch, 32),
                                   generator=torch.Generator().manual_seed(0))

            def generate(model, prompt=prompt):
                with torch.no_grad():
                    model.generate(prompt, max_new_tokens=settings.decode_tokens, min_new_tokens=settings.decode_tokens,
                                   do_sample=False, pad_token_id=0)
            tokens = batch * settings.decode_tokens
            result[backend][f"batch{batch}"] = summarise(
                interleaved({v: functools.partial(generate, m) for v, m in models.items()},
                            max(3, settings.runs // 3), settings.warmup), "original", per_call=tokens)
        torch._dynamo.reset()
    return result


# Per configuration: the families timed and their size (full: the decode section's Llama shape). Sliding
# windows: onnxruntime-genai 0.18's windowed cache fails once the window slides, so export.to_genai takes
# the builder's graph only for a window no shorter than the context (max_position_embeddings), Mistral's and
# Gemma 2's here, and writes it without the window (which never binds then). The builder's folder of the
# original gets the same (genai_builder.without_window): its windowed cache (Gemma 2's) refuses a
# generation shorter than the window.
# Gemma 2 stands for its family: the builder (0.18) cannot read transformers' Gemma 3 config (a rope per
# layer type). The vocabulary differs from intermediate_size: the builder's int4 head is the first linear
# layer with vocab_size outputs, which would be the first MLP's.
GENAI_SMALL = dict(num_hidden_layers=8, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=64, vocab_size=1000, max_position_embeddings=512)
GENAI_LARGE = {**GENAI_SMALL, "num_hidden_layers": 16, "hidden_size": 1024, "intermediate_size": 4096,
               "num_attention_heads": 16, "num_key_value_heads": 16}
# entry -> (family, config fields); the torch.onnx folder only for entries whose size is GENAI_SMALL.
GENAI_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2")
GENAI = {"full": dict(entries={**{f: (f, GENAI_SMALL) for f in GENAI_FAMILIES},
                               "llama_1024x16": ("llama", GENAI_LARGE)}, prompt=32),
         "quick": dict(entries={"llama": ("llama", {})}, prompt=8)}


def genai_section(settings: Settings, config_name: str, entries: list[str] | None = None) -> dict:
    """onnxruntime-genai generating from the builder's folder of each family's original model and from
    the folders of the converted model (random pseudo-queries, N=4), per precision; ``entries``: a subset
    of the configuration's."""
    from attnres_fx.testing import randomise_pseudo_queries
    from attnres_fx.testing.serving import tiny_tokenizer

    plan = GENAI[config_name]
    result: dict = {"new_tokens": settings.decode_tokens, "prompt": plan["prompt"],
                    "clock": "one onnxruntime thread, thread CPU time of the decoding steps"}
    with tempfile.TemporaryDirectory() as tmp:
        for name in entries or plan["entries"]:
            family, size = plan["entries"][name]
            model = genai_model(family, size)
            config = model.config
            rows: dict = {"model": f"{type(model).__name__} ({config.num_hidden_layers} layers, hidden "
                                   f"{config.hidden_size})"}
            converted = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(model), num_blocks=4))
            for precision in ("fp32", "int4"):
                progress(f"genai {name} {precision}: the builder's folder and the converted model's")
                built = genai_folders(model, converted, tiny_tokenizer(config.vocab_size),
                                      Path(tmp) / name / precision, precision, torch_onnx=size is not GENAI_LARGE)
                if built is None:
                    continue
                folders, baseline = built
                entry: dict = {"baseline": baseline, "nodes": {v: node_count(f) for v, f in folders.items()},
                               "graph": {v: written_graph(f) for v, f in folders.items()}}
                for batch in (1, 8):
                    progress(f"genai {name} {precision} batch {batch}")
                    runners = genai_runners(folders, batch, plan["prompt"], settings.decode_tokens)
                    times = interleaved(runners, max(3, settings.runs // 2), settings.warmup, clock=None)
                    entry[f"batch{batch}"] = summarise(times, "builder", per_call=batch * (settings.decode_tokens - 1))
                    entry[f"batch{batch}"]["load_average"] = os.getloadavg()[0]
                progress(f"genai {name} {precision} memory")
                entry["memory"] = {variant: genai_child_memory(folder, plan["prompt"], settings.decode_tokens)
                                   for variant, folder in folders.items()}
                for memory in entry["memory"].values():
                    memory["ratio"] = memory["peak_delta_mb"] / entry["memory"]["builder"]["peak_delta_mb"]
                rows[precision] = entry
            result[name] = rows
    return result


def genai_model(family: str, size: dict) -> nn.Module:
    from attnres_fx.testing.serving import serving_model

    window = {"sliding_window": size.get("max_position_embeddings")}
    fields = {"mistral": window, "gemma2": window,
              # Phi-3 without long-context rope scaling (which the builder reads from rope_scaling).
              "phi3": {"original_max_position_embeddings": size.get("max_position_embeddings")}}
    return serving_model(family, use_cache=True, **size, **(fields.get(family, {}) if size else {}))


def genai_folders(model: nn.Module, converted: nn.Module, tokenizer, root: Path, precision: str,
                  torch_onnx: bool = True) -> tuple[dict[str, Path], str] | None:
    """The folders of one precision (each set to one onnxruntime thread) and what the baseline is: the
    builder's folder of the original, or at fp32 export.to_genai's (torch.onnx) of the original where the
    builder fails on the family; None for int4 where the builder does not take the family."""
    folders = _genai_folders(model, converted, tokenizer, root, precision, torch_onnx)
    if folders is not None:
        for folder in folders[0].values():
            one_thread(folder)
    return folders


def one_thread(folder: Path) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options.update(intra_op_num_threads=1, inter_op_num_threads=1)
    path.write_text(json.dumps(config, indent=4))


def _genai_folders(model: nn.Module, converted: nn.Module, tokenizer, root: Path, precision: str,
                   torch_onnx: bool) -> tuple[dict[str, Path], str] | None:
    from attnres_fx import export
    from attnres_fx.export.genai_builder import builder_takes, write_builder_folder

    if precision == "int4" and builder_takes(converted, "int4", "cpu", model.config.max_position_embeddings):
        return None
    source = root / "original"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    folders = {"builder": root / "builder", "converted": root / "converted"}
    built = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o",
                            str(folders["builder"]), "-p", precision, "-e", "cpu", "-c", str(root / "cache")],
                           capture_output=True, text=True)
    export.to_genai(converted, folders["converted"], tokenizer=tokenizer, precision=precision)
    if not builder_takes(converted, precision, "cpu", model.config.max_position_embeddings):
        folders["attention"] = root / "attention"
        write_builder_folder(converted, folders["attention"], precision, "cpu", tokenizer=tokenizer, form="attention")
    if precision == "fp32" and torch_onnx:
        folders["torch_onnx"] = export.to_genai(converted, root / "torch_onnx", tokenizer=tokenizer, graph="torch.onnx")
    if built.returncode == 0:
        _without_window(folders["builder"])
        return folders, "onnxruntime-genai's model builder"
    if precision == "int4":
        return None
    progress(f"the builder failed ({built.stderr.strip().splitlines()[-1:]}): "
             "export.to_genai's original is the baseline")
    folders["builder"] = export.to_genai(model, root / "exported", tokenizer=tokenizer, graph="torch.onnx")
    return folders, "export.to_genai, torch.onnx (the builder failed)"


def _without_window(folder: Path) -> None:
    import onnx

    from attnres_fx.export.genai_builder import load_config, without_window

    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    config = without_window(graph, load_config(folder))
    onnx.save(graph, str(folder / "model.onnx"))
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4))


def node_count(folder: Path) -> int:
    import onnx

    return len(onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node)


def written_graph(folder: Path) -> str:
    written = folder / "written_by.json"
    return json.loads(written.read_text())["graph"] if written.is_file() else "builder (original)"


def genai_runners(folders: dict[str, Path], batch: int, prompt: int, new_tokens: int) -> dict[str, Callable[[], float]]:
    """One greedy generation of exactly ``new_tokens`` tokens (EOS suppressed by the minimum length) per
    folder, each model loaded once; it returns the calling thread's CPU seconds of the ``new_tokens - 1``
    decoding steps (the first token comes with the prompt)."""
    import numpy as np
    import onnxruntime_genai as og

    runners = {}
    for variant, folder in folders.items():
        model = og.Model(str(folder))
        vocabulary = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
        # No special token (pad, bos, eos are 0, 1, 2): a trailing pad id would read as padding.
        tokens = np.random.default_rng(0).integers(3, vocabulary, (batch, prompt), dtype=np.int32)

        def generate(model=model, tokens=tokens) -> float:
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, batch_size=batch, max_length=prompt + new_tokens,
                                      min_length=prompt + new_tokens)
            generator = og.Generator(model, params)
            generator.append_tokens(tokens)
            start = time.thread_time()
            while not generator.is_done():
                generator.generate_next_token()
            return time.thread_time() - start
        runners[variant] = generate
    return runners


def genai_child_memory(folder: Path, prompt: int, new_tokens: int) -> dict:
    command = [sys.executable, __file__, "--child-genai", str(folder), str(prompt), str(new_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_genai(folder: str, prompt: int, new_tokens: int) -> dict:
    """Runs in a fresh process: peak resident set of loading ``folder`` and generating a batch of 8 with it,
    minus the resident set before (onnxruntime-genai imported)."""
    import onnxruntime_genai  # noqa: F401 - imported before the baseline: the library is no cost of the folder

    reset_peak()
    before = status_bytes("VmRSS")
    genai_runners({"folder": Path(folder)}, 8, prompt, new_tokens)["folder"]()
    peak = status_bytes("VmHWM")
    return {"peak_mb": peak / 1e6, "peak_delta_mb": (peak - before) / 1e6}


def stages_section(settings: Settings) -> dict:
    """What crosses pipeline stage boundaries per microbatch (the stages run in one process, in turn),
    with and without cross-stage caching, and the state held between two blocks of a forward."""
    from attnres_fx.conversion import conversion_of
    from attnres_fx.routing.state import state_of

    shape = settings.shapes["deep"]
    ids, _ = inputs(shape)
    model = converted(shape, original(shape))
    count = 4
    splits = [f"blocks.{k * shape.layers // count}" for k in range(1, count)]
    sent = {}
    for label, ranks in (("plain", None), ("cached", 2)):
        stages = attnres_fx.pipeline_stages(model, splits, example_inputs=(ids,), ranks=ranks)
        with torch.no_grad():
            values = stages[0](ids)
            tensors = [len(values)]
            for stage in stages[1:-1]:
                values = stage(*values)
                tensors.append(len(values))
            stages[-1](*values)
        sent[label] = (sum(stage.sent_bytes for stage in stages), tensors)
    held: list[tuple[int, int]] = []

    def record(module, args, output):
        state, _ = state_of(output, conversion_of(model), 0)
        if state is not None:
            distinct = {id(t): t for t in state.tensors}.values()
            held.append((len(distinct), sum(t.numel() * t.element_size() for t in distinct)))
    handles = [block.register_forward_hook(record) for block in model.blocks]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    stream_bytes = shape.batch * shape.seq * shape.dim * 4
    return {"shape": shape.describe(), "stages": count, "ranks": 2, "microbatch": f"batch {shape.batch} x {shape.seq}",
            "plain_bytes": sent["plain"][0], "cached_bytes": sent["cached"][0], "plain_tensors": sent["plain"][1],
            "cached_tensors": sent["cached"][1], "num_blocks": shape.num_blocks,
            "state_tensors": max(n for n, _ in held), "state_mb": max(b for _, b in held) / 1e6,
            "state_predicted_mb": (shape.num_blocks + 1) * stream_bytes / 1e6}


def memory_section(settings: Settings, config_name: str) -> dict:
    """Each (variant, mode) in a fresh process; the budget is the N + 1 stream tensors AttnRes keeps."""
    shape = settings.shapes["bench"]
    result: dict = {"shape": shape.describe(),
                    "budget_mb": (-(-shape.sites // shape.block_size) + 1) * shape.stream_bytes / 1e6}
    for mode in ("inference", "train"):
        result[mode] = {}
        for variant in ("original", "converted"):
            progress(f"memory {mode} {variant}")
            command = [sys.executable, __file__, "--child-memory", variant, mode, "--config", config_name]
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
            result[mode][variant] = json.loads(done.stdout.strip().splitlines()[-1])
        base = result[mode]["original"]["peak_delta_mb"]
        for entry in result[mode].values():
            entry["ratio"] = entry["peak_delta_mb"] / base if base > 0 else None
    # Inference keeps the N + 1 block sums alive and nothing else: the extra peak against that model.
    extra = result["inference"]["converted"]["peak_delta_mb"] - result["inference"]["original"]["peak_delta_mb"]
    result["inference"]["extra_vs_model"] = {"ratio": extra / result["budget_mb"], "extra_mb": extra}
    return result


def child_memory(settings: Settings, variant: str, mode: str) -> dict:
    """Runs in a fresh process: peak resident set of the work minus the resident set before it.

    A warm-up call on a tiny batch first initialises the libraries and the route (and, for training,
    AdamW's state), so that the difference is the activations'. With a 64 KiB mmap threshold every
    tensor is mapped and unmapped, so the resident set follows the live tensors. The peak is the
    kernel's high-water mark (``VmHWM``), reset after the warm-up.
    """
    shape = settings.shapes["bench"]
    model = original(shape)
    if variant == "converted":
        model = converted(shape, model)
    ids, targets = inputs(shape)
    if mode == "train":
        model.train()
        step = train_step(model, ids, targets, compile_it=False)
        train_step(model, ids[:1, :4], targets[:1, :4], compile_it=False)()
    else:
        with torch.no_grad():
            model(ids[:1, :4])
    gc.collect()
    reset_peak()
    before = status_bytes("VmRSS")
    for _ in range(2):
        if mode == "train":
            step()
        else:
            with torch.no_grad():
                model(ids)
    peak = status_bytes("VmHWM")
    return {"resident_before_mb": before / 1e6, "peak_mb": peak / 1e6, "peak_delta_mb": (peak - before) / 1e6}


def reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def op_section(settings: Settings, device: torch.device) -> dict:
    """One aggregation at the ``bench`` shape, run by the kernel (the operator, eager) and compiled, each
    against the streaming bound: a compiled sum of the same sources, which reads each once and writes
    the result (what any aggregation must move at least)."""
    shape = settings.shapes["bench"]
    dims = (shape.batch, shape.seq, shape.dim)
    torch.manual_seed(0)
    result: dict = {"shape": shape.describe(), "device": str(device), "block_op": {}}
    with torch.no_grad():
        for count in settings.op_sources:
            progress(f"op, {count} sources")
            result["block_op"][str(count)] = op_against_bound(settings, dims, count, shape.stream_bytes, device)
        result["block_group"] = group_against_bound(settings, dims, shape, device)
    for kind in ("kernel", "compiled"):
        fractions = [e[f"{kind}_fraction"] for e in result["block_op"].values()]
        result[f"{kind}_worst"] = {"ratio": min(fractions), "ratio_min": min(
            e[f"{kind}_fraction_min"] for e in result["block_op"].values())}
    torch._dynamo.reset()
    return result


def _random_site(dim: int, device: torch.device | str = "cpu") -> attnres_fx.BlockAttnRes:
    module = attnres_fx.BlockAttnRes(dim, device=device)
    nn.init.normal_(module.proj.weight, std=0.5)
    nn.init.uniform_(module.norm.weight, 0.5, 1.5)
    return module


def op_against_bound(settings: Settings, dims: tuple[int, ...], count: int, stream_bytes: int,
                     device: torch.device) -> dict:
    sources = [torch.randn(dims, device=device) for _ in range(count)]
    site = _random_site(dims[-1], device)
    compiled_site = torch.compile(site, fullgraph=True)
    bound = torch.compile(lambda *xs: functools.reduce(torch.add, xs), fullgraph=True, dynamic=False)
    fns = {"kernel": functools.partial(site, *sources), "compiled": functools.partial(compiled_site, *sources),
           "bound": functools.partial(bound, *sources)}
    times = summarise(interleaved(fns, settings.op_runs,
                                  settings.warmup, device=device), "bound")
    entry = {"sources": count, "bound_ms": times["bound"]["median_ms"],
             "bytes_moved_mb": (count + 1) * stream_bytes / 1e6}
    for kind in ("kernel", "compiled"):
        entry[f"{kind}_ms"] = times[kind]["median_ms"]
        entry[f"{kind}_fraction"] = 1.0 / times[kind]["ratio"]
        entry[f"{kind}_fraction_min"] = 1.0 / times[kind]["ratio_min"]
    return entry


def op_train_section(settings: Settings, device: torch.device) -> dict:
    """One aggregation's forward and backward against a copy of the same bytes: per shape and source count,
    median microseconds of (``eager``) what eager calls run (:func:`attnres_fx.op.ops.eager`: on the CPU
    the C++ operator, its autograd in C++), (``python_autograd``) the operator ``attnres::aggregate``,
    whose autograd is registered in Python, and, on the CPU, (``kernels``) the forward and backward
    kernels called directly; and of (``copy``) a copy reading and writing as many bytes as forward and
    backward together: 3K + 2 stream tensors (forward: K sources in, one out; backward: the gradient and
    K sources in, K gradients out). Fraction: copy / candidate. Gradients are taken with
    ``torch.autograd.grad``, a backward call of its own per aggregation, whose fixed cost a model's
    backward pays once for all its nodes: (``engine``) that call on a one-node graph of a one-element
    leaf, timed beside the others, and ``eager_net_fraction``, copy / (eager - engine), the aggregation's
    share of a model's step against the copy."""
    from attnres_fx.op import ops
    from attnres_fx.op.kernels import cpu

    on_cpu = device.type == "cpu"
    kernels = on_cpu and cpu.available()
    clock = time.thread_time if on_cpu else time.perf_counter
    rows = []
    with single_thread() if on_cpu else contextlib.nullcontext():
        for dims in settings.op_train_shapes:
            for count in settings.op_sources:
                progress(f"op forward and backward, {list(dims)} x {count}")
                generator = torch.Generator().manual_seed(count)
                sources = [torch.randn(dims, generator=generator).to(device).requires_grad_() for _ in range(count)]
                proj = (torch.randn(1, dims[-1], generator=generator) * 0.05).to(device).requires_grad_()
                norm = (torch.rand(dims[-1], generator=generator) + 0.5).to(device).requires_grad_()
                grad = torch.randn(dims, generator=generator).to(device)
                leaves = [*sources, proj, norm]
                elements = (3 * count + 2) * grad.numel() // 2
                source, target = torch.randn(elements, device=device), torch.empty(elements, device=device)
                plain = [s.detach() for s in sources]
                leaf, one = torch.ones(1, device=device, requires_grad=True), torch.ones(1, device=device)
                candidates = {
                    "eager": lambda: torch.autograd.grad(ops.eager(proj, norm, sources, eps=1e-6, preserve_scale=False),
                                                         leaves, grad),
                    "python_autograd": lambda: torch.autograd.grad(
                        torch.ops.attnres.aggregate(sources, proj, norm, 1e-6, False), leaves, grad),
                    "copy": lambda: target.copy_(source),
                    "engine": lambda: torch.autograd.grad(leaf * 2.0, leaf, one)}
                if kernels:
                    candidates["kernels"] = lambda: torch.ops.attnres_cpu.aggregate_backward_saved(
                        grad, plain, torch.ops.attnres_cpu.aggregate_saving_logits(
                            plain, proj.detach(), norm.detach(), 1e-6, False)[1], proj.detach(), norm.detach(), 1e-6,
                        False)
                times = interleaved(candidates, settings.op_runs, settings.warmup, device=device, clock=clock)
                us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
                best = {k: 1e6 * min(v) for k, v in times.items()}
                fractions = [k for k in us if k not in ("copy", "engine")]
                rows.append({"shape": list(dims), "sources": count, **{f"{k}_us": v for k, v in us.items()},
                             **{f"{k}_fraction": us["copy"] / us[k] for k in fractions},
                             **{f"{k}_fraction_min": best["copy"] / best[k] for k in fractions},
                             "eager_net_fraction": us["copy"] / max(us["eager"] - us["engine"], 1e-9)})
    first = [row for row in rows if row["shape"] == list(settings.op_train_shapes[0])]
    return {"device": str(device), "clock": "one thread, thread CPU time" if on_cpu else "wall time",
            "rows": rows, "eager_worst": {"ratio": min(r["eager_fraction"] for r in first),
                                          "ratio_min": min(r["eager_fraction_min"] for r in first),
                                          "net_ratio": min(r["eager_net_fraction"] for r in first)}}


def group_against_bound(settings: Settings, dims: tuple[int, ...], shape: Shape, device: torch.device) -> dict:
    """The S sites that share N completed blocks: per-site aggregations against phase 1 + S phase 2,
    eager (the kernels) and compiled."""
    blocks = tuple(torch.randn(dims, device=device) for _ in range(shape.sites // shape.block_size))
    partials = tuple(torch.randn(dims, device=device) for _ in range(shape.block_size))
    sites = [_random_site(dims[-1], device) for _ in partials]
    projs, norms = tuple(s.proj.weight for s in sites), tuple(s.norm.weight for s in sites)
    eps = sites[0].eps

    def per_site(blocks, partials):
        return [site(*blocks, partial) for site, partial in zip(sites, partials)]

    def two_phase(blocks, partials):
        states = phase1(projs, norms, blocks, eps=eps)
        return [phase2(state, proj, norm, partial, blocks[0], eps=eps, scale=1.0)
                for state, proj, norm, partial in zip(states, projs, norms, partials)]

    def bound(blocks, partials):
        total = functools.reduce(torch.add, blocks)
        return [total + partial for partial in partials]

    progress("op, one block per site and two-phase")
    fns = {}
    for name, fn in (("per_site", per_site), ("two_phase", two_phase)):
        fns[f"eager_{name}"] = functools.partial(fn, blocks, partials)
        fns[f"compiled_{name}"] = functools.partial(torch.compile(fn, fullgraph=True), blocks, partials)
    fns["bound"] = functools.partial(torch.compile(bound, fullgraph=True), blocks, partials)
    times = interleaved(fns, settings.op_runs, settings.warmup, device=device)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"completed_blocks": len(blocks), "sites": len(partials), **{f"{k}_ms": v for k, v in ms.items()},
            **{f"{k}_fraction": ms["bound"] / v for k, v in ms.items() if k != "bound"}}


def choices_section(settings: Settings, device: torch.device) -> dict:
    """The measurements behind the implementation choices (``attnres_fx.op.ops.eager``, the captured and the
    exported forms): each candidate on the same inputs, interleaved, median microseconds."""
    from attnres_fx.op import aggregation, ops
    from attnres_fx.op.kernels import cpu

    torch.manual_seed(0)
    result: dict = {"device": str(device), "eager": [], "training": [], "inductor": [], "onnx": []}
    kernel = device.type == "cuda" or cpu.available()
    for dims in settings.choice_shapes:
        for count in settings.op_sources:
            progress(f"choices, eager {dims} x {count}")
            dim = dims[-1]
            sources = [torch.randn(dims, device=device) for _ in range(count)]
            proj, norm = torch.randn(1, dim, device=device) * 0.05, torch.rand(dim, device=device) + 0.5
            candidates = {"stacked": lambda: aggregation.stacked(proj, norm, sources, eps=1e-6, preserve_scale=False),
                          "fusable": lambda: aggregation.fusable(proj, norm, sources, eps=1e-6, preserve_scale=False)}
            if kernel:
                candidates["operator"] = lambda: torch.ops.attnres.aggregate(sources, proj, norm, 1e-6, False)
                if device.type == "cpu":
                    candidates["cpp direct"] = lambda: torch.ops.attnres_cpu.aggregate(sources, proj, norm, 1e-6, False)
            with torch.no_grad():
                times = interleaved(candidates, settings.op_runs, settings.warmup, device=device)
            result["eager"].append({"shape": list(dims), "sources": count,
                                    **{k: 1e6 * statistics.median(v) for k, v in times.items()}})
            if dims[1] == 1:
                continue
            progress(f"choices, training {dims} x {count}")
            leaves = [s.clone().requires_grad_() for s in sources]
            weights = [proj.clone().requires_grad_(), norm.clone().requires_grad_()]
            steps = {"autograd through fusable": lambda: aggregation.fusable(*weights, leaves, eps=1e-6,
                                                                             preserve_scale=False).sum().backward()}
            steps["operator (fused backward)"] = lambda: ops.aggregate(leaves, *weights, eps=1e-6,
                                                                       preserve_scale=False).sum().backward()
            times = interleaved(steps, settings.op_runs // 2 or 1,
                                settings.warmup, device=device)
            result["training"].append({"shape": list(dims), "sources": count,
                                       **{k: 1e6 * statistics.median(v) for k, v in times.items()}})
    result["inductor"] = inductor_choice(settings, device)
    if device.type == "cpu":
        result["onnx"] = onnx_choice(settings)
    torch._dynamo.reset()
    return result


def inductor_choice(settings: Settings, device: torch.device) -> list[dict]:
    """Under Inductor: the plain-op form (fused with the RMSNorm after it) against the opaque operator
    followed by the same norm, inference and a training step."""
    from attnres_fx.op import aggregation

    shape = settings.shapes["bench"]
    dims = (shape.batch, shape.seq, shape.dim)
    weight = torch.rand(shape.dim, device=device) + 0.5
    proj = torch.randn(1, shape.dim, device=device) * 0.05
    norm = torch.rand(shape.dim, device=device) + 0.5
    rows = []
    for count in settings.op_sources:
        progress(f"choices, inductor, {count} sources")
        sources = [torch.randn(dims, device=device) for _ in range(count)]

        def decomposition(*xs):
            return F.rms_norm(aggregation.fusable(proj, norm, list(xs), eps=1e-6, preserve_scale=False),
                              (shape.dim,), weight)

        def operator(*xs):
            return F.rms_norm(torch.ops.attnres.aggregate(list(xs), proj, norm, 1e-6, False), (shape.dim,), weight)

        row = {"sources": count}
        with torch.no_grad():
            fns = {k: functools.partial(torch.compile(f, fullgraph=True), *sources)
                   for k, f in (("decomposition", decomposition), ("operator", operator))}
            for k, v in interleaved(fns, settings.op_runs,
                                    settings.warmup, device=device).items():
                row[f"inference {k}"] = 1e6 * statistics.median(v)
        torch._dynamo.reset()
        leaves = [s.clone().requires_grad_() for s in sources]
        compiled_fns = {k: torch.compile(f, fullgraph=True) for k, f in (("decomposition", decomposition),
                                                                          ("operator", operator))}
        steps = {k: (lambda f=f: f(*leaves).sum().backward()) for k, f in compiled_fns.items()}
        for k, v in interleaved(steps, settings.op_runs // 2 or 1,
                                settings.warmup, device=device).items():
            row[f"training {k}"] = 1e6 * statistics.median(v)
        torch._dynamo.reset()
        rows.append(row)
    return rows


def onnx_choice(settings: Settings) -> list[dict]:
    """onnxruntime on one aggregation exported in each plain-op form: per source (as Inductor gets it),
    stacked (a few ops on one tensor), batched (two MatMuls: what the exporter emits)."""
    import onnxruntime as ort

    from attnres_fx.op import aggregation

    shape = settings.shapes["bench"]
    dims = (shape.batch, shape.seq, shape.dim)
    forms = {"per-source": aggregation.fusable, "stacked": aggregation.stacked, "batched": aggregation.batched}
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in settings.op_sources:
            progress(f"choices, onnxruntime forms, {count} sources")
            site = _random_site(shape.dim)
            sources = tuple(torch.randn(dims) for _ in range(count))
            runners = {}
            for name, form in forms.items():
                module = _FormModule(site, form)
                path = Path(tmp) / f"{name}-{count}.onnx"
                torch.onnx.export(module, sources, dynamo=True, verbose=False).save(path)
                session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                feed = {i.name: s.numpy() for i, s in zip(session.get_inputs(), sources)}
                runners[name] = functools.partial(session.run, None, feed)
            times = interleaved(runners, settings.op_runs, settings.warmup)
            rows.append({"sources": count, **{k: 1e6 * statistics.median(v) for k, v in times.items()}})
    return rows


class _FormModule(nn.Module):
    def __init__(self, site: attnres_fx.BlockAttnRes, form: Callable):
        super().__init__()
        self.site, self.form = site, form

    def forward(self, *sources):
        return self.form(self.site.proj.weight, self.site.norm.weight, list(sources), eps=self.site.eps,
                         preserve_scale=False)


# -------------------------------------------------------------------------------------------- report
def targets(results: dict) -> dict:
    """Each target with the measured ratio (median, minimum) and whether it is met, where measured."""
    judged = {}
    for label, (path, variant, bound, sense, *field) in TARGETS.items():
        node = results
        for key in path.split("/"):
            node = node.get(key, {}) if isinstance(node, dict) else {}
        entry = node.get(variant) if isinstance(node, dict) else None
        key = field[0] if field else ("ratio" if entry and "ratio" in entry else "value")
        if not entry or entry.get(key) is None:
            continue
        value, value_min = entry[key], entry.get(f"{key}_min", entry[key])
        better = (lambda v: v <= bound) if sense == "<=" else (lambda v: v >= bound)
        judged[label] = {"value": value, "value_min": value_min, "target": f"{sense} {bound:g}",
                         "met": better(value), "met_min": better(value_min)}
    return judged


def genai_report(genai: dict) -> list[str]:
    lines = [f"## onnxruntime-genai decoding ({genai['prompt']}-token prompts, {genai['new_tokens']} new tokens, "
             "greedy, CPU)", "",
             "Decoding tokens/s of onnxruntime-genai on each folder, one onnxruntime thread, in that thread's CPU time "
             "(ratio to the baseline, median / max): the baseline is onnxruntime-genai's model builder on the "
             "original model at the same precision; *per-site* is export.to_genai of the converted model (N=4, "
             "random pseudo-queries; the builder's graph with the AttnRes pass in its default form where it "
             "applies), *attention* the pass's attention form, *torch.onnx* export.to_genai's torch.onnx graph. "
             "Load: the machine's 1-minute load average after the cell. Peak memory: resident set added by "
             "loading the folder and generating a batch of 8, fresh process each.", "",
             "| model | precision | batch | baseline tokens/s | per-site (ratio) | attention (ratio) | "
             "torch.onnx (ratio) | load |", "|---|---|---|---|---|---|---|---|"]
    memory_rows = []

    def cell(row: dict | None) -> str:
        return f"{row['rate']:.1f} ({row['ratio']:.3f} / {row['ratio_min']:.3f})" if row else "-"

    def memory_cell(row: dict | None) -> str:
        return f"{row['peak_delta_mb']:.1f} ({row['ratio']:.2f})" if row else "-"

    for name, rows in ((n, r) for n, r in genai.items() if isinstance(r, dict)):
        for precision in ("fp32", "int4"):
            entry = rows.get(precision)
            if not entry:
                continue
            for batch in ("batch1", "batch8"):
                timed = entry[batch]
                lines.append(f"| {name} | {precision} | {batch[5:]} | {timed['builder']['rate']:.1f} | "
                             f"{cell(timed.get('converted'))} | {cell(timed.get('attention'))} | "
                             f"{cell(timed.get('torch_onnx'))} | {timed.get('load_average', float('nan')):.1f} |")
            m, n = entry["memory"], entry["nodes"]
            memory_rows.append(f"| {name} | {precision} | {rows['model']} | {entry['baseline']} | "
                               f"{m['builder']['peak_delta_mb']:.1f} | {memory_cell(m.get('converted'))} | "
                               f"{memory_cell(m.get('attention'))} | {memory_cell(m.get('torch_onnx'))} | "
                               f"{n['builder']} / {n['converted']} / {n.get('attention', '-')} / "
                               f"{n.get('torch_onnx', '-')} |")
    return lines + ["", "| model | precision | size | baseline | baseline peak MB | per-site peak MB (ratio) | "
                    "attention peak MB (ratio) | torch.onnx peak MB (ratio) | nodes: baseline / per-site / attention / "
                    "torch.onnx |", "|---|---|---|---|---|---|---|---|---|", *memory_rows, ""]


def _ratio_table(rows: dict) -> list[str]:
    backends = [b for b in ("eager", "compiled", "onnx") if b in rows]
    if not backends:
        return []
    variants_ = list(dict.fromkeys(v for b in backends for v in rows[b]))
    lines = _head("backend", *variants_)
    for backend in backends:
        cells = []
        for v in variants_:
            e = rows[backend].get(v)
            cells.append("-" if e is None else f"{e['median_ms']:.1f} ms ({e['ratio']:.3f} / {e['ratio_min']:.3f})")
        lines.append(f"| {backend} | " + " | ".join(cells) + " |")
    return lines


def _table(title: str, rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    if not rows:
        return []
    columns = [k for k in rows[0] if k not in keys]
    lines = [title, "", "| " + " | ".join((*keys, *columns)) + " |", "|" + "---|" * (len(keys) + len(columns))]
    for row in rows:
        best = min(row[c] for c in columns)
        cells = [str(row[k]) for k in keys] + [f"**{row[c]:.1f}**" if row[c] == best else f"{row[c]:.1f}"
                                               for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _choice_tables(choices: dict) -> list[str]:
    """Median microseconds per candidate, the fastest in bold."""
    return [f"## Implementation choices ({choices['device']}; median us, fastest in bold)", "",
            *_table("Eager, no gradient (`attnres_fx.op.ops.eager`):", choices["eager"], ("shape", "sources")),
            *_table("Eager forward and backward:", choices["training"], ("shape", "sources")),
            *_table("Inductor, the aggregation then an RMSNorm, at the bench shape:", choices["inductor"],
                    ("sources",)),
            *_table("onnxruntime, one aggregation per ONNX form, at the bench shape:", choices["onnx"],
                    ("sources",))]


def markdown(settings: Settings, results: dict) -> str:
    env = results["environment"]
    lines = [f"# attnres_fx benchmark{' (--quick)' if results['quick'] else ''}", "",
             f"torch {env['torch']}, {env['threads']} threads, load average {env['load_before'][0]:.2f} before / "
             f"{env['load_after'][0]:.2f} after. Cells: median ms (ratio to original, median / minimum); "
             f"{settings.runs} interleaved runs.", ""]
    lines += routes_markdown(results)
    for title, key in (("Forward latency", "forward"), ("Training step (forward, backward, AdamW)", "train")):
        for shape, rows in results.get(key, {}).items():
            lines += [f"## {title}, {rows['shape']}", "", *_ratio_table(rows), ""]
    first = results.get("first_call")
    if first:
        lines += [f"## First call ({first['shape']})", "",
                  *_head("route", "conversion, s", "first call (captures and rewrites), s", "second call, s")]
        for route in ("layer", "model"):
            e = first[route]
            lines.append(f"| {route} | {e['convert_s']:.2f} | {e['first_call_s']:.2f} | {e['second_call_s']:.3f} |")
        lines.append("")
    decode = results.get("decode")
    if decode:
        lines += [f"## Decoding with the KV cache ({decode['model']}, {decode['new_tokens']} new tokens, greedy)", "",
                  "| backend | batch | original tokens/s | layer route tokens/s (ratio median / max) "
                  "| model route tokens/s (ratio) |", "|---|---|---|---|---|"]
        for backend in ("eager", "compiled"):
            for batch, rows in decode.get(backend, {}).items():
                lines.append(f"| {backend} | {batch[5:]} | {rows['original']['rate']:.1f} "
                             f"| {rows['converted']['rate']:.1f} ({rows['converted']['ratio']:.3f} "
                             f"/ {rows['converted']['ratio_min']:.3f}) | "
                             f"{rows['model_route']['rate']:.1f} ({rows['model_route']['ratio']:.3f}) |")
        lines.append("")
    genai = results.get("genai")
    if genai:
        lines += genai_report(genai)
    stages = results.get("stages")
    if stages:
        plain_mib, cached_mib = stages["plain_bytes"] / 2**20, stages["cached_bytes"] / 2**20
        plain_counts = ", ".join(str(n) for n in stages["plain_tensors"])
        cached_counts = ", ".join(str(n) for n in stages["cached_tensors"])
        lines += [f"## Pipeline stages and the state between blocks ({stages['shape']})", "",
                  f"Bytes each microbatch sends across the stage boundaries of {stages['stages']} stages "
                  f"({stages['microbatch']}): {plain_mib:.2f} MiB without cross-stage caching, {cached_mib:.2f} MiB "
                  f"with it over {stages['ranks']} ranks ({cached_mib / plain_mib:.3f}); per boundary {plain_counts} "
                  f"tensors without, {cached_counts} with.", "",
                  "State held between two blocks in one forward (the completed block sums and the partial sum, no "
                  f"gradients): at most {stages['state_tensors']} tensors, {stages['state_mb']:.1f} MB measured, "
                  f"{stages['state_predicted_mb']:.1f} MB predicted (N + 1 = {stages['num_blocks'] + 1} stream "
                  "tensors).", ""]
    memory = results.get("memory")
    if memory:
        lines += [f"## Peak memory ({memory['shape']}; fresh process each, 64 KiB mmap threshold)", "",
                  *_head("mode", "original, MB", "converted, MB", "ratio")]
        for mode in ("inference", "train"):
            o, c = memory[mode]["original"], memory[mode]["converted"]
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
            lines.append(f"| {mode} | {o['peak_delta_mb']:.1f} | {c['peak_delta_mb']:.1f} | {ratio} |")
        lines += ["", f"AttnRes keeps up to N + 1 stream tensors alive: {memory['budget_mb']:.1f} MB here; inference "
                  f"measured {memory['inference']['extra_vs_model']['extra_mb']:.1f} MB over the original.", ""]
    op = results.get("op")
    if op:
        lines += [f"## The op against the streaming bound ({op['shape']}; {op['device']})", "",
                  "The bound: a compiled sum of the same sources (reads each once, writes one). "
                  "Fraction = bound / op.", "",
                  *_head("case", "kernel ms", "compiled ms", "bound ms", "kernel fraction (median / min)",
                         "compiled fraction")]
        for e in op["block_op"].values():
            lines.append(f"| one aggregation, {e['sources']} sources | {e['kernel_ms']:.3f} | {e['compiled_ms']:.3f} | "
                         f"{e['bound_ms']:.3f} | {e['kernel_fraction']:.2f} / {e['kernel_fraction_min']:.2f} | "
                         f"{e['compiled_fraction']:.2f} / {e['compiled_fraction_min']:.2f} |")
        g = op["block_group"]
        for mode in ("eager", "compiled"):
            for form in ("per_site", "two_phase"):
                key = f"{mode}_{form}"
                lines.append(f"| one block, {mode}: {g['sites']} sites over {g['completed_blocks']} blocks, "
                             f"{form.replace('_', '-')} | {g[key + '_ms']:.3f} | | {g['bound_ms']:.3f} | "
                             f"{g[key + '_fraction']:.2f} | |")
        lines.append("")
    op_train = results.get("op_train")
    if op_train:
        columns = [c for c in ("eager", "python_autograd", "kernels") if f"{c}_us" in op_train["rows"][0]]
        lines += [f"## The op's forward and backward against a copy of the same bytes ({op_train['device']}, "
                  f"{op_train['clock']})", "",
                  "Median us; fraction = copy / candidate (the copy reads and writes 3K + 2 stream tensors, what "
                  "forward and backward move for K sources). eager: what eager calls run (on the CPU the C++ "
                  "operator, its autograd in C++); python_autograd: the operator with its autograd registered "
                  "in Python; kernels: the two kernels called directly (the forward that keeps the logits, "
                  "the backward that takes them). engine: torch.autograd.grad on a one-node graph, the fixed "
                  "cost of the backward call every candidate makes, which a model's backward pays once for all "
                  "its nodes; eager net: copy / (eager - engine).", "",
                  "| shape | sources | " + " | ".join(f"{c} us" for c in columns) + " | copy us | engine us | "
                  + " | ".join(f"{c} fraction" for c in columns) + " | eager net fraction |",
                  "|---|---|" + "---|" * (2 * len(columns) + 3)]
        for row in op_train["rows"]:
            lines.append(f"| {row['shape']} | {row['sources']} | "
                         + " | ".join(f"{row[c + '_us']:.1f}" for c in columns)
                         + f" | {row['copy_us']:.1f} | {row['engine_us']:.1f} | "
                         + " | ".join(f"{row[c + '_fraction']:.2f}" for c in columns)
                         + f" | {row['eager_net_fraction']:.2f} |")
        lines.append("")
    deep = results.get("deep_train")
    if deep:
        timing = f"{deep['clock']}; {deep['copies']} copies a side averaged per round, {deep['rounds']} rounds"
        lines += [f"## Training step, eager, {deep['shape']} ({timing})", "",
                  *_head("original", "converted", "median of round ratios"),
                  _row(_cell(deep["train"]["original"]), _cell(deep["train"]["converted"]),
                       f"{deep['paired_ratio']['converted']:.3f}"), ""]
    choices = results.get("choices")
    if choices:
        lines += _choice_tables(choices)
    bench = settings.shapes["bench"]
    lines += [f"## Memory-traffic model (benchmarks/traffic.py; per token, units of d; {bench.describe()})", "",
              traffic.format_table(traffic.traffic(bench.sites, block_size=bench.block_size),
                                   tokens=bench.batch * bench.seq, dim=bench.dim), ""]
    if results["targets"]:
        lines += ["## Targets", "", *_head("measure", "median", "min", "target", "met (median / min)")]
        for name, e in results["targets"].items():
            lines.append(f"| {name} | {e['value']:.3f} | {e['value_min']:.3f} | {e['target']} | "
                         f"{'yes' if e['met'] else 'no'} / {'yes' if e['met_min'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)


def routes_markdown(results: dict) -> list[str]:
    """The sections of :mod:`routes`: the default route (``converted``) beside ``route="model"``."""
    lines: list[str] = []
    llama = results.get("llama")
    if llama:
        lines += [f"## Hugging Face Llama, default route and model route ({llama['model']}, "
                  f"batch {llama['batch']})", "",
                  "Cells: median ms (ratio to the original, median / minimum); decoding: tokens/s (ratio of rates, "
                  "batch 1, greedy, KV cache). Last column: default route / model route.", "",
                  *_head("measure", "original", "default route", "model route", "default / model")]
        for row, title in (("forward", "eager forward"), ("train", "eager training step"),
                           ("compiled", "attnres_fx.compile forward"), ("decode", "decode, eager"),
                           ("decode_compiled", "decode, compiled")):
            entries = llama[row]
            cells = [_cell(entries[v]) for v in ("original", "converted", "model_route")]
            lines.append(f"| {title} | {' | '.join(cells)} | {entries['versus_model_route']['ratio']:.3f} |")
        lines.append("")
    hand = results.get("handwritten")
    if hand:
        mid, deep = hand["mid"], hand["deep"]
        lines += [f"## A Llama written by hand, default route ({mid['model']}; deep narrow: {deep['model']}; batch "
                  f"{hand['batch']})", "",
                  f"One thread, timed in its CPU time; each side {hand['copies']} copies of its model (the same "
                  f"weights elsewhere in memory), their times averaged per round; {hand['rounds']} rounds. Cells: "
                  "median ms (ratio to the original, median / minimum); decoding: tokens/s (batch 1, greedy, a new "
                  "start_pos each step).", "",
                  *_head("measure", "original", "converted")]
        for title, entries in (("eager forward", mid["forward"]), ("eager training step", mid["train"]),
                               ("eager training step, deep narrow", deep["train"]), ("decode, eager", mid["decode"])):
            lines.append(f"| {title} | {_cell(entries['original'])} | {_cell(entries['converted'])} |")
        lines += ["", f"Added per block: {mid['forward_us_per_block']['value']:.0f} us of a forward, "
                      f"{mid['decode_us_per_block']['value']:.1f} us of a decoding step. Kept for the backward by a "
                      f"training forward (saved tensors, parameters aside): {mid['kept_mb']['original']:.1f} MB "
                      f"original, {mid['kept_mb']['converted']:.1f} MB converted; deep narrow "
                      f"{deep['kept_mb']['original']:.1f} / {deep['kept_mb']['converted']:.1f} MB.", ""]
    sizes = results.get("query_sizes")
    if sizes:
        names = [name for name in sizes["train"] if name != "original"]
        paired = sizes["paired_ratio"]
        versus = sizes["versus_std0.1"]
        lines += [f"## Training step against the pseudo-queries' size ({sizes['model']}, batch {sizes['batch']}, "
                  f"eager, {sizes['clock']})", "", "Cells: median ms (ratio to the original, median / minimum); "
                  "then the median of each round's ratio to the original's step in the same round, and to std "
                  "0.1's.", "",
                  f"| | original | {' | '.join(name.replace('std', 'std ') for name in names)} |",
                  "|---" * (len(names) + 2) + "|",
                  f"| step | {' | '.join(_cell(sizes['train'][name]) for name in ['original', *names])} |",
                  f"| median of round ratios | {' | '.join(f'{paired[name]:.3f}' for name in ['original', *names])} |",
                  f"| against std 0.1 | | | | "
                  f"{' | '.join(format(versus[n]['ratio'], '.3f') for n in ('std1', 'std3'))} |",
                  ""]
    startup = results.get("startup")
    if startup:
        lines += [f"## Conversion and first call against depth (Llama, hidden {startup['hidden']}, batch "
                  f"{startup['batch']}; the first call builds a KV cache)", "",
                  *_head("layers", "route", "attnresify, s", "first call, s", "second call, s", "total, s")]
        for depth, by_route in startup["depths"].items():
            for route, e in by_route.items():
                name = "default" if route == "converted" else "model"
                lines.append(_row(depth, name, f"{e['convert_s']:.2f}", f"{e['first_call_s']:.2f}",
                                  f"{e['second_call_s']:.3f}", f"{e['total_s']:.2f}"))
        meta = startup["meta_8b"]
        lines += ["", f"8B-shaped Llama built on the meta device ({meta['sites']} sites): attnresify in "
                  f"{meta['convert_s']:.1f} s, peak resident memory {meta['peak_mb']:.0f} MB (fresh process).", ""]
    load = results.get("load")
    if load:
        lines += [f"## Loading a saved folder (Llama, hidden {load['hidden']}; AutoModelForCausalLM.from_pretrained, "
                  f"{load['clock']}, medians of {load['runs']} interleaved loads)", "",
                  *_head("layers", "original's folder, s", "converted folder, s", "converted / original",
                         "difference, s")]
        for depth, e in load["depths"].items():
            lines.append(_row(depth, f"{e['original_s']:.3f}", f"{e['converted_s']:.3f}", f"{e['ratio']:.2f}",
                              f"{e['difference_s']:.3f}"))
        lines.append("")
    overhead = results.get("overhead")
    if overhead:
        lines += [f"## Per-block call overhead ({overhead['layers']}-layer Llama, {overhead['call']}; one thread, "
                  f"CPU time, median of {overhead['runs']} interleaved calls)", "",
                  f"Original {overhead['original_us']:.0f} us a call; default route "
                  f"{overhead['converted']['us']:.0f} us (+{overhead['converted']['per_block_us']:.1f} us per block, "
                  f"aggregations included); model route {overhead['model_route']['us']:.0f} us "
                  f"(+{overhead['model_route']['per_block_us']:.1f} us per block).", ""]
    threaded = results.get("threads")
    if threaded:
        lines += [f"## Calls from several threads ({threaded['model']}, {threaded['call']}, inference_mode)", "",
                  *_head("threads", "original calls/s", "converted calls/s", "ratio")]
        for count in (1, 4):
            key = f"threads{count}"
            lines.append(_row(count, f"{threaded['original'][key]:.1f}", f"{threaded['converted'][key]:.1f}",
                              f"{threaded['versus_original'][key]:.3f}"))
        lines.append("")
    demo = results.get("demo")
    if demo:
        lines += [f"## The demo's model ({demo['model']}): forward {_cell(demo['forward']['converted'])} against "
                  f"{demo['forward']['original']['median_ms']:.3f} ms", ""]
    return lines


def _head(*columns: str) -> list[str]:
    """A markdown table's header row and its separator."""
    return [_row(*columns), "|" + "---|" * len(columns)]


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _cell(entry: dict) -> str:
    if "rate" in entry:
        return f"{entry['rate']:.1f} tok/s ({entry['ratio']:.3f} / {entry['ratio_min']:.3f})"
    return f"{entry['median_ms']:.2f} ms ({entry['ratio']:.3f} / {entry['ratio_min']:.3f})"


def environment(threads: int) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads": threads, "load_before": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and few runs (seconds)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where bench.json and bench.md go")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="where the op and choices sections run (cpu, cuda)")
    parser.add_argument("--child-memory", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--child-genai", nargs=3, metavar=("FOLDER", "PROMPT", "NEW"), help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=("full", "quick"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--genai-entries", default=None,
                        help=f"subset of the genai section's models ({','.join(GENAI['full']['entries'])})")
    args = parser.parse_args(argv)
    config_name = args.config or ("quick" if args.quick else "full")
    settings = QUICK if config_name == "quick" else FULL
    torch.set_num_threads(args.threads)
    if args.child_memory:
        print(json.dumps(child_memory(settings, *args.child_memory)))
        return None
    if args.child_genai:
        folder, prompt, new_tokens = args.child_genai
        print(json.dumps(child_genai(folder, int(prompt), int(new_tokens))))
        return None
    sections = _subset(args.sections, SECTIONS, "--sections")
    backends = _subset(args.backends, BACKENDS, "--backends")
    results: dict = {"quick": args.quick, "settings": asdict(settings), "environment": environment(args.threads)}
    quick = config_name == "quick"
    runners = {"llama": lambda: routes.llama_section(quick, settings.runs, settings.warmup, summarise, progress),
               "handwritten": lambda: routes.handwritten_section(quick, settings.runs, settings.warmup, summarise,
                                                                 progress),
               "query_sizes": lambda: routes.query_sizes_section(quick, settings.runs, settings.warmup, summarise,
                                                                 progress),
               "startup": lambda: routes.startup_section(quick, progress),
               "load": lambda: routes.load_section(quick, progress),
               "overhead": lambda: routes.overhead_section(quick),
               "threads": lambda: routes.threads_section(quick, progress),
               "demo": lambda: routes.demo_section(settings.runs, settings.warmup, summarise),
               "forward": lambda: forward_section(settings, backends),
               "train": lambda: train_section(settings, backends),
               "first_call": lambda: first_call_section(settings),
               "stages": lambda: stages_section(settings),
               "decode": lambda: decode_section(settings, backends),
               "genai": lambda: genai_section(settings, config_name,
                                              args.genai_entries.split(",") if args.genai_entries else None),
               "memory": lambda: memory_section(settings, config_name),
               "deep_train": lambda: deep_train_section(settings),
               "op": lambda: op_section(settings, torch.device(args.device)),
               "op_train": lambda: op_train_section(settings, torch.device(args.device)),
               "choices": lambda: choices_section(settings, torch.device(args.device))}
    for section in sections:
        if section in ("op", "choices") and "compiled" not in backends:
            continue
        start = time.perf_counter()
        progress(f"{section} ...")
        results[section] = runners[section]()
        progress(f"{section} done in {time.perf_counter() - start:.0f} s")
    results["environment"]["load_after"] = os.getloadavg()
    results["targets"] = targets(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=2))
    report = markdown(settings, results)
    (args.out / "bench.md").write_text(report)
    print(report)
    return results


def _subset(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(allowed))
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {','.join(allowed)}")
    return chosen


if __name__ == "__main__":
    main()
