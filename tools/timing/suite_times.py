"""Where the test suite's time goes: seconds per test file, by tier, from pytest's JUnit XML files.

    .venv/bin/python -m pytest -q --junitxml=after.xml
    python -m tools.timing.suite_times after.xml                 # one run: seconds per file, slowest first
    python -m tools.timing.suite_times before.xml after.xml      # two runs side by side

A test's time is its setup, call and teardown (pytest's `junit_duration_report=total`, the
default), so a module fixture's job counts against the file whose first test starts it. The tier
of a test (quick, or e2e) is read from the test ids that `-m e2e --collect-only -q` prints
(docs/development.md#tests), passed as `--e2e-ids FILE`; without it the table has no tier columns.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict


def per_test(path: str) -> dict[str, float]:
    """test id (tests/test_x.py::name[param]) -> seconds, from one JUnit XML file."""
    out = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        # pytest writes classname "tests.test_x" (or "tests.test_x.Class") and name "test_y[param]"
        parts = module.split(".")
        file_parts = [p for p in parts if not p[:1].isupper()]
        classes = [p for p in parts if p[:1].isupper()]
        test_id = "/".join(file_parts) + ".py::" + "::".join([*classes, case.get("name", "")])
        out[test_id] = out.get(test_id, 0.0) + float(case.get("time", 0.0))
    return out


def per_file(times: dict[str, float], e2e: set[str] | None = None) -> dict[str, dict[str, float]]:
    """file -> {"all", "quick", "e2e"} seconds."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: {"all": 0.0, "quick": 0.0, "e2e": 0.0})
    for test_id, seconds in times.items():
        file = test_id.split("::", 1)[0]
        files[file]["all"] += seconds
        if e2e is not None:
            files[file]["e2e" if test_id in e2e else "quick"] += seconds
    return dict(files)


def table(runs: list[dict[str, dict[str, float]]], names: list[str], tiers: bool) -> str:
    files = sorted(set().union(*runs), key=lambda f: -max(r.get(f, {}).get("all", 0.0) for r in runs))
    cols = [f"{n} (s)" for n in names]
    lines = ["| file | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for f in files:
        lines.append(f"| {f.removeprefix('tests/')} | " + " | ".join(
            f"{r[f]['all']:.0f}" if f in r else "-" for r in runs) + " |")
    lines.append("| **all files** | " + " | ".join(f"{sum(v['all'] for v in r.values()):.0f}" for r in runs) + " |")
    if tiers:
        for tier in ("quick", "e2e"):
            lines.append(f"| {tier} tier | " + " | ".join(f"{sum(v[tier] for v in r.values()):.0f}" for r in runs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.timing.suite_times", description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+", help="pytest --junitxml files, oldest first")
    parser.add_argument("--e2e-ids", help="a file of the e2e tier's test ids (pytest -m e2e --collect-only -q)")
    args = parser.parse_args(argv)
    e2e = None
    if args.e2e_ids:
        with open(args.e2e_ids) as f:
            e2e = {line.strip() for line in f if "::" in line}
    runs = [per_file(per_test(path), e2e) for path in args.junit]
    print(table(runs, [p.rsplit("/", 1)[-1].removesuffix(".xml") for p in args.junit], e2e is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
