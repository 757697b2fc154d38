"""The GPU check: what attnres_fx does on a CUDA machine, in one run, written to one report (markdown).

    python benchmarks/gpu_check.py --out docs/gpu.md          # on a CUDA machine (<= 8 minutes on an H200)
    python benchmarks/gpu_check.py --dry-run --out report.md  # anywhere: the same steps at tiny sizes on the CPU

Steps, each reported as passed / FAILED / skipped with its figures:

1. ``kernels``: the Triton kernels (forward and backward), fp32, bf16 and fp16, against a float64
   restatement of the aggregation, for 2 to 9 sources and ``[B, T, D]`` up to ``[8, 4096, 4096]``.
2. ``compile``: ``attnres_fx.compile`` of a converted transformers Llama (Inductor) equal to eager, and one
   bf16 autocast training step equal to the eager one within bf16 tolerance.
3. ``op timings``: the project's kernel, a compiled torch restatement and the peers' GPU kernels where their
   packages are importable (flash-linear-attention, liger-kernel), forward and forward+backward, with the
   achieved GB/s against a same-bytes device copy timed in the same run.
4. ``model timings``: a converted Llama's forward, training step and greedy decode against the original's,
   interleaved in one process, medians.

Without CUDA every GPU step reports "skipped: no CUDA". ``--dry-run`` runs each step at tiny sizes on the
CPU instead (the Triton kernels under ``TRITON_INTERPRET=1``, which must be set before Triton is imported;
bf16 is skipped there: the interpreter's bf16 arithmetic is wrong), so the script is exercised by the test
suite and cannot rot. The exit status is 1 when any step failed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import attnres_fx
from attnres_fx.op import aggregation
from attnres_fx import timing
from attnres_fx.models import build_hf
from attnres_fx.testing import randomise_pseudo_queries

# Error bounds against the float64 restatement, relative to the largest magnitude of the reference: fp32
# accumulates rounding over D terms; bf16 (8 mantissa bits) and fp16 (11) round each stored value once.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each step runs on: the CUDA sizes, or the dry run's tiny ones."""
    kernel_shapes: tuple[tuple[tuple[int, int, int], tuple[int, ...]], ...]   # ([B, T, D], source counts)
    llama: dict
    batch: int
    seq: int
    decode_tokens: int
    op_shape: tuple[int, int, int]
    op_sources: int
    runs: int


CUDA_SIZES = Sizes(
    kernel_shapes=(((1, 1, 64), (2, 3, 5, 9)), ((2, 128, 512), (2, 3, 5, 9)), ((4, 1024, 2048), (2, 9)),
                   ((8, 4096, 4096), (2, 9))),
    llama=dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
               num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048),
    batch=8, seq=512, decode_tokens=32, op_shape=(8, 4096, 4096), op_sources=9, runs=20)

DRY_SIZES = Sizes(
    kernel_shapes=(((1, 1, 32), (2, 3)), ((2, 8, 64), (2, 9))),
    llama=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=128),
    batch=2, seq=8, decode_tokens=2, op_shape=(2, 8, 64), op_sources=3, runs=2)


@dataclasses.dataclass
class Step:
    name: str
    status: str = "passed"                  # passed | FAILED | skipped: why
    lines: list[str] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------------------ restatement
def reference(sources, proj_weight, norm_weight, grad, eps: float):
    """The aggregation in float64 (the method's formula, :func:`attnres_fx.op.aggregation.fusable`) and, for the
    upstream gradient ``grad``, the gradients of the sources and of the folded query ``proj * norm`` (what
    the kernels return: ``d/dq = d/dproj / norm`` by the chain rule)."""
    leaves = [s.detach().double().requires_grad_() for s in sources]
    proj = proj_weight.detach().double().requires_grad_()
    norm = norm_weight.detach().double()
    out = aggregation.fusable(proj, norm, leaves, eps=eps, preserve_scale=False)
    out.backward(grad.double())
    return out.detach(), [leaf.grad for leaf in leaves], proj.grad.reshape(-1) / norm


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------- steps
def kernel_step(device: torch.device, sizes: Sizes, dry_run: bool) -> Step:
    step = Step("kernels: Triton forward and backward against float64")
    from attnres_fx.op.kernels import gpu

    dtypes = (torch.float32, torch.float16) if dry_run else (torch.float32, torch.bfloat16, torch.float16)
    if dry_run:
        step.lines.append("bf16 skipped: Triton's CPU interpreter computes bf16 wrongly")
    step.lines.append("Errors relative to the float64 result's largest magnitude; in brackets PyTorch's own formula in "
                      "the same dtype. A case passes within the bound or within twice PyTorch's error.")
    step.lines.append("| shape | sources | dtype | forward error | source-grad error | query-grad error | bound |")
    step.lines.append("|---|---|---|---|---|---|---|")
    generator = torch.Generator(device=device).manual_seed(0)
    worst_ok = True
    for shape, counts in sizes.kernel_shapes:
        for count in counts:
            for dtype in dtypes:
                if not dry_run and shape == sizes.kernel_shapes[-1][0] and dtype == torch.float16:
                    continue  # the largest shape in fp32 and bf16 only: its float64 restatement dominates the time
                sources = [torch.randn(shape, device=device, dtype=torch.float32, generator=generator).to(dtype)
                           for _ in range(count)]
                # Pseudo-queries of std 0.5: depth logits of a few units, a softmax that is not saturated (a
                # saturated one has gradients near zero, whose relative error any fp32 order loses).
                proj = torch.randn(1, shape[-1], device=device, generator=generator) * 0.5
                norm = torch.rand(shape[-1], device=device, generator=generator) + 0.5
                grad = torch.randn(shape, device=device, generator=generator).to(dtype)
                want_out, want_grads, want_query = reference(sources, proj, norm, grad, 1e-6)
                out = gpu.aggregate(sources, proj, norm, 1e-6, False)
                grads, grad_query = gpu.aggregate_backward(grad, sources, proj, norm, 1e-6, False)
                errors = (relative_error(out, want_out),
                          max(relative_error(g, w) for g, w in zip(grads, want_grads)),
                          relative_error(grad_query, want_query))
                # PyTorch's own formula in the same dtype: where the gradient nearly cancels (a saturated
                # softmax), any evaluation order loses digits; the kernel must be no worse than it.
                leaves = [s.detach().clone().requires_grad_() for s in sources]
                proj_leaf = proj.detach().clone().requires_grad_()
                torch_out = aggregation.fusable(proj_leaf, norm, leaves, eps=1e-6, preserve_scale=False)
                torch_out.backward(grad.to(torch_out.dtype))
                torch_errors = (relative_error(torch_out, want_out),
                                max(relative_error(leaf.grad, w) for leaf, w in zip(leaves, want_grads)),
                                relative_error(proj_leaf.grad.reshape(-1) / norm, want_query))
                bound = TOLERANCE[dtype]
                ok = all(e <= max(bound, 2 * t) for e, t in zip(errors, torch_errors))
                worst_ok &= ok
                cells = " | ".join(f"{e:.1e} ({t:.1e})" for e, t in zip(errors, torch_errors))
                step.lines.append(f"| {list(shape)} | {count} | {DTYPE_NAMES[dtype]} | {cells} | "
                                  f"{bound:.0e}{'' if ok else ' EXCEEDED'} |")
                del leaves, proj_leaf, torch_out
                del sources, grads, out, want_out, want_grads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step.status = "passed" if worst_ok else "FAILED"
    return step


def _llama(sizes: Sizes, device: torch.device):
    base = build_hf("llama", **sizes.llama).to(device)
    converted = randomise_pseudo_queries(attnres_fx.attnresify(copy.deepcopy(base), num_blocks=4), std=0.1)
    return base, converted.to(device)


def _ids(sizes: Sizes, device: torch.device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, sizes.llama["vocab_size"], (sizes.batch, sizes.seq), generator=generator).to(device)


def compile_step(device: torch.device, sizes: Sizes) -> Step:
    step = Step("compile: attnres_fx.compile (Inductor) of a converted Llama against eager")
    _, model = _llama(sizes, device)
    ids, targets = _ids(sizes, device), _ids(sizes, device, seed=1)
    with torch.no_grad():
        eager = model(ids).logits
    compiled = attnres_fx.compile(copy.deepcopy(model))
    with torch.no_grad():
        got = compiled(ids).logits
    forward_error = relative_error(got, eager.double())
    # Inductor reorders and fuses fp32 arithmetic; 1e-4 of the largest logit is rounding, not a formula change.
    ok = forward_error <= 1e-4
    step.lines.append(f"- fp32 forward: max error {forward_error:.1e} of the largest logit (bound 1e-4)")

    def train_step(forward, weights):
        weights.zero_grad(set_to_none=True)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
        with autocast:
            loss = F.cross_entropy(forward(ids).logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        return float(loss), {n: p.grad.detach().clone() for n, p in weights.named_parameters() if p.grad is not None}

    eager_model = copy.deepcopy(model).train()
    compiled_model = attnres_fx.compile(copy.deepcopy(model).train())
    eager_loss, eager_grads = train_step(eager_model, eager_model)
    compiled_loss, compiled_grads = train_step(compiled_model, compiled_model)
    loss_error = abs(eager_loss - compiled_loss) / abs(eager_loss)
    grad_errors = {n: relative_error(compiled_grads[n], g.double())
                   for n, g in eager_grads.items() if n in compiled_grads}
    worst = max(grad_errors, key=grad_errors.get)
    # bf16 keeps 8 bits of mantissa: two orders of evaluation differ by a few of its ulps (2^-8 = 3.9e-3).
    ok &= loss_error <= 1e-2 and grad_errors[worst] <= 5e-2 and len(compiled_grads) == len(eager_grads)
    step.lines.append(f"- bf16 autocast training step: loss {eager_loss:.5f} eager, {compiled_loss:.5f} compiled "
                      f"(relative {loss_error:.1e}, bound 1e-2); gradients of {len(compiled_grads)} of "
                      f"{len(eager_grads)} parameters, worst {worst} at {grad_errors[worst]:.1e} (bound 5e-2)")
    step.status = "passed" if ok else "FAILED"
    return step


def _peer_ops() -> dict[str, Callable]:
    """The peers' AttnRes aggregation kernels importable here, by package: each as
    ``op(sources, query [D], norm weight [D], eps)``, the same formula as ``attnres::aggregate`` (key RMSNorm,
    logit ``q . k``, softmax over sources, weighted sum of the raw sources)."""
    peers: dict[str, Callable] = {}
    try:  # flash-linear-attention (fla-core): fused_attnres(query, residuals, rms_weight, rms_eps=...)
        from fla.ops.attnres import fused_attnres
    except ImportError:
        pass
    else:
        peers["flash-linear-attention"] = lambda sources, query, norm, eps: fused_attnres(
            query, list(sources), norm, rms_eps=eps)
    try:  # liger-kernel: liger_attn_res(V [N, B, T, D], w_query, w_norm, eps)
        from liger_kernel.transformers.functional import liger_attn_res
    except ImportError:
        pass
    else:
        peers["liger-kernel"] = lambda sources, query, norm, eps: liger_attn_res(torch.stack(sources), query, norm, eps)
    return peers


def op_timing_step(device: torch.device, sizes: Sizes) -> Step:
    step = Step("op timings: kernel, compiled restatement, peers, against a same-bytes copy")
    shape, count = sizes.op_shape, sizes.op_sources
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sources = [torch.randn(shape, device=device, dtype=dtype) for _ in range(count)]
    proj = torch.randn(1, shape[-1], device=device) * 0.1
    norm = torch.ones(shape[-1], device=device)
    grad = torch.randn(shape, device=device, dtype=dtype)
    element = sources[0].element_size()
    forward_bytes = (count + 1) * sources[0].numel() * element          # read every source, write the result
    backward_bytes = (2 * count + 2) * sources[0].numel() * element     # forward, then read again, write grads
    copy_source = torch.empty(forward_bytes // 2, dtype=torch.uint8, device=device)

    restated = torch.compile(lambda p, n, *s: aggregation.fusable(p, n, list(s), eps=1e-6, preserve_scale=False),
                             backend="inductor", fullgraph=True)
    forwards: dict[str, Callable] = {
        "copy": lambda: copy_source.clone(),
        "attnres_fx kernel": lambda: torch.ops.attnres.aggregate(sources, proj, norm, 1e-6, False),
        "compiled restatement": lambda: restated(proj, norm, *sources),
    }
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    trained = {
        "attnres_fx kernel": lambda: torch.ops.attnres.aggregate(leaves, proj, norm, 1e-6, False).backward(grad),
        "compiled restatement": lambda: restated(proj, norm, *leaves).backward(grad),
    }
    ours = torch.ops.attnres.aggregate(sources, proj, norm, 1e-6, False).float()
    # The peers take the query unfolded from the key norm's weight: q . (v / rms(v) * w) as ours.
    query = proj.reshape(-1).to(dtype)
    for name, op in _peer_ops().items():
        agreement = relative_error(op(sources, query, norm.to(dtype), 1e-6), ours.double())
        step.lines.append(f"- {name}: agrees with attnres_fx's kernel within {agreement:.1e} of the largest value")
        forwards[name] = lambda op=op: op(sources, query, norm.to(dtype), 1e-6)
        trained[name] = lambda op=op: op(leaves, query, norm.to(dtype), 1e-6).backward(grad)
    times = timing.median_ms(timing.interleaved(forwards, sizes.runs, warmup=2, device=device))
    train_times = timing.median_ms(timing.interleaved(trained, sizes.runs, warmup=2, device=device))
    copy_rate = forward_bytes / (times["copy"] / 1e3) / 1e9
    step.lines.append(f"{count} sources of {list(shape)} {DTYPE_NAMES[dtype]}; the copy moves the forward's bytes "
                      f"({forward_bytes / 1e6:.0f} MB read + written): {times['copy']:.3f} ms, {copy_rate:.1f} GB/s")
    step.lines.append("| op | forward ms | forward GB/s | of copy | forward+backward ms | fwd+bwd GB/s | of copy |")
    step.lines.append("|---|---|---|---|---|---|---|")
    for name, ms in times.items():
        if name == "copy":
            continue
        rate = forward_bytes / (ms / 1e3) / 1e9
        row = f"| {name} | {ms:.3f} | {rate:.1f} | {rate / copy_rate:.2f} |"
        if name in train_times:
            train_rate = backward_bytes / (train_times[name] / 1e3) / 1e9
            row += f" {train_times[name]:.3f} | {train_rate:.1f} | {train_rate / copy_rate:.2f} |"
        else:
            row += " - | - | - |"
        step.lines.append(row)
    missing = [name for name in ("flash-linear-attention", "liger-kernel") if name not in forwards]
    if missing:
        step.lines.append(f"not timed (package not importable here): {', '.join(missing)}")
    return step


def model_timing_step(device: torch.device, sizes: Sizes) -> Step:
    step = Step("model timings: converted Llama against the original, interleaved medians")
    base, model = _llama(sizes, device)
    ids, targets = _ids(sizes, device), _ids(sizes, device, seed=1)
    models = {"original": base, "converted": model}

    def forward(m):
        with torch.no_grad():
            m(ids)

    def train(m, optimizer):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(m(ids).logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()

    def decode(m):
        with torch.no_grad():
            m.generate(ids[:1, :32], max_new_tokens=sizes.decode_tokens, min_new_tokens=sizes.decode_tokens,
                       do_sample=False, pad_token_id=0)

    rows = {"forward": timing.median_ms(timing.interleaved({n: (lambda m=m: forward(m)) for n, m in models.items()},
                                                           sizes.runs, 2, device))}
    trained = {n: copy.deepcopy(m).train() for n, m in models.items()}
    optimizers = {n: torch.optim.AdamW(m.parameters(), lr=1e-5) for n, m in trained.items()}
    rows["training step (bf16 autocast)" if device.type == "cuda" else "training step"] = timing.median_ms(
        timing.interleaved({n: (lambda n=n: train(trained[n], optimizers[n])) for n in trained}, sizes.runs, 2, device))
    decode_ms = timing.median_ms(timing.interleaved({n: (lambda m=m: decode(m)) for n, m in models.items()},
                                                    max(3, sizes.runs // 4), 1, device))
    rows[f"decode ({sizes.decode_tokens} tokens, batch 1)"] = decode_ms
    step.lines.append(f"LlamaForCausalLM {sizes.llama}, batch {sizes.batch} x {sizes.seq}, default route")
    step.lines.append("| what | original ms | converted ms | converted / original |")
    step.lines.append("|---|---|---|---|")
    for what, ms in rows.items():
        step.lines.append(f"| {what} | {ms['original']:.2f} | {ms['converted']:.2f} "
                          f"| {ms['converted'] / ms['original']:.3f} |")
    return step


# ---------------------------------------------------------------------------------------------- report
def environment() -> list[str]:
    import transformers

    lines = [f"- python {platform.python_version()}, torch {torch.__version__}, "
             f"transformers {transformers.__version__}, attnres_fx {attnres_fx.__version__}"]
    try:
        import triton
        lines[0] += f", triton {triton.__version__}"
    except ImportError:
        pass
    if torch.cuda.is_available():
        lines.append(f"- device: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    else:
        lines.append("- device: no CUDA")
    return lines


def run_step(name: str, function: Callable[[], Step]) -> Step:
    start = time.perf_counter()
    try:
        step = function()
    except Exception as err:  # a failing step is reported and the others still run
        step = Step(name, status="FAILED", lines=["```", *traceback.format_exception(err)[-6:], "```"])
    step.lines.append(f"({time.perf_counter() - start:.1f} s)")
    print(f"{step.status:>8}  {step.name}", flush=True)
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step at tiny sizes on the CPU")
    parser.add_argument("--out", type=Path, default=Path("docs/gpu.md"), help="the report (markdown)")
    parser.add_argument("--steps", default="kernels,compile,op,model", help="which steps, comma-separated")
    args = parser.parse_args(argv)
    wanted = set(args.steps.split(","))
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    sizes = CUDA_SIZES if cuda else DRY_SIZES
    if args.dry_run and "kernels" in wanted and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run runs the Triton kernels in Triton's CPU interpreter: set TRITON_INTERPRET=1")
    steps_available = {
        "kernels": ("kernels", lambda: kernel_step(device, sizes, dry_run=not cuda)),
        "compile": ("compile", lambda: compile_step(device, sizes)),
        "op": ("op timings", lambda: op_timing_step(device, sizes)),
        "model": ("model timings", lambda: model_timing_step(device, sizes)),
    }
    steps = []
    for key, (name, function) in steps_available.items():
        if key not in wanted:
            continue
        if not cuda and not args.dry_run:
            steps.append(Step(name, status="skipped: no CUDA"))
            print(f"skipped: no CUDA  {name}", flush=True)
            continue
        steps.append(run_step(name, function))
    mode = "dry run on the CPU (tiny sizes; figures are not GPU figures)" if args.dry_run else (
        "CUDA" if cuda else "no CUDA: every GPU step skipped")
    report = [f"# GPU check ({mode})", "", *environment(), ""]
    for step in steps:
        report += [f"## {step.name}: {step.status}", "", *step.lines, ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report))
    print(f"report: {args.out}")
    return 1 if any(step.status == "FAILED" for step in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
