"""The Triton kernels (attnres_fx/op/kernels/gpu.py), fp32, against the reference oracle: forward and
gradients. On a CUDA machine they run compiled (``benchmarks/gpu_check.sh``); elsewhere in Triton's CPU
interpreter, in a process of their own started with TRITON_INTERPRET=1: Triton reads it when it is
first imported (its own library functions are kernels too), and Inductor may have imported it already
in this one."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from test_ops import CASES, SATURATING, SATURATING_IDS, _check, _kernel_call, check_no_subnormals

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
ON_GPU = torch.cuda.is_available()
RUNS_HERE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"
here = pytest.mark.skipif(not RUNS_HERE, reason="run by test_the_kernels_in_the_interpreter")


@pytest.mark.slow
@pytest.mark.skipif(RUNS_HERE, reason="the kernels' tests run in this process")
def test_the_kernels_in_the_interpreter():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300,
                          cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    # Every kernel test ran there: the reference cases, the saturated ones and the width check (this test skips itself,
    # and the operator's CUDA dispatch needs a GPU).
    assert f"{len(CASES) + len(SATURATING) + 1} passed, 3 skipped" in done.stdout, done.stdout[-2000:]


def _on_device(implementation):
    def run(sources, proj, norm, preserve_scale, grad):
        moved = [s.detach().to(DEVICE).requires_grad_() for s in sources]
        out, grads = implementation(moved, proj.to(DEVICE), norm.to(DEVICE), preserve_scale, grad.to(DEVICE))
        return out.cpu(), [g.cpu() for g in grads]
    return run


@here
@pytest.mark.parametrize("k, shape", CASES, ids=[f"{k}x{'x'.join(map(str, s))}" for k, s in CASES])
def test_matches_the_reference_fp32(k, shape):
    from attnres_fx.op.kernels import gpu

    _check(_on_device(_kernel_call(gpu.aggregate, gpu.aggregate_backward)), k, shape, preserve_scale=k % 2 == 1)


@here
@pytest.mark.parametrize("query_std, magnitude", SATURATING, ids=SATURATING_IDS)
def test_saturated_softmax_leaves_no_subnormal_value(query_std, magnitude):
    from attnres_fx.op.kernels import gpu

    # Few rows: the interpreter runs each program in Python.
    check_no_subnormals(_on_device(_kernel_call(gpu.aggregate, gpu.aggregate_backward)), query_std, magnitude,
                        shape=(1, 16, 512))


@here
def test_rows_wider_than_a_program_are_left_to_pytorch():
    from attnres_fx.op.kernels import gpu

    assert gpu.supports([torch.empty(1, gpu.MAX_DIM)]) and not gpu.supports([torch.empty(1, gpu.MAX_DIM + 1)])


@pytest.mark.skipif(not ON_GPU, reason="the operator's CUDA dispatch needs a GPU")
@pytest.mark.parametrize("k, shape", [(3, (8, 1, 1000)), (9, (2, 64, 128))])
def test_the_operator_runs_the_triton_kernel_on_cuda(k, shape):
    from test_ops import IMPLEMENTATIONS

    _check(_on_device(IMPLEMENTATIONS["operator"]), k, shape, preserve_scale=True)
    sources = [torch.randn(shape, device=DEVICE, requires_grad=True) for _ in range(k)]
    proj = torch.randn(1, shape[-1], device=DEVICE, requires_grad=True)
    norm = torch.rand(shape[-1], device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.attnres.aggregate.default, (sources, proj, norm, 1e-6, False))
