"""benchmarks/bench.py keeps working: its --quick mode end to end, and its timing helpers. No test
asserts a timing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnres_fx.timing import interleaved, median_ms, pooled
from conftest import cold_compile, load_script
from genai_support import needs_genai

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


def _module():
    return load_script(BENCH, "attnres_bench")


def _run(out: Path, *flags: str) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


@cold_compile
@pytest.mark.slow
def test_quick_eager_sections(tmp_path):
    results, report = _run(tmp_path, "--backends", "eager", "--sections", "forward,train,first_call,decode,stages")
    forward = results["forward"]["bench"]["eager"]
    assert set(forward) == {"original", "converted", "model_route", "graph", "full"}
    assert forward["original"]["ratio"] == 1.0
    assert all(entry["min_ms"] > 0 for entry in forward.values())
    assert set(results["train"]["bench"]["eager"]) == {"original", "converted", "model_route", "full"}
    for route in ("layer", "model"):
        assert results["first_call"][route]["first_call_s"] > 0 and results["first_call"][route]["convert_s"] > 0
    assert set(results["decode"]["eager"]) == {"batch1", "batch8"}
    assert results["decode"]["eager"]["batch8"]["converted"]["rate"] > 0
    assert results["decode"]["eager"]["batch8"]["model_route"]["rate"] > 0
    stages = results["stages"]
    # Cross-stage caching sends each completed block once: never more bytes than the plain boundaries.
    assert 0 < stages["cached_bytes"] < stages["plain_bytes"]
    assert stages["state_tensors"] == stages["num_blocks"] and stages["state_mb"] > 0
    assert "eager forward, bench" in results["targets"]
    for heading in ("## Forward latency", "## Training step", "## First call", "## Decoding",
                    "## Pipeline stages and the state between blocks", "## Memory-traffic model", "## Targets"):
        assert heading in report


@pytest.mark.slow
def test_quick_training_overhead_sections(tmp_path):
    """The training-cost rows: the Llama step against the pseudo-queries' std, the deep model's step and the
    op's forward and backward against a copy of the same bytes, each on one thread in CPU time."""
    results, report = _run(tmp_path, "--backends", "eager", "--sections", "query_sizes,deep_train,op_train")
    sizes = results["query_sizes"]
    assert set(sizes["train"]) == {"original", "std0", "std0.1", "std1", "std3"}
    assert set(sizes["versus_std0.1"]) == {"std1", "std3"} and sizes["clock"] == "one thread, thread CPU time"
    deep = results["deep_train"]
    assert set(deep["train"]) == {"original", "converted"} and deep["copies"] == 3
    assert deep["train"]["converted"]["runs"] == deep["rounds"] == 3 * 3  # the quick run's rounds, three times
    rows = results["op_train"]["rows"]
    assert [(row["shape"], row["sources"]) for row in rows] == [([2, 16, 64], 2), ([2, 16, 64], 3), ([1, 1, 64], 2),
                                                                ([1, 1, 64], 3)]
    assert all(row["eager_us"] > 0 and row["copy_us"] > 0 and row["engine_us"] > 0 and 0 < row["eager_fraction"]
               for row in rows)
    assert {"Llama training step, std 1 / std 0.1 (median of round ratios)",
            "op forward+backward / same-bytes copy at [2, 128, 512] (fewest of its source counts)",
            } <= set(results["targets"])
    for heading in ("## Training step against the pseudo-queries' size", "## The op's forward and backward against",
                    "## Training step, eager, deep"):
        assert heading in report


@pytest.mark.slow
def test_quick_load_section(tmp_path):
    results, report = _run(tmp_path, "--sections", "load")
    depths = results["load"]["depths"]
    assert set(depths) == {"2", "4"}
    assert all(entry["original_s"] > 0 and entry["converted_s"] > 0 for entry in depths.values())
    assert "## Loading a saved folder" in report


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_quick_memory_and_compiled_op(tmp_path):
    """The compiled forward and training step run the eager sections' code with Inductor as the backend
    (``make bench-quick`` runs them); the op section runs the aggregation eagerly and compiled, the choices
    section every candidate."""
    results, report = _run(tmp_path, "--sections", "memory,op,choices", "--backends", "compiled")
    memory = results["memory"]
    assert memory["budget_mb"] > 0 and set(memory["train"]) == {"original", "converted"}
    assert "extra_mb" in memory["inference"]["extra_vs_model"]
    op = results["op"]
    assert set(op["block_op"]) == {"2", "3"} and op["block_op"]["2"]["kernel_fraction"] > 0
    assert {"eager_two_phase_ms", "compiled_per_site_ms", "bound_ms"} <= set(op["block_group"])
    choices = results["choices"]
    assert {"stacked", "fusable", "operator"} <= set(choices["eager"][0]) and choices["training"]
    assert {"inference decomposition", "training operator"} <= set(choices["inductor"][0])
    assert {"per-source", "stacked", "batched"} <= set(choices["onnx"][0])
    assert {"op / streaming bound, C++ kernel (fewest of its source counts)",
            "inference peak memory: extra over original / N + 1 block sums"} <= set(results["targets"])
    for heading in ("## Peak memory", "## The op against the streaming bound", "## Implementation choices"):
        assert heading in report


@pytest.mark.integration
@pytest.mark.timeout(600)
@needs_genai
def test_quick_genai_section(tmp_path):
    """onnxruntime-genai on the model builder's folder of the original Llama and on the folders of the
    converted model (the builder's graph with the pass in each form, and torch.onnx's at fp32), fp32 and
    int4: rates, their ratios to the builder's, the load beside them, node counts, peak memory."""
    results, report = _run(tmp_path, "--sections", "genai")
    llama = results["genai"]["llama"]
    for precision, variants in (("fp32", {"builder", "converted", "attention", "torch_onnx"}),
                                ("int4", {"builder", "converted", "attention"})):
        entry = llama[precision]
        assert entry["baseline"] == "onnxruntime-genai's model builder"
        assert entry["graph"]["converted"] == "builder"
        for batch in ("batch1", "batch8"):
            timed = dict(entry[batch])
            assert timed.pop("load_average") >= 0
            assert set(timed) == variants and timed["builder"]["ratio"] == 1.0
            assert all(row["rate"] > 0 for row in timed.values())
        assert all(row["peak_delta_mb"] > 0 for row in entry["memory"].values())
        assert entry["nodes"]["converted"] > entry["nodes"]["builder"]
    assert llama["fp32"]["graph"]["torch_onnx"] == "torch.onnx"
    assert ("decode tokens/s, onnxruntime-genai, converted folder / builder's original, Llama int4 batch 8"
            in results["targets"])
    assert entry["nodes"]["attention"] < entry["nodes"]["converted"]
    assert "## onnxruntime-genai decoding" in report and "| llama | int4 | 1 |" in report


def test_interleaved_alternates_order_and_summarise_takes_ratios():
    """The one timing helper (:mod:`attnres_fx.timing`, which the CLI and the export report use too)."""
    bench = _module()
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = interleaved(fns, runs=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert set(median_ms(times)) == {"a", "b"}
    summary = bench.summarise({"a": [1.0, 3.0, 2.0], "b": [4.0, 2.0, 8.0]}, "a")
    assert summary["a"]["ratio"] == 1.0 and summary["b"]["ratio"] == 2.0 and summary["b"]["ratio_min"] == 2.0
    assert summary["b"]["median_ms"] == 4000.0
    rates = bench.summarise({"a": [1.0, 2.0], "b": [2.0, 4.0]}, "a", per_call=10)
    assert rates["b"]["rate"] == pytest.approx(10 / 3) and rates["b"]["ratio"] == pytest.approx(0.5)


def test_pooled_averages_each_candidates_copies_round_by_round():
    times = {"a#0": [1.0, 4.0], "a#1": [3.0, 2.0], "b#0": [5.0, 5.0]}
    assert pooled(times, {"a": ["a#0", "a#1"], "b": ["b#0"]}) == {"a": [2.0, 3.0], "b": [5.0, 5.0]}
    with pytest.raises(ValueError):
        pooled({"a#0": [1.0], "a#1": [1.0, 2.0]}, {"a": ["a#0", "a#1"]})      # rounds missing: not an average


@pytest.mark.slow
def test_quick_handwritten_section(tmp_path):
    """The hand-written Llama's rows, each side timed as several copies of its model."""
    results, report = _run(tmp_path, "--sections", "handwritten")
    hand = results["handwritten"]
    assert hand["copies"] > 1
    for row in (hand["mid"]["forward"], hand["mid"]["train"], hand["deep"]["train"], hand["mid"]["decode"]):
        assert set(row) == {"original", "converted"} and row["original"]["ratio"] == 1.0
        assert row["converted"]["runs"] == row["original"]["runs"] > 0 and row["converted"]["min_ms"] > 0
    assert hand["mid"]["decode"]["converted"]["rate"] > 0
    for shape in ("mid", "deep"):
        kept = hand[shape]["kept_mb"]
        assert kept["original"] > 0 and kept["converted"] > 0
        # A fused site keeps no copy of its aggregate for its norm: the converted model's forward keeps no more
        # than the original's (which keeps each norm's input and its intermediates) plus a tenth.
        assert kept["converted"] < 1.1 * kept["original"], kept
    assert "Kept for the backward by a training forward" in report
    assert "## A Llama written by hand" in report and f"each side {hand['copies']} copies" in report
    assert "Hand-written Llama decode tokens/s, eager, one thread" in results["targets"]


def test_rejects_unknown_sections(tmp_path):
    with pytest.raises(SystemExit, match="unknown"):
        _module().main(["--quick", "--sections", "forward,latency", "--out", str(tmp_path)])
