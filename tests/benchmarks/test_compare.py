"""benchmarks/compare.py: its --quick mode end to end (outputs written, every number finite, the exact
conversion leaves the loss where it was), and the data and schedule it trains with. No test asserts a
timing or which variant wins."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_script

COMPARE = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"


def _module():
    return load_script(COMPARE, "attnres_compare")


def _finite(values):
    return all(math.isfinite(v) for v in values)


@pytest.mark.slow
def test_quick_run_writes_every_output_with_finite_numbers(tmp_path):
    done = subprocess.run([sys.executable, str(COMPARE), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "compare.json").read_text())
    config = results["config"]
    assert results["quick"] and config["seeds"] == 2
    runs = results["runs"]
    assert sorted((r["variant"], r["seed"]) for r in runs) == sorted(
        (variant, seed) for variant in ("baseline", "block4", "block8", "full") for seed in (0, 1))
    for run in runs:
        assert len(run["train_loss"]) == config["steps"] and _finite(run["train_loss"])
        assert [p["step"] for p in run["validation"]] == list(range(config["eval_every"], config["steps"] + 1,
                                                                     config["eval_every"]))
        assert _finite([p["loss"] for p in run["validation"]] + [run["final_validation_loss"],
                                                                  run["tokens_per_second"]])
        if run["variant"] != "baseline":
            depth = run["depth"]
            assert len(depth["weights"]) == len(depth["sites"]) == 2 * config["model"]["num_layers"] + 1
            assert all(abs(sum(row) - 1) < 1e-4 for row in depth["weights"])
    conversions = [r["conversion"] for r in runs if "conversion" in r]
    assert len(conversions) == 2
    for conversion in conversions:
        # preserve_scale=True: the converted model computes the trained baseline's function.
        assert abs(conversion["loss_after_conversion"] - conversion["loss_before_conversion"]) < 1e-4
        assert len(conversion["train_loss"]) == config["steps"] - config["steps"] // 2
        assert conversion["validation"][0]["step"] == config["steps"] // 2
        assert _finite(conversion["train_loss"] + [conversion["final_validation_loss"]])
    summary = results["summary"]
    assert set(summary["variants"]) == {"baseline", "block4", "block8", "full"}
    assert _finite(summary["variants"]["block4"]["difference_to_baseline"])
    report = (tmp_path / "compare.md").read_text()
    assert "| variant | final validation loss |" in report and "Converting the trained baseline" in report
    assert report in done.stdout
    for name in ("curves", "conversion", "depth_block4", "depth_block8", "depth_full", "depth_converted"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_batches_follow_seed_and_step_and_validation_is_held_out():
    compare = _module()
    assert not set(compare.TRAIN_MODULES) & set(compare.VALIDATION_MODULES)
    corpus = compare.Corpus()
    cfg = compare.QUICK
    x, y = corpus.batch(0, 3, cfg)
    assert x.shape == y.shape == (cfg.batch, cfg.seq) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(corpus.batch(0, 3, cfg)[0], x), "the same batch for every variant of a seed"
    assert not torch.equal(corpus.batch(1, 3, cfg)[0], x) and not torch.equal(corpus.batch(0, 4, cfg)[0], x)
    windows = corpus.validation_windows(5, cfg.seq)
    assert windows.shape == (5, cfg.seq + 1) and int(windows.max()) < 256


def test_schedule_warms_up_decays_and_ramps_a_group_that_starts_late():
    compare = _module()
    cfg = compare.Config(steps=100, warmup=0.1, min_lr_ratio=0.1)
    weights = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    optimizer = torch.optim.SGD([{"params": [weights[0]], "lr": 1.0, "base_lr": 1.0, "start": 0},
                                 {"params": [weights[1]], "lr": 2.0, "base_lr": 2.0, "start": 50}])
    rates = {}
    for step in (0, 4, 9, 10, 50, 54, 59, 99):
        compare.set_rates(optimizer, step, cfg)
        rates[step] = [group["lr"] for group in optimizer.param_groups]
    assert rates[0][0] == pytest.approx(0.1) and rates[4][0] == pytest.approx(0.5) and rates[9][0] == 1.0
    assert rates[10][0] == 1.0 and rates[99][0] == pytest.approx(0.1, abs=1e-3)
    assert rates[0][1] == rates[10][1] == 0.0, "a group that starts later has no rate before"
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 49 / 90))
    assert rates[59][1] == pytest.approx(2.0 * cosine) and rates[54][1] == pytest.approx(2.0 * 0.5 * rates[54][0])


def test_unknown_variants_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        _module().parse_args(["--quick", "--variants", "baseline,block5", "--out", str(tmp_path)])


def test_flags_set_the_parts_of_a_copy_of_the_configuration(tmp_path):
    compare = _module()
    _, cfg = compare.parse_args(["--quick", "--layers", "3", "--seq", "8", "--lr", "0.5", "--steps", "6",
                                 "--out", str(tmp_path)])
    assert (cfg.model.num_layers, cfg.seq, cfg.optimiser.lr, cfg.steps) == (3, 8, 0.5, 6)
    assert (compare.QUICK.model.num_layers, compare.QUICK.optimiser.lr, compare.QUICK.steps) == (2, 3e-3, 8)
