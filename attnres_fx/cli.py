"""attnres-fx: convert a Transformer's residual stream to Block Attention Residuals, check it, export it.

    attnres-fx demo [--model NAME] [--num-blocks N | --block-size S] [--preserve-scale] [--no-backends]
    attnres-fx export MODEL --onnx OUT.onnx [--num-blocks N | --block-size S] [--preserve-scale]

MODEL is ``tiny`` (the built-in model) or a tiny random-weight Hugging Face model (``llama``, ``t5``...).
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from . import __version__, api
from .checks import eps_bound, relative_error
from .errors import AttnResError
from .models import (HF_MODELS, HF_NAMES, LAYERS, HIDDEN, TinyConfig, TinyTransformer, build_hf, example_ids,
                     hf_example_inputs, hf_model, main_output)
from .passes.plan import DEFAULT_NUM_BLOCKS

MODELS = ("tiny", *HF_NAMES)
NORMS = ("layernorm", "rmsnorm", "functional_layernorm", "functional_rmsnorm", "manual_rmsnorm")
DEMO_NUM_BLOCKS = 4
EXACT = 1e-5            # preserve_scale=True: exact up to fp32 reassociation of the stream sums
TIMED_RUNS = 10


class UsageError(Exception):
    """A mistake in the command line or its inputs: one line on stderr, exit code 2."""


def build_model(name: str, args: argparse.Namespace) -> tuple[torch.nn.Module, tuple, dict]:
    """The model ``name`` with example inputs ``(args, kwargs)``: ``tiny`` is the built-in TinyTransformer
    (sized by ``--layers`` / ``--dim`` / ``--norm`` / ``--seed``), every other name one of the tiny
    random-weight Hugging Face models of :data:`attnres_fx.models.HF_MODELS` (needs ``attnres-fx[hf]``)."""
    if name == "tiny":
        torch.manual_seed(args.seed)
        cfg = TinyConfig(dim=args.dim, num_layers=args.layers, num_heads=4, norm=args.norm)
        return TinyTransformer(cfg).eval(), (example_ids(cfg, batch=2, seq=16),), {}
    if name not in HF_MODELS:
        raise UsageError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    try:
        model = build_hf(name)
    except ImportError as err:
        raise UsageError(str(err)) from err
    inputs, kwargs = hf_example_inputs(name)
    return model, inputs, kwargs


def describe(name: str, args: argparse.Namespace) -> str:
    if name == "tiny":
        return f"built-in TinyTransformer ({args.layers} layers, dim {args.dim}, norm={args.norm})"
    return f"{hf_model(name).hf_class} (tiny random-weight config: {LAYERS} layers, hidden {HIDDEN})"


def block_options(args: argparse.Namespace) -> tuple[dict, str]:
    """``num_blocks`` / ``block_size`` for attnresify, and a sentence saying why."""
    if args.block_size is not None or args.num_blocks is not None:
        return {"num_blocks": args.num_blocks, "block_size": args.block_size}, "as given on the command line"
    if args.command == "demo":
        return {"num_blocks": DEMO_NUM_BLOCKS}, (
            f"the demo uses {DEMO_NUM_BLOCKS} blocks, not the API default of {DEFAULT_NUM_BLOCKS}: with a few "
            f"layers, {DEFAULT_NUM_BLOCKS} blocks would make nearly every site its own block (Full AttnRes) "
            "and hide the block structure")
    return {}, f"the API default (num_blocks={DEFAULT_NUM_BLOCKS})"


@contextmanager
def step(what: str):
    """Say what is running, and how long it took."""
    print(f"{what} ...", end="", flush=True)
    start = time.perf_counter()
    yield
    print(f" done in {time.perf_counter() - start:.1f} s", flush=True)


def interleaved_medians(first, second, runs: int = TIMED_RUNS) -> tuple[float, float]:
    """Median ms of ``first()`` and ``second()``, timed alternately after one warm-up call each."""
    first(), second()
    times: tuple[list, list] = ([], [])
    for _ in range(runs):
        for fn, bucket in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            bucket.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def cmd_demo(args: argparse.Namespace) -> int:
    model, inputs, kwargs = build_model(args.model, args)
    original = copy.deepcopy(model)
    options, why = block_options(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"attnres-fx {__version__} demo: {describe(args.model, args)}")
    detection = api.detect(model, inputs, example_kwargs=kwargs)
    print(f"\nResidual stream(s) found ({detection.num_sites} sites):")
    print(detection.table())
    with step("\nConverting (capture with TorchDynamo on fake tensors, detect, plan)"):
        api.attnresify(model, inputs, example_kwargs=kwargs, preserve_scale=args.preserve_scale, **options)
    plan = api.plan_of(model)
    sizes = ", ".join(str(size) for size in plan.block_sizes)
    print(f"Blocks: {sizes} site(s) per block; {why}.")
    print("Injected BlockAttnRes aggregations (block 0 is the embedding):")
    print(plan.table(indent="  "))

    with step("First call (Dynamo capture and rewrite of this call's graph)"), torch.no_grad():
        converted = main_output(args.model, model(*inputs, **kwargs))
    with torch.no_grad():
        reference = main_output(args.model, original(*inputs, **kwargs))
    error = relative_error(converted, reference)
    if args.preserve_scale:
        bound, why_bound = EXACT, "preserve_scale=True: exact up to fp32 round-off"
    else:
        exact = api.attnresify(copy.deepcopy(original), inputs, example_kwargs=kwargs, preserve_scale=True,
                               **options)
        bound = eps_bound(exact, inputs, kwargs, _norm_eps(original, args)) + EXACT
        why_bound = "zero init differs by the norms' eps only, see README"
    verdict = "PASS" if error <= bound else "FAIL"
    print(f"\n{verdict} equivalence: max relative difference {error:.1e} <= bound {bound:.1e} ({why_bound})"
          if verdict == "PASS" else
          f"\n{verdict} equivalence: max relative difference {error:.1e} > bound {bound:.1e} ({why_bound})")
    now = {name: type(module) for name, module in model.named_modules()}
    same = type(model) is type(original) and all(now.get(name) is type(module)
                                                 for name, module in original.named_modules())
    print(f"{'PASS' if same else 'FAIL'} same model: {type(model).__name__}, every original submodule in place, "
          f"{len(plan.sites)} BlockAttnRes added")
    with torch.no_grad():
        before_ms, after_ms = interleaved_medians(lambda: original(*inputs, **kwargs),
                                                  lambda: model(*inputs, **kwargs))
    print(f"Forward time, eager, {torch.get_num_threads()} thread(s), median of {TIMED_RUNS} interleaved runs: "
          f"original {before_ms:.2f} ms, converted {after_ms:.2f} ms (ratio {after_ms / before_ms:.2f})")
    code_path = out_dir / "rewritten_graph.py"
    code_path.write_text(api.rewrite(model, inputs, example_kwargs=kwargs).code)
    print(f"Explicit graph code (attnres_fx.rewrite) saved to {code_path}")
    if args.backends:
        # Imported here: the ONNX packages are an optional extra.
        from .export import three_way_report
        with step("\nHand-off: compiling with Inductor and exporting to ONNX"):
            report = three_way_report(model, inputs, out_dir, example_kwargs=kwargs)
        print(report)
    return 0 if verdict == "PASS" and same else 1


def _norm_eps(model: torch.nn.Module, args: argparse.Namespace) -> float:
    if args.model == "tiny":
        return model.config.eps
    return getattr(model.config, hf_model(args.model).eps_field)


def cmd_export(args: argparse.Namespace) -> int:
    # Imported here: the ONNX packages are an optional extra that only this command needs.
    from .export import attnres_node_groups, session, to_onnx, verify

    model, inputs, kwargs = build_model(args.model, args)
    options, _ = block_options(args)
    api.attnresify(model, inputs, example_kwargs=kwargs, preserve_scale=args.preserve_scale, **options)
    with step(f"Exporting {args.model} to {args.onnx}"):
        path = to_onnx(model, inputs, args.onnx, example_kwargs=kwargs, opset=args.opset)
    runtime = path if args.device is None else session(path, device=args.device)
    report = verify(model, runtime, inputs, example_kwargs=kwargs)
    groups = attnres_node_groups(path)
    print(f"model: {args.model}, {len(api.sites(model))} BlockAttnRes sites; ONNX written to {path}")
    print("ONNX nodes per BlockAttnRes: " + ", ".join(f"{name} {len(nodes)}" for name, nodes in groups.items()))
    print(report)
    print(f"providers used: {', '.join(report.providers)}; max |onnxruntime - torch| = {report.max_abs:.3e}")
    return 0 if report.ok else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument("--num-blocks", type=_positive_int, metavar="N",
                        help=f"blocks per stream (API default {DEFAULT_NUM_BLOCKS}; the demo uses {DEMO_NUM_BLOCKS})")
    blocks.add_argument("--block-size", type=_positive_int, metavar="S",
                        help="sites per block; 1 is Full AttnRes")
    parser.add_argument("--preserve-scale", action="store_true",
                        help="multiply each aggregate by its number of sources: the converted model starts out "
                             "exactly equal to the original (default: off, the paper's convex form)")
    tiny = parser.add_argument_group("the built-in model (MODEL tiny)")
    tiny.add_argument("--layers", type=_positive_int, default=4, help="number of layers (default: 4)")
    tiny.add_argument("--dim", type=_positive_int, default=64, help="hidden size, a multiple of 4 (default: 64)")
    tiny.add_argument("--norm", choices=NORMS, default="layernorm", help="how the pre-norms are written "
                      "(default: layernorm)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres-fx", description=__doc__.splitlines()[0].split(": ", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"MODEL: {', '.join(MODELS)}")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="convert a model, check it against the original, time and export it",
                          description="Convert the built-in model (or --model NAME) and check it: the residual "
                                      "stream found, the sites injected, equivalence at zero init, timings, and "
                                      "the hand-off to Inductor and onnxruntime.")
    demo.add_argument("--model", choices=MODELS, default="tiny", metavar="MODEL",
                      help=f"one of: {', '.join(MODELS)} (default: tiny)")
    _add_model_options(demo)
    demo.add_argument("--out", default="attnres_demo_out", metavar="DIR",
                      help="folder for the graph code and the ONNX file (default: attnres_demo_out)")
    demo.add_argument("--no-backends", dest="backends", action="store_false",
                      help="skip compiling with Inductor and exporting to ONNX / onnxruntime")
    demo.set_defaults(func=cmd_demo)

    export = sub.add_parser("export", help="convert a model, export it to ONNX and check it with onnxruntime",
                            description="Convert MODEL, export it to ONNX (dynamic batch and sequence) and "
                                        "compare onnxruntime's outputs with PyTorch's.")
    export.add_argument("model", choices=MODELS, metavar="MODEL", help=f"one of: {', '.join(MODELS)}")
    export.add_argument("--onnx", required=True, metavar="OUT", help="path of the ONNX file to write")
    _add_model_options(export)
    export.add_argument("--opset", type=_positive_int, default=None, help="ONNX opset (default: the exporter's)")
    export.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="onnxruntime device (default: the model's)")
    export.set_defaults(func=cmd_export)
    return parser


def _quiet_third_party_logs() -> None:
    """The exporters log notices (e.g. "torchvision is not installed") that say nothing about the user's
    model; the CLI's own report carries what matters. Errors still show."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_third_party_logs()
    try:
        return args.func(args)
    except UsageError as err:
        print(f"attnres-fx: error: {err}", file=sys.stderr)
        return 2
    except (AttnResError, ImportError) as err:
        print(f"\nattnres-fx: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
