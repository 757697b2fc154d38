"""The parity harness: the pytest plugin attnres_fx.testing.hf_parity and benchmarks/hf_parity.py."""

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
# The in-process runs below put sys.modules back as they found it: a module first imported inside them
# would be dropped while the operators it registered stay, and importing it again later in this process
# fails (torchao, which transformers' models import, defines its operators at import). Imported here first.
from transformers import LlamaConfig, LlamaModel  # noqa: E402, F401

from attnres_fx.integrations import autoload  # noqa: E402
from attnres_fx.testing.hf_parity import describe_failure  # noqa: E402

pytest_plugins = ("pytester",)

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_parity.py"

# A model test file as transformers' own are written: tiny models built from a config, called, checked.
MODEL_TESTS = textwrap.dedent('''
    import unittest

    import torch
    from transformers import LlamaConfig, LlamaModel

    import attnres_fx


    def tiny():
        return LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2))


    class TinyTest(unittest.TestCase):
        def test_runs(self):
            ids = torch.randint(0, 64, (2, 5))
            self.assertEqual(tiny()(ids).last_hidden_state.shape, (2, 5, 32))

        def test_is_original(self):
            self.assertFalse(attnres_fx.is_converted(tiny()))

        def test_builds_no_model(self):
            self.assertEqual(1 + 1, 2)

        def test_subtests(self):
            for size in (1, 2):
                with self.subTest(size=size):
                    self.assertFalse(attnres_fx.is_converted(tiny()))
''')


def records(path: Path) -> dict:
    return {json.loads(line)["nodeid"].split("::")[-1]: json.loads(line) for line in path.read_text().splitlines()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["converted", "original"])
def test_plugin_converts_every_model_built_and_records_it(pytester, mode):
    pytester.makepyfile(test_tiny=MODEL_TESTS)
    record = pytester.path / "record.jsonl"
    result = pytester.runpytest_inprocess("-p", "attnres_fx.testing.hf_parity", f"--attnres-mode={mode}",
                                          f"--attnres-record={record}", "-p", "no:cacheprovider")
    assert autoload._POLICY == [], "the policy outlives the run"
    found = records(record)
    assert found["test_builds_no_model"] | {"duration": 0} == {
        "nodeid": "test_tiny.py::TinyTest::test_builds_no_model", "outcome": "passed", "duration": 0,
        "converted": [], "not_converted": [], "failures": []}
    assert found["test_runs"]["outcome"] == "passed"
    if mode == "original":
        result.assert_outcomes(passed=4)
        assert all(entry["converted"] == [] and entry["outcome"] == "passed" for entry in found.values())
        return
    assert found["test_runs"]["converted"] == ["LlamaModel"]
    assert found["test_is_original"]["outcome"] == "failed"
    assert found["test_is_original"]["failures"][0]["exception"].startswith("AssertionError: True is not false")
    assert found["test_is_original"]["failures"][0]["test_line"].endswith("(test_is_original)")
    # A failing subtest fails the test, though its own call passed.
    assert found["test_subtests"]["outcome"] == "failed"
    assert found["test_subtests"]["converted"] == ["LlamaModel", "LlamaModel"]
    result.stdout.fnmatch_lines(["*attnres_fx parity*", "*1 passing test(s) did not have every model converted*"])


def test_plugin_counts_a_model_built_inside_another_as_covered(pytester):
    """A model built inside another's __init__ is the outer conversion's part: only the outer one counts;
    a model whose post_init runs again is counted once."""
    pytester.makepyfile(test_nested='''
        import attnres_fx.testing.hf_parity as parity


        class Inner:
            def modules(self):
                return [self]


        class Outer:
            def __init__(self, inner):
                self.inner = inner

            def modules(self):
                return [self, self.inner]


        def test_nested(request):
            recorder = parity.autoload._POLICY[0].__self__
            inner = Inner()
            recorder.policy(inner)
            outer = Outer(inner)
            recorder.policy(outer)
            assert recorder.policy(outer) is None, "post_init run again on a model built before"
            assert [(b.name, b.state) for b in recorder.current.built] == [("Inner", "inner"), ("Outer", "pending")]
    ''')
    result = pytester.runpytest_inprocess("-p", "attnres_fx.testing.hf_parity", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_describe_failure_names_where_a_chained_error_arises():
    def inner():
        raise KeyError("layers.0.attn_res.proj.weight")

    try:
        try:
            inner()
        except KeyError as err:
            raise RuntimeError("loading failed\nfrom user code:\n"
                               "  File \"/x/modeling_llama.py\", line 7, in forward") from err
    except RuntimeError as err:
        described = describe_failure(err)
    assert described["exception"] == ('RuntimeError: loading failed from user code: '
                                      'File "/x/modeling_llama.py", line 7, in forward')
    assert described["root_cause"] == "KeyError: 'layers.0.attn_res.proj.weight'"
    assert described["traced_line"] == "/x/modeling_llama.py:7 (forward)"
    assert described["crash_line"].endswith("(test_describe_failure_names_where_a_chained_error_arises)")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("hf_parity_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def entry(nodeid, outcome, converted=("LlamaModel",), not_converted=(), exception=None):
    failures = [{"when": "call", "exception": exception, "attnres_fx_line": "live.py:154 (run)"}] if exception else []
    return {"nodeid": nodeid, "outcome": outcome, "converted": list(converted), "not_converted": list(not_converted),
            "failures": failures}


def test_benchmark_groups_regressions_by_folded_cause():
    bench = load_benchmark()
    original = {n: entry(n, "passed", converted=()) for n in ("f::T::a", "f::T::b", "f::T::c", "f::T::d", "f::T::e")}
    original["f::T::f"] = entry("f::T::f", "failed", converted=())
    converted = {
        "f::T::a": entry("f::T::a", "failed", exception="TraceError: layers.0 (LlamaDecoderLayer) at 0x7f01"),
        "f::T::b": entry("f::T::b", "failed", exception="TraceError: layers.1 (LlamaDecoderLayer) at 0x7f99"),
        "f::T::c": entry("f::T::c", "failed", exception="KeyError: 'x'"),
        "f::T::d": entry("f::T::d", "passed", converted=(), not_converted=("LlamaForCausalLM",)),
        "f::T::e": entry("f::T::e", "passed", converted=()),
        "f::T::f": entry("f::T::f", "passed"),
    }
    summary = bench.compare("llama", original, converted)
    assert (summary["passed_original"], summary["passed_converted"], summary["regressions"]) == (5, 3, 3)
    assert summary["passed_converted_with_every_model_converted"] == 1
    causes = summary["regression_causes"]
    assert [c["tests"] for c in causes] == [["T::a", "T::b"], ["T::c"]]
    assert causes[0]["lines"] == ["2x attnres_fx_line: live.py:154 (run)"]
    assert summary["passed_converted_without_conversion"] == {"not converted": ["T::d"], "partly converted": [],
                                                              "no model": ["T::e"]}
    assert summary["passed_converted_only"] == ["T::f"]


@pytest.mark.slow
def test_benchmark_runs_a_source_tree_twice_and_summarises(tmp_path):
    src = tmp_path / "transformers"
    (src / "tests" / "models" / "tiny").mkdir(parents=True)
    (src / "tests" / "models" / "tiny" / "test_modeling_tiny.py").write_text(MODEL_TESTS)
    out = tmp_path / "out"
    bench = load_benchmark()
    assert bench.main(["--transformers-src", str(src), "--models", "tiny", "--out", str(out),
                       "-k", "not subtests", "--python", sys.executable]) == 0
    summary = json.loads((out / "hf_parity.json").read_text())["architectures"][0]
    assert (summary["passed_original"], summary["passed_converted"], summary["regressions"]) == (3, 2, 1)
    assert summary["regression_causes"][0]["tests"] == ["TinyTest::test_is_original"]
    assert summary["passed_converted_without_conversion"]["no model"] == ["TinyTest::test_builds_no_model"]
    assert set(summary["runs"]) == {"original", "converted"}
    report = (out / "hf_parity.md").read_text()
    assert "| tiny | 3 | 3 | 2 | 1 | 1 | 0 |" in report
    # No variant: the records already there are summarised again, nothing runs.
    (out / "hf_parity.md").unlink()
    assert bench.main(["--transformers-src", str(src), "--models", "tiny", "--out", str(out), "-k", "not subtests",
                       "--variants"]) == 0
    assert (out / "hf_parity.md").read_text() == report


def test_benchmark_names_architectures_without_a_test_file(tmp_path):
    bench = load_benchmark()
    with pytest.raises(SystemExit, match="for: nosuch"):
        bench.main(["--transformers-src", str(tmp_path), "--models", "nosuch"])


def test_the_architectures_table_reads_the_parity_summary(tmp_path):
    """benchmarks/architectures.py's column: passed original / converted per architecture, by the
    directory transformers tests a model class in; an architecture not run says so."""
    from conftest import load_script

    architectures = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "architectures.py",
                                "attnres_architectures")
    summary = {"architectures": [{"architecture": "t5", "passed_original": 268, "passed_converted": 260},
                                 {"architecture": "llama", "passed_original": 170, "passed_converted": 169}]}
    path = tmp_path / "hf_parity.json"
    path.write_text(json.dumps(summary))
    parity = architectures.read_parity(path)
    assert architectures.parity_cell("t5_encoder", parity) == "268 / 260"
    assert architectures.parity_cell("llama", parity) == "170 / 169"
    assert architectures.parity_cell("gemma2", parity) == "not run"
    assert architectures.read_parity(tmp_path / "missing.json") == {}
