"""How each sample's reward is computed: by which function, called how, bounded in time, and what
became of each call. `RewardCalls.score(samples)` scores a batch, its calls concurrent, and returns
one `Scored` per sample, never an exception for a fault of the function (roles/reward.py decides
what a failed sample scores: reward.on_error).

Which function, and how it runs:
- no custom function, no server: the built-in scorer of each sample's data_source (rewards/rule.py).
  Those that compute run inline, one after another (microseconds to milliseconds each); those that
  wait (WAITING_SOURCES: the code data_sources, whose programs run in the sandbox or on a
  SandboxFusion server) run concurrently on the event loop.
- reward.remote_url: a reward server (rewards/remote.py), reward.max_concurrency requests in flight.
- reward.custom_fn, by its shape and reward.reward_manager.name (verl's): an `async def` on the event
  loop, reward.max_concurrency calls at once; a plain def under `naive` in threads (reward.num_workers
  at once, 0 = 64), under `prime` in worker processes (reward.num_workers, 0 = the rank's cores);
  under `batch`, one call per batch with verl's batch signature (lists), in a thread.
Every call is bounded by reward.timeout_s (a batch call's bound is the batch's).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from spmdsplit.errors import ConfigError
from spmdsplit.rewards import rule
from spmdsplit.rewards.remote import ServerError, check_installed
from spmdsplit.usercode import EXCEPTION, TIMEOUT, Outcome, UserCode, Workers, error_line

BAD_RESULT = "bad_result"  # a number that is not one, a dict without "score", a batch of the wrong length
# Every kind a sample's reward can fail with (rewards/remote.py adds the server's own two).
ERROR_KINDS = (EXCEPTION, TIMEOUT, BAD_RESULT, "http_error", "unreachable")
THREADS_DEFAULT = 64  # naive plain functions: threads only wait, so many are cheap


@dataclass
class Sample:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Any
    prompt_str: str = ""  # decoded only for those that read it: a reward server, the judge, a function taking it


@dataclass
class Scored:
    """A sample's score and the other numbers its function returned, or the error kind, its
    message and the exception behind it (score None)."""
    score: float | None = None
    extras: dict = field(default_factory=dict)
    error: str | None = None
    message: str = ""
    exception: BaseException | None = None


def rank_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class RewardCalls:
    """The reward function of a RuleReward (see the module's docstring), with its event loop and,
    for `prime`, its worker processes; `waiting` maps data_sources to async scorers
    (rewards/code.py and sandbox_fusion.py, given by roles/build.py)."""

    def __init__(self, reward_cfg, custom_fn: Callable | None = None, remote=None,
                 waiting: dict[str, Callable] | None = None, judge=None):
        """`waiting`: the built-in scorers that wait, by data_source (waiting_scorers; none: every
        built-in scorer inline, and the code data_sources have no scorer). `judge`: reward.judge's
        (rewards/judge.py), started: it scores the rows of reward.judge.data_sources (all of them
        without a custom function), and a custom function that takes verl's
        `reward_router_address` gets its endpoint's."""
        self.cfg, self.custom_fn, self.remote, self.waiting = reward_cfg, custom_fn, remote, waiting or {}
        manager = reward_cfg.reward_manager.name
        self.judge = judge
        self.judge_sources = set(reward_cfg.judge.data_sources) if judge is not None else set()
        self.verdict_texts: list[str] = []  # the last `score`'s first verdict per sample ("" = not judged)
        self.router_kwargs = router_kwargs(custom_fn, judge, manager)
        # The prompt's text (decoded as the response is), to a function that takes `prompt_str`
        # (a batch function: `prompt_strs`).
        self.takes_prompt = custom_fn is not None and takes(custom_fn, "prompt_strs" if manager == "batch" else "prompt_str")
        self.usercode = UserCode("spmdsplit-reward")
        self.workers = None
        if custom_fn is not None and manager == "prime" and not inspect.iscoroutinefunction(custom_fn):
            self.workers = Workers(reward_cfg.custom_fn.path, reward_cfg.custom_fn.name,
                                   reward_cfg.num_workers or rank_cores())

    @property
    def how(self) -> str:
        """What scores the samples, in a few words (errors name it)."""
        if self.remote is not None:
            return f"the reward server at {self.remote.url}"
        return "the custom reward function" if self.custom_fn is not None else "the rule reward"

    @property
    def needs_prompts(self) -> bool:
        """Whether the samples must carry their prompt's text (a reward server, the judge and a
        function taking `prompt_str` read it)."""
        return self.remote is not None or self.judge is not None or self.takes_prompt

    def judges(self, sample: Sample) -> bool:
        """Whether the judge scores `sample` itself (its verdict parsed) rather than its other scorer."""
        if self.judge is None:
            return False
        if self.judge_sources:
            return sample.data_source in self.judge_sources
        return self.custom_fn is None

    def score(self, samples: list[Sample], measure: bool = True) -> list[Scored]:
        """`measure`: the judge's work counts in its metrics (training's batches, not validation's)."""
        judged = [i for i, s in enumerate(samples) if self.judges(s)]
        self.verdict_texts = [""] * len(samples)
        if not judged:
            return self._score(samples)
        by_judge, texts = self.judge.score([samples[i] for i in judged], measure)
        judged_set = set(judged)
        rest = [i for i in range(len(samples)) if i not in judged_set]
        out: list[Scored | None] = [None] * len(samples)
        for i, result, text in zip(judged, by_judge, texts):
            out[i], self.verdict_texts[i] = result, text
        for i, result in zip(rest, self._score([samples[i] for i in rest]) if rest else []):
            out[i] = result
        return out

    def _score(self, samples: list[Sample]) -> list[Scored]:
        if self.remote is not None:
            return self._concurrently(samples, lambda s: lambda: self.remote.score(s), self.cfg.max_concurrency)
        if self.custom_fn is None:
            return self._built_in(samples)
        if self.cfg.reward_manager.name == "batch":
            return self._batch(samples)
        if inspect.iscoroutinefunction(self.custom_fn):
            return self._concurrently(samples, lambda s: lambda: self.custom_fn(**self.kwargs(s)), self.cfg.max_concurrency)
        if self.workers is not None:
            return self._concurrently(samples, lambda s: lambda: self.workers.call(**self.kwargs(s)), self.workers.size)
        return self._concurrently(samples, lambda s: lambda: self.usercode.call(self.custom_fn, **self.kwargs(s)),
                                  self.cfg.num_workers or THREADS_DEFAULT)

    def _built_in(self, samples: list[Sample]) -> list[Scored]:
        """Inline, but for the data_sources whose scorers wait: those concurrently, on the loop."""
        out: list[Scored | None] = [None] * len(samples)
        waiting = [i for i, s in enumerate(samples) if s.data_source in self.waiting]
        if waiting:
            jobs = [(lambda s: lambda: self.waiting[s.data_source](s.solution_str, s.ground_truth))(samples[i])
                    for i in waiting]
            outcomes = self.usercode.map(jobs, self.cfg.timeout_s).result()
            for i, outcome in zip(waiting, outcomes):
                out[i] = scored(outcome, samples[i])
        for i, s in enumerate(samples):
            if out[i] is None:
                try:
                    result = rule.compute_score(s.data_source, s.solution_str, s.ground_truth, s.extra_info)
                except KeyError:
                    raise  # no scorer for the data_source: the data's error, not a call's (roles/reward.py)
                except Exception as e:  # noqa: BLE001 - the scorer's fault: said with the sample, or scored
                    out[i] = Scored(error=EXCEPTION, message=error_line(e), exception=e)
                    continue
                out[i] = scored(Outcome(result), s)
        return out

    def _concurrently(self, samples: list[Sample], job: Callable[[Sample], Callable], at_once: int) -> list[Scored]:
        outcomes = self.usercode.map([job(s) for s in samples], self.cfg.timeout_s, at_once).result()
        return [scored(o, s) for o, s in zip(outcomes, samples)]

    def _batch(self, samples: list[Sample]) -> list[Scored]:
        """verl's batch reward function: one call with the batch's columns as lists; it returns one
        result per sample."""
        columns = dict(data_sources=[s.data_source for s in samples], solution_strs=[s.solution_str for s in samples],
                       ground_truths=[s.ground_truth for s in samples], extra_infos=[s.extra_info for s in samples],
                       **self.router_kwargs)
        if self.takes_prompt:
            columns["prompt_strs"] = [s.prompt_str for s in samples]
        [outcome] = self.usercode.map([lambda: self.usercode.call(self.custom_fn, **columns)], self.cfg.timeout_s).result()
        if outcome.error:
            return [Scored(error=outcome.error, message=outcome.message, exception=outcome.exception) for _ in samples]
        results = outcome.value
        if not isinstance(results, (list, tuple)) or len(results) != len(samples):
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
            return [Scored(error=BAD_RESULT, message=f"the batch function returned {got} for {len(samples)} samples")
                    for _ in samples]
        return [scored(Outcome(r), s) for r, s in zip(results, samples)]

    def kwargs(self, s: Sample) -> dict:
        """A custom function's arguments: verl's four, the judge's address, the prompt's text."""
        return {**verl_kwargs(s), **self.router_kwargs, **({"prompt_str": s.prompt_str} if self.takes_prompt else {})}

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        if self.judge is not None:
            self.judge.close()
        self.usercode.close()


BATCH_ARGUMENTS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def check_reward_function(reward_cfg, fn: Callable | None) -> None:
    """What a job's reward settings ask of its function, checked on every rank before the first
    collective: a ConfigError of one line naming the key."""
    manager = reward_cfg.reward_manager.name
    if reward_cfg.remote_url:
        if fn is not None:
            raise ConfigError(f"reward.remote_url={reward_cfg.remote_url!r} and reward.custom_fn.path are both set: a "
                              "sample has one reward; call the server from the function, or leave out one of them")
        if not reward_cfg.remote_url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.remote_url={reward_cfg.remote_url!r}: expected an http:// or https:// address")
        check_installed()
    if manager != "naive" and fn is None:
        raise ConfigError(f"reward.reward_manager.name={manager}: it says how a custom reward function is called; "
                          "set reward.custom_fn.path (or leave the manager at naive)")
    if fn is None:
        return
    if manager == "prime" and inspect.iscoroutinefunction(fn):
        raise ConfigError("reward.reward_manager.name=prime runs a plain def in worker processes; "
                          f"{reward_cfg.custom_fn.name} is an async def: use naive (it runs on the event loop)")
    if manager == "batch":
        missing = [a for a in BATCH_ARGUMENTS if not takes(fn, a)]
        if missing:
            raise ConfigError(f"reward.reward_manager.name=batch: {reward_cfg.custom_fn.name} must take verl's batch "
                              f"arguments ({', '.join(BATCH_ARGUMENTS)}) by keyword; it lacks {', '.join(missing)}")


def runs_code_in_sandbox(reward_cfg, data_sources) -> bool:
    """Whether the job's rewards run programs in the rank's sandbox: the built-in scorers score it
    (no custom function, no server, no SandboxFusion url) and its data holds a code data_source."""
    from spmdsplit.rewards.code import DATA_SOURCES

    built_in = not (reward_cfg.custom_fn.path or reward_cfg.remote_url or reward_cfg.sandbox_fusion.url)
    return built_in and any(source in DATA_SOURCES for source in data_sources)


def waiting_scorers(reward_cfg) -> dict[str, Callable]:
    """The built-in scorers that wait, by data_source (RewardCalls runs them concurrently on its
    loop): verl's code sets, on the SandboxFusion server at reward.sandbox_fusion.url, else in the
    rank's sandbox, made when the first such sample comes (its isolation probe runs once per
    process; start-up already ran it where the data holds code)."""
    import functools

    from spmdsplit.rewards import code

    if reward_cfg.sandbox_fusion.url:
        from spmdsplit.rewards import sandbox_fusion

        client = functools.cache(lambda: sandbox_fusion.SandboxFusionClient.from_config(reward_cfg.sandbox_fusion))

        def score(solution_str, ground_truth):
            return sandbox_fusion.compute_score(solution_str, ground_truth, client())
    else:
        from spmdsplit.sandbox import Sandbox

        sandbox = functools.cache(lambda: Sandbox.from_config(reward_cfg.sandbox))

        def score(solution_str, ground_truth):
            return code.compute_score(solution_str, ground_truth, sandbox())
    return dict.fromkeys(code.DATA_SOURCES, score)


def takes(fn: Callable, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (by name, or through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def router_kwargs(fn: Callable | None, judge, manager: str) -> dict:
    """What a custom function gets besides verl's four arguments when a judge serves on the rank, as
    verl's reward loop gives it: `reward_router_address` ("127.0.0.1:<port>") and
    `reward_model_tokenizer` (the judge's; not to worker processes, under prime), each only to a
    function that takes it."""
    if fn is None or judge is None or judge.router_address is None:
        return {}
    out = {}
    if takes(fn, "reward_router_address"):
        out["reward_router_address"] = judge.router_address
    if manager != "prime" and takes(fn, "reward_model_tokenizer"):
        out["reward_model_tokenizer"] = judge.tokenizer
    return out


def verl_kwargs(s: Sample) -> dict:
    """A custom function's arguments, by keyword, as verl calls it."""
    return dict(data_source=s.data_source, solution_str=s.solution_str, ground_truth=s.ground_truth,
                extra_info=s.extra_info)


def scored(outcome: Outcome, sample: Sample) -> Scored:
    """A call's outcome as the sample's score: its result read as rule.normalize_result reads it
    (a number, or a dict with "score"), anything else a BAD_RESULT."""
    if outcome.error:
        # A server's failure carries its own kind (unreachable, http_error, ...).
        kind = outcome.exception.kind if isinstance(outcome.exception, ServerError) else outcome.error
        message = str(outcome.exception) if isinstance(outcome.exception, ServerError) else outcome.message
        return Scored(error=kind, message=message, exception=outcome.exception)
    try:
        score, extras = rule.normalize_result(outcome.value, sample.data_source, sample.solution_str, sample.ground_truth)
    except (TypeError, ValueError) as e:
        return Scored(error=BAD_RESULT, message=" ".join(str(e).split()), exception=e)
    return Scored(score, extras)
