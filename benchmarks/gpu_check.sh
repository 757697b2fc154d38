#!/usr/bin/env bash
# On a CUDA machine, in one command: the Triton kernels compiled for the GPU against the reference
# oracle (forward, gradients, the operator's CUDA dispatch, opcheck), then the op and choices sections
# of the benchmark on the GPU. Results in benchmarks/results/gpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device visible to torch'"
"$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
"$PY" benchmarks/bench.py --sections op,choices --backends compiled --device cuda --out benchmarks/results/gpu
