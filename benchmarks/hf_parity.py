"""Transformers' own model tests, on the original models and on converted ones: what conversion breaks.

    python benchmarks/hf_parity.py --transformers-src ~/src/transformers
    python benchmarks/hf_parity.py --transformers-src DIR --models llama t5 vit --out benchmarks/results/hf_parity
    python benchmarks/hf_parity.py --transformers-src DIR --models gpt2 -k "not export" --run-timeout 3600

For each architecture NAME it runs ``DIR/tests/models/NAME/test_modeling_NAME.py`` twice, each in its
own pytest subprocess started in ``DIR`` (so the checkout's ``conftest.py`` and pytest configuration
apply): once on the original models, once with the plugin :mod:`attnres_fx.testing.hf_parity`
converting every model the tests build (``preserve_scale=True``, random pseudo-queries). Both runs
load the plugin, which records each test's outcome as it ends; the original run converts nothing.
With ``--recheck`` it then runs again, converted, only the tests that regressed in the records (after a
fix: minutes rather than a whole run); their outcomes replace the earlier ones, and the summary says how
many were rechecked. Then it writes ``OUT/hf_parity.json`` and ``OUT/hf_parity.md``:

- per architecture: tests passed on the original and on the converted models;
- the *regressions* (passed on the original, failed converted), grouped by root cause: the exception
  and its message with test-specific details (numbers, addresses, class names) folded, and where it
  arises (the deepest attnres_fx frame, the deepest transformers frame, the line TorchDynamo traced);
- tests that passed converted although some or all of the models they built were not converted (they
  prove nothing about conversion), and tests that passed converted but failed on the original.

DIR is any transformers source checkout (or a tree laid out like one: ``tests/`` with the common
mixins, ``tests/models/NAME/``) whose tests import against the transformers installed for
``--python``. They need transformers' test dependencies (its ``testing`` extra, or at least
``parameterized``, ``httpx`` and ``pytest-timeout``). Nothing is downloaded: the runs set ``HF_HUB_OFFLINE=1``, and
tests that need the Hub are skipped or fail on both sides alike. A run that exceeds ``--run-timeout`` is stopped; what
it recorded until then is kept and the summary marks it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

DEFAULT_MODELS = ("llama", "qwen2", "mixtral", "gpt2", "t5", "vit")
VARIANTS = ("original", "converted")
PLUGIN = "attnres_fx.testing.hf_parity"
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:Model|For[A-Z][A-Za-z]*|LMHeadModel|Layer|Block|Stack|Attention|"
                        r"MLP|Encoder|Decoder|Config)\b")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformers-src", required=True, type=Path,
                        help="a transformers source checkout (holds tests/models/NAME/test_modeling_NAME.py)")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), metavar="NAME",
                        help=f"architectures, as named under tests/models (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf_parity"),
                        help="where the records, logs and summaries go")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression, for both runs")
    parser.add_argument("--run-timeout", type=float, default=2400.0, help="seconds one pytest run may take")
    parser.add_argument("--test-timeout", type=float, default=300.0, help="seconds one test may take (pytest-timeout)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the converted models' random pseudo-queries")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    parser.add_argument("--recheck", action="store_true",
                        help="after the runs, run again on the converted models only the tests that regressed in "
                             "OUT's records (after a fix: minutes, not a whole run); their new outcomes replace the "
                             "old ones, and the summary counts them")
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS),
                        help="which runs to do; the records in OUT of the others are reused (none: only "
                             "summarise what OUT holds)")
    return parser.parse_args(argv)


def test_file(src: Path, name: str) -> Path:
    return src / "tests" / "models" / name / f"test_modeling_{name}.py"


def run_tests(args: argparse.Namespace, name: str, variant: str, tests: list[str] | None = None) -> dict:
    """One pytest subprocess over the architecture's test file (or the node ids ``tests``, whose records
    go to ``<variant>.recheck.jsonl``); returns how it ended."""
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{variant}.recheck" if tests is not None else variant
    record, log = out / f"{stem}.jsonl", out / f"{stem}.log"
    targets = (tests if tests is not None
               else [str(test_file(args.transformers_src, name).relative_to(args.transformers_src))])
    command = [args.python, "-m", "pytest", *targets,
               "-p", PLUGIN, f"--attnres-mode={variant}", f"--attnres-seed={args.seed}", f"--attnres-record={record}",
               "-p", "no:cacheprovider", "-q", "-rN", "--tb=short", "-o", "log_cli=false",
               f"--timeout={args.test_timeout:g}"]
    if args.keyword:
        command += ["-k", args.keyword]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, cwd=args.transformers_src, env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode, timed_out = process.wait(timeout=args.run_timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode, timed_out = process.wait(), True
    return {"returncode": returncode, "timed_out": timed_out, "seconds": round(time.perf_counter() - start, 1),
            "command": command, "log": str(log)}


def read_records(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            records[entry["nodeid"]] = entry
    return records


def fold(message: str) -> str:
    """A message with what differs between tests of one cause folded: addresses, numbers, model classes,
    quoted tensors."""
    message = re.sub(r"0x[0-9a-fA-F]+", "0x?", message)
    message = CLASS_NAME.sub("<Class>", message)
    message = re.sub(r"\d+", "N", message)
    return message[:240]


def cause_of(entry: dict) -> dict:
    failure = (entry.get("failures") or [{}])[0]
    exception = failure.get("exception") or "(no exception recorded)"
    return {"key": fold(exception), "exception": exception, "root_cause": failure.get("root_cause"),
            "attnres_fx_line": failure.get("attnres_fx_line"), "transformers_line": failure.get("transformers_line"),
            "traced_line": failure.get("traced_line"), "test_line": failure.get("test_line")}


def short_test(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def compare(name: str, original: dict[str, dict], converted: dict[str, dict]) -> dict:
    """One architecture's summary from the two runs' records."""
    passed = {variant: {k for k, e in records.items() if e["outcome"] == "passed"}
              for variant, records in (("original", original), ("converted", converted))}
    regressions = sorted(k for k in passed["original"] if converted.get(k, {}).get("outcome") == "failed")
    not_run = sorted(k for k in passed["original"] if k not in converted)
    groups: dict[str, dict] = {}
    for nodeid in regressions:
        cause = cause_of(converted[nodeid])
        group = groups.setdefault(cause["key"], {"cause": cause["exception"], "root_cause": cause["root_cause"],
                                                 "lines": Counter(), "tests": []})
        group["tests"].append(short_test(nodeid))
        for kind in ("attnres_fx_line", "transformers_line", "traced_line"):
            if cause[kind]:
                group["lines"][f"{kind}: {cause[kind]}"] += 1
    unproven = {state: sorted(short_test(k) for k in passed["converted"]
                              if _state(converted[k]) == state)
                for state in ("not converted", "partly converted", "no model")}
    return {
        "architecture": name,
        "tests": len(set(original) | set(converted)),
        "passed_original": len(passed["original"]),
        "passed_converted": len(passed["converted"]),
        "passed_converted_with_every_model_converted": sum(_state(converted[k]) == "converted"
                                                           for k in passed["converted"]),
        "regressions": len(regressions),
        "regressed_tests": regressions,
        "regression_causes": sorted(({**g, "lines": [f"{n}x {line}" for line, n in g["lines"].most_common()]}
                                     for g in groups.values()), key=lambda g: -len(g["tests"])),
        "passed_converted_only": sorted(short_test(k) for k in passed["converted"]
                                        if original.get(k, {}).get("outcome") == "failed"),
        "passed_converted_without_conversion": unproven,
        "not_run_converted": [short_test(k) for k in not_run],
    }


def _state(entry: dict) -> str:
    if entry["converted"] and not entry["not_converted"]:
        return "converted"
    if entry["converted"]:
        return "partly converted"
    return "not converted" if entry["not_converted"] else "no model"


def markdown(summary: dict) -> str:
    lines = ["# Transformers' model tests: original vs converted (attnres_fx)", "",
             f"transformers source: `{summary['transformers_src']}`, transformers {summary['transformers_version']}, "
             f"torch {summary['torch_version']}; converted with preserve_scale=True, random pseudo-queries "
             f"(seed {summary['seed']}){'; -k ' + repr(summary['keyword']) if summary['keyword'] else ''}.", "",
             "| architecture | tests | passed original | passed converted | of those, every model converted | "
             "regressions | passed converted only | rechecked | run time original / converted |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arch in summary["architectures"]:
        runs = arch["runs"]
        times = " / ".join(f"{runs[v]['seconds']:.0f} s{' (timed out)' if runs[v]['timed_out'] else ''}"
                           if v in runs else "-" for v in VARIANTS)
        lines.append(f"| {arch['architecture']} | {arch['tests']} | {arch['passed_original']} | "
                     f"{arch['passed_converted']} | {arch['passed_converted_with_every_model_converted']} | "
                     f"{arch['regressions']} | {len(arch['passed_converted_only'])} | {arch.get('rechecked', 0)} | "
                     f"{times} |")
    for arch in summary["architectures"]:
        lines += ["", f"## {arch['architecture']}", ""]
        for number, group in enumerate(arch["regression_causes"], 1):
            lines += [f"### {number}. {len(group['tests'])} test(s): `{group['cause'][:300]}`", ""]
            if group["root_cause"]:
                lines += [f"root cause: `{group['root_cause'][:300]}`", ""]
            lines += [f"- {line}" for line in group["lines"]]
            lines += ["", "tests: " + ", ".join(f"`{t}`" for t in group["tests"]), ""]
        for state, tests in arch["passed_converted_without_conversion"].items():
            if tests:
                lines += [f"passed converted, {state}: " + ", ".join(f"`{t}`" for t in tests), ""]
        if arch["passed_converted_only"]:
            passed = ", ".join(f"`{t}`" for t in arch["passed_converted_only"])
            lines += [f"passed converted, failed original: {passed}", ""]
        if arch["not_run_converted"]:
            lines += ["passed original, no record converted (run stopped?): " +
                      ", ".join(f"`{t}`" for t in arch["not_run_converted"]), ""]
    return "\n".join(lines) + "\n"


def versions(python: str) -> tuple[str, str]:
    script = "import torch, transformers; print(transformers.__version__, torch.__version__)"
    found = subprocess.run([python, "-c", script],
                           capture_output=True, text=True, check=True).stdout.split()
    return found[0], found[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    args.transformers_src = args.transformers_src.resolve()
    args.out = args.out.resolve()
    missing = [name for name in args.models if not test_file(args.transformers_src, name).is_file()]
    if missing:
        raise SystemExit(f"no tests/models/NAME/test_modeling_NAME.py in {args.transformers_src} "
                         f"for: {', '.join(missing)}")
    transformers_version, torch_version = versions(args.python)
    architectures = []
    for name in args.models:
        runs_path = args.out / name / "runs.json"
        runs = json.loads(runs_path.read_text()) if runs_path.is_file() else {}
        for variant in args.variants:
            print(f"{name}: {variant} ...", flush=True)
            runs[variant] = run_tests(args, name, variant)
            runs_path.write_text(json.dumps(runs, indent=2) + "\n")
        records = {v: read_records(args.out / name / f"{v}.jsonl") for v in VARIANTS}
        if args.recheck:
            regressed = sorted(compare(name, records["original"], records["converted"])["regressed_tests"])
            if regressed:
                print(f"{name}: rechecking {len(regressed)} regressed test(s) ...", flush=True)
                runs["recheck"] = run_tests(args, name, "converted", regressed)
                runs_path.write_text(json.dumps(runs, indent=2) + "\n")
        rechecked = read_records(args.out / name / "converted.recheck.jsonl")
        arch = compare(name, records["original"], {**records["converted"], **rechecked})
        arch["rechecked"] = len(rechecked)
        arch["runs"] = runs
        architectures.append(arch)
        print(f"{name}: passed original {arch['passed_original']}, converted {arch['passed_converted']}, "
              f"regressions {arch['regressions']}", flush=True)
    summary = {"transformers_src": str(args.transformers_src), "transformers_version": transformers_version,
               "torch_version": torch_version, "seed": args.seed, "keyword": args.keyword,
               "architectures": architectures}
    (args.out / "hf_parity.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "hf_parity.md").write_text(markdown(summary))
    print(f"wrote {args.out / 'hf_parity.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
