"""Training comparison: the baseline against Block AttnRes and Full AttnRes, and a trained baseline
converted half-way, on the bytes of the Python standard library's source.

    python benchmarks/compare.py               # the full comparison (about an hour on 2 CPU cores)
    python benchmarks/compare.py --quick       # a tiny model, a few steps: checks that everything runs
    python benchmarks/compare.py --steps 300 --seeds 2 --variants baseline,block4 --out DIR

Experiment 1, from scratch. Every variant of one seed starts from the same initial weights of the
parameters they share (the AttnRes parameters are zero-initialised: uniform depth weights) and sees
the same batches in the same order:

- ``baseline``: the built-in pre-norm Transformer (``attnres_fx.models.TinyTransformer``), deep and narrow;
- ``block4`` / ``block8``: ``attnresify(num_blocks=4)`` / ``(num_blocks=8)``, Block AttnRes;
- ``full``: ``attnresify(block_size=1)``, Full AttnRes.

AdamW (betas 0.9, 0.95) with ``attnres_fx.param_groups``: weight decay on matrices and embeddings, none
on norms and biases, the AttnRes parameters at ``attnres_lr_mult`` times the learning rate without
decay; linear warm-up, cosine decay to ``min_lr_ratio`` of the peak; gradient clipping at 1.

Experiment 2, conversion of a trained model: the baseline's model and optimizer are copied half-way,
converted with ``preserve_scale=True`` (``convert_variant``'s blocks), which must leave the loss where
it was (the validation loss just before and after conversion is reported), then trained for the other
half on the same batches as the baseline, the AttnRes parameters frozen for the first
``freeze_fraction`` of it and warmed up after release. The baseline's own second half is the
"continue the baseline" arm.

Data: byte-level (vocabulary 256) text of a fixed list of standard-library modules, read from the
running interpreter's standard library (every machine has it offline); a few held-out modules are the
validation set. Batches are random windows of ``seq + 1`` bytes, drawn from a generator seeded by
(seed, step); validation windows are evenly spaced over the held-out text.

Runs are spread over ``--workers`` processes (default: one per core, each with one intra-op thread):
on a small CPU two single-threaded runs side by side train faster than one run on two threads. Every
run is timed under the same sharing, so tokens/s compare across variants, not with other machines.

Writes to ``--out`` (default ``benchmarks/results/compare/``): ``compare.json`` (configuration,
environment, every training and validation point of every run, summaries), ``compare.md`` (the report,
also printed), ``curves.png`` (validation loss per variant: mean over seeds, band from min to max),
``conversion.png`` and ``depth_<variant>.png`` (the depth map of each converted model at the end, first
seed). Progress bars (tqdm) go to stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import attnres_fx
from attnres_fx.models import TinyConfig, TinyTransformer
from attnres_fx.text import format_table

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compare"

VARIANTS = {
    "baseline": None,
    "block4": {"num_blocks": 4},
    "block8": {"num_blocks": 8},
    "full": {"block_size": 1},
}
LABELS = {"baseline": "baseline", "block4": "Block AttnRes, N=4", "block8": "Block AttnRes, N=8",
          "full": "Full AttnRes", "converted": "baseline converted half-way"}

# Standard-library modules present, as source, in CPython 3.10 to 3.13 (and in Debian's and Ubuntu's
# split packages: no tkinter, lib2to3, distutils, test). About 5.1 MB of training text.
TRAIN_MODULES = (
    "argparse", "ast", "base64", "bdb", "bisect", "cmd", "code", "codecs", "codeop", "collections",
    "colorsys", "compileall", "concurrent.futures._base", "concurrent.futures.process", "contextlib", "copy",
    "copyreg", "csv", "dataclasses", "datetime", "dis", "doctest", "email.message", "email.utils",
    "email.feedparser", "email._header_value_parser", "email.headerregistry", "enum", "filecmp", "fileinput",
    "fnmatch", "ftplib", "functools", "genericpath", "getopt", "getpass", "gettext", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookiejar", "http.cookies", "http.server",
    "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder", "keyword", "linecache", "locale",
    "logging", "logging.handlers", "logging.config", "lzma", "mimetypes", "modulefinder", "netrc", "ntpath",
    "numbers", "opcode", "operator", "optparse", "os", "pdb", "pickle", "pickletools", "pkgutil", "platform",
    "plistlib", "poplib", "posixpath", "profile", "pstats", "py_compile", "pyclbr", "pydoc", "queue",
    "quopri", "random", "reprlib", "rlcompleter", "runpy", "sched", "secrets", "selectors", "shelve",
    "shutil", "signal", "site", "smtplib", "socket", "socketserver", "ssl", "stat", "statistics", "string",
    "stringprep", "struct", "subprocess", "symtable", "sysconfig", "tabnanny", "tempfile", "threading",
    "timeit", "token", "tokenize", "trace", "traceback", "tracemalloc", "types", "typing", "unittest.case",
    "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "webbrowser",
    "zipapp", "zipfile", "zipimport", "_pydecimal", "_pyio", "_strptime", "asyncio.base_events",
    "asyncio.events", "asyncio.tasks", "asyncio.streams", "asyncio.sslproto", "multiprocessing.connection",
    "multiprocessing.pool", "multiprocessing.managers", "xml.dom.minidom", "xml.etree.ElementTree",
    "xml.sax.expatreader", "xmlrpc.client", "xmlrpc.server", "importlib._bootstrap",
    "importlib._bootstrap_external",
)
# Held out: about 0.45 MB.
VALIDATION_MODULES = ("calendar", "configparser", "difflib", "fractions", "mailbox", "pprint", "shlex",
                      "tarfile", "textwrap")


@dataclass
class Optimiser:
    """AdamW (betas 0.9, 0.95) over ``attnres_fx.param_groups``, its gradients clipped to ``grad_clip``."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    attnres_lr_mult: float = 2.0
    attnres_weight_decay: float = 0.0
    grad_clip: float = 1.0

    def param_groups(self, model: nn.Module) -> list[dict]:
        return attnres_fx.param_groups(model, lr=self.lr, weight_decay=self.weight_decay,
                                       attnres_lr_mult=self.attnres_lr_mult,
                                       attnres_weight_decay=self.attnres_weight_decay)


def _deep_narrow() -> TinyConfig:
    return TinyConfig(vocab_size=256, dim=64, num_layers=24, num_heads=4, max_seq_len=128)


@dataclass
class Config:
    model: TinyConfig = field(default_factory=_deep_narrow)  # its max_seq_len is the windows' length
    batch: int = 16
    steps: int = 400
    warmup: float = 0.05               # fraction of the steps
    min_lr_ratio: float = 0.1
    optimiser: Optimiser = field(default_factory=Optimiser)
    seeds: int = 3
    eval_every: int = 50
    eval_windows: int = 64             # validation windows at every evaluation during training
    final_windows: int = 512           # and at the end
    variants: tuple[str, ...] = tuple(VARIANTS)
    convert_variant: str = "block4"    # "" skips experiment 2
    freeze_fraction: float = 0.1       # of the steps after conversion

    @property
    def seq(self) -> int:
        return self.model.max_seq_len

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup * self.steps))

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


FULL = Config()
QUICK = Config(TinyConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, max_seq_len=16), batch=4, steps=8,
               eval_every=4, eval_windows=4, final_windows=8, seeds=2)


# ------------------------------------------------------------------------------------------------ data
def module_path(stdlib: Path, module: str) -> Path:
    base = stdlib.joinpath(*module.split("."))
    for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"standard-library module {module} has no source under {stdlib}")


class Corpus:
    """The training and validation bytes, and the batches and windows drawn from them."""

    def __init__(self, stdlib: Path | None = None):
        stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
        self.train = self._read(stdlib, TRAIN_MODULES)
        self.validation = self._read(stdlib, VALIDATION_MODULES)

    @staticmethod
    def _read(stdlib: Path, modules: tuple[str, ...]) -> torch.Tensor:
        text = b"\n".join(module_path(stdlib, module).read_bytes() for module in modules)
        return torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def batch(self, seed: int, step: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets of one step: the same for every variant of a seed."""
        generator = torch.Generator().manual_seed(1_000_003 * seed + step)
        starts = torch.randint(0, len(self.train) - cfg.seq - 1, (cfg.batch,), generator=generator)
        windows = torch.stack([self.train[s:s + cfg.seq + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def validation_windows(self, count: int, seq: int) -> torch.Tensor:
        """``count`` windows of ``seq + 1`` bytes evenly spaced over the held-out text."""
        starts = torch.linspace(0, len(self.validation) - seq - 1, count).long()
        return torch.stack([self.validation[s:s + seq + 1] for s in starts.tolist()]).long()

    def describe(self) -> dict:
        return {"train_bytes": len(self.train), "validation_bytes": len(self.validation),
                "train_modules": len(TRAIN_MODULES), "validation_modules": list(VALIDATION_MODULES),
                "python": platform.python_version()}


# -------------------------------------------------------------------------------------------- training
def build(cfg: Config, variant: str, seed: int) -> nn.Module:
    """The seed's initial weights, converted as ``variant`` says (the AttnRes parameters start at zero)."""
    torch.manual_seed(seed)
    model = TinyTransformer(cfg.model).train()
    options = VARIANTS[variant]
    if options is not None:
        example = torch.zeros(1, cfg.seq, dtype=torch.long)
        attnres_fx.attnresify(model, (example,), **options)
    return model


def scheduled(groups: list[dict], start: int) -> list[dict]:
    """Parameter groups that remember their peak rate and the step they start training at."""
    return [{**group, "base_lr": group["lr"], "start": start} for group in groups]


def set_rates(optimizer: torch.optim.Optimizer, step: int, cfg: Config) -> None:
    """Each group: its peak rate, times a linear warm-up from the step it starts training, times the
    cosine decay of the run (flat during the run's warm-up)."""
    warmup = cfg.warmup_steps
    progress = max(0.0, (step - warmup) / max(1, cfg.steps - warmup))
    decay = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    for group in optimizer.param_groups:
        ramp = min(1.0, max(0, step - group["start"] + 1) / warmup)
        group["lr"] = group["base_lr"] * ramp * decay


def optimizer_for(model: nn.Module, cfg: Config, start: int = 0) -> torch.optim.Optimizer:
    groups = cfg.optimiser.param_groups(model)
    return torch.optim.AdamW(scheduled(groups, start), betas=(0.9, 0.95), eps=1e-8)


def loss_of(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1))


def evaluate(model: nn.Module, windows: torch.Tensor, batch: int) -> float:
    """Mean next-byte cross-entropy (nats) over ``windows``, in eval mode, without gradients."""
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for chunk in windows.split(batch):
            total += float(loss_of(model, chunk)) * len(chunk)
    model.train(was_training)
    return total / len(windows)


@dataclass
class Curve:
    """Every point of one run: the training loss of every step, the validation loss every
    ``eval_every`` steps (and at the end), and the seconds spent in the timed training steps (all but
    the first of each :func:`train` call, which includes TorchDynamo's capture of the model)."""

    train_loss: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    train_seconds: float = 0.0
    timed_steps: int = 0

    def tokens_per_second(self, cfg: Config) -> float:
        return self.timed_steps * cfg.tokens_per_step / self.train_seconds if self.train_seconds else math.nan


def train(model: nn.Module, optimizer: torch.optim.Optimizer, corpus: Corpus, cfg: Config, seed: int,
          steps: range, curve: Curve, bar: tqdm, at_step=None) -> None:
    """Train over ``steps`` (global step numbers, for the schedule and the data); ``at_step(step)``
    runs before each step (freezing, snapshots)."""
    eval_windows = corpus.validation_windows(cfg.eval_windows, cfg.seq)
    for step in steps:
        if at_step is not None:
            at_step(step)
        set_rates(optimizer, step, cfg)
        x, y = corpus.batch(seed, step, cfg)
        started = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.optimiser.grad_clip)
        optimizer.step()
        if step != steps.start:
            curve.train_seconds += time.perf_counter() - started
            curve.timed_steps += 1
        curve.train_loss.append(loss.item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == steps.stop:
            curve.validation.append((step + 1, evaluate(model, eval_windows, cfg.batch)))
        bar.update(1)
        bar.set_postfix(loss=f"{curve.train_loss[-1]:.3f}", val=f"{curve.validation[-1][1]:.3f}"
                        if curve.validation else "-", tok_s=f"{curve.tokens_per_second(cfg):.0f}", refresh=False)


def depth_map(model: nn.Module, corpus: Corpus, cfg: Config) -> attnres_fx.DepthWeights:
    """The depth attention of the trained model on validation windows (eval mode)."""
    windows = corpus.validation_windows(min(cfg.final_windows, 4 * cfg.batch), cfg.seq)
    was_training = model.training
    model.eval()
    weights = attnres_fx.depth_weights(model, windows[:, :-1])
    model.train(was_training)
    return weights


def summary_of(curve: Curve, model: nn.Module, corpus: Corpus, cfg: Config) -> dict:
    final = evaluate(model, corpus.validation_windows(cfg.final_windows, cfg.seq), cfg.batch)
    return {"final_validation_loss": final, "train_loss": curve.train_loss,
            "validation": [{"step": step, "loss": loss} for step, loss in curve.validation],
            "tokens_per_second": curve.tokens_per_second(cfg),
            "train_seconds": curve.train_seconds}


def depth_record(model: nn.Module, corpus: Corpus, cfg: Config, out: Path, name: str, plot: bool) -> dict:
    weights = depth_map(model, corpus, cfg)
    if plot:
        weights.plot(out / f"depth_{name}.png", title=f"Depth attention after training: {LABELS[name]} "
                                                      f"({cfg.model.num_layers} layers, d={cfg.model.dim})")
    return {"sites": [row.site.name for row in weights],
            "weights": [[round(float(w), 6) for w in row.weights] for row in weights],
            "entropy": [row.entropy for row in weights], "max_weight": [row.max_weight for row in weights]}


@dataclass(frozen=True)
class Job:
    variant: str
    seed: int
    convert: bool       # the baseline's run that also makes experiment 2's branch


def run_job(cfg: Config, job: Job, out: Path, plot: bool) -> dict:
    """One training run (and, for the baseline, the conversion branch); runs in a worker process."""
    corpus = Corpus()
    model = build(cfg, job.variant, job.seed)
    optimizer = optimizer_for(model, cfg)
    curve = Curve()
    half = cfg.steps // 2
    snapshot = {}

    def keep_half_way(step: int) -> None:
        if job.convert and step == half:
            # Model and optimizer copied together: the copy's optimizer refers to the copy's parameters.
            snapshot["model"], snapshot["optimizer"] = copy.deepcopy((model, optimizer))

    bar = tqdm(total=cfg.steps + (cfg.steps - half if job.convert else 0), position=_slot(), leave=False,
               desc=f"{job.variant} seed {job.seed}", dynamic_ncols=True, mininterval=2.0)
    with bar:
        train(model, optimizer, corpus, cfg, job.seed, range(cfg.steps), curve, bar, keep_half_way)
        result = {"variant": job.variant, "seed": job.seed, **summary_of(curve, model, corpus, cfg),
                  "parameters": sum(p.numel() for p in model.parameters())}
        if job.variant != "baseline":
            result["depth"] = depth_record(model, corpus, cfg, out, job.variant, plot)
        if job.convert:
            result["conversion"] = continue_converted(snapshot["model"], snapshot["optimizer"], corpus, cfg,
                                                      job.seed, bar, out, plot)
    return result


def continue_converted(model: nn.Module, optimizer: torch.optim.Optimizer, corpus: Corpus, cfg: Config,
                       seed: int, bar: tqdm, out: Path, plot: bool) -> dict:
    """Experiment 2: convert the half-trained baseline exactly and train it for the other half."""
    half = cfg.steps // 2
    windows = corpus.validation_windows(cfg.final_windows, cfg.seq)
    before = evaluate(model, windows, cfg.batch)
    attnres_fx.attnresify(model, (windows[:1, :-1],), preserve_scale=True, **VARIANTS[cfg.convert_variant])
    after = evaluate(model, windows, cfg.batch)
    # attnresify converts in place and keeps every original parameter (the same tensors), so the
    # optimizer copied with the model still holds them with their AdamW moments and step counts. The new
    # AttnRes parameters get groups of their own (fresh moments, their own learning rate), starting
    # to train when the freeze ends, with a warm-up of their own from there.
    release = half + round(cfg.freeze_fraction * (cfg.steps - half))
    groups = cfg.optimiser.param_groups(model)
    for group in scheduled([g for g in groups if g["name"].startswith("attnres")], release):
        optimizer.add_param_group(group)
    attnres_fx.freeze(model)

    def release_at(step: int) -> None:
        if step == release:
            attnres_fx.unfreeze(model)

    # The curve starts at the conversion, on the windows of every evaluation during training.
    curve = Curve(validation=[(half, evaluate(model, corpus.validation_windows(cfg.eval_windows, cfg.seq),
                                              cfg.batch))])
    bar.set_description(f"converted seed {seed}")
    train(model, optimizer, corpus, cfg, seed, range(half, cfg.steps), curve, bar, release_at)
    return {"converted_at": half, "released_at": release, "loss_before_conversion": before,
            "loss_after_conversion": after, **summary_of(curve, model, corpus, cfg),
            "depth": depth_record(model, corpus, cfg, out, "converted", plot)}


_WORKER_SLOT = {"slot": 0}


def _slot() -> int:
    return _WORKER_SLOT["slot"]


def _init_worker(threads: int, counter) -> None:
    torch.set_num_threads(threads)
    with counter.get_lock():
        _WORKER_SLOT["slot"] = counter.value
        counter.value += 1


# ----------------------------------------------------------------------------------------------- report
def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(cfg: Config, runs: list[dict]) -> dict:
    """Per variant: final validation loss (mean, std over seeds), its paired difference to the baseline
    of the same seed, the seeds where it is lower, tokens/s."""
    by_variant = {v: sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"]) for v in cfg.variants}
    baseline = {r["seed"]: r["final_validation_loss"] for r in by_variant.get("baseline", [])}
    table = {}
    for variant, rows in by_variant.items():
        losses = [r["final_validation_loss"] for r in rows]
        entry = {"final_validation_loss": mean_std(losses), "tokens_per_second": mean_std(
            [r["tokens_per_second"] for r in rows]), "parameters": rows[0]["parameters"], "seeds": len(rows)}
        paired = [r["final_validation_loss"] - baseline[r["seed"]] for r in rows if r["seed"] in baseline]
        if variant != "baseline" and paired:
            entry["difference_to_baseline"] = mean_std(paired)
            entry["lower_than_baseline"] = sum(d < 0 for d in paired)
        table[variant] = entry
    conversions = [dict(r["conversion"], seed=r["seed"], baseline_final=r["final_validation_loss"])
                   for r in runs if "conversion" in r]
    result = {"variants": table}
    if conversions:
        differences = [c["final_validation_loss"] - c["baseline_final"] for c in conversions]
        result["conversion"] = {
            "final_validation_loss": mean_std([c["final_validation_loss"] for c in conversions]),
            "baseline_final": mean_std([c["baseline_final"] for c in conversions]),
            "difference_to_baseline": mean_std(differences), "lower_than_baseline": sum(d < 0 for d in differences),
            "largest_jump_at_conversion": max(abs(c["loss_after_conversion"] - c["loss_before_conversion"])
                                              for c in conversions)}
    return result


def markdown(cfg: Config, results: dict) -> str:
    summary, env = results["summary"], results["environment"]
    corpus = results["corpus"]

    def pm(pair, digits=3):
        return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"

    shape, opt = cfg.model, cfg.optimiser
    lines = ["# Training comparison: baseline, Block AttnRes, Full AttnRes", "",
             f"TinyTransformer (pre-norm, LayerNorm), {shape.num_layers} layers, d={shape.dim}, {shape.num_heads} "
             f"heads, context {cfg.seq} bytes; {cfg.steps} steps of {cfg.batch} x {cfg.seq} bytes "
             f"({cfg.steps * cfg.tokens_per_step / 1e6:.2f} M tokens per run); AdamW (0.9, 0.95), lr {opt.lr:g}, "
             f"warm-up {cfg.warmup_steps} steps, cosine to {cfg.min_lr_ratio:g}x, weight decay {opt.weight_decay:g} "
             f"(matrices and embeddings), AttnRes parameters at {opt.attnres_lr_mult:g}x the rate with decay "
             f"{opt.attnres_weight_decay:g}, gradient clipping {opt.grad_clip:g}; {cfg.seeds} seed(s).",
             "", f"Data: {corpus['train_bytes'] / 1e6:.2f} MB of Python {corpus['python']} standard-library "
             f"source ({corpus['train_modules']} modules) for training, {corpus['validation_bytes'] / 1e3:.0f} kB "
             f"held out ({', '.join(corpus['validation_modules'])}); final validation loss (nats per byte) "
             f"over {cfg.final_windows} windows.", ""]
    header = ("variant", "final validation loss", "minus baseline (paired)", "lower on seeds", "tokens/s",
              "parameters")
    rows = []
    for variant, entry in summary["variants"].items():
        paired = entry.get("difference_to_baseline")
        rows.append((LABELS[variant], pm(entry["final_validation_loss"]), f"{paired[0]:+.3f} ± {paired[1]:.3f}"
                     if paired else "-", f"{entry['lower_than_baseline']}/{entry['seeds']}" if paired else "-",
                     f"{entry['tokens_per_second'][0]:.0f}", f"{entry['parameters']:,}"))
    lines += [_markdown_table(header, rows), "",
              f"Mean ± standard deviation over seeds. Tokens/s: training steps only, {env['workers']} run(s) at a time "
              f"with {env['threads']} thread(s) each on {env['cpus']} CPU(s) (load average "
              f"{env['load_before'][0]:.1f} before, {env['load_after'][0]:.1f} after).", ""]
    if "conversion" in summary:
        conversion = summary["conversion"]
        lines += [f"## Converting the trained baseline half-way ({LABELS[cfg.convert_variant]}, "
                  "preserve_scale=True)", "",
                  f"Converted after {cfg.steps // 2} steps; AttnRes parameters frozen for "
                  f"{round(cfg.freeze_fraction * (cfg.steps - cfg.steps // 2))} steps, then released with a "
                  "warm-up of their own.", ""]
        rows = [(str(r["seed"]), f"{r['conversion']['loss_before_conversion']:.5f}",
                 f"{r['conversion']['loss_after_conversion']:.5f}", f"{r['final_validation_loss']:.3f}",
                 f"{r['conversion']['final_validation_loss']:.3f}",
                 f"{r['conversion']['final_validation_loss'] - r['final_validation_loss']:+.3f}")
                for r in results["runs"] if "conversion" in r]
        lines += [_markdown_table(("seed", "loss before conversion", "loss after conversion",
                                   "final, baseline continued", "final, converted", "difference"), rows), "",
                  f"Converted: {pm(conversion['final_validation_loss'])}; baseline continued: "
                  f"{pm(conversion['baseline_final'])}; paired difference "
                  f"{conversion['difference_to_baseline'][0]:+.3f} ± {conversion['difference_to_baseline'][1]:.3f} "
                  f"(lower on {conversion['lower_than_baseline']} of {len(rows)} seeds). Largest change of the "
                  f"loss at conversion: {conversion['largest_jump_at_conversion']:.1e}.", ""]
    lines += ["Files: `compare.json` (every point), `curves.png`, "
              + ", ".join(f"`depth_{v}.png`" for v in cfg.variants if v != "baseline")
              + (", `conversion.png`, `depth_converted.png`" if "conversion" in summary else "") + "."]
    return "\n".join(lines) + "\n"


def _markdown_table(header, rows) -> str:
    # format_table's aligned columns, turned into a markdown table.
    text = format_table(header, rows).splitlines()
    widths = [len(cell) for cell in text[1].split("  ")]
    out = []
    for line in [text[0], *text[2:]]:
        cells, position = [], 0
        for width in widths:
            cells.append(line[position:position + width].strip())
            position += width + 2
        out.append("| " + " | ".join(cells) + " |")
    out.insert(1, "| " + " | ".join("---" for _ in widths) + " |")
    return "\n".join(out)


def plot_curves(cfg: Config, results: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    whole, late = figure.subplots(1, 2)
    for variant in cfg.variants:
        runs = [r for r in results["runs"] if r["variant"] == variant]
        _band(whole, late, [r["validation"] for r in runs], LABELS[variant], cfg)
    for ax, title in ((whole, "validation loss"), (late, "second half")):
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats per byte)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.suptitle(f"{cfg.model.num_layers} layers, d={cfg.model.dim}, {cfg.steps} steps: mean over "
                    f"{cfg.seeds} seed(s), band from min to max")
    figure.savefig(out / "curves.png")

    conversions = [r for r in results["runs"] if "conversion" in r]
    if conversions:
        figure = Figure(figsize=(7, 5), dpi=100, layout="constrained")
        FigureCanvasAgg(figure)
        ax = figure.subplots()
        half = cfg.steps // 2
        _band(ax, None, [[p for p in r["validation"] if p["step"] >= half] for r in conversions],
              "baseline continued", cfg)
        _band(ax, None, [r["conversion"]["validation"] for r in conversions], LABELS["converted"], cfg)
        ax.axvline(half, color="grey", linestyle=":", label="conversion")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats per byte)")
        ax.legend()
        ax.grid(alpha=0.3)
        figure.suptitle(f"Converting the trained baseline half-way ({LABELS[cfg.convert_variant]})")
        figure.savefig(out / "conversion.png")


def _band(ax, late_ax, curves: list[list[dict]], label: str, cfg: Config) -> None:
    steps = [p["step"] for p in curves[0]]
    values = [[p["loss"] for p in curve] for curve in curves]
    mean = [statistics.fmean(column) for column in zip(*values)]
    low, high = [min(column) for column in zip(*values)], [max(column) for column in zip(*values)]
    line, = ax.plot(steps, mean, label=label)
    ax.fill_between(steps, low, high, alpha=0.2, color=line.get_color())
    if late_ax is not None:
        keep = [i for i, step in enumerate(steps) if step >= cfg.steps // 2]
        late_ax.plot([steps[i] for i in keep], [mean[i] for i in keep], label=label, color=line.get_color())
        late_ax.fill_between([steps[i] for i in keep], [low[i] for i in keep], [high[i] for i in keep],
                             alpha=0.2, color=line.get_color())


# ------------------------------------------------------------------------------------------------- main
def jobs_of(cfg: Config) -> list[Job]:
    """Every run, the longest first so that the workers finish together: seconds per step measured on
    2 cores with 2 single-threaded runs side by side (24 layers, d=64, 16 x 128 bytes): baseline 0.64
    (plus 0.44 for its conversion branch), Block N=4 0.87, Block N=8 1.14, Full 2.15."""
    cost = {"full": 2.15, "block8": 1.14, "block4": 0.87, "baseline": 1.08 if cfg.convert_variant else 0.64}
    jobs = [Job(variant, seed, variant == "baseline" and bool(cfg.convert_variant))
            for variant in cfg.variants for seed in range(cfg.seeds)]
    return sorted(jobs, key=lambda job: -cost[job.variant])


def run_all(cfg: Config, out: Path, workers: int, threads: int) -> list[dict]:
    jobs = jobs_of(cfg)
    first_seed = {job.variant: min(j.seed for j in jobs if j.variant == job.variant) for job in jobs}
    results = []

    def done(result: dict) -> None:
        results.append(result)
        tqdm.write(f"[compare] {result['variant']} seed {result['seed']}: final validation loss "
                   f"{result['final_validation_loss']:.4f}, {result['tokens_per_second']:.0f} tokens/s",
                   file=sys.stderr)

    if workers == 1:
        torch.set_num_threads(threads)
        for job in jobs:
            done(run_job(cfg, job, out, job.seed == first_seed[job.variant]))
        return results
    context = multiprocessing.get_context("spawn")
    counter = context.Value("i", 0)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                             initargs=(threads, counter)) as pool:
        futures = [pool.submit(run_job, cfg, job, out, job.seed == first_seed[job.variant]) for job in jobs]
        for future in as_completed(futures):
            done(future.result())
    return results


# Command-line flags: where each sets its value in a Config (part of it, field) and its type.
FLAGS = {"layers": ("model", "num_layers", int), "dim": ("model", "dim", int), "heads": ("model", "num_heads", int),
         "seq": ("model", "max_seq_len", int), **{name: ("", name, int) for name in (
             "batch", "steps", "seeds", "eval_every", "eval_windows", "final_windows")},
         **{name: ("optimiser", name, float) for name in (
             "lr", "weight_decay", "attnres_lr_mult", "attnres_weight_decay")},
         **{name: ("", name, float) for name in ("warmup", "min_lr_ratio", "freeze_fraction")}}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (under a minute)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--workers", type=int, default=None, help="parallel runs (default: one per core)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads per run (default: cores "
                        "divided by workers)")
    parser.add_argument("--variants", help=f"subset of {','.join(VARIANTS)}")
    parser.add_argument("--convert-variant", choices=[v for v in VARIANTS if v != "baseline"] + ["none"],
                        help="blocks of experiment 2 (none: skip it)")
    for flag, (_, _, kind) in FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", type=kind)
    args = parser.parse_args(argv)
    cfg = copy.deepcopy(QUICK if args.quick else FULL)
    for flag, (part, name, _) in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(getattr(cfg, part) if part else cfg, name, value)
    if args.variants:
        variants = tuple(args.variants.split(","))
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
        cfg.variants = variants
    if args.convert_variant:
        cfg.convert_variant = "" if args.convert_variant == "none" else args.convert_variant
    if cfg.convert_variant and "baseline" not in cfg.variants:
        cfg.convert_variant = ""
    return args, cfg


def main(argv: list[str] | None = None) -> dict:
    args, cfg = parse_args(argv)
    cpus = os.cpu_count() or 1
    jobs = len(jobs_of(cfg))
    workers = max(1, min(args.workers or cpus, jobs))
    threads = args.threads or max(1, cpus // workers)
    args.out.mkdir(parents=True, exist_ok=True)
    environment = {"torch": torch.__version__, "python": platform.python_version(), "cpus": cpus,
                   "workers": workers, "threads": threads, "load_before": os.getloadavg()}
    started = time.perf_counter()
    runs = run_all(cfg, args.out, workers, threads)
    environment.update(load_after=os.getloadavg(), wall_seconds=time.perf_counter() - started)
    runs.sort(key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"]))
    results = {"quick": args.quick, "config": asdict(cfg), "environment": environment,
               "corpus": Corpus().describe(), "runs": runs}
    results["summary"] = summarise(cfg, runs)
    (args.out / "compare.json").write_text(json.dumps(results, indent=1))
    plot_curves(cfg, results, args.out)
    report = markdown(cfg, results)
    (args.out / "compare.md").write_text(report)
    print(report)
    return results


if __name__ == "__main__":
    main()
