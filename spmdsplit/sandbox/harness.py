"""A program loaded and run on its tests the way verl 0.9.1's prime_code testing_util runs it
(runner side, standard library only). What each test produced goes to the rank as an event
(spmdsplit/sandbox/protocol.py); whether it is right is decided there.

Loading. The program's text gets a prelude of star-imports and imports (`PRELUDE`: so `sqrt`,
`Counter`, `deque`, `gcd`... work without an import), and becomes a module named `tmp_sol` (so a
trailing `if __name__ == "__main__":` block of a function-call program never runs). Then, by the
ground truth's kind:

- a function-call program (`fn_name`): the module itself, or an instance of its `Solution`
  class when the text contains "class Solution"; the entry point is its `fn_name` attribute;
- a stdin/stdout program: a last statement `if __name__ == '__main__':` is replaced by its body
  (through ast, so the text is re-formatted and comments go), then every line that does not
  start with `import ` or `from ` is indented into a function `code()`, together with the import
  lines that come after the first such line; the imports before it stay at the top.

Any exception while loading, or no entry point, is a load error (verl's -2). A SystemExit or
other BaseException while loading kills verl's process: here a crash.

Running, test after test in the same module (state carries over, as in verl):

- stdin/stdout: `code()` with the test's input fed as spmdsplit/sandbox/stdio.py describes;
  SystemExit ends the call normally, any other exception is a runtime error;
- function call: each line of the input is a JSON value, one argument each (a first argument that
  is a dict with keys that all read as ints gets int keys, and is then the only argument); the
  returned value must pass `json.dumps` (else a runtime error), and is reported with its types
  (spmdsplit/sandbox/values.py). SystemExit is not caught here (verl catches it only around
  stdin programs): a crash.

A runtime error is reported and ends the run (verl returns at the first failure); so does output
over the sandbox's limit. A wrong answer cannot end the run here: the rank, which knows, stops it.
"""

from __future__ import annotations

import ast
import json
import sys
import types

from spmdsplit.sandbox import protocol, stdio, values

_STAR_IMPORTED = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                  "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
_IMPORTED = _STAR_IMPORTED[:-2]  # all but builtins and typing, after the star-imports
PRELUDE = ("".join(f"from {name} import *\n" for name in _STAR_IMPORTED)
           + "".join(f"import {name}\n" for name in _IMPORTED)
           + "sys.setrecursionlimit(6*10**5)\n")
MODULE_NAME = "tmp_sol"
EVENT_OVERHEAD = 4096  # an event's bytes besides the output it carries
STDIN_ENTRY = "code"


class Crash(Exception):
    """verl's process would have died here: every result of the run is lost."""


def _is_import(line: str) -> bool:
    return line.startswith("import ") or line.startswith("from ")


def without_main_guard(source: str) -> str:
    """A last `if __name__ == '__main__':` statement replaced by its body (else-branch dropped)."""
    try:
        body = ast.parse(source).body
        last = body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            return ast.unparse(body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:  # noqa: BLE001 - not Python (the load reports it), or an empty program
        pass
    return source


def as_stdin_function(source: str) -> str:
    """A stdin/stdout program's lines indented into `code()` (see the module's docstring)."""
    pieces = []
    opened = False
    for line in source.split("\n"):
        if not _is_import(line):
            if not opened:
                pieces.append(f"stdin = sys.stdin\nstdout = sys.stdout\ndef {STDIN_ENTRY}():\n")
                opened = True
            line = "\t" + line
        elif opened:
            line = "\t" + line
        pieces.append(line + "\n")
    return "".join(pieces)


def load(code: str, fn_name: str | None):
    """The program's entry point; Crash on a BaseException; None on a load error."""
    text = PRELUDE + (code if fn_name is not None else as_stdin_function(without_main_guard(code)))
    module = types.ModuleType(MODULE_NAME)
    try:
        exec(compile(text, "<string>", "exec"), module.__dict__)
        sys.modules[MODULE_NAME] = module
        target = module.Solution() if fn_name is not None and "class Solution" in code else module
        return getattr(target, fn_name if fn_name is not None else STDIN_ENTRY)
    except Exception:  # noqa: BLE001 - the program's own failure
        return None
    except BaseException as e:
        raise Crash(type(e).__name__) from None


def call_arguments(text: str) -> list:
    arguments = [json.loads(line) for line in text.split("\n")]
    try:
        if isinstance(arguments[0], dict):
            arguments = [{int(key): value for key, value in arguments[0].items()}]
    except Exception:  # noqa: BLE001 - keys that are not ints stay as they are
        pass
    return arguments


def run_stdin_test(entry, original_stdin, text: str, limit: int) -> tuple[str | None, str]:
    """(error kind or None, what it printed)."""
    capture = stdio.Capture(limit)
    saved = sys.stdout
    sys.stdout = capture
    try:
        with stdio.fed(original_stdin, text):
            try:
                entry()
            except SystemExit:
                pass
    except Exception:  # noqa: BLE001 - the program's own failure
        return (protocol.OUTPUT_TOO_LARGE if capture.overflowed else protocol.RUNTIME_ERROR), ""
    except BaseException as e:
        raise Crash(type(e).__name__) from None
    finally:
        sys.stdout = saved
    if capture.overflowed:
        return protocol.OUTPUT_TOO_LARGE, ""
    return None, capture.getvalue()


def run_call_test(entry, text: str):
    """(error kind or None, the returned value encoded)."""
    try:
        arguments = call_arguments(text)
    except Exception as e:  # noqa: BLE001 - the rank checks inputs first; verl's run dies on these
        raise Crash(type(e).__name__) from None
    try:
        value = entry(*arguments)
        json.dumps(value)
        return None, values.encode(value)
    except Exception:  # noqa: BLE001 - the program's own failure, or a value json cannot write
        return protocol.RUNTIME_ERROR, None
    except BaseException as e:
        raise Crash(type(e).__name__) from None


def run(program: dict, write, original_stdin, limit: int) -> None:
    """Load `program` ({"code", "fn_name", "inputs"}) and run its tests, `write`ing each event's
    bytes; `limit`: the most characters one test may print, and bytes its event may take past
    EVENT_OVERHEAD."""
    fn_name = program.get("fn_name")

    def send(event: dict) -> None:
        write(protocol.encode(event))

    try:
        entry = load(program["code"], fn_name)
        if entry is None:
            send({"e": protocol.LOAD_ERROR})
            return
        send({"e": protocol.LOADED})
        for index, text in enumerate(program["inputs"]):
            if not isinstance(text, str):
                raise Crash("an input that is not text")
            if fn_name is None:
                error, output = run_stdin_test(entry, original_stdin, text, limit)
                event = {"e": protocol.TEST, "i": index, "out": output}
            else:
                error, output = run_call_test(entry, text)
                event = {"e": protocol.TEST, "i": index, "value": output}
            line = protocol.encode(event) if error is None else b""
            if len(line) > limit + EVENT_OVERHEAD:
                error = protocol.OUTPUT_TOO_LARGE
            if error is not None:
                send({"e": protocol.ERROR, "i": index, "kind": error})
                return
            write(line)
        send({"e": protocol.DONE})
    except Crash:
        send({"e": protocol.CRASH})
