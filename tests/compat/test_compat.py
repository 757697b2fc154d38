"""The supported releases: one range per library, stated once in compat and once in pyproject.toml, checked
at import; the differences between releases handled in compat."""

import functools
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from attnres_fx import compat

ROOT = Path(__file__).resolve().parents[2]


def _pyproject_range(library: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(minimum, first excluded)`` of the one requirement on ``library`` in pyproject.toml, as
    ``(major, minor)`` pairs (``<6`` is ``(6, 0)``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    found = {r for r in requirements if re.match(rf"{library}[<>=]", r)}
    assert len(found) == 1, found
    low, high = re.fullmatch(rf"{library}>=([\d.]+),<([\d.]+)", found.pop()).groups()
    return compat.release(low + ".0"), compat.release(high + ".0")


def test_pyproject_states_the_ranges_compat_checks():
    assert _pyproject_range("torch") == compat.SUPPORTED_TORCH
    assert _pyproject_range("transformers") == compat.SUPPORTED_TRANSFORMERS


def test_the_running_releases_are_in_the_supported_range():
    low, high = compat.SUPPORTED_TORCH
    assert low <= compat.release(torch.__version__) < high
    transformers = pytest.importorskip("transformers")
    low, high = compat.SUPPORTED_TRANSFORMERS
    assert low <= compat.release(transformers.__version__) < high


@pytest.mark.parametrize("version, release", [("2.11.0+cu130", (2, 11)), ("2.14.1", (2, 14)), ("5.17.0.dev0", (5, 17)),
                                              ("2.13.0+cpu", (2, 13))])
def test_release_reads_major_and_minor(version, release):
    assert compat.release(version) == release


def test_a_release_below_the_range_raises_naming_the_range_and_the_fix():
    with pytest.raises(ImportError, match=r"attnres_fx needs torch>=2\.11,<2\.15; this is torch 2\.10\.0 "
                                          r"\(pip install 'torch>=2\.11,<2\.15'\)"):
        compat.check_version("torch", "2.10.0", compat.SUPPORTED_TORCH)
    with pytest.raises(ImportError, match=r"transformers>=5\.16,<6\.0; this is transformers 5\.15\.1"):
        compat.check_version("transformers", "5.15.1", compat.SUPPORTED_TRANSFORMERS)


def test_a_newer_release_warns_and_a_supported_one_is_silent():
    with pytest.warns(UserWarning, match=r"tested on torch>=2\.11,<2\.15; torch 2\.15\.0 is newer"):
        compat.check_version("torch", "2.15.0", compat.SUPPORTED_TORCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version in ("2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu128"):
            compat.check_version("torch", version, compat.SUPPORTED_TORCH)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["attnres_fx, transformers", "transformers, attnres_fx"])
def test_an_unsupported_transformers_is_refused_at_its_import_beside_attnres_fx(tmp_path, order):
    """A transformers 5.15 installed (a package of that version on the path), imported in either order
    in a fresh process. Formerly both imports passed: the check waited for transformers' models, which
    ``import transformers`` does not import, and the error came at the first model class used."""
    package = tmp_path / "transformers"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "5.15.0"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", f"import {order}"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1] == (
        "ImportError: attnres_fx needs transformers>=5.16,<6.0; this is transformers 5.15.0 "
        "(pip install 'transformers>=5.16,<6.0')"), out.stderr


def test_the_auto_classes_of_a_model_are_found_without_listing_transformers():
    """Formerly ``dir(transformers)``: its lazy module lists thousands of names, half a second of every
    converted save."""
    transformers = pytest.importorskip("transformers")

    def listed(module):
        raise AssertionError("dir(transformers) listed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(transformers), "__dir__", listed)
        assert compat.hf_auto_classes(transformers.LlamaForCausalLM, transformers.LlamaConfig) == [
            "AutoModelForCausalLM"]
        assert "AutoModel" in compat.hf_auto_classes(transformers.LlamaModel, transformers.LlamaConfig)


def test_compile_with_recompile_limit_allows_that_many_graphs_and_restores_the_setting():
    """Dynamo's default is 8 graphs per code object; the limit given is honoured on every release (a
    keyword of torch.compile from 2.13, the process-wide setting raised during calls before), and the
    user's own setting is as it was afterwards."""
    before = torch._dynamo.config.recompile_limit
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return gm.forward

    compiled = compat.compile_with_recompile_limit(lambda x, n: x * n, 12, backend=backend, fullgraph=True,
                                                   dynamic=False)
    for n in range(10):  # ints are specialised: one graph per value
        compiled(torch.ones(2), n)
    assert len(calls) == 10
    assert torch._dynamo.config.recompile_limit == before


def test_a_capture_ignoring_several_logging_functions_logs_no_error():
    """transformers' once-only logging helpers are functools.lru_cache wrappers, which do not sort; torch
    2.11 sorts Dynamo's config sets into each compilation's metrics and logs the failure as an error at
    every capture. No error is logged on any release, and the logging calls stay no-ops in the graph."""
    import logging

    quiet = [functools.lru_cache(None)(lambda message, i=i: print(message, i)) for i in range(2)]

    def block(x):
        quiet[0]("inside")
        quiet[1]("inside")
        return x + 1

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    dynamo_logger = logging.getLogger("torch._dynamo")
    dynamo_logger.addHandler(handler)
    try:
        with compat.dynamo_capture_config(set(quiet)):
            out = torch.compile(block, backend="eager", fullgraph=True)(torch.zeros(2))
    finally:
        dynamo_logger.removeHandler(handler)
    assert torch.equal(out, torch.ones(2))
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage()[:300] for r in records]
