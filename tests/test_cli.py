"""The attnres-fx command: version, help, one-line errors with exit code 2, the demo's report."""

import re
import subprocess
import sys

import pytest

from attnres_fx import __version__
from attnres_fx.cli import build_parser, main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "attnres_fx", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_version_and_module_entry_point():
    done = _run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"attnres-fx {__version__}"


def test_every_flag_has_help_and_choices_or_defaults_are_shown():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            if action.dest in ("help",):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            if action.default not in (None, False, True) and action.option_strings:
                assert "default" in action.help, f"{name} {action.option_strings} does not state its default"
    assert "*" not in parser.description and "`" not in parser.description, "no markup in the description"


@pytest.mark.parametrize("args,needle", [
    (["demo", "--block-size", "0"], "expected a positive integer"),
    (["demo", "--model", "gpt3"], "invalid choice"),
    (["demo", "--dim", "30"], "divisible by num_heads"),
    (["demo", "--num-blocks", "2", "--block-size", "2"], "not allowed with argument"),
    (["export", "nowhere", "--onnx", "x.onnx"], "neither a model directory nor a built-in model"),
])
def test_user_mistakes_exit_2_with_one_line(args, needle, capsys):
    # In process: argparse's errors exit, the command's own return 2; any other exception fails the test.
    # The installed entry point itself is test_version_and_module_entry_point's.
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert needle in lines[-1] and "Traceback" not in stderr


def test_demo_reports_verdicts_timings_and_block_configuration(tmp_path, capsys):
    assert main(["demo", "--layers", "2", "--dim", "32", "--out", str(tmp_path), "--no-backends"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"PASS equivalence: max relative difference \S+ <= bound \S+ \(zero init differs by the "
                     r"norms' eps only, see README\)", out)
    assert "PASS same model: TinyTransformer" in out
    assert re.search(r"Forward time, eager, \d+ thread\(s\), median of \d+ interleaved runs: original \S+ ms, "
                     r"converted \S+ ms", out)
    assert "the demo uses 4 blocks, not the API default of 8" in out
    injected = out[out.index("Injected BlockAttnRes"):].splitlines()
    assert injected[1].split() == ["site", "name", "layer", "kind", "block", "sources", "normalised", "route"]
    assert injected[3].split() == ["0", "blocks.0.attn_res", "blocks.0", "attn", "1", "1", "yes", "layer"]
    tables = out[:out.index("Forward time")]
    assert not re.search(r"\b(add|linear|layer_norm)_\d+\b", tables), "tables name modules, not fx nodes"
    assert (tmp_path / "rewritten_graph.py").read_text().count("attn_res") >= 4


def test_preserve_scale_demo_is_judged_exact(tmp_path, capsys):
    assert main(["demo", "--layers", "2", "--dim", "32", "--preserve-scale", "--block-size", "1", "--out",
                 str(tmp_path), "--no-backends"]) == 0
    out = capsys.readouterr().out
    assert "preserve_scale=True: exact up to fp32 round-off" in out and "as given on the command line" in out


def test_inspect_prints_sites_and_depth_weights_and_writes_the_heatmap(tmp_path, capsys):
    png = tmp_path / "depth.png"
    assert main(["inspect", "tiny", "--layers", "2", "--dim", "32", "--block-size", "2", "--png", str(png),
                 "--text", "def f(x): return x"]) == 0
    out = capsys.readouterr().out
    assert "blocks.1.mlp_res" in out and "entropy" in out and f"written to {png}" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("blocks.1.mlp_res ")]
    weights = [float(cell) for cell in rows[-1][3:-2]]
    assert abs(sum(weights) - 1) < 1e-3, "a site's weights over its sources sum to 1"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
