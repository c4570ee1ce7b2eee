"""A scorer's call bounded in time, from any thread: the call runs in a daemon thread of its own,
and the caller waits for it at most `seconds`.

Signals (math-verify's own `signal.alarm` timeouts) work on the main thread only, and a process per
call would cost more than most scores take. A thread cannot be stopped, so one that overruns is
left to finish on its own, its result dropped; `abandoned` counts them for the log.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

abandoned = 0  # calls given up on in this process


class Overrun(TimeoutError):
    """The call did not return within its bound."""


def call_within(seconds: float, fn: Callable, *args, **kwargs) -> Any:
    """fn(*args, **kwargs)'s result, or its exception re-raised here; Overrun after `seconds`."""
    global abandoned
    outcome: list = []

    def work() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread, whatever it is
            outcome.append((False, e))

    thread = threading.Thread(target=work, name=f"scorer-{getattr(fn, '__qualname__', '')}", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        abandoned += 1
        message = f"{getattr(fn, '__qualname__', fn)} took more than {seconds} s"
        warnings.warn(f"{message}: scored as a timeout ({abandoned} so far in this process; its thread runs on)")
        raise Overrun(message)
    ok, value = outcome[0]
    if ok:
        return value
    raise value
