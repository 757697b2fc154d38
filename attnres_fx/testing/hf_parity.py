"""A pytest plugin that runs a library's own tests on converted Hugging Face models.

    python -m pytest -p attnres_fx.testing.hf_parity tests/models/llama/test_modeling_llama.py

At configure time it sets :func:`attnres_fx.integrations.autoload.construction_policy`, so that every outermost
``PreTrainedModel`` the tests build is converted right after transformers' ``post_init`` with
``preserve_scale=True`` and then given random pseudo-queries and key-norm weights
(:func:`attnres_fx.testing.randomise_pseudo_queries`, one seed for every model, so that two models built
from the same weights stay equal). A conversion that raises is not hidden: the model's construction
raises it, and the test fails with it, as it would for a user who converts every model.

For each test it records which models were converted, which were built but not converted (a model
built inside another is not counted: the outer conversion covers it), and for a failure the exception
with where it arises: the deepest frame in attnres_fx, in transformers, in the test, and the line of
user code TorchDynamo was tracing. The record goes into each report's ``user_properties`` (so
``--junitxml`` carries it) and, with ``--attnres-record PATH``, into a JSON-lines file written as each
test ends (what ran survives a run that is killed). A test that passes without any model converted
proves nothing about conversion: the terminal summary counts those apart.

Options:
    --attnres-mode converted|original   ``original`` records without converting anything (the baseline
                                        run of ``benchmarks/hf_parity.py``); default ``converted``.
    --attnres-seed N                    seed of the random pseudo-queries (default 0).
    --attnres-record PATH               the JSON-lines record, one object per test.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import weakref
from dataclasses import dataclass, field

import pytest
from torch import nn

from attnres_fx import diagnostics, is_converted
from attnres_fx.integrations import autoload
from attnres_fx.testing import randomise_pseudo_queries

CONVERSION_OPTIONS = {"preserve_scale": True}
USER_CODE_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
MESSAGE_CHARS = 600


@dataclass
class BuiltModel:
    """One ``PreTrainedModel`` a test built: ``state`` is "pending" until it is converted ("converted")
    or found inside a model built after it ("inner")."""

    model: weakref.ref
    name: str
    state: str = "pending"


@dataclass
class TestRecord:
    nodeid: str
    built: list[BuiltModel] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)      # of the setup, call and teardown phases
    subtest_failed: bool = False
    failures: list[dict] = field(default_factory=list)
    duration: float = 0.0

    def outcome(self) -> str:
        """"failed" if a phase or a subtest failed, else "passed" if the test's call passed, else
        "skipped" (a test whose subtests are partly skipped has passed)."""
        if self.subtest_failed or "failed" in self.outcomes:
            return "failed"
        return "passed" if self.outcomes[1:2] == ["passed"] else "skipped"

    def models(self, state: str) -> list[str]:
        return [b.name for b in self.built if b.state == state]

    def as_dict(self) -> dict:
        return {"nodeid": self.nodeid, "outcome": self.outcome(), "duration": round(self.duration, 3),
                "converted": self.models("converted"), "not_converted": self.models("pending"),
                "failures": self.failures}


def built_inside_another(model) -> bool:
    """Whether ``model`` is being built inside another model's ``__init__`` (a base model inside a model
    with a head, a text model inside a vision-language one): the frames of the calls under way."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            other = frame.f_locals.get("self")
            if other is not model and isinstance(other, nn.Module) and hasattr(other, "config"):
                return True
        frame = frame.f_back
    return False


class ParityRecorder:
    """The plugin's state: the construction policy and the record of the test that runs now."""

    def __init__(self, mode: str, seed: int, record_path: str | None):
        self.mode = mode
        self.seed = seed
        self.record_file = open(record_path, "w") if record_path else None  # noqa: SIM115 - open for the run
        self.current: TestRecord | None = None
        self.totals: dict[str, int] = {}

    # -- conversion ---------------------------------------------------------------------------------
    def policy(self, model) -> dict | None:
        """What :func:`attnres_fx.integrations.autoload.construction_policy` asks of every model built:
        attnresify's arguments, and a hook that randomises the pseudo-queries and notes the conversion; None
        for a model built inside another's ``__init__`` (the outer conversion covers it)."""
        record = self.current
        if record is None:
            return None if built_inside_another(model) else dict(CONVERSION_OPTIONS, after=self.randomise)
        if is_converted(model) or any(built.model() is model for built in record.built):
            return None         # post_init run again on a model already built (converted or not)
        inside = {id(m) for m in model.modules()}
        for built in record.built:
            if built.state == "pending" and id(built.model()) in inside:
                built.state = "inner"
        built = BuiltModel(weakref.ref(model), type(model).__name__)
        record.built.append(built)
        if built_inside_another(model):
            return None

        def after(converted):
            self.randomise(converted)
            built.state = "converted"
        return dict(CONVERSION_OPTIONS, after=after)

    def randomise(self, model) -> None:
        randomise_pseudo_queries(model, seed=self.seed)

    # -- records ------------------------------------------------------------------------------------
    def start(self, nodeid: str) -> None:
        self.current = TestRecord(nodeid)

    def add_failure(self, report, excinfo, test_file: str) -> None:
        """From ``pytest_runtest_makereport``: a failed phase or subtest, with its exception."""
        record = self.current
        if record is not None and record.nodeid == report.nodeid and report.failed and excinfo is not None:
            record.failures.append({"when": report.when, **describe_failure(excinfo.value, test_file)})

    def add_report(self, report) -> None:
        """From ``pytest_runtest_logreport``: the outcome of a phase or of a subtest."""
        record = self.current
        if record is None or record.nodeid != report.nodeid:
            return
        if is_subtest(report):
            record.subtest_failed |= report.failed
            return
        record.outcomes.append(report.outcome)
        record.duration += report.duration

    def finish(self, report) -> None:
        record, self.current = self.current, None
        if record is None:
            return
        entry = record.as_dict()
        report.user_properties.extend([
            ("attnres_converted", ", ".join(entry["converted"])),
            ("attnres_not_converted", ", ".join(entry["not_converted"])),
        ] + [("attnres_failure", json.dumps(failure)) for failure in entry["failures"][:1]])
        key = f"{entry['outcome']}, {conversion_state(entry)}"
        self.totals[key] = self.totals.get(key, 0) + 1
        if self.record_file is not None:
            self.record_file.write(json.dumps(entry) + "\n")
            self.record_file.flush()

    def close(self) -> None:
        if self.record_file is not None:
            self.record_file.close()


def conversion_state(entry: dict) -> str:
    """"converted" (every model built was converted), "partly converted", "not converted" (models were
    built, none converted) or "no model" (the test built none)."""
    if entry["converted"] and not entry["not_converted"]:
        return "converted"
    if entry["converted"]:
        return "partly converted"
    return "not converted" if entry["not_converted"] else "no model"


def describe_failure(error: BaseException, test_file: str | None = None) -> dict:
    """The exception, its root cause, and where it arises: the deepest frame of attnres_fx, of
    transformers and of the tests (``test_file``, or a module of the ``tests`` package: transformers'
    mixins), and the line of user code TorchDynamo was tracing."""
    chain = list(itertools.islice(diagnostics.chain(error), 16))
    frames = [frame for exc in reversed(chain) for frame in _frames(exc)]

    def deepest(prefix: str, exclude: str = "\0", path: str | None = None) -> str | None:
        for module, filename, where in reversed(frames):
            if (module.startswith(prefix) and not module.startswith(exclude)) or filename == path:
                return where
        return None

    described = {"exception": _one_line(error), "attnres_fx_line": deepest("attnres_fx.", "attnres_fx.testing"),
                 "transformers_line": deepest("transformers."), "test_line": deepest("tests.", path=test_file),
                 "crash_line": frames[-1][2] if frames else None, "traced_line": _traced_line(chain)}
    if len(chain) > 1:
        described["root_cause"] = _one_line(chain[-1])
    return described


def _frames(error: BaseException) -> list[tuple[str, str, str]]:
    """(module, file, "file:line (function)") of each frame of ``error``'s traceback, outermost first."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((tb.tb_frame.f_globals.get("__name__", ""), code.co_filename,
                       f"{code.co_filename}:{tb.tb_lineno} ({code.co_name})"))
        tb = tb.tb_next
    return frames


def _one_line(error: BaseException) -> str:
    message = " ".join(str(error).split())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + " ..."
    return f"{type(error).__qualname__}: {message}" if message else type(error).__qualname__


def _traced_line(chain: list[BaseException]) -> str | None:
    """The innermost ``File "...", line N`` under "from user code:" in a TorchDynamo message."""
    for error in chain:
        text = str(error)
        if "from user code:" in text:
            found = USER_CODE_LINE.findall(text.split("from user code:", 1)[1])
            if found:
                path, line, function = found[-1]
                return f"{path}:{line} ({function})"
    return None


def is_subtest(report) -> bool:
    """A subtest's report (``self.subTest`` / the ``subtests`` fixture) carries its context."""
    return getattr(report, "context", None) is not None


# -- pytest hooks ---------------------------------------------------------------------------------------

class ParityPlugin:
    """The hooks that need the recorder, registered at configure time."""

    def __init__(self, recorder: ParityRecorder):
        self.recorder = recorder

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.recorder.start(item.nodeid)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        self.recorder.add_failure(report, call.excinfo, str(item.path))
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report) -> None:
        """Before junitxml reads the teardown report: the test's record goes into its user_properties."""
        self.recorder.add_report(report)
        if report.when == "teardown" and not is_subtest(report):
            self.recorder.finish(report)

    def pytest_report_header(self, config) -> str:
        if self.recorder.mode == "original":
            return "attnres_fx parity: original models (recording only)"
        options = ", ".join(f"{k}={v}" for k, v in CONVERSION_OPTIONS.items())
        return (f"attnres_fx parity: every model built is converted ({options}, random pseudo-queries, "
                f"seed {self.recorder.seed})")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        totals = self.recorder.totals
        if not totals:
            return
        terminalreporter.section("attnres_fx parity")
        for key, count in sorted(totals.items()):
            terminalreporter.write_line(f"{count:5d} {key}")
        if self.recorder.mode == "converted":
            unproven = sum(n for k, n in totals.items() if k.startswith("passed") and not k.endswith(", converted"))
            terminalreporter.write_line(f"{unproven} passing test(s) did not have every model converted: they prove "
                                        "nothing about conversion")

    def pytest_unconfigure(self, config) -> None:
        autoload.construction_policy(None)
        self.recorder.close()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("attnres-parity", "attnres_fx: the tests on converted models")
    group.addoption("--attnres-mode", choices=("converted", "original"), default="converted",
                    help="convert every model the tests build (default), or only record (the baseline)")
    group.addoption("--attnres-seed", type=int, default=0, help="seed of the random pseudo-queries")
    group.addoption("--attnres-record", default=None, metavar="PATH",
                    help="write one JSON object per test: outcome, models converted, failure")


def pytest_configure(config) -> None:
    recorder = ParityRecorder(config.getoption("--attnres-mode"), config.getoption("--attnres-seed"),
                              config.getoption("--attnres-record"))
    config.pluginmanager.register(ParityPlugin(recorder), "attnres-parity")
    if recorder.mode == "converted":
        autoload.construction_policy(recorder.policy)
