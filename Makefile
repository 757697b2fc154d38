# Everything runs inside .venv; `make demo` and `make test` build it on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo lint test test-fast test-integration test-compat integration-venvs coverage fuzz bench bench-quick gpu-check gpu-check-dry gpu-wheels compare compare-quick clean

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

# ruff's findings (the rules in pyproject.toml) fail test and test-fast before a test runs.
lint: venv
	$(PY) -m ruff check .

# The tiers (pyproject.toml): test-fast, the edit loop; test, what a release needs (test-fast included);
# test-integration, what needs other venvs or engines (.ci/run runs it after test).
test: lint
	$(PYTEST) -m "not integration"

test-fast: lint
	$(PYTEST) -m "not slow and not integration"

# Each part runs, also after an earlier one failed; the target fails if any did.
test-integration: venv
	@status=0; \
	$(MAKE) --no-print-directory test-compat || status=1; \
	$(MAKE) --no-print-directory test-vllm || status=1; \
	$(PYTEST) -m integration || status=1; \
	exit $$status

# Line coverage per package (attnres_fx, passes, export) of what .ci/run runs at the default versions: make test's
# selection and the integration tests in .venv, then the vLLM tests in their venv, every process they start
# included ([tool.coverage.run] in pyproject.toml); a report, and coverage.json. Each part runs, also after an
# earlier one failed; the target fails if any did. Under coverage's tracer Python-heavy tests (the Triton
# interpreter, onnxruntime-genai's model builder) run 2-3x longer: 600 s each instead of 120.
coverage: venv
	@rm -f .coverage .coverage.*; status=0; \
	$(PY) -m coverage run -m pytest -q -n 2 --dist loadfile -p no:cacheprovider --timeout=600 -m "not integration" || status=1; \
	$(PY) -m coverage run -m pytest -q -n 2 --dist loadfile -p no:cacheprovider --timeout=600 -m integration || status=1; \
	venv=$$(bash .ci/vllm-venv) && $$venv/bin/python -m coverage run -m pytest -q -p no:cacheprovider --timeout=600 -m integration \
		tests/serving/test_vllm.py || status=1; \
	$(PY) -m coverage combine -q && $(PY) -m coverage report && $(PY) -m coverage json -q -o coverage.json || status=1; \
	exit $$status

# The ends of the supported range (pyproject.toml), torch:transformers: the GPU machines' pair and the newest
# releases that install (make's .venv runs torch 2.13 with the newest transformers too). Each
# pair has its own venv under ~/.cache, built on a machine's first run (PyPI's CUDA builds of torch: minutes,
# ~5 GB) and reused after. In each: the fast suite, then the slow tests of conversion, the Hugging Face
# workflow, compilation and distributed training (pipeline stages included).
COMPAT_PAIRS ?= 2.11.0:5.17.0 2.14.1:5.25.0
COMPAT_SLOW  := tests/test_api.py tests/passes/test_rewrite.py tests/integrations/test_hf_workflow.py \
                tests/routing/test_live.py tests/routing/test_layer_route.py tests/integrations/test_distributed.py \
                tests/test_readme.py::test_the_pipelining_block_on_two_ranks

# Every pair runs, also after a failure in an earlier one; the target fails if any run failed.
test-compat:
	@status=0; for pair in $(COMPAT_PAIRS); do \
		venv=$$(bash .ci/compat-venv $${pair%%:*} $${pair##*:}) || { status=1; continue; }; \
		echo "== torch $${pair%%:*}, transformers $${pair##*:} ($$venv)"; \
		$$venv/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -m "not slow and not integration" || status=1; \
		$$venv/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -m slow $(COMPAT_SLOW) || status=1; \
	done; exit $$status

# The integration tier's venvs, built (or brought up to date) without running a test: .ci/run builds them while make
# test runs, since on a machine's first run they are mostly downloads (GBs of torch).
integration-venvs:
	@status=0; for pair in $(COMPAT_PAIRS); do bash .ci/compat-venv $${pair%%:*} $${pair##*:} || status=1; done; \
	bash .ci/vllm-venv || status=1; exit $$status

# Serving converted folders with vLLM (tests/serving/test_vllm.py): its CPU build in a venv of its own under ~/.cache
# (.ci/vllm-venv), built on a machine's first run and reused after.
.PHONY: venv-vllm test-vllm
venv-vllm:
	bash .ci/vllm-venv

test-vllm:
	venv=$$(bash .ci/vllm-venv) && $$venv/bin/python -m pytest -q -p no:cacheprovider -m integration tests/serving/test_vllm.py

# The property tests with many random examples (make test runs a small derandomised set).
fuzz: venv
	$(PY) -m pytest -q tests/passes/test_properties.py --hypothesis-profile=fuzz --hypothesis-show-statistics --timeout=0

bench: venv
	$(PY) benchmarks/bench.py

bench-quick: venv
	$(PY) benchmarks/bench.py --quick

# The GPU check (benchmarks/gpu_check.sh): on a CUDA machine with its own python3 and torch, the report in
# docs/gpu.md; gpu-check-dry runs the same steps at tiny sizes on the CPU (the suite runs it too).
gpu-check:
	bash benchmarks/gpu_check.sh

gpu-check-dry: venv
	PYTHON=$(PY) bash benchmarks/gpu_check.sh --dry-run --out benchmarks/results/gpu_dry_run.md

# The peers' AttnRes kernels, as wheels for a machine without an index (.whl/, carried to the GPU machine).
gpu-wheels:
	python3 -m pip download --no-deps --only-binary=:all: -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 liger-kernel==0.8.5

# Training comparison (benchmarks/compare.py): about an hour on 2 CPU cores; results in benchmarks/results/compare.
compare: venv
	$(PY) benchmarks/compare.py

compare-quick: venv
	$(PY) benchmarks/compare.py --quick

clean:
	rm -rf $(VENV) build *.egg-info attnres_demo_out
