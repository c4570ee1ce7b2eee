"""The program's standard streams during a test, as verl's testing_util arranges them (runner
side, standard library only).

verl runs a stdin/stdout program as a function called in its own process, with:

- `sys.stdout` a StringIO that collects what it prints, whose `close` is a stand-in that takes one
  argument and does nothing (so `sys.stdout.close()` raises TypeError), with no `.buffer`;
- `sys.stdin` a StringIO of the test's input (`input()` and `sys.stdin.readline()` read from it,
  lines keeping their newline; `sys.stdin.buffer` does not exist);
- the process's *original* `sys.stdin` object (/dev/null) patched too: its `read` gives the
  whole input, `readline` the next line *without* its newline (StopIteration at the end),
  `readlines` the lines split on newlines. The program reaches that object through names bound
  when it was loaded: the `stdin` of `from sys import *`, `from sys import stdin` at its top;
- `builtins.open` a stand-in whose files read the input, which only code that looks `open` up
  in builtins at call time sees (the program's own `open` is bound when it is loaded, by
  `from builtins import *`: `open(0)` reads the real fd 0, /dev/null).

`fed(original_stdin, text)` sets all of that up for one call and puts everything back after.
"""

from __future__ import annotations

import builtins
import io
import sys
from contextlib import contextmanager


class Capture(io.StringIO):
    """What the program prints, up to `limit` characters: past that, write raises and
    `overflowed` stays set whatever the program does about the exception."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.written = 0
        self.overflowed = False

    def write(self, text):
        if isinstance(text, str):
            self.written += len(text)
            if self.written > self.limit:
                self.overflowed = True
                raise OSError(f"output over the sandbox's limit of {self.limit} characters")
        return super().write(text)

    def close(self, _argument):  # verl's capture: one argument, no effect; close() is a TypeError
        return 1


_PATCHED = ("read", "readline", "readlines")


@contextmanager
def fed(original_stdin, text: str):
    """sys.stdin, the original stdin object's read methods and builtins.open, all reading `text`."""
    lines = iter(text.split("\n"))
    patches = {
        "read": lambda *_: text,
        "readline": lambda *_: next(lines),
        "readlines": lambda *_: text.split("\n"),
    }
    for name, method in patches.items():
        setattr(original_stdin, name, method)
    real_open = builtins.open
    builtins.open = lambda *_args, **_kwargs: io.StringIO(text)
    sys.stdin = io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = original_stdin
        builtins.open = real_open
        for name in _PATCHED:
            try:
                delattr(original_stdin, name)
            except AttributeError:
                pass
