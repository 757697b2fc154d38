# Everything runs inside .venv; `make demo` and `make test` build it on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-fast fuzz bench bench-quick gpu-check compare compare-quick clean

venv: $(STAMP)

# torch is pinned first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[hf,onnx,genai,test,viz,bench,kernels,triton]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/attnres-fx demo

# Two workers (one per CI core); tests of one file share a worker, and the file's cached models.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

test: venv
	$(PYTEST)

test-fast: venv
	$(PYTEST) -m "not slow"

# The property tests with many random examples (make test runs a small derandomised set).
fuzz: venv
	$(PY) -m pytest -q tests/test_properties.py --hypothesis-profile=fuzz --hypothesis-show-statistics --timeout=0

bench: venv
	$(PY) benchmarks/bench.py

bench-quick: venv
	$(PY) benchmarks/bench.py --quick

# On a CUDA machine (torch with CUDA installed in .venv): the Triton kernels' tests and the op benchmark there.
gpu-check: venv
	PYTHON=$(PY) bash benchmarks/gpu_check.sh

# Training comparison (benchmarks/compare.py): about an hour on 2 CPU cores; results in benchmarks/results/compare.
compare: venv
	$(PY) benchmarks/compare.py

compare-quick: venv
	$(PY) benchmarks/compare.py --quick

clean:
	rm -rf $(VENV) build *.egg-info attnres_demo_out
