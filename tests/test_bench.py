"""benchmarks/bench.py keeps working: its --quick mode end to end, and its timing helpers. No test
asserts a timing."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
VARIANTS = {"original", "block", "block_two_phase", "full", "full_two_phase"}


def _module():
    if "attnres_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("attnres_bench", BENCH)
        module = importlib.util.module_from_spec(spec)
        # dataclasses resolve the module's string annotations through sys.modules.
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["attnres_bench"]


def _run(out: Path, *flags: str) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


def test_quick_eager_forward_and_training(tmp_path):
    results, report = _run(tmp_path, "--backends", "eager", "--sections", "forward,train")
    assert results["quick"] and set(results["forward"]) == {"eager"}
    forward = results["forward"]["eager"]
    assert set(forward) == VARIANTS and forward["original"]["ratio"] == 1.0
    runs = results["config"]["runs"]
    assert all(entry["runs"] == runs and entry["min_ms"] > 0 for entry in forward.values())
    assert set(results["train"]["eager"]) == {"original", "block"}
    assert {row["variant"] for row in results["traffic"]} >= {"standard", "block_two_phase"}
    for heading in ("## Forward latency", "## Training step", "## Memory-traffic model"):
        assert heading in report


@pytest.mark.slow
def test_quick_every_section(tmp_path):
    results, report = _run(tmp_path)
    assert set(results["forward"]) == {"eager", "compiled", "onnx"}
    assert all(set(rows) == VARIANTS for rows in results["forward"].values())
    assert set(results["train"]) == {"eager", "compiled"}
    memory = results["memory"]
    assert memory["budget_mb"] > 0
    for allocator in ("glibc_default", "mmap_64k"):
        assert set(memory[allocator]["inference"]) == {"original", "block", "block_two_phase"}
        assert set(memory[allocator]["train"]) == {"original", "block"}
    op = results["op"]
    assert set(op["block_op"]) == {"2", "3"} and op["full_widest_site"]["sources"] == 5
    assert {"per_site_ms", "two_phase_ms", "bound_ms"} <= set(op["block_group"])
    assert any(name.startswith("compiled forward overhead") for name in results["targets"])
    for heading in ("## Peak memory", "## Compiled op", "## Targets"):
        assert heading in report


def test_interleaved_alternates_order_and_summarise_takes_ratios():
    bench = _module()
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = bench.interleaved(fns, runs=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    summary = bench.summarise({"a": [1.0, 3.0, 2.0], "b": [4.0, 2.0, 8.0]}, "a")
    assert summary["a"]["ratio"] == 1.0 and summary["b"]["ratio"] == 2.0 and summary["b"]["ratio_min"] == 2.0
    assert summary["b"]["median_ms"] == 4000.0


def test_rejects_unknown_sections(tmp_path):
    with pytest.raises(SystemExit, match="unknown"):
        _module().main(["--quick", "--sections", "forward,latency", "--out", str(tmp_path)])
