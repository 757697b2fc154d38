"""Cost of the rewrite on TinyTransformer: latency, training step, peak memory, and the op's bandwidth.

    python benchmarks/bench.py                 # d=512, 12 layers, 8 heads, batch 4, seq 256, fp32, N=8
    python benchmarks/bench.py --quick         # tiny model, few runs: checks that every path works
    python benchmarks/bench.py --out DIR --sections forward,op --backends eager,compiled

Variants: ``original`` (the model itself), ``block`` (``attnresify(num_blocks=8)``, per-site form),
``block_two_phase`` (``block`` after ``apply_two_phase``), ``full`` (``block_size=1``, Full AttnRes)
and ``full_two_phase``. Every model has its own weights (the rewrite of a deep copy of the original).

Sections (all timings: ``--runs`` timed runs after warm-up, variants interleaved in one process, the
order reversed every other round, so that drift and neighbours hit all alike; medians, and minima):

1. ``forward``: inference latency of every variant, as a ratio to ``original``, for eager PyTorch,
   Inductor (``attnres_fx.export.compile``, fullgraph) and onnxruntime on CPU (``export.to_onnx``).
2. ``train``: one training step (forward, cross-entropy, backward, AdamW) of ``block`` against
   ``original``, eager and compiled.
3. ``memory``: peak resident memory of a forward (no grad) and of a training step, each variant in a
   fresh subprocess: the high-water mark of the resident set during the work minus the resident set
   before it, with glibc's default malloc and with a fixed mmap threshold (live tensors only). The
   budget for the rewrite is the N + 1 stream tensors (completed blocks and partial) it keeps alive.
4. ``op``: one compiled BlockAttnRes against the bandwidth bound, a compiled streaming sum of the same
   sources (each read once, one output written): ``bound_ms / op_ms``. Also the sites of one block
   (S queries over N completed blocks) per site against two-phase, and Full AttnRes's widest site.

Writes ``bench.json`` and ``bench.md`` to ``--out`` (default ``benchmarks/results/``) and prints the
latter; progress goes to stderr. The load average is recorded: other processes on the machine stretch
timings (each parallel region waits for every thread), so compare ratios, not absolute times; the
minima are the least disturbed runs.
"""

from __future__ import annotations

import argparse
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import attnres_fx
from attnres_fx.models import TinyConfig, TinyTransformer, example_ids
from attnres_fx.passes.two_phase import apply_two_phase, phase1, phase2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import traffic  # noqa: E402 - the memory-traffic model beside this script

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SECTIONS = ("forward", "train", "memory", "op")
BACKENDS = ("eager", "compiled", "onnx")
VARIANTS = ("original", "block", "block_two_phase", "full", "full_two_phase")
TRAIN_VARIANTS = ("original", "block")
MEMORY_RUNS = (("original", "inference"), ("block", "inference"), ("block_two_phase", "inference"),
               ("original", "train"), ("block", "train"))
# glibc malloc raises its mmap threshold after freeing a large block, after which big tensors come from
# the heap and their pages stay resident when freed: the resident set then also measures fragmentation.
# A fixed 64 KiB threshold maps and unmaps every tensor, so the resident set follows the live tensors.
ALLOCATORS = {"glibc_default": {}, "mmap_64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
TARGETS = {"compiled_forward_overhead": 0.03, "compiled_train_overhead": 0.08, "op_bandwidth_fraction": 0.70}


@dataclass
class Config:
    dim: int
    layers: int
    heads: int
    batch: int
    seq: int
    num_blocks: int
    runs: int
    warmup: int
    op_runs: int
    op_sources: tuple[int, ...]

    @property
    def sites(self) -> int:
        return 2 * self.layers

    @property
    def block_size(self) -> int:
        return -(-self.sites // self.num_blocks)

    @property
    def blocks(self) -> int:
        """Completed sources the widest site reads (the embedding included): N."""
        return -(-self.sites // self.block_size)

    @property
    def stream_bytes(self) -> int:
        return self.batch * self.seq * self.dim * 4

    def model_config(self) -> TinyConfig:
        return TinyConfig(dim=self.dim, num_layers=self.layers, num_heads=self.heads, max_seq_len=self.seq)


FULL = Config(dim=512, layers=12, heads=8, batch=4, seq=256, num_blocks=8, runs=20, warmup=3, op_runs=200,
              op_sources=(2, 5, 9))
QUICK = Config(dim=64, layers=2, heads=2, batch=2, seq=16, num_blocks=8, runs=3, warmup=1, op_runs=5,
               op_sources=(2, 3))


# --------------------------------------------------------------------------------------------- models
def build(cfg: Config, variant: str) -> nn.Module:
    """One variant, with its own copy of the (seeded) original weights, in eval mode."""
    torch.manual_seed(0)
    original = TinyTransformer(cfg.model_config()).eval()
    if variant == "original":
        return original
    example = example_ids(cfg.model_config(), batch=cfg.batch, seq=cfg.seq)
    options = {"block_size": 1} if variant.startswith("full") else {"num_blocks": cfg.num_blocks}
    converted = attnres_fx.attnresify(original, (example,), **options)
    # The two-phase schedule applies to explicit graphs (the ONNX export and export.compile use it).
    return apply_two_phase(attnres_fx.rewrite(converted, (example,))) if variant.endswith("two_phase") \
        else converted


def inputs(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    mcfg = cfg.model_config()
    return example_ids(mcfg, cfg.batch, cfg.seq), example_ids(mcfg, cfg.batch, cfg.seq, seed=1)


def compiler() -> Callable[[nn.Module], nn.Module]:
    """Inductor, fullgraph: ``attnres_fx.compile`` for a converted model (its routes use Inductor), the
    hand-off's ``export.compile`` for an explicit graph, ``torch.compile`` for the original."""
    from attnres_fx.export import compile as export_compile

    def compile_(model: nn.Module) -> nn.Module:
        if attnres_fx.is_converted(model) or isinstance(model, torch.fx.GraphModule):
            return export_compile(model)
        return torch.compile(model, backend="inductor", fullgraph=True)
    return compile_


# --------------------------------------------------------------------------------------------- timing
def interleaved(fns: dict[str, Callable[[], object]], runs: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each function, timed round-robin (order reversed every other round)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(runs):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def summarise(times: dict[str, list[float]], reference: str) -> dict[str, dict]:
    """Median and minimum per function, and their ratios to ``reference``'s.

    The minimum is the least disturbed run: on a shared machine it tracks the code's own cost when
    other processes stretch the median.
    """
    base, base_min = statistics.median(times[reference]), min(times[reference])
    return {name: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "runs": len(t),
                   "ratio": statistics.median(t) / base, "ratio_min": min(t) / base_min}
            for name, t in times.items()}


# ------------------------------------------------------------------------------------------- sections
def forward_section(cfg: Config, backends: list[str]) -> dict:
    ids, _ = inputs(cfg)
    models = {variant: build(cfg, variant) for variant in VARIANTS}
    result = {}
    with torch.no_grad():
        if "eager" in backends:
            result["eager"] = summarise(interleaved(
                {v: functools.partial(m, ids) for v, m in models.items()}, cfg.runs, cfg.warmup), "original")
        if "compiled" in backends:
            compile_ = compiler()
            compiled = {v: compile_(m) for v, m in models.items()}
            result["compiled"] = summarise(interleaved(
                {v: functools.partial(m, ids) for v, m in compiled.items()}, cfg.runs, cfg.warmup), "original")
            torch._dynamo.reset()
    if "onnx" in backends:
        result["onnx"] = summarise(interleaved(onnx_runners(models, ids), cfg.runs, cfg.warmup), "original")
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


def train_section(cfg: Config, backends: list[str]) -> dict:
    ids, targets = inputs(cfg)
    result = {}
    for backend in (b for b in ("eager", "compiled") if b in backends):
        steps = {variant: train_step(build(cfg, variant).train(), ids, targets, backend == "compiled")
                 for variant in TRAIN_VARIANTS}
        result[backend] = summarise(interleaved(steps, cfg.runs, cfg.warmup), "original")
        torch._dynamo.reset()
    return result


def train_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
               compiled: bool) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = compiler()(model) if compiled else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = forward(ids)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
    return step


def memory_section(cfg: Config, config_name: str) -> dict:
    """Each (variant, mode) in a fresh process, under each allocator setting of ``ALLOCATORS``."""
    result: dict = {"budget_mb": (cfg.blocks + 1) * cfg.stream_bytes / 1e6}
    for allocator, env in ALLOCATORS.items():
        runs: dict = {}
        for variant, mode in MEMORY_RUNS:
            command = [sys.executable, __file__, "--child-memory", variant, mode, "--config", config_name]
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, **env})
            runs.setdefault(mode, {})[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        for by_variant in runs.values():
            base = by_variant["original"]["peak_delta_mb"]
            for entry in by_variant.values():
                entry["ratio"] = entry["peak_delta_mb"] / base if base > 0 else None
                entry["extra_mb"] = entry["peak_delta_mb"] - base
        result[allocator] = runs
    return result


def child_memory(cfg: Config, variant: str, mode: str) -> dict:
    """Runs in a fresh process: peak resident set of the work minus the resident set before it.

    A warm-up on a tiny batch first initialises the libraries (thread pools, kernels) and, for
    training, AdamW's state, so that the difference is the activations' memory. The peak is the
    kernel's high-water mark (``VmHWM``), reset after the warm-up; ``ru_maxrss`` cannot serve, as a
    child inherits its parent's value across fork and exec.
    """
    model = build(cfg, variant)
    ids, targets = inputs(cfg)
    tiny_ids, tiny_targets = ids[:1, :4], targets[:1, :4]
    if mode == "train":
        model.train()
        train_step(model, tiny_ids, tiny_targets, compiled=False)()
        step = train_step(model, ids, targets, compiled=False)
    else:
        with torch.no_grad():
            model(tiny_ids)
    gc.collect()
    reset_peak()
    before = status_bytes("VmRSS")
    if mode == "train":
        for _ in range(2):
            step()
    else:
        with torch.no_grad():
            for _ in range(2):
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


def op_section(cfg: Config) -> dict:
    shape = (cfg.batch, cfg.seq, cfg.dim)
    torch.manual_seed(0)
    result: dict = {"block_op": {}}
    with torch.no_grad():
        for count in cfg.op_sources:
            result["block_op"][str(count)] = op_against_bound(cfg, shape, count)
        # Full AttnRes's last site reads the embedding and every sublayer output.
        result["full_widest_site"] = op_against_bound(cfg, shape, cfg.sites + 1)
        result["block_group"] = group_against_bound(cfg, shape)
    torch._dynamo.reset()
    return result


def _random_site(dim: int) -> attnres_fx.BlockAttnRes:
    module = attnres_fx.BlockAttnRes(dim)
    nn.init.normal_(module.proj.weight, std=0.5)
    nn.init.uniform_(module.norm.weight, 0.5, 1.5)
    return module


def op_against_bound(cfg: Config, shape: tuple[int, ...], count: int) -> dict:
    sources = [torch.randn(shape) for _ in range(count)]
    op = torch.compile(_random_site(shape[-1]), fullgraph=True)
    bound = torch.compile(lambda *xs: functools.reduce(torch.add, xs), fullgraph=True)
    times = summarise(interleaved({"op": functools.partial(op, *sources),
                                   "bound": functools.partial(bound, *sources)}, cfg.op_runs, cfg.warmup), "op")
    return {"sources": count, "op_ms": times["op"]["median_ms"], "bound_ms": times["bound"]["median_ms"],
            "fraction": times["bound"]["ratio"], "op_min_ms": times["op"]["min_ms"],
            "bound_min_ms": times["bound"]["min_ms"], "fraction_min": times["bound"]["ratio_min"],
            "bytes_moved_mb": (count + 1) * cfg.stream_bytes / 1e6}


def group_against_bound(cfg: Config, shape: tuple[int, ...]) -> dict:
    """The S sites that share N completed blocks: per-site aggregations against phase 1 + S phase 2."""
    blocks = tuple(torch.randn(shape) for _ in range(cfg.blocks))
    partials = tuple(torch.randn(shape) for _ in range(cfg.block_size))
    sites = [_random_site(shape[-1]) for _ in partials]
    projs = tuple(s.proj.weight for s in sites)
    norms = tuple(s.norm.weight for s in sites)
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

    fns = {name: functools.partial(torch.compile(fn, fullgraph=True), blocks, partials)
           for name, fn in (("per_site", per_site), ("two_phase", two_phase), ("bound", bound))}
    times = interleaved(fns, cfg.op_runs, cfg.warmup)
    result = {"completed_blocks": len(blocks), "sites": len(partials)}
    for name, stat in (("", statistics.median), ("_min", min)):
        ms = {k: 1e3 * stat(v) for k, v in times.items()}
        result.update({f"per_site{name}_ms": ms["per_site"], f"two_phase{name}_ms": ms["two_phase"],
                       f"bound{name}_ms": ms["bound"], f"per_site_fraction{name}": ms["bound"] / ms["per_site"],
                       f"two_phase_fraction{name}": ms["bound"] / ms["two_phase"]})
    return result


# -------------------------------------------------------------------------------------------- report
def targets(cfg: Config, results: dict) -> dict:
    """Each target, judged on the medians (``met``) and on the minima (``met_min``)."""
    checks = {}   # name -> (value from medians, value from minima, bound, "<=" or ">=")
    for key, section, label in (("compiled_forward_overhead", "forward", "compiled forward overhead"),
                                ("compiled_train_overhead", "train", "compiled training-step overhead")):
        compiled = results.get(section, {}).get("compiled")
        if compiled:
            entry = compiled["block"]
            checks[f"{label} (block / original - 1)"] = (entry["ratio"] - 1, entry["ratio_min"] - 1,
                                                         TARGETS[key], "<=")
    for count, entry in results.get("op", {}).get("block_op", {}).items():
        checks[f"op at {count} sources: bound / op"] = (entry["fraction"], entry["fraction_min"],
                                                        TARGETS["op_bandwidth_fraction"], ">=")
    memory = results.get("memory")
    if memory:
        for allocator in ALLOCATORS:
            extra = memory[allocator]["inference"]["block"]["extra_mb"]
            checks[f"inference peak memory over original, MB ({allocator}; bound: N+1 streams)"] = (
                extra, extra, memory["budget_mb"], "<=")

    def met(value, bound, sense):
        return value <= bound if sense == "<=" else value >= bound

    return {name: {"value": value, "value_min": value_min, "target": f"{sense} {bound:.3g}",
                   "met": met(value, bound, sense), "met_min": met(value_min, bound, sense)}
            for name, (value, value_min, bound, sense) in checks.items()}


def markdown(cfg: Config, results: dict) -> str:
    env = results["environment"]
    lines = [f"# attnres_fx benchmark{' (--quick)' if results['quick'] else ''}", "",
             f"TinyTransformer d={cfg.dim}, {cfg.layers} layers ({cfg.sites} sites), {cfg.heads} heads, "
             f"batch {cfg.batch}, seq {cfg.seq}, fp32, num_blocks={cfg.num_blocks} (block size "
             f"{cfg.block_size}). torch {env['torch']}, {env['threads']} threads, load average "
             f"{env['load_before'][0]:.2f} before / {env['load_after'][0]:.2f} after. {cfg.runs} interleaved "
             "runs per cell: median (ratio of medians to original) / min (ratio of minima).", ""]
    for title, key in (("Forward latency", "forward"), ("Training step (forward, backward, AdamW)", "train")):
        section = results.get(key)
        if not section:
            continue
        variants = list(next(iter(section.values())))
        lines += [f"## {title}", "", "| backend | " + " | ".join(variants) + " |",
                  "|---|" + "---|" * len(variants)]
        for backend, rows in section.items():
            lines.append(f"| {backend} | " + " | ".join(
                f"{r['median_ms']:.1f} ms ({r['ratio']:.3f}x) / {r['min_ms']:.1f} ms ({r['ratio_min']:.3f}x)"
                for r in rows.values()) + " |")
        lines.append("")
    memory = results.get("memory")
    if memory:
        lines += ["## Peak memory (fresh process each; high-water resident set minus resident set before)", "",
                  "| mode | variant | " + " | ".join(f"{a}: peak delta, MB (ratio, extra)" for a in ALLOCATORS)
                  + " |", "|---|---|" + "---|" * len(ALLOCATORS)]
        for variant, mode in MEMORY_RUNS:
            cells = []
            for allocator in ALLOCATORS:
                entry = memory[allocator][mode][variant]
                ratio = "-" if entry["ratio"] is None else f"{entry['ratio']:.3f}x"
                cells.append(f"{entry['peak_delta_mb']:.1f} ({ratio}, {entry['extra_mb']:+.1f})")
            lines.append(f"| {mode} | {variant} | " + " | ".join(cells) + " |")
        lines += ["", f"Budget for the rewrite: N+1 = {cfg.blocks + 1} stream tensors = "
                  f"{memory['budget_mb']:.1f} MB. ``mmap_64k``: MALLOC_MMAP_THRESHOLD_=65536, so that the "
                  "resident set follows the live tensors; ``glibc_default`` adds heap fragmentation.", ""]
    op = results.get("op")
    if op:
        lines += ["## Compiled op against the bandwidth bound (bound = streaming sum of the same inputs)", "",
                  "| case | op ms (median / min) | bound ms (median / min) | bound / op (median / min) |",
                  "|---|---|---|---|"]
        cases = [(f"BlockAttnRes, {e['sources']} sources", e) for e in op["block_op"].values()]
        cases.append((f"Full AttnRes widest site, {op['full_widest_site']['sources']} sources",
                      op["full_widest_site"]))
        for label, e in cases:
            lines.append(f"| {label} | {e['op_ms']:.3f} / {e['op_min_ms']:.3f} | {e['bound_ms']:.3f} / "
                         f"{e['bound_min_ms']:.3f} | {e['fraction']:.2f} / {e['fraction_min']:.2f} |")
        g = op["block_group"]
        for form in ("per_site", "two_phase"):
            lines.append(f"| one block: {g['sites']} sites over {g['completed_blocks']} blocks, "
                         f"{form.replace('_', '-')} | {g[form + '_ms']:.3f} / {g[form + '_min_ms']:.3f} | "
                         f"{g['bound_ms']:.3f} / {g['bound_min_ms']:.3f} | {g[form + '_fraction']:.2f} / "
                         f"{g[form + '_fraction_min']:.2f} |")
        lines.append("")
    lines += ["## Memory-traffic model (attnres_fx.traffic; per token, units of d)", "",
              traffic.format_table(traffic.traffic(cfg.sites, block_size=cfg.block_size),
                                   tokens=cfg.batch * cfg.seq, dim=cfg.dim), ""]
    if results["targets"]:
        lines += ["## Targets", "", "| check | median | min | target | met (median / min) |",
                  "|---|---|---|---|---|"]
        for name, e in results["targets"].items():
            lines.append(f"| {name} | {e['value']:.3f} | {e['value_min']:.3f} | {e['target']} | "
                         f"{'yes' if e['met'] else 'no'} / {'yes' if e['met_min'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)


def environment(threads: int) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads": threads, "load_before": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and few runs (seconds)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where bench.json and bench.md go")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--child-memory", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=("full", "quick"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config_name = args.config or ("quick" if args.quick else "full")
    cfg = replace(QUICK if config_name == "quick" else FULL)
    if args.runs is not None:
        cfg.runs = args.runs
    torch.set_num_threads(args.threads)
    if args.child_memory:
        print(json.dumps(child_memory(cfg, *args.child_memory)))
        return None
    sections = _subset(args.sections, SECTIONS, "--sections")
    backends = _subset(args.backends, BACKENDS, "--backends")
    results: dict = {"quick": args.quick, "config": asdict(cfg), "environment": environment(args.threads)}
    runners = {"forward": lambda: forward_section(cfg, backends), "train": lambda: train_section(cfg, backends),
               "memory": lambda: memory_section(cfg, config_name), "op": lambda: op_section(cfg)}
    for section in sections:
        if section == "op" and "compiled" not in backends:
            continue
        start = time.perf_counter()
        print(f"[bench] {section} ...", file=sys.stderr, flush=True)
        results[section] = runners[section]()
        print(f"[bench] {section} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    results["environment"]["load_after"] = os.getloadavg()
    results["traffic"] = [asdict(row) for row in traffic.traffic(cfg.sites, block_size=cfg.block_size)]
    results["targets"] = targets(cfg, results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=2))
    report = markdown(cfg, results)
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
