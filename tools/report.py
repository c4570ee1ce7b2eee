"""Writing a tool's report: the numbers as JSON, the same as Markdown, and the Markdown on
stdout; `fmt` prints a number that may be missing."""

from __future__ import annotations

import json
import os
import sys


def fmt(x, spec="{:.3f}") -> str:
    return "n/a" if x is None else spec.format(x)


def write_report(out: str, name: str, report: dict, markdown: str) -> None:
    """`<out>/<name>.json` and `<out>/<name>.md`, and the Markdown on stdout."""
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown)
    print(markdown)


def run_and_write(out: str, name: str, run, render, args) -> int:
    """A benchmark's main: `run(args)` -> report, written by `write_report` as `name`; a failed job
    (tools.jobs.BenchError) is one line on stderr and exit code 1."""
    from tools.jobs import BenchError

    try:
        report = run(args)
    except BenchError as e:
        print(f"tools.bench: error: {e}", file=sys.stderr)
        return 1
    write_report(out, name, report, render(report))
    return 0
