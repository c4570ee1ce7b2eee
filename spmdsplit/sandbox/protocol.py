"""What the rank and the runner say to each other (standard library only: the runner imports it).

The rank writes one request, a line of JSON, on the runner's stdin, and keeps stdin open: its
end of file tells the runner that the rank is gone (or done with it). The runner answers with
events, a line of JSON each, on its stdout, which no code of the program writes to (the program's
`sys.stdout` is a capture and its fd 1 is /dev/null): this is the report channel. A program can
still find that descriptor and write to it; the rank then reads a line that is not an event, or
an event out of order, and counts the run as crashed. It can never make a wrong output pass: the
runner reports outputs, never verdicts, and the expected outputs never enter its process.

Events, in order:
    {"e": "ready"}                        set up; the program is about to be loaded (clocks start)
    {"e": "loaded"} | {"e": "load_error"} compiled and its entry point found, or not (verl's -2)
    {"e": "test", "i": i, "out": text}    a stdin/stdout program's output on test i
    {"e": "test", "i": i, "value": data}  a function's returned value (spmdsplit/sandbox/values.py)
    {"e": "error", "i": i, "kind": k}     test i failed to run (RUNTIME_ERROR, OUTPUT_TOO_LARGE); last
    {"e": "crash"}                        verl's run would have died here (all its results lost); last
    {"e": "done"}                         every test reported
    {"e": "setup_error", "why": text}     the sandbox itself failed, before "ready"
"""

from __future__ import annotations

import json
import os
from typing import Any

READY = "ready"
LOADED = "loaded"
LOAD_ERROR = "load_error"
TEST = "test"
ERROR = "error"
CRASH = "crash"
DONE = "done"
SETUP_ERROR = "setup_error"

RUNTIME_ERROR = "runtime_error"
OUTPUT_TOO_LARGE = "output_too_large"
ERROR_KINDS = (RUNTIME_ERROR, OUTPUT_TOO_LARGE)

# Lone surrogates are valid in a Python str (a program may print one) but not in UTF-8: carried.
_ENCODING = ("utf-8", "surrogatepass")


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, ensure_ascii=False) + "\n").encode(*_ENCODING)


def decode(line: bytes) -> dict[str, Any]:
    """A line read from the other side, as a dict with a str "e" or the request's keys. Raises
    ValueError on anything else (undecodable, not JSON, nested too deep, not an object)."""
    try:
        message = json.loads(line.decode(*_ENCODING))
    except (UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"unreadable line: {e}") from None
    if not isinstance(message, dict):
        raise ValueError("a line that is not a JSON object")
    return message


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_line(fd: int) -> bytes:
    """The request's line from the runner's stdin. The rank writes nothing after it (stdin then
    stays open as the lifeline), so reading until a chunk ends the line takes exactly the line."""
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            break
    return b"".join(chunks)
