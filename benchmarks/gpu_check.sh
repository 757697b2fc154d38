#!/usr/bin/env bash
# The GPU check in one command, on a CUDA machine as it comes: its own python3 (torch with CUDA, Triton,
# transformers), the project from this checkout by PYTHONPATH (nothing is built or installed), the peers'
# kernels from wheels in .whl/ where `make gpu-wheels` put them (installed into a temporary folder, no index).
# Arguments go to benchmarks/gpu_check.py (--dry-run: every step at tiny sizes on the CPU; --out FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case " $* " in
    *" --dry-run "*) export TRITON_INTERPRET=1 ;;
esac
exec "$PY" benchmarks/gpu_check.py "$@"
