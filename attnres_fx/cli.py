"""``attnres-fx``: command-line entry point.

    attnres-fx demo [--model NAME] [--block-size S] [--num-blocks N] [--preserve-scale] [--out DIR]
                    [--no-backends]
    attnres-fx export MODEL --onnx OUT.onnx [--block-size S] [--preserve-scale] [--device D]
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import torch

from . import api, zoo
from .errors import AttnResError
from .models import TinyConfig, TinyTransformer, example_ids


def _build_builtin(args) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(args.seed)
    cfg = TinyConfig(dim=args.dim, num_layers=args.layers, num_heads=4, norm=args.norm)
    model = TinyTransformer(cfg).eval()
    return model, (example_ids(cfg, batch=2, seq=16),), {}


MODELS = ("tiny", *zoo.ARCH_NAMES)


def build_model(name: str, args) -> tuple[torch.nn.Module, tuple, dict]:
    """The model ``name`` with example inputs ``(args, kwargs)``: ``tiny`` is the built-in TinyTransformer
    (sized by ``args.layers`` / ``args.dim`` / ``args.norm`` / ``args.seed``), every other name one of
    :mod:`attnres_fx.zoo`'s tiny random-weight Hugging Face models (needs ``attnres-fx[hf]``)."""
    if name == "tiny":
        return _build_builtin(args)
    if name not in zoo.ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    inputs, kwargs = zoo.example_inputs(name)
    return zoo.build(name), inputs, kwargs


def _describe(name: str, args) -> str:
    if name == "tiny":
        return f"built-in TinyTransformer ({args.layers} layers, dim {args.dim}, norm={args.norm})"
    spec = zoo.spec(name)
    return f"{spec.hf_class} (tiny random-weight config: {spec.num_layers} layers, hidden {zoo.HIDDEN})"


NUM_BLOCKS_HELP = "blocks per stream (default 4 unless --block-size is given)"


def _num_blocks(args) -> int | None:
    """The CLI's default of 4 blocks makes the small models' block structure visible (8 blocks would
    make the 8 sites of the default tiny model Full AttnRes); an explicit --block-size stands alone."""
    if args.num_blocks is None and args.block_size is None:
        return 4
    return args.num_blocks


def _sites_table(injected) -> str:
    header = ("site", "name", "layer", "kind", "block", "sources", "normalised")
    rows = [(str(s.index), s.name, s.layer or "<root>", s.kind, "-" if s.block is None else str(s.block),
             str(s.num_sources), "-" if s.normalised is None else ("yes" if s.normalised else "NO (raw)"))
            for s in injected]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in [header, tuple("-" * w for w in widths), *rows])


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def cmd_demo(args) -> int:
    try:
        model, inputs, kwargs = build_model(args.model, args)
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"model: {_describe(args.model, args)}")
    detection = api.detect(model, inputs, example_kwargs=kwargs)
    print(f"\nDetected residual stream ({detection.num_sites} sites):")
    print(detection.table())
    try:
        new = api.attnresify(model, inputs, example_kwargs=kwargs, num_blocks=_num_blocks(args),
                             block_size=args.block_size, preserve_scale=args.preserve_scale)
    except AttnResError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return 1
    print("\nInjected BlockAttnRes aggregations (block 0 is the embedding):")
    print(_sites_table(api.sites(new)))
    with torch.no_grad():
        original = zoo.main_output(args.model, model(*inputs, **kwargs))
        rewritten = zoo.main_output(args.model, new(*inputs, **kwargs))
    diff = _max_diff(original, rewritten)
    scale = float(original.abs().max())
    mode = "preserve_scale=True (exact)" if args.preserve_scale else "zero-init convex form (equal up to norm eps)"
    print(f"\nZero-init equivalence, {mode}: max |original - rewritten| = {diff:.3e} "
          f"(relative {diff / scale:.3e})")
    code_path = out_dir / "rewritten_graph.py"
    code_path.write_text(new.code)
    print(f"Rewritten graph code saved to {code_path}")
    if args.backends:
        # Imported here: the ONNX packages are an optional extra.
        from .export import three_way_report
        print("\nHand-off: torch.compile (Inductor) and ONNX / onnxruntime")
        try:
            print(three_way_report(new, inputs, out_dir, example_kwargs=kwargs))
        except (AttnResError, ImportError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return 0


def cmd_export(args) -> int:
    # Imported here: the ONNX packages are an optional extra that only this command needs.
    from .export import attnres_node_groups, session, to_onnx, verify

    try:
        model, inputs, kwargs = build_model(args.model, args)
        new = api.attnresify(model, inputs, example_kwargs=kwargs, num_blocks=_num_blocks(args),
                             block_size=args.block_size, preserve_scale=args.preserve_scale)
        path = to_onnx(new, inputs, args.onnx, example_kwargs=kwargs, opset=args.opset)
        runtime = path if args.device is None else session(path, device=args.device)
        report = verify(new, runtime, inputs, example_kwargs=kwargs)
    except (AttnResError, ImportError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    groups = attnres_node_groups(path)
    print(f"model: {args.model}, {len(api.sites(new))} BlockAttnRes sites; ONNX written to {path}")
    print("ONNX nodes per BlockAttnRes: " + ", ".join(f"{name} {len(nodes)}" for name, nodes in groups.items()))
    print(report)
    print(f"providers used: {', '.join(report.providers)}; max |onnxruntime - torch| = {report.max_abs:.3e}")
    return 0 if report.ok else 1


def _add_export_parser(sub) -> None:
    export = sub.add_parser("export", help="rewrite a model, export it to ONNX and check it with onnxruntime")
    export.add_argument("model", help=f"model to convert: {', '.join(MODELS)}")
    export.add_argument("--onnx", required=True, help="path of the ONNX file to write")
    export.add_argument("--block-size", type=int, default=None, help="sites per block (wins over --num-blocks)")
    export.add_argument("--num-blocks", type=int, default=None, help=NUM_BLOCKS_HELP)
    export.add_argument("--preserve-scale", action="store_true")
    export.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    export.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="onnxruntime device (default: the model's)")
    export.add_argument("--layers", type=int, default=4, help="tiny: number of layers")
    export.add_argument("--dim", type=int, default=64, help="tiny: hidden size")
    export.add_argument("--norm", default="layernorm", help="tiny: norm style")
    export.add_argument("--seed", type=int, default=0)
    export.set_defaults(func=cmd_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres-fx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="detect, rewrite and check the built-in model (or --model NAME)")
    demo.add_argument("--model", choices=MODELS, default="tiny",
                      help="tiny: the built-in model; the others: tiny random-weight Hugging Face models")
    demo.add_argument("--block-size", type=int, default=None, help="sites per block (wins over --num-blocks)")
    demo.add_argument("--num-blocks", type=int, default=None, help=NUM_BLOCKS_HELP)
    demo.add_argument("--preserve-scale", action="store_true")
    demo.add_argument("--layers", type=int, default=4, help="tiny: number of layers")
    demo.add_argument("--dim", type=int, default=64, help="tiny: hidden size")
    demo.add_argument("--norm", default="layernorm", help="tiny: norm style")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="attnres_demo_out", help="folder for the saved graph code and ONNX file")
    demo.add_argument("--no-backends", dest="backends", action="store_false",
                      help="skip compiling with Inductor and exporting to ONNX / onnxruntime")
    demo.set_defaults(func=cmd_demo)
    _add_export_parser(sub)
    return parser


def _quiet_third_party_logs() -> None:
    """The exporters log notices (e.g. "torchvision is not installed") that say nothing about the user's
    model; the CLI's own report carries what matters. Errors still show."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_third_party_logs()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
