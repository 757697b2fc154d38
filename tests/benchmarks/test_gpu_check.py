"""benchmarks/gpu_check.sh, the GPU check: on a machine without CUDA every GPU step says it is skipped; its
dry run runs every step at tiny sizes on the CPU and passes, so the script the GPU machine runs works."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("kernels", "compile", "op timings", "model timings")


def _run(tmp_path, *args, timeout):
    report = tmp_path / "gpu.md"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), *args, "--out", str(report)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return done, report.read_text() if report.exists() else ""


@pytest.mark.slow
def test_without_cuda_every_gpu_step_is_skipped_and_said_so(tmp_path):
    done, report = _run(tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert report.startswith("# GPU check (no CUDA: every GPU step skipped)")
    for step in STEPS:
        assert f"## {step}" in report and report.count("skipped: no CUDA") == len(STEPS), report


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_dry_run_runs_every_step_on_the_cpu_and_passes(tmp_path):
    done, report = _run(tmp_path, "--dry-run", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dry run on the CPU" in report
    for heading in [line for line in report.splitlines() if line.startswith("## ")]:
        assert heading.endswith(": passed"), report
    assert len([line for line in report.splitlines() if line.startswith("## ")]) == len(STEPS)
    # Each step produced its figures: the kernel table's rows, the compile errors, the op and model tables.
    assert "| [2, 8, 64] | 9 | fp32 |" in report and "| [2, 8, 64] | 9 | fp16 |" in report
    assert "fp32 forward: max error" in report and "bf16 autocast training step" in report
    assert "| attnres_fx kernel |" in report and "| forward |" in report and "| decode (2 tokens, batch 1) |" in report
