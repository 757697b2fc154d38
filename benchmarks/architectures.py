"""Measure attnres_fx on every tiny Hugging Face model of attnres_fx.models and write the README's table.

    python benchmarks/architectures.py            # rewrites README.md between the architectures markers
    python benchmarks/architectures.py --print    # prints the table only

For each model (inputs: batch 2, sequence 16; default ``num_blocks=8``, so each of the 2-layer models'
sites is its own block): the residual sites detected per stream; the zero-init difference between the
converted and the original model with ``preserve_scale=True`` and with the default convex aggregation,
next to the eps bound (:func:`attnres_fx.checks.eps_bound`) and to the default difference once the norms'
eps is 1e-12; whether ``generate`` with the KV cache (greedy, 12 new tokens, after conversion with
``preserve_scale=True``) gives the original's tokens; whether ``save_pretrained`` and
``attnres_fx.from_pretrained`` give back identical outputs (random pseudo-queries); and how many of
transformers' own tests of the architecture pass on the original and on converted models, read from the
summary ``benchmarks/hf_parity.py`` wrote (``--parity``, default ``docs/hf_parity.json``; it needs a
transformers source checkout, which this script does not). Differences are
``attnres_fx.checks.relative_error``: the largest per-token ``|converted - original| / |original|``.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

import attnres_fx
from attnres_fx.checks import eps_bound, relative_error
from attnres_fx.models import HF_NAMES, HIDDEN, LAYERS, build_hf, hf_example_inputs, hf_model, main_output
from attnres_fx.testing import EXPECTED, randomise_pseudo_queries

README = Path(__file__).resolve().parent.parent / "README.md"
PARITY = Path(__file__).resolve().parent.parent / "docs" / "hf_parity.json"
# The directory of transformers' tests (tests/models/NAME) each model's class is tested in.
TEST_DIRECTORY = {"t5_encoder": "t5", "vit_classifier": "vit"}
BEGIN, END = "<!-- architectures:begin -->", "<!-- architectures:end -->"
TINY_EPS = 1e-12
NEW_TOKENS = 12

NOTES = f"""\
Measured by `python benchmarks/architectures.py`, which writes this table: the tiny random-weight
configs of `attnres_fx.models` ({LAYERS} layers, hidden {HIDDEN}, Hugging Face initialisation), converted
in place and called as usual (inputs of batch 2 and sequence 16, default `num_blocks=8`). A difference
is the largest per-token `|converted - original| / |original|` of the main output (logits, or the last
hidden state); below ~1e-6 it is fp32 round-off (the 1-4e-7 of the RMS-norm and layer-norm models with
`preserve_scale=True`: each site runs fused with the norm that reads it, whose sums are taken in another
order, and with `1 / sqrt` for `rsqrt`).

*eps bound*: with zero-initialised pseudo-queries each norm reads `h / c` (`c` sources), which is the
norm of `h` with eps replaced by `c^2 eps`: its output shrinks by the factor
`sqrt((var + eps) / (var + c^2 eps))` per token. The bound sums one minus that factor over all
aggregations, from the model's eps and the measured per-token variance of its stream
(`attnres_fx.checks.eps_bound`). Hugging Face initialisation keeps that variance small (~2e-4 in most
LMs); Gemma2 multiplies its embeddings by sqrt(hidden) and T5 initialises them with std 1, hence their
~1e-5. The next column rebuilds the model with every norm eps at {TINY_EPS:g}: the difference is the eps
and nothing else.

*generate (cache) = original*: `generate` with the default KV cache, greedy, {NEW_TOKENS} new tokens,
converted with `preserve_scale=True`: the same tokens as the original model (T5: its encoder is called
on its own by `generate`, and converted too). *save/reload*: with random pseudo-queries,
`save_pretrained` then `attnres_fx.from_pretrained(model class, dir)` gives identical outputs.
`tests/integrations/test_hf_models.py`, `tests/integrations/test_hf_generate.py` and
`tests/integrations/test_hf_workflow.py` run the same checks and more (other shapes, training, sampling, left padding,
the cache against a no-cache loop).

*transformers' tests passed*: transformers' own model tests of the architecture
(`tests/models/NAME/test_modeling_NAME.py` of its 5.24 source, every model class it tests, common,
generation and training mixins) on the original models and on every model they build converted
(`preserve_scale=True`, random pseudo-queries), by `benchmarks/hf_parity.py`; what still fails and why is
in `docs/hf_parity.md` and under *Hugging Face* above. "not run": not measured yet.
"""


def _sites(detection, expected) -> str:
    parts = []
    for stream_name, stream in zip(expected.streams, detection.streams):
        form = " parallel" if expected.parallel_residual else ""
        where = f" ({stream_name})" if expected.num_streams > 1 else ""
        parts.append(f"{len(stream.sites)}{form} + 1 final{where}")
    return ", ".join(parts)


def _difference(name: str, model, args, kwargs, **options) -> float:
    new = attnres_fx.attnresify(copy.deepcopy(model), args, example_kwargs=kwargs, **options)
    with torch.no_grad():
        return relative_error(main_output(name, new(*args, **kwargs)), main_output(name, model(*args, **kwargs)))


def _generates_the_same(name: str, model, exact) -> str:
    if not hf_model(name).is_lm:
        return "-"
    ids = hf_example_inputs(name, 2, 6)[0][0]
    tokens = [m.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
              for m in (exact, model)]
    return "yes" if torch.equal(*tokens) else "NO"


def _reloads_the_same(name: str, exact, args, kwargs) -> str:
    model = randomise_pseudo_queries(copy.deepcopy(exact), seed=2)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        again = attnres_fx.from_pretrained(type(model), directory,
                                           attn_implementation=model.config._attn_implementation)
    with torch.no_grad():
        same = torch.equal(main_output(name, again(*args, **kwargs)), main_output(name, model(*args, **kwargs)))
    return "yes" if same else "NO"


def parity_cell(name: str, parity: dict) -> str:
    """``passed original / passed converted`` of transformers' tests for ``name``'s architecture."""
    arch = parity.get(TEST_DIRECTORY.get(name, name))
    if arch is None:
        return "not run"
    return f"{arch['passed_original']} / {arch['passed_converted']}"


def read_parity(path: Path) -> dict:
    if not path.is_file():
        return {}
    return {arch["architecture"]: arch for arch in json.loads(path.read_text())["architectures"]}


def measure(name: str) -> list[str]:
    spec, expected = hf_model(name), EXPECTED[name]
    model = build_hf(name, use_cache=True)
    args, kwargs = hf_example_inputs(name)
    label = f"`{spec.hf_class}`"
    form = {"pre": "pre-norm", "sandwich": "pre-norm (+ post-norms)", "post": "post-norm"}[expected.norm_position]
    form = f"{form}, {'parallel' if expected.parallel_residual else 'sequential'}, {expected.norm}"
    detection = attnres_fx.detect(model, args, example_kwargs=kwargs)
    try:
        exact = attnres_fx.attnresify(copy.deepcopy(model), args, example_kwargs=kwargs, preserve_scale=True)
    except attnres_fx.UnsupportedArchitectureError:
        return [label, form, "none (post-norm)", "UnsupportedArchitectureError", "-", "-", "-", "-", "-"]
    with torch.no_grad():
        exact_diff = relative_error(main_output(name, exact(*args, **kwargs)),
                                    main_output(name, model(*args, **kwargs)))
    eps = getattr(model.config, spec.eps_field)
    bound = eps_bound(exact, args, kwargs, eps)
    default = _difference(name, model, args, kwargs)
    tiny_eps = _difference(name, build_hf(name, **{spec.eps_field: TINY_EPS}), args, kwargs)
    return [label, form, _sites(detection, expected), f"{exact_diff:.1e}", f"{default:.1e}",
            f"{bound:.1e} (eps {eps:g})", f"{tiny_eps:.1e}", _generates_the_same(name, model, exact),
            _reloads_the_same(name, exact, args, kwargs)]


def table(names, parity: dict) -> str:
    header = ["Model", "Residual stream", "Sites found", "`preserve_scale=True`", "default (zero-init)",
              "eps bound", "default, eps 1e-12", "generate (cache) = original", "save/reload",
              "transformers' tests passed, original / converted"]
    rows = [header, ["---"] * len(header)]
    for name in names:
        start = time.perf_counter()
        rows.append([*measure(name), parity_cell(name, parity)])
        print(f"[architectures] {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
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
    parser.add_argument("--parity", type=Path, default=PARITY,
                        help="the hf_parity.json of benchmarks/hf_parity.py (default: docs/hf_parity.json)")
    parser.add_argument("models", nargs="*", default=list(HF_NAMES), help="model names (default: all)")
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    text = f"### Architectures covered\n\n{table(options.models, read_parity(options.parity))}\n\n{NOTES}"
    if options.print:
        print(text)
    else:
        write_readme(text)
        print(f"wrote the architectures table to {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
