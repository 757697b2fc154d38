"""attnres-fx: convert a Transformer's residual stream to Block Attention Residuals, check it, export it.

    attnres-fx demo [--model NAME] [--num-blocks N | --block-size S] [--preserve-scale] [--no-backends]
    attnres-fx convert PATH_OR_NAME --out DIR [--num-blocks N | --block-size S] [--preserve-scale]
    attnres-fx export MODEL_OR_DIR --onnx OUT.onnx [--with-cache] [--num-blocks N | --block-size S]
    attnres-fx genai MODEL_OR_DIR --out DIR [--precision fp32|fp16|int4] [--provider cpu|cuda] [--chunk-size N]
                                          [--graph auto|builder|torch.onnx]
    attnres-fx inspect MODEL_OR_DIR [--png OUT.png] [--text TEXT]

NAME is ``tiny`` (the built-in model) or a tiny random-weight Hugging Face model (``llama``, ``t5``...);
PATH / DIR is a local Hugging Face model directory (``config.json`` and safetensors weights; one
written by ``convert`` holds a converted model).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from . import api, atomic
from .checks import eps_bound, relative_error
from .integrations.depth import depth_weights
from .errors import AttnResError
from .models import (HF_MODELS, HF_NAMES, LAYERS, HIDDEN, TinyConfig, TinyTransformer, build_hf, example_ids,
                     hf_example_inputs, hf_model, main_output)
from .passes.plan import DEFAULT_NUM_BLOCKS
from .timing import interleaved, median_ms
from .version import __version__

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
        try:
            cfg = TinyConfig(dim=args.dim, num_layers=args.layers, num_heads=4, norm=args.norm)
        except ValueError as err:
            raise UsageError(str(err)) from err
        return TinyTransformer(cfg).eval(), (example_ids(cfg, batch=2, seq=16),), {}
    if name not in HF_MODELS:
        raise UsageError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    try:
        model = build_hf(name)
    except ImportError as err:
        raise UsageError(str(err)) from err
    inputs, kwargs = hf_example_inputs(name)
    return model, inputs, kwargs


def load_directory(path: Path) -> tuple[torch.nn.Module, tuple, dict]:
    """A Hugging Face model saved in ``path`` (converted if it holds ``attnres_config.json``), with
    example inputs made from its config."""
    from .capture.tracers import dummy_inputs
    from .integrations.hf import CONFIG_NAME, from_pretrained

    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        import transformers
    except ImportError as err:
        raise UsageError("loading a model directory needs transformers: pip install 'attnres-fx[hf]'") from err
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    cls = next((getattr(transformers, name) for name in architectures if hasattr(transformers, name)), None)
    if cls is None:
        raise UsageError(f"{config_file} names no architecture this transformers knows: {architectures}")
    model = from_pretrained(cls, path) if (path / CONFIG_NAME).is_file() else cls.from_pretrained(path)
    model.eval()
    inputs = dummy_inputs(model)
    if inputs is None:
        raise UsageError(f"cannot make example inputs for {cls.__name__} from its config")
    return model, *inputs


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
    with step("\nConverting (record one call, detect, plan, try the routes)"):
        api.attnresify(model, inputs, example_kwargs=kwargs, preserve_scale=args.preserve_scale, **options)
    plan = api.plan_of(model)
    sizes = ", ".join(str(size) for size in plan.block_sizes)
    print(f"Blocks: {sizes} site(s) per block; {why}.")
    print("Injected BlockAttnRes aggregations (block 0 is the embedding):")
    print(plan.table(indent="  "))

    with step("First call (each block's graph traced and rewritten for this call)"), torch.no_grad():
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
        ms = median_ms(interleaved({"original": lambda: original(*inputs, **kwargs),
                                    "converted": lambda: model(*inputs, **kwargs)}, TIMED_RUNS))
    before_ms, after_ms = ms["original"], ms["converted"]
    print(f"Forward time, eager, {torch.get_num_threads()} thread(s), median of {TIMED_RUNS} interleaved runs: "
          f"original {before_ms:.2f} ms, converted {after_ms:.2f} ms (ratio {after_ms / before_ms:.2f})")
    code_path = out_dir / "rewritten_graph.py"
    code = api.rewrite(model, inputs, example_kwargs=kwargs).code
    with atomic.replaced_files(code_path) as staged, atomic.writing(code_path, "writing the graph's code"):
        staged.write_text(code)
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


def model_or_directory(name: str, args: argparse.Namespace) -> tuple[torch.nn.Module, tuple, dict]:
    """``name`` as a built-in model name, else as a model directory; converted with the command's block
    options unless the directory holds a converted model already."""
    path = Path(name)
    if name not in MODELS and path.is_dir():
        with step(f"Loading {path}"):
            model, inputs, kwargs = load_directory(path)
    else:
        if name not in MODELS:
            raise UsageError(f"{name!r} is neither a model directory nor a built-in model ({', '.join(MODELS)})")
        model, inputs, kwargs = build_model(name, args)
    if not api.is_converted(model):
        options, why = block_options(args)
        with step(f"Converting {type(model).__name__} ({why})"):
            api.attnresify(model, inputs, example_kwargs=kwargs, preserve_scale=args.preserve_scale, **options)
    return model, inputs, kwargs


def cmd_convert(args: argparse.Namespace) -> int:
    if args.source == "tiny":
        raise UsageError("convert writes a Hugging Face directory (save_pretrained); the built-in TinyTransformer "
                         "is no Hugging Face model: pick one of " + ", ".join(HF_NAMES) + " or a model directory")
    model, _, _ = model_or_directory(args.source, args)
    with step(f"Saving to {args.out}"):
        model.save_pretrained(args.out)
    plan = api.plan_of(model)
    print(f"{type(model).__name__}: {len(plan.sites)} BlockAttnRes sites, block sizes "
          f"{', '.join(map(str, plan.block_sizes))}; written to {args.out} (weights, config.json, attnres_config.json)")
    print(plan.table(indent="  "))
    print(f"Reload with attnres_fx.from_pretrained({type(model).__name__}, {str(args.out)!r}).")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    # Imported here: the ONNX packages are an optional extra that only this command needs.
    from .export import attnres_node_groups, generate_onnx, session, to_onnx, verify

    model, inputs, kwargs = model_or_directory(args.model, args)
    with step(f"Exporting to {args.onnx}{' with the KV cache' if args.with_cache else ''}"):
        path = to_onnx(model, inputs, args.onnx, example_kwargs=kwargs, opset=args.opset, with_cache=args.with_cache)
    runtime = session(path, device=args.device or "cpu")
    groups = attnres_node_groups(path)
    print(f"{type(model).__name__}: {len(api.sites(model))} BlockAttnRes sites; ONNX written to {path}")
    print("ONNX nodes per BlockAttnRes: " + ", ".join(f"{name} {len(nodes)}" for name, nodes in groups.items()))
    if args.with_cache:
        ids = inputs[0] if inputs else kwargs["input_ids"]
        pad = getattr(model.generation_config, "pad_token_id", None)
        got = generate_onnx(runtime, ids, max_new_tokens=8)
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False, pad_token_id=0 if pad is None else pad).numpy()
        same = got.shape == want.shape and (got == want).all()
        print(f"{'PASS' if same else 'FAIL'} greedy decoding, 8 new tokens: onnxruntime with the cache "
              f"{'equals' if same else 'differs from'} model.generate "
              f"(providers: {', '.join(runtime.get_providers())})")
        return 0 if same else 1
    report = verify(model, runtime, inputs, example_kwargs=kwargs)
    print(report)
    print(f"providers used: {', '.join(report.providers)}; max |onnxruntime - torch| = {report.max_abs:.3e}")
    return 0 if report.ok else 1


def directory_tokenizer(name: str):
    """The tokenizer saved in the model directory ``name``, if it holds one."""
    directory = Path(name)
    if name in MODELS or not (directory / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def cmd_genai(args: argparse.Namespace) -> int:
    # Imported here: the ONNX packages are an optional extra that only this command needs.
    from .export import generate_genai, to_genai

    model, inputs, kwargs = model_or_directory(args.model, args)
    tokenizer = directory_tokenizer(args.model)
    with step(f"Writing the onnxruntime-genai folder {args.out} ({args.precision}, {args.provider})"):
        folder = to_genai(model, args.out, tokenizer=tokenizer, precision=args.precision,
                          execution_provider=args.provider, context_length=args.context_length,
                          chunk_size=args.chunk_size, graph=args.graph)
    files = ", ".join(sorted(path.name for path in folder.iterdir()))
    written = json.loads((folder / "written_by.json").read_text())["graph"]
    print(f"{type(model).__name__}: {len(api.sites(model))} BlockAttnRes sites; {folder} ({written} graph): {files}")
    if args.provider != "cpu":
        print(f"Not checked here: the {args.provider} execution provider needs onnxruntime-genai-cuda on a GPU.")
        return 0
    if args.precision == "int4":
        print("Tokens not compared: int4 weights round the model's logits, which moves its near-ties.")
        return 0
    # One prompt: a batch would be right-padded with the pad id, which a random example row may end with.
    prompt = (inputs[0] if inputs else kwargs["input_ids"])[:1]
    pad = json.loads((folder / "genai_config.json").read_text())["model"]["pad_token_id"]
    with step("Greedy decoding, 8 new tokens, in onnxruntime-genai and with model.generate"):
        got = generate_genai(folder, prompt.tolist(), max_new_tokens=8)[0]
        with torch.no_grad():
            want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                                  pad_token_id=pad)
        want = want[0, prompt.shape[1]:].tolist()[:len(got)]
    same = got == want
    print(f"{'PASS' if same else 'FAIL'} onnxruntime-genai "
          f"{'generates the same tokens as' if same else 'differs from'} model.generate: {got}"
          + ("" if same else f" against {want}"))
    return 0 if same else 1


def inspect_inputs(model: torch.nn.Module, inputs: tuple, kwargs: dict, text: str | None,
                   directory: Path | None) -> tuple[tuple, dict]:
    """The inputs depth weights are measured on: ``text`` through the directory's tokenizer when it has
    one, else as UTF-8 bytes folded into the vocabulary; without ``text``, the example inputs."""
    if text is None:
        return inputs, kwargs
    vocabulary = next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if vocabulary is None:
        raise UsageError(f"--text: {type(model).__name__} takes no token ids")
    if directory is not None and (directory / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(directory)(text, return_tensors="pt")["input_ids"]
    else:
        ids = torch.tensor([list(text.encode())], dtype=torch.long) % vocabulary
    return ((ids,), {}) if inputs else ((), {"input_ids": ids})


def cmd_inspect(args: argparse.Namespace) -> int:
    model, inputs, kwargs = model_or_directory(args.model, args)
    directory = Path(args.model) if args.model not in MODELS else None
    inputs, kwargs = inspect_inputs(model, inputs, kwargs, args.text, directory)
    print(f"{type(model).__name__}: sites (block 0 is the embedding)")
    print(api.plan_of(model).table(indent="  "))
    with step("\nMeasuring the depth attention (one call, no gradients)"):
        weights = depth_weights(model.eval(), *inputs, **kwargs)
    print(weights)
    if args.png:
        try:
            path = weights.plot(args.png)
        except ImportError as err:
            raise UsageError(str(err)) from err
        print(f"Depth-attention map written to {path}")
    return 0


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


def _command(sub, func, help: str, description: str) -> argparse.ArgumentParser:
    """The subcommand ``func`` runs (``cmd_NAME`` runs ``NAME``)."""
    parser = sub.add_parser(func.__name__.removeprefix("cmd_"), help=help, description=description)
    parser.set_defaults(func=func)
    return parser


def _model_source(parser: argparse.ArgumentParser, names, dest: str = "model", metavar: str = "MODEL_OR_DIR") -> None:
    parser.add_argument(dest, metavar=metavar, help=f"a model directory, or one of: {', '.join(names)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres-fx", description=__doc__.splitlines()[0].split(": ", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"MODEL: {', '.join(MODELS)}")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _command(sub, cmd_demo, "convert a model, check it against the original, time and export it",
                    "Convert the built-in model (or --model NAME) and check it: the residual "
                    "stream found, the sites injected, equivalence at zero init, timings, and "
                    "the hand-off to Inductor and onnxruntime.")
    demo.add_argument("--model", choices=MODELS, default="tiny", metavar="MODEL",
                      help=f"one of: {', '.join(MODELS)} (default: tiny)")
    _add_model_options(demo)
    demo.add_argument("--out", default="attnres_demo_out", metavar="DIR",
                      help="folder for the graph code and the ONNX file (default: attnres_demo_out)")
    demo.add_argument("--no-backends", dest="backends", action="store_false",
                      help="skip compiling with Inductor and exporting to ONNX / onnxruntime")

    convert = _command(sub, cmd_convert, "convert a Hugging Face model and save it (save_pretrained)",
                       "Convert a local Hugging Face model directory (or a built-in tiny "
                       "Hugging Face model) and save it as a directory that "
                       "attnres_fx.from_pretrained reloads.")
    _model_source(convert, HF_NAMES, dest="source", metavar="PATH_OR_NAME")
    convert.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    _add_model_options(convert)

    export = _command(sub, cmd_export, "export a converted model to ONNX and check it with onnxruntime",
                      "Convert MODEL (or load a directory written by convert), export it to "
                      "ONNX (dynamic batch and sequence) and compare onnxruntime's outputs "
                      "with PyTorch's.")
    _model_source(export, MODELS)
    export.add_argument("--onnx", required=True, metavar="OUT", help="path of the ONNX file to write")
    export.add_argument("--with-cache", action="store_true",
                        help="decoder LMs: past keys and values as inputs and outputs, checked by greedy "
                             "decoding in onnxruntime against model.generate")
    _add_model_options(export)
    export.add_argument("--opset", type=_positive_int, default=None, help="ONNX opset (default: the exporter's)")
    export.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="onnxruntime device (default: cpu)")

    genai = _command(sub, cmd_genai, "write an onnxruntime-genai model folder and check it generates as the model",
                     "Convert MODEL (or load a directory written by convert) and write the folder "
                     "onnxruntime-genai serves: model.onnx with the KV cache, genai_config.json, "
                     "and the directory's tokenizer if it has one; then compare greedy decoding "
                     "in onnxruntime-genai with model.generate (CPU only).")
    _model_source(genai, HF_NAMES)
    genai.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    genai.add_argument("--precision", choices=("fp32", "fp16", "int4"), default="fp32",
                       help="weights and cache; int4: the model builder's graph only (default: fp32)")
    genai.add_argument("--graph", choices=("auto", "builder", "torch.onnx"), default="auto",
                       help="onnxruntime-genai's model builder graph with the AttnRes pass, or the torch.onnx export "
                            "(default: auto, the builder's where it takes the architecture)")
    genai.add_argument("--provider", choices=("cpu", "cuda"), default="cpu",
                       help="execution provider recorded in genai_config.json (default: cpu)")
    genai.add_argument("--context-length", type=_positive_int, default=None, metavar="N",
                       help="longest sequence (default: the model's max_position_embeddings)")
    genai.add_argument("--chunk-size", type=_positive_int, default=None, metavar="N",
                       help="process a single prompt in chunks of N tokens (default: all at once)")
    _add_model_options(genai)

    inspect = _command(sub, cmd_inspect, "show what a converted model attends to over depth",
                       "Print the sites of a converted model (a directory written by convert, "
                       "or a model converted here) and the softmax weights each site gives its "
                       "sources, averaged over the tokens of one call; optionally a heatmap.")
    _model_source(inspect, MODELS)
    inspect.add_argument("--png", metavar="OUT", default=None,
                         help="write the depth-attention heatmap there (needs attnres-fx[viz]; default: none)")
    inspect.add_argument("--text", default=None,
                         help="text to measure on: the directory's tokenizer if it has one, else UTF-8 bytes "
                              "(default: the model's example inputs)")
    _add_model_options(inspect)
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
