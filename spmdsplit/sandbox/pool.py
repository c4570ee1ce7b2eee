"""The rank's side of the sandbox: `Sandbox.run` runs one program on its tests' inputs in a runner
process of its own (spmdsplit/sandbox/runner.py), at most `workers` at once, follows its report
against the clock, and kills it at the deadline or as soon as the judge has seen enough.

All of it is asyncio: runners are started with `asyncio.create_subprocess_exec` (no preexec_fn:
the rank has many threads; the runner sets its own limits), and many samples are scored at once
from one event loop (`asyncio.gather`).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spmdsplit.sandbox import isolation, launch, protocol, reaper, values
from spmdsplit.sandbox.harness import EVENT_OVERHEAD
from spmdsplit.sandbox.isolation import SandboxError
from spmdsplit.sandbox.limits import Limits
from spmdsplit.sandbox.runner import GUARD

SETUP_TIMEOUT_S = 30.0  # a runner's start and set-up, before the program's clocks start
STDERR_KEPT = 1 << 16  # of the runner's stderr, for the message of a SandboxError
EXIT_WAIT_S = 2.0  # for the runner to end the program and exit, once told to

DONE = "done"  # every test reported
STOPPED = "stopped"  # ended at a test: the judge said so, or the test failed to run (its outcome's error)
LOAD_ERROR = "load_error"  # the program did not compile, or has no entry point
TIMEOUT = "timeout"  # a test (or the program's load) overran its time, or the run its total
CRASHED = "crashed"  # the runner died, its report broke off or made no sense, or verl's would have died


@dataclass
class Outcome:
    index: int
    output: str | None = None  # what a stdin/stdout program printed
    value: Any = None  # what a function returned (its plain-typed copy)
    error: str | None = None  # protocol.RUNTIME_ERROR or OUTPUT_TOO_LARGE: the test did not run through


@dataclass
class RunResult:
    status: str
    outcomes: list[Outcome] = field(default_factory=list)
    detail: str = ""  # for a log line: why a run crashed


Judge = Callable[[Outcome], bool]  # False: the run's result is known, stop it


class _Slots:
    """Small numbers for the programs running at one time, across event loops: a program's uid
    is made from its slot (launch.program_uid)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._taken: set[int] = set()

    def take(self) -> int:
        with self._lock:
            slot = next(n for n in range(launch.SLOTS + 1) if n not in self._taken)
            if slot == launch.SLOTS:
                raise SandboxError(f"more than {launch.SLOTS} programs at once in one process")
            self._taken.add(slot)
            return slot

    def give(self, slot: int) -> None:
        with self._lock:
            self._taken.discard(slot)


_slots = _Slots()
_warned: set[str] = set()


class Sandbox:
    """Programs under test, each in a process of its own (see spmdsplit/sandbox/isolation.py for
    what each isolation level stops). `workers`: programs at once (0: the rank's CPU cores)."""

    def __init__(self, isolation_level: str = isolation.AUTO, workers: int = 0, limits: Limits = Limits()):
        self.isolation, self._why = isolation.resolve(isolation_level)
        self.workers = workers or len(os.sched_getaffinity(0))
        self.limits = limits
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if self.isolation == GUARD and self._why not in _warned:
            _warned.add(self._why)
            warnings.warn(self.describe())

    @classmethod
    def from_config(cls, sandbox) -> "Sandbox":
        """From reward.sandbox (spmdsplit/config.py SandboxConfig)."""
        return cls(sandbox.isolation, int(sandbox.workers), Limits.from_config(sandbox))

    def describe(self) -> str:
        """The line the job prints at start: the isolation its programs get, and their limits."""
        return isolation.describe(self.isolation, self._why, self.limits, self.workers)

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.workers)
        return self._semaphores[loop]

    async def run(self, program: dict, test_timeout_s: float, judge: Judge | None = None) -> RunResult:
        """Run `program` ({"code": str, "fn_name": str or None, "inputs": [str, ...]}: a
        stdin/stdout program when fn_name is None) on its inputs in order. Each test, and the load
        before them, gets `test_timeout_s`; the whole run that and 1 s more (verl's limits). `judge`
        sees each outcome as it comes and may stop the run. Raises SandboxError when the sandbox
        itself fails; whatever the program does ends in a RunResult."""
        async with self._semaphore():
            slot = _slots.take()
            folder = tempfile.mkdtemp(prefix=f"spmdsplit-program-{os.getpid()}-")  # a leftover names its rank
            try:
                launch.prepare_folder(folder, self.isolation, slot)
                return await self._run_in(folder, slot, program, test_timeout_s, judge)
            finally:
                _slots.give(slot)
                reaper.remove_folder(folder)

    async def _run_in(self, folder: str, slot: int, program: dict, test_timeout_s: float, judge: Judge | None):
        total_s = test_timeout_s + 1.0
        options = launch.spawn_options(self.isolation, slot)
        runner = await asyncio.create_subprocess_exec(
            *launch.command(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=folder, env=launch.environment(folder), start_new_session=True,
            limit=(self.limits.max_output_mb << 20) + 2 * EVENT_OVERHEAD, **options)
        stderr = asyncio.ensure_future(_read_capped(runner.stderr, STDERR_KEPT))
        try:
            try:
                runner.stdin.write(launch.request(self.isolation, folder, slot, self.limits, total_s + 1.0, program))
                await runner.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the runner died at once: its report is empty, and that is reported below
            report = _Report(runner.stdout, program, judge)
            result = await report.follow(test_timeout_s, total_s, stderr)
        finally:
            await _end(runner, options)
            stderr.cancel()
        if result.status == DONE and runner.returncode < 0:
            # Every test reported, but the runner was killed (it exits on its own when told to end,
            # and only a runner that does not is killed here): the program did it, past verl's guard.
            return RunResult(CRASHED, result.outcomes, f"the runner was killed (signal {-runner.returncode})")
        return result


class _Report:
    """One run's events, checked as they come (protocol.py's order) and turned into a RunResult."""

    def __init__(self, stream: asyncio.StreamReader, program: dict, judge: Judge | None):
        self.stream = stream
        self.calls = program.get("fn_name") is not None
        self.tests = len(program["inputs"])
        self.judge = judge
        self.outcomes: list[Outcome] = []
        self.loaded = False

    async def follow(self, test_timeout_s: float, total_s: float, stderr: asyncio.Future) -> RunResult:
        loop = asyncio.get_running_loop()
        step_end = loop.time() + SETUP_TIMEOUT_S
        total_end = None
        while True:
            end = step_end if total_end is None else min(step_end, total_end)
            try:
                line = await asyncio.wait_for(self.stream.readline(), max(0.0, end - loop.time()))
            except asyncio.TimeoutError:
                if total_end is None:
                    raise SandboxError(f"the sandbox's runner was not ready in {SETUP_TIMEOUT_S:g} s") from None
                return RunResult(TIMEOUT, self.outcomes)
            except ValueError:  # a line longer than the stream's limit: not the runner's
                return RunResult(CRASHED, self.outcomes, "a report line over the limit")
            if total_end is None:
                await self._expect_ready(line, stderr)
                total_end = loop.time() + total_s
            else:
                result = self._take(line)
                if result is not None:
                    return result
            step_end = loop.time() + test_timeout_s

    async def _expect_ready(self, line: bytes, stderr: asyncio.Future) -> None:
        try:
            event = protocol.decode(line)
        except ValueError:
            event = {}
        if event.get("e") == protocol.READY:
            return
        why = event.get("why") if event.get("e") == protocol.SETUP_ERROR else None
        if why is None:
            stderr_text = (await _settled(stderr)).decode(errors="replace")
            why = f"no report ({line[:200]!r}); stderr: {stderr_text[-2000:]}"
        raise SandboxError(f"the sandbox's runner failed to set up: {why}")

    def _take(self, line: bytes) -> RunResult | None:
        """The run's result when `line` ends it, else None."""
        if not line:
            return RunResult(CRASHED, self.outcomes, "the report ended early")
        try:
            event = protocol.decode(line)
            kind = event.get("e")
            if kind == protocol.LOADED and not self.loaded:
                self.loaded = True
                return None
            if kind == protocol.LOAD_ERROR and not self.loaded:
                return RunResult(LOAD_ERROR)
            if kind == protocol.TEST and self.loaded:
                outcome = self._test(event)
                self.outcomes.append(outcome)
                if self.judge is not None and not self.judge(outcome):
                    return RunResult(STOPPED, self.outcomes)
                return None
            if kind == protocol.ERROR and self.loaded and event.get("kind") in protocol.ERROR_KINDS:
                self.outcomes.append(Outcome(self._index(event), error=event["kind"]))
                return RunResult(STOPPED, self.outcomes)
            if kind == protocol.CRASH:
                return RunResult(CRASHED, self.outcomes, "the program ended its run")
            if kind == protocol.DONE and self.loaded and len(self.outcomes) == self.tests:
                return RunResult(DONE, self.outcomes)
            raise ValueError(f"an event out of place: {str(event)[:200]}")
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            return RunResult(CRASHED, self.outcomes, f"a garbled report: {type(e).__name__}: {e}")

    def _index(self, event: dict) -> int:
        index = event.get("i")
        if index != len(self.outcomes) or type(index) is not int:
            raise ValueError(f"test {index!r} reported where {len(self.outcomes)} was due")
        return index

    def _test(self, event: dict) -> Outcome:
        index = self._index(event)
        if self.calls:
            return Outcome(index, value=values.decode(event["value"]))
        output = event["out"]
        if not isinstance(output, str):
            raise ValueError("an output that is not text")
        return Outcome(index, output=output)


async def _end(runner: asyncio.subprocess.Process, options: dict) -> None:
    """The runner and the program's processes gone: the end of its stdin tells the runner to kill
    the program's process group and reap it; a runner that has not exited by EXIT_WAIT_S is killed
    with its own group. Under guard with a uid of the program's own, whatever left the group too."""
    runner.stdin.close()
    try:
        await asyncio.wait_for(runner.wait(), EXIT_WAIT_S)
    except asyncio.TimeoutError:
        reaper.kill_group(runner.pid)  # still running: its pid is still its own
        await runner.wait()
    if options:
        reaper.kill_uid(options["user"])


async def _read_capped(stream: asyncio.StreamReader, keep: int) -> bytes:
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[:keep]
    return kept


async def _settled(future: asyncio.Future) -> bytes:
    """The stderr read so far, waiting a moment for the runner's last words."""
    try:
        return await asyncio.wait_for(asyncio.shield(future), 1.0)
    except asyncio.TimeoutError:
        return b""

