"""The engine while it serves: requests from any thread, one thread stepping the engine.

An engine (inference/base.py StepwiseEngine) is not thread-safe and decodes every request it holds
at each step, so one thread owns it: `submit` queues a request from any thread or coroutine and
returns a future; the stepping thread puts every queued request into the engine before each step,
so requests that arrive together share the engine's steps (a batch), and resolves each future when
its request ends. Nothing else may call the engine while the driver runs, except while paused.

`pause` frees the engine (its device may then go to training: `engine.sleep()`): the requests it
held are taken out of it, with their tokens so far, and wait with the new ones; `resume` puts them
back (prompt and tokens so far as the context, for the budget left). A pause never fails a request;
`stop` does (DriverStopped).

Where another loop owns the engine (continuous generation steps it, taking weights between steps),
`SteppedDriver` has no thread: its owner enters the queued requests and settles each step's deltas.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmdsplit.seeds import nth_seed


@dataclass
class Completion:
    """A request's end: the tokens the engine sampled (the one that ended it included: an EOS, a
    stop token, or the one that completed a stop string) and their log-probs; `text`: the tokens
    decoded without special tokens, cut before the first stop string; `finish_reason`: "stop"
    (an EOS, a stop token or string) or "length" (the budget spent)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    text: str
    versions: list[int] = field(default_factory=list)  # each token's weights version (SteppedDriver's owner sets it)


class DriverStopped(RuntimeError):
    """The driver was stopped before the request ended."""


class ContextTooLong(ValueError):
    """Prompt and budget together exceed the engine's longest context."""


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The request's budget: `max_tokens`, or all the room the prompt leaves (None); ContextTooLong
    when prompt + budget is over `max_model_len` (its message names both numbers)."""
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            raise ContextTooLong(f"the prompt's {prompt_tokens} tokens leave no room for a completion in the "
                                 f"engine's longest context of {max_model_len} tokens")
        return max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        raise ContextTooLong(f"the prompt's {prompt_tokens} tokens and max_tokens={max_tokens} make "
                             f"{prompt_tokens + max_tokens}, over the engine's longest context of "
                             f"{max_model_len} tokens")
    return max_tokens


def single_token_ids(tokenizer, strings: Sequence[str]) -> list[int]:
    """The ids of the stop strings that are one token each: the engine stops on them itself (as on
    an EOS), without a step past them; longer ones are matched in the decoded text."""
    ids = []
    for s in strings:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) == 1 and tokenizer.decode(encoded) == s:
            ids.append(encoded[0])
    return ids


@dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    budget: int
    seed: int | None
    stop: tuple[str, ...]
    stop_ids: list[int] | None  # None: the engine's own EOS ids
    future: concurrent.futures.Future
    validate: bool = False  # sampled as the engine's validation settings say
    tag: str | None = None  # what the caller said it belongs to (an episode)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def entry(self) -> tuple[list[int], int, int | None]:
        """What goes into the engine: the prompt and the tokens so far as the context, the budget
        left, the seed (back after a pause: not the same draws again)."""
        seed = self.seed
        if seed is not None and self.tokens:
            seed = nth_seed(seed, len(self.tokens))
        return self.prompt + self.tokens, self.budget - len(self.tokens), seed


class EngineDriver:
    """`engine` (a StepwiseEngine: HFEngine, VLLMEngine) served to callers on any thread.
    `validate`: the engine samples as its validation settings say (rollout.val_kwargs), unless a
    request says otherwise (submit's `validate`). `gather_s`:
    when a request finds the engine idle, how long the driver waits for others to join it before
    the first step (again after each that comes, up to GATHER_ROUNDS): concurrent HTTP calls arrive
    spread over milliseconds, and an engine whose step decodes a request's whole budget (the judge's
    HF engine) would otherwise run the first alone and make the rest wait for the next step."""

    GATHER_ROUNDS = 10

    def __init__(self, engine, tokenizer, validate: bool = False, name: str = "spmdsplit-serving-engine",
                 gather_s: float = 0.0):
        self.engine, self.tokenizer, self.validate, self.name = engine, tokenizer, validate, name
        self.gather_s = gather_s
        self.eos_ids = list(engine.eos_token_ids)
        self.max_model_len = engine.max_model_len
        self._cond = threading.Condition()
        self._queue: list[_Request] = []  # waiting to go into the engine: new, or taken out by a pause
        self._live: dict[str, _Request] = {}  # in the engine
        self._paused = self._parked = self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._prefix = "s"  # request ids: prefix + a count
        self.steps = self.requests = self.tokens = 0  # engine steps run, requests taken, tokens sampled

    # ---- from any thread

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("EngineDriver.start: already started (a driver runs once)")
            self._thread = threading.Thread(target=self._run, args=(_current_cuda_device(),), name=self.name,
                                            daemon=True)
            self._thread.start()

    def submit(self, prompt_ids: Sequence[int], max_tokens: int | None = None, seed: int | None = None,
               stop: Sequence[str] = (), tag: str | None = None,
               validate: bool | None = None) -> concurrent.futures.Future:
        """A future of the request's Completion: `prompt_ids` continued by at most `max_tokens`
        tokens (None: up to the engine's longest context), until an EOS or one of the `stop` strings.
        Raises ContextTooLong at once. Cancelling the future drops the request from the engine at
        its next step. `tag`: what the request belongs to (SteppedDriver.first_version's key)."""
        budget = check_context(len(prompt_ids), max_tokens, self.max_model_len)
        single = single_token_ids(self.tokenizer, stop)
        request = _Request(f"{self._prefix}{next(self._ids)}", list(prompt_ids), budget, seed, tuple(stop),
                           self.eos_ids + single if single else None, concurrent.futures.Future(),
                           self.validate if validate is None else validate, tag)
        with self._cond:
            if self._stopping or not self._running():
                request.future.set_exception(DriverStopped("the engine driver is not running"))
                return request.future
            self._queue.append(request)
            self.requests += 1
            self._cond.notify_all()
        return request.future

    def _running(self) -> bool:
        return self._thread is not None

    def pause(self) -> None:
        """Returns once the engine holds none of the driver's requests and no step runs: the engine
        may sleep (and take new weights) until `resume`. Requests keep waiting meanwhile. Call it
        from any thread but the stepping thread or the server's event loop (it waits for a step)."""
        with self._cond:
            if not self._paused:  # parked again by this pause (a LockstepDriver's peer may have parked it)
                self._paused, self._parked = True, False
            self._cond.notify_all()
            while not self._parked and self._thread is not None and self._thread.is_alive():
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = self._parked = False
            self._cond.notify_all()

    def stop(self) -> None:
        """Ends the stepping thread; every request not ended fails with DriverStopped."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            left, self._queue = [*self._queue, *self._live.values()], []
            live, self._live = list(self._live), {}
        if live:
            self.engine.abort(live)
        for request in left:
            _fail(request, DriverStopped("the server was stopped before the request ended"))

    # ---- the stepping thread

    def _run(self, cuda_device) -> None:
        try:
            # OpenMP's thread count is per thread, and a new one starts from OMP_NUM_THREADS: torch
            # sets the process's count here on its first parallel op, but vLLM's CPU attention
            # kernel may run before any and refuses metadata made for another count.
            torch.get_num_threads()
            if cuda_device is not None:  # the device is per thread too: this one would default to cuda:0
                torch.cuda.set_device(cuda_device)
            self._loop()
        except BaseException as e:  # a fault of the driver's own: no request may wait for a thread that is gone
            with self._cond:
                self._stopping = True
                left, self._queue, self._live = [*self._queue, *self._live.values()], [], {}
                self._cond.notify_all()
            for request in left:
                _fail(request, DriverStopped(f"the engine driver failed: {type(e).__name__}: {e}"))
            raise

    def _loop(self) -> None:
        """Until stopped: what is queued into the engine, then a step."""
        while True:
            with self._cond:
                while not self._stopping:
                    self._drop_cancelled()
                    if self._paused:
                        self._park()
                    elif self._queue or self._live:
                        break
                    self._cond.wait()
                if self._stopping:
                    return
                if not self._live and self.gather_s > 0:
                    self._gather()
                new, self._queue = self._queue, []
            self._enter(new)
            self._step()

    def _gather(self) -> None:
        """(The lock held.) Waits while requests keep arriving, gather_s after the last one."""
        for _ in range(self.GATHER_ROUNDS):
            seen = len(self._queue)
            self._cond.wait(self.gather_s)
            if len(self._queue) == seen or self._stopping or self._paused:
                return

    def _park(self) -> None:
        """A pause (the lock held): the engine's requests taken out of it, to go back on resume."""
        if self._live:
            self.engine.abort(list(self._live))
            self._queue[:0] = self._live.values()  # ahead of the new ones
            self._live = {}
        if not self._parked:
            self._parked = True
            self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        """Requests whose callers went away (a client that disconnected) leave the engine."""
        gone = [rid for rid, r in self._live.items() if r.future.cancelled()]
        if gone:
            self._abort(gone)
            for rid in gone:
                del self._live[rid]
        self._queue = [r for r in self._queue if not r.future.cancelled()]

    def _enter(self, new: list[_Request]) -> None:
        """The requests into the engine (one the engine refuses fails alone)."""
        for request in new:
            context, budget, seed = request.entry()
            try:
                self.engine.submit(request.id, context, budget, seed, validate=request.validate,
                                   stop_ids=request.stop_ids)
            except Exception as e:  # noqa: BLE001 - its caller hears of it
                _fail(request, e)
                continue
            self._live[request.id] = request

    def _step(self) -> None:
        if self._live:
            self._run_step()

    def _run_step(self) -> list | None:
        """One engine step, its deltas given to the requests they belong to; returns the deltas
        (None: the step failed, every request of this driver in the engine failed with it)."""
        try:
            deltas = self.engine.step()
        except Exception as e:  # noqa: BLE001 - every caller of this step hears of it; the driver goes on
            self._fail_live(e)
            return None
        self._settle_deltas(deltas)
        return deltas

    def _fail_live(self, error: BaseException) -> None:
        """A step failed: every request of this driver in the engine fails with it."""
        failed, self._live = list(self._live.values()), {}
        self.engine.abort([r.id for r in failed])
        for request in failed:
            _fail(request, error)

    def _settle_deltas(self, deltas: list, version: int = 0) -> None:
        """A step's deltas given to this driver's requests they belong to (the others' ignored), each
        token recorded with `version`; the requests they end settled."""
        self.steps += 1
        for delta in deltas:
            request = self._live.get(delta.request_id)
            if request is None:
                continue
            before = len(request.tokens)
            request.tokens += delta.token_ids
            request.log_probs += delta.log_probs
            request.versions += [version] * len(delta.token_ids)
            self.tokens += len(delta.token_ids)
            cut = self._stop_string(request, before)
            if cut is not None and not delta.finished:
                self._abort([request.id])
            if cut is not None or delta.finished:
                del self._live[request.id]
                text = self.tokenizer.decode(request.tokens, skip_special_tokens=True)[:cut]
                _settle(request, Completion(request.tokens, request.log_probs, self._reason(request, cut), text,
                                            request.versions))

    def _abort(self, request_ids: list[str]) -> None:
        """Requests out of the engine before its next step."""
        self.engine.abort(request_ids)

    def _stop_string(self, request: _Request, before: int) -> int | None:
        """Where the first stop string starts in the text (None: none there yet). A step may have
        sampled past it (HF: several tokens a step): the request's tokens end with the one that
        completed it, whatever the engine's step, as if it had stopped there."""
        for end in range(before + 1, len(request.tokens) + 1) if request.stop else ():
            text = self.tokenizer.decode(request.tokens[:end], skip_special_tokens=True)
            found = [i for i in (text.find(s) for s in request.stop) if i >= 0]
            if found:
                del request.tokens[end:], request.log_probs[end:], request.versions[end:]
                return min(found)
        return None

    def _reason(self, request: _Request, cut: int | None) -> str:
        stop_ids = request.stop_ids or self.eos_ids
        return "stop" if cut is not None or (request.tokens and request.tokens[-1] in stop_ids) else "length"


class LockstepDriver(EngineDriver):
    """An EngineDriver on one rank of a tensor-parallel engine (vLLM, tensor_parallel_size > 1),
    whose ranks must put the same requests into it, in the same order, and step it together: a
    rank whose batch differs desynchronises the engine's collectives (vLLM-CPU aborts with a gloo
    size mismatch). Each rank's driver takes requests from callers on its own rank; before every
    step the engine's drivers trade over `peers` (a gloo group of the engine's ranks, in rank
    order) what each has new: requests (context, budget and seed as its owner computed them),
    aborts, and whether it is paused or stopping. Every rank then enters every rank's requests in
    rank order, steps, and settles only its own; what the peers asked stays in the engine as theirs
    (`_shadows`) until they finish or are aborted. Aborts wait for the next trade: an abort by one
    rank alone would change its batch only.

    - A pause by any rank parks every rank's engine (every request out of it; each rank keeps its
      own to put back); the engine steps again once no rank is paused. `pause` returns once a trade
      carried this rank's pause, so no step can run after it returns until it resumes.
    - Idle, the drivers still trade, every POLL_S, backing off to IDLE_POLL_S: a request on one
      rank must reach the others' engines.
    - `stop` returns once every rank's driver stopped (the job's end: each rank stops its own).
    - `post(obj)`: an object for the other ranks, carried by the next trade (`posted()` on theirs):
      what one rank made of its callers' answers (a harness's episodes) reaches the ranks that only
      stepped the engine with it, over the group the drivers already trade on."""

    POLL_S, IDLE_POLL_S = 0.002, 0.05

    def __init__(self, engine, tokenizer, peers, **kwargs):
        super().__init__(engine, tokenizer, **kwargs)
        self.peers, self.place = peers, dist.get_rank(peers)
        self._prefix = f"r{self.place}s"  # unique over the engine's ranks
        self._aborts: list[str] = []  # for the next trade
        self._shadows: set[str] = set()  # the other ranks' requests in the engine
        self._outbox: list = []  # posted here, for the next trade
        self._inbox: list = []  # the other ranks' posts, in the order traded

    def _abort(self, request_ids: list[str]) -> None:
        self._aborts += request_ids

    def post(self, obj) -> None:
        with self._cond:
            self._outbox.append(obj)
            self._cond.notify_all()

    def posted(self, timeout_s: float | None = None):
        """The next object another rank posted, waiting for it (DriverStopped if the driver stops
        first, TimeoutError after `timeout_s`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._inbox or self._stopping, timeout_s):
                raise TimeoutError(f"no peer posted within {timeout_s} s")
            if not self._inbox:
                raise DriverStopped("the engine driver stopped before a peer posted")
            return self._inbox.pop(0)

    def _loop(self) -> None:
        wait = self.POLL_S
        while True:
            offer, offered = self._offer(wait)
            offers = [None] * dist.get_world_size(self.peers)
            dist.all_gather_object(offers, offer, group=self.peers)
            if all(o["stopping"] for o in offers):
                return
            busy = self._apply(offers, offered, paused=offer["paused"])
            wait = self.POLL_S if busy else min(wait * 2, self.IDLE_POLL_S)

    def _offer(self, wait: float) -> tuple[dict, list[_Request]]:
        """What this rank trades now; with nothing in the engine, after up to `wait` (a new request,
        a pause or a stop cuts it short)."""
        with self._cond:
            stepping = self._live or self._shadows
            if not stepping and not self._outbox:
                self._cond.wait(wait)
            if self._queue and not stepping and self.gather_s > 0 and not self._paused:
                self._gather()
            self._drop_cancelled()
            offered = [] if self._paused or self._stopping else list(self._queue)
            aborts, self._aborts = self._aborts, []
            outbox, self._outbox = self._outbox, []
            offer = {"post": outbox, "requests": [(r.id, *r.entry(), r.stop_ids, r.validate) for r in offered], "aborts": aborts,
                     "paused": self._paused, "stopping": self._stopping}
        return offer, offered

    def _apply(self, offers: list[dict], offered: list[_Request], paused: bool) -> bool:
        """Every rank's trade applied alike; returns whether anything happened or is held."""
        posts = [obj for place, o in enumerate(offers) if place != self.place for obj in o["post"]]
        if posts:
            with self._cond:
                self._inbox += posts
                self._cond.notify_all()
        aborts = [rid for o in offers for rid in o["aborts"]]
        if aborts:
            self.engine.abort(aborts)
            self._shadows.difference_update(aborts)
        if any(o["paused"] for o in offers):
            with self._cond:
                held = [*self._live, *self._shadows]
                if held:
                    self.engine.abort(held)
                self._queue[:0] = self._live.values()  # ahead of the waiting ones, which were not entered
                self._live, self._shadows = {}, set()
                if paused:  # a trade carried this rank's pause: nothing steps until it resumes
                    self._parked = True
                    self._cond.notify_all()
            return bool(aborts or held)
        mine = {r.id: r for r in offered}
        with self._cond:
            self._queue = [r for r in self._queue if r.id not in mine]
        for o in offers:
            for rid, context, budget, seed, stop_ids, validate in o["requests"]:
                try:
                    self.engine.submit(rid, context, budget, seed, validate=validate, stop_ids=stop_ids)
                except Exception as e:  # noqa: BLE001 - refused alike on every rank; its owner hears of it
                    if rid in mine:
                        _fail(mine[rid], e)
                    continue
                if rid in mine:
                    self._live[rid] = mine[rid]
                else:
                    self._shadows.add(rid)
        if not (self._live or self._shadows):
            return bool(aborts)
        deltas = self._run_step()
        if deltas is None:  # failed on every rank alike: the peers' requests are out too
            self.engine.abort(list(self._shadows))
            self._shadows.clear()
        else:
            self._shadows.difference_update(d.request_id for d in deltas if d.finished)
        return True


class SteppedDriver(EngineDriver):
    """An EngineDriver whose engine its owner steps, on the owner's thread: continuous generation
    (spmdsplit/generation/continuous.py), which takes new weights between two steps while requests go on. No
    thread of its own: callers submit from any thread as to any driver, and each submit sets
    `signal` (the owner's: it waits on it while it has nothing to step); the owner calls `enter()`
    before an engine step (what callers queued goes into the engine) and `settle(deltas, version)`
    after it (each token recorded with the weights version that sampled it, each tag's first such
    version kept in `first_version`). Not paused: the engine does not sleep while it serves
    continuously."""

    def __init__(self, engine, tokenizer, signal: threading.Event, **kwargs):
        super().__init__(engine, tokenizer, **kwargs)
        self.signal, self._started = signal, False
        self.first_version: dict[str, int] = {}  # tag -> the version of its first token sampled

    def _running(self) -> bool:
        return self._started

    def start(self) -> None:
        with self._cond:
            self._started = True

    def submit(self, *args, **kwargs) -> concurrent.futures.Future:
        future = super().submit(*args, **kwargs)
        self.signal.set()
        return future

    def enter(self) -> bool:
        """The requests queued into the engine (those whose callers went away out of it first; where
        the engine held none of this driver's, after gather_s for others to come); whether it holds
        any now."""
        with self._cond:
            self._drop_cancelled()
            if self._queue and not self._live and self.gather_s > 0:
                self._gather()
            new, self._queue = self._queue, []
        self._enter(new)
        return bool(self._live)

    def settle(self, deltas: list, version: int) -> None:
        for delta in deltas:
            request = self._live.get(delta.request_id)
            if request is not None and request.tag is not None and delta.token_ids:
                self.first_version.setdefault(request.tag, version)
        self._settle_deltas(deltas, version)

    def fail(self, error: BaseException) -> None:
        """The owner's engine step failed: this driver's requests in it fail with it."""
        self._fail_live(error)

    @property
    def held(self) -> int:
        """How many of its requests the engine holds."""
        return len(self._live)


def _settle(request: _Request, completion: Completion) -> None:
    if request.future.set_running_or_notify_cancel():  # False: the caller cancelled it
        request.future.set_result(completion)


def _fail(request: _Request, error: BaseException) -> None:
    if request.future.set_running_or_notify_cancel():
        request.future.set_exception(error)


def make_driver(engine, tokenizer, peers=None, stepped: threading.Event | None = None, **kwargs) -> EngineDriver:
    """An EngineDriver; with `peers` (the gloo group of a tensor-parallel engine's ranks, more than
    one) a LockstepDriver; with `stepped` (the owner's signal) a SteppedDriver."""
    if stepped is not None:
        if peers is not None and dist.get_world_size(peers) > 1:
            raise ValueError("a SteppedDriver serves an engine of one rank (its owner steps it alone)")
        return SteppedDriver(engine, tokenizer, stepped, **kwargs)
    if peers is not None and dist.get_world_size(peers) > 1:
        return LockstepDriver(engine, tokenizer, peers, **kwargs)
    return EngineDriver(engine, tokenizer, **kwargs)


def _current_cuda_device() -> int | None:
    """The CUDA device of the thread that starts the driver, for the stepping thread (None off CUDA)."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
