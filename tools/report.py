"""Writing a tool's report: the numbers as JSON, the same as Markdown, and the Markdown on
stdout; `fmt` prints a number that may be missing."""

from __future__ import annotations

import json
import os


def fmt(x, spec="{:.3f}") -> str:
    return "n/a" if x is None else spec.format(x)


def write_report(out: str, name: str, report: dict, markdown: str) -> None:
    """`<out>/<name>.json` and `<out>/<name>.md`, and the Markdown on stdout."""
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown)
    print(markdown)
