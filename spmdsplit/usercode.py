"""User code run within a time limit, one way for every caller: reward functions, tools and
environments (and, next, judges).

Where a call runs, by what it is:
- code that waits (HTTP, a sandbox, a judge, a sleep) runs on one private asyncio event loop per
  `UserCode`, in a daemon thread of its own: an `async def` on the loop itself, a plain function in a
  fresh daemon thread (a pool would queue the calls, and its workers are joined at interpreter exit:
  one hung call would hang the job's exit);
- CPU-bound trusted code (a plain reward function under reward.reward_manager.name=prime) runs in
  worker processes (`Workers`, spmdsplit/usercode_worker.py), and a worker whose call overruns is
  killed and replaced;
- untrusted code (a program under test) runs in spmdsplit/sandbox/, a fresh isolated process each.

One deadline mechanism: the loop's own timers. `within` bounds a coroutine (a whole tool call, create
to release; one environment step; one reward) by `timeout_s`; at the deadline its task is cancelled
without being waited for, and the threads it started are counted in `stuck` until they end (a
thread cannot be stopped). The same error kinds everywhere (EXCEPTION, TIMEOUT; callers add their
own for answers they cannot read), in `Outcome.error`; a fault of user code never raises here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import os
import pickle
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

EXCEPTION, TIMEOUT = "exception", "timeout"

# The threads started by the coroutine `within` runs (each task sees its own list), so that those of
# a call that overran are counted as stuck.
_THREADS: contextvars.ContextVar[list | None] = contextvars.ContextVar("spmdsplit_usercode_threads", default=None)


def error_line(e: BaseException) -> str:
    """An exception as one line: its type and its message, whitespace collapsed (a worker's
    FunctionFailed is already the function's exception as one line)."""
    if isinstance(e, FunctionFailed):
        return str(e)
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


@dataclass
class Outcome:
    """A call's end: its value, or why there is none (`error`: EXCEPTION, TIMEOUT, or a caller's
    kind), with the exception it raised; `seconds` from its start."""
    value: Any = None
    error: str | None = None
    exception: BaseException | None = None
    seconds: float = 0.0

    @property
    def message(self) -> str:
        if self.error == TIMEOUT:
            return f"did not return within {self.seconds:.3g} s"
        return error_line(self.exception) if self.exception is not None else (self.error or "")


class UserCode:
    """One event loop (started on first use) and what it runs. Safe to use from any thread."""

    def __init__(self, name: str = "spmdsplit-usercode"):
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._abandoned: set[threading.Thread] = set()
        self._background: set[asyncio.Future] = set()  # tasks nobody awaits, kept from garbage collection

    @property
    def stuck(self) -> int:
        """How many threads of calls that overran are still running."""
        with self._lock:
            self._abandoned = {t for t in self._abandoned if t.is_alive()}
            return len(self._abandoned)

    # ---- from any thread

    def submit(self, coroutine: Awaitable) -> concurrent.futures.Future:
        """Runs `coroutine` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop())

    def run(self, fn: Callable, *args, timeout_s: float, **kwargs) -> Outcome:
        """One call of `fn`, bounded by `timeout_s`, waited for here."""
        return self.submit(self.within(lambda: self.call(fn, *args, **kwargs), timeout_s)).result()

    def map(self, jobs: Sequence[Callable[[], Awaitable]], timeout_s: float,
            max_concurrency: int | None = None) -> concurrent.futures.Future:
        """Every job (a function giving a coroutine) on the loop at once, at most `max_concurrency`
        running at a time, each bounded by `timeout_s` from its own start; a future of one Outcome
        per job, in order, never an exception."""
        async def all_jobs() -> list[Outcome]:
            limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

            async def one(job: Callable[[], Awaitable]) -> Outcome:
                if limit is None:
                    return await self.within(job, timeout_s)
                async with limit:
                    return await self.within(job, timeout_s)
            return list(await asyncio.gather(*(one(job) for job in jobs)))
        if not jobs:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result([])
            return done
        return self.submit(all_jobs())

    def close(self) -> None:
        """Stops the loop's thread (a later call starts another); threads still running are daemons."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return

        def cancel_and_stop() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_soon(loop.stop)  # after the cancellations' own callbacks
        loop.call_soon_threadsafe(cancel_and_stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
            return self._loop

    # ---- on the loop

    async def within(self, job: Callable[[], Awaitable], timeout_s: float) -> Outcome:
        """`job()`'s coroutine as a task bounded by `timeout_s`; at the deadline the task is
        cancelled (not waited for: user code may ignore the cancellation) and the threads it
        started are left behind, counted in `stuck`."""
        threads: list[threading.Thread] = []

        async def tracked() -> Any:
            _THREADS.set(threads)  # this task's own context: its calls' threads land in `threads`
            return await job()
        start = time.monotonic()
        task = asyncio.ensure_future(tracked())
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
        except asyncio.CancelledError:  # the caller gave the call up (a restarted episode): it ends too
            self.keep(task)
            task.cancel()
            raise
        seconds = time.monotonic() - start
        if not done:
            self.keep(task)
            task.cancel()
            with self._lock:
                self._abandoned.update(t for t in threads if t.is_alive())
            return Outcome(error=TIMEOUT, seconds=seconds)
        if task.cancelled():
            return Outcome(error=EXCEPTION, exception=asyncio.CancelledError("the call was cancelled"), seconds=seconds)
        if task.exception() is not None:
            return Outcome(error=EXCEPTION, exception=task.exception(), seconds=seconds)
        return Outcome(task.result(), seconds=seconds)

    async def call(self, fn: Callable, *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)`: a coroutine function awaited on the loop, a plain function in a
        fresh daemon thread; its exception raised here (SystemExit and the like as RuntimeError:
        they would stop the loop)."""
        if inspect.iscoroutinefunction(fn):
            try:
                return await fn(*args, **kwargs)
            except (SystemExit, KeyboardInterrupt) as e:
                raise RuntimeError(error_line(e)) from None
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not future.done():  # cancelled when the call overran
                future.set_result(value) if ok else future.set_exception(value)

        def work() -> None:
            try:
                ok, value = True, fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised on the loop, whatever it is
                ok, value = False, e if isinstance(e, Exception) else RuntimeError(error_line(e))
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop is closed: nobody waits for this call any more
                pass
        thread = threading.Thread(target=work, name=f"{self.name}-{getattr(fn, '__qualname__', '')}", daemon=True)
        threads = _THREADS.get()
        if threads is not None:
            threads.append(thread)
        thread.start()
        value = await future
        return await value if inspect.isawaitable(value) else value  # a def that returns a coroutine

    def keep(self, task: asyncio.Future) -> None:
        """Holds a task nobody awaits until it ends, reading its outcome (so asyncio logs no
        "exception was never retrieved")."""
        self._background.add(task)
        task.add_done_callback(lambda t: (self._background.discard(t), t.cancelled() or t.exception()))


# ------------------------------------------------------------------ a blocking call, bounded

class Overrun(TimeoutError):
    """The call did not return within its bound."""


_BOUNDED = UserCode("spmdsplit-bounded")  # call_within's own loop: never the loop of its caller


def call_within(seconds: float, fn: Callable, *args, **kwargs) -> Any:
    """fn(*args, **kwargs)'s result, or its exception re-raised here; Overrun after `seconds` (the
    call's thread is left to finish on its own, counted in `stuck_bounded()`, with a warning). For a
    scorer that must be bounded from whatever thread calls it: signal-based timeouts (math-verify's
    own) work on the main thread only, and a process per call would cost more than most scores take."""
    import warnings

    outcome = _BOUNDED.run(fn, *args, timeout_s=seconds, **kwargs)
    if outcome.error == TIMEOUT:
        name = getattr(fn, "__qualname__", fn)
        warnings.warn(f"{name} took more than {seconds} s: scored as a timeout ({stuck_bounded()} calls still "
                      "running in this process)")
        raise Overrun(f"{name} took more than {seconds} s")
    if outcome.error:
        raise outcome.exception
    return outcome.value


def stuck_bounded() -> int:
    """How many of call_within's calls that overran are still running in this process."""
    return _BOUNDED.stuck


# ------------------------------------------------------------------ worker processes

def write_message(stream, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def read_message(stream) -> Any:
    """One message, or EOFError when the stream ends."""
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


class WorkerDied(RuntimeError):
    """A worker process ended in the middle of a call (killed, crashed, or its function exited it)."""


class _Worker:
    """One process running spmdsplit/usercode_worker.py: the function loaded once, then a call per
    message, each answered (ok, value or the error as one line)."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process

    async def send(self, kwargs: dict) -> None:
        data = pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)
        self.process.stdin.write(struct.pack("<Q", len(data)) + data)
        await self.process.stdin.drain()

    async def answer(self) -> Any:
        try:
            head = await self.process.stdout.readexactly(8)
            (size,) = struct.unpack("<Q", head)
            ok, value = pickle.loads(await self.process.stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            await self.process.wait()
            raise WorkerDied(f"the worker process ended during the call (exit code {self.process.returncode})") from e
        if not ok:
            raise FunctionFailed(value)
        return value

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


class FunctionFailed(RuntimeError):
    """The function raised in its worker (its exception as one line: the object may not pickle)."""


class Workers:
    """`size` processes calling one function by keyword (a file's `name`, loaded in each process
    as spmdsplit/rewards/custom.py loads it), at most `size` calls at once, each on an idle
    process or a new one. A call that overruns or ends its process costs that process: it is
    killed, and a later call starts another. Use on the UserCode loop (`await workers.call(...)`
    inside `within`)."""

    def __init__(self, path: str, name: str, size: int):
        self.path, self.name, self.size = path, name, size
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None  # made on the loop that uses it

    async def call(self, **kwargs) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            while self._idle and self._idle[-1].process.returncode is not None:  # ended while idle
                self._idle.pop()
            worker = self._idle.pop() if self._idle else await self._start()
            fit = False
            try:
                await worker.send(kwargs)
                value = await worker.answer()
                fit = True
                return value
            except FunctionFailed:
                fit = True  # the function raised and its process goes on
                raise
            finally:  # a call cancelled at its deadline, or a process that ended, costs the process
                if fit:
                    self._idle.append(worker)
                else:
                    worker.kill()

    async def _start(self) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "spmdsplit.usercode_worker", self.path, self.name,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        worker = _Worker(process)
        try:
            await worker.answer()  # loaded: (True, None); the load's error otherwise
        except BaseException:
            worker.kill()
            raise
        return worker

    def close(self) -> None:
        """Kills the idle workers (busy ones are killed when their calls overrun, or end with the job)."""
        while self._idle:
            self._idle.pop().kill()
