"""Measure attnres_fx on every architecture of attnres_fx.zoo and write the README's table.

    python benchmarks/architectures.py            # rewrites README.md between the architectures markers
    python benchmarks/architectures.py --print    # prints the table only

For each tiny random-weight Hugging Face model (inputs: batch 2, sequence 16; default ``num_blocks=8``,
so each of the 2-layer models' sites is its own block): the residual sites detected per stream, and the
zero-init difference between the rewritten and the original model, with ``preserve_scale=True`` and
with the default convex aggregation, next to the eps bound (:func:`attnres_fx.zoo.eps_bound`) and to
the default difference once the norms' eps is set to 1e-12. Differences are ``zoo.relative_error``:
the largest per-token ``|rewritten - original| / |original|`` of the main output.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

import attnres_fx
from attnres_fx import zoo

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- architectures:begin -->", "<!-- architectures:end -->"
TINY_EPS = 1e-12

NOTES = f"""\
Measured by `python benchmarks/architectures.py`, which writes this table: the tiny random-weight
configs of `attnres_fx.zoo` ({zoo.LAYERS} layers, hidden {zoo.HIDDEN}, Hugging Face initialisation),
traced with `torch.export` (`tracer="auto"` falls back to it: fx cannot trace them), inputs of batch
2 and sequence 16, default `num_blocks=8`. A difference is the largest per-token
`|rewritten - original| / |original|` of the main output (logits, or the last hidden state); below
~1e-6 it is fp32 round-off.

*eps bound*: with zero-initialised pseudo-queries each norm reads `h / c` (`c` sources), which is the
norm of `h` with eps replaced by `c^2 eps`: its output shrinks by the factor
`sqrt((var + eps) / (var + c^2 eps))` per token. The bound sums one minus that factor over all
aggregations, from the model's eps and the measured per-token variance of its stream
(`zoo.eps_bound`). Hugging Face initialisation keeps that variance small (~2e-4 in most LMs); Gemma2
multiplies its embeddings by sqrt(hidden) and T5 initialises them with std 1, hence their ~1e-5. The
last column rebuilds the model with every norm eps at {TINY_EPS:g}: the difference is the eps and
nothing else. `tests/test_hf_models.py` runs the same checks, plus shapes (3, 11) and (1, 64) and
one training step.

Hugging Face models are traced with `config.use_cache` off (the rewritten graph has no KV cache);
passing `use_cache=True` raises `TraceError`. `attnres-fx demo --model NAME` runs one of them. timm's
`VisionTransformer` is checked by the same test file wherever `import timm` works (see Limits).
"""


def _sites(detection, spec) -> str:
    parts = []
    for stream_name, stream in zip(spec.streams, detection.streams):
        form = " parallel" if spec.parallel_residual else ""
        where = f" ({stream_name})" if spec.num_streams > 1 else ""
        parts.append(f"{len(stream.sites)}{form} + 1 final{where}")
    return ", ".join(parts)


def _difference(name: str, model, args, kwargs, **options) -> float:
    new = attnres_fx.attnresify(model, args, example_kwargs=kwargs, **options)
    with torch.no_grad():
        return zoo.relative_error(zoo.main_output(name, new(*args, **kwargs)),
                                  zoo.main_output(name, model(*args, **kwargs)))


def measure(name: str) -> list[str]:
    spec = zoo.spec(name)
    model = zoo.build(name)
    args, kwargs = zoo.example_inputs(name)
    label = f"`{spec.hf_class}`"
    form = {"pre": "pre-norm", "sandwich": "pre-norm (+ post-norms)", "post": "post-norm"}[spec.norm_position]
    form = f"{form}, {'parallel' if spec.parallel_residual else 'sequential'}, {spec.norm}"
    detection = attnres_fx.detect(model, args, example_kwargs=kwargs)
    try:
        exact = attnres_fx.attnresify(model, args, example_kwargs=kwargs, preserve_scale=True)
    except attnres_fx.UnsupportedArchitectureError:
        return [label, form, "none (post-norm)", "UnsupportedArchitectureError", "-", "-", "-"]
    with torch.no_grad():
        exact_diff = zoo.relative_error(zoo.main_output(name, exact(*args, **kwargs)),
                                        zoo.main_output(name, model(*args, **kwargs)))
    eps = getattr(model.config, spec.eps_field)
    bound = zoo.eps_bound(exact, args, kwargs, eps)
    default = _difference(name, model, args, kwargs)
    tiny_eps = _difference(name, zoo.build(name, **{spec.eps_field: TINY_EPS}), args, kwargs)
    return [label, form, _sites(detection, spec), f"{exact_diff:.1e}", f"{default:.1e}",
            f"{bound:.1e} (eps {eps:g})", f"{tiny_eps:.1e}"]


def table(names) -> str:
    header = ["Model", "Residual stream", "Sites found", "`preserve_scale=True`", "default (zero-init)",
              "eps bound", "default, eps 1e-12"]
    rows = [header, ["---"] * len(header), *(measure(name) for name in names)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def write_readme(text: str, readme: Path = README) -> None:
    content = readme.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(content):
        raise SystemExit(f"{readme}: markers {BEGIN} / {END} not found")
    readme.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}{END}", content, count=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the table instead of writing README.md")
    parser.add_argument("models", nargs="*", default=list(zoo.ARCH_NAMES), help="zoo names (default: all)")
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    text = f"### Architectures covered\n\n{table(options.models)}\n\n{NOTES}"
    if options.print:
        print(text)
    else:
        write_readme(text)
        print(f"wrote the architectures table to {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
