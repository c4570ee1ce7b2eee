"""Environments users bring, run as multi-turn episodes (rollout.multi_turn.environment).

The protocol is gymnasium's and OpenEnv's, three calls on one instance per episode:

    reset(seed=None, **row_kwargs) -> observation, or gymnasium's (observation, info)
    step(action) -> observation, or gymnasium's (observation, reward, terminated, truncated, info)
                    (gym's older (observation, reward, done, info) too)
    close()                                           optional, when the episode ends

An observation is anything with `done` and `reward` attributes and its text: our `Observation`
below, an OpenEnv `Observation` (a pydantic model: its one text field, or its fields other than
done/reward/metadata as JSON), or a plain string (reward 0, not done); inside gymnasium's tuples the
tuple says reward and end, and the observation gives the text (a string, such an object, or a dict
as JSON). `terminated` and `truncated` stay apart: a truncated episode (a time limit) ended without
reaching a terminal state, and each row says which (roles read `env_terminated`, `env_truncated`);
old gym's done reads `info["TimeLimit.truncated"]`. The numbers in `info` are logged
(env/info/<key>/mean) and reach the reward function in extra_info["environment_info"]. GEM's
environments (`gem.make` with `env_id`) and TextArena's games through GEM run as they are. The action is the policy's
turn as text, or, when `step` is annotated with a pydantic model (an OpenEnv `Action` subclass),
that model built from the text: its field named by rollout.multi_turn.environment_action_field, or
its one required string field. So an OpenEnv `Environment` subclass runs as it is and OpenEnv is
never imported; users who do not have it write the same three methods.

Environments are user code: each call runs in a fresh daemon thread (spmdsplit/usercode.py, where all
user code runs) bounded by rollout.multi_turn.tool_timeout_s; one that raises, hangs or returns what is not an observation
ends its episode there (the steps' rewards so far kept), is counted under the tools' error kinds
(exception, timeout, not_text) and is never shown to the job as an exception. An observation's
text is cut to rollout.multi_turn.max_tool_response_length characters like a tool's response. The
instance is closed when its episode ends, or when the episode is dropped (a continuous stream's
restart) and collected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import math
import numbers
import typing
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from spmdsplit.agent.tools import ToolConfigError, import_target, truncate
from spmdsplit.usercode import UserCode

SETTING = "rollout.multi_turn.environment"
NOT_TEXT = ("done", "reward", "metadata")  # an OpenEnv observation's fields that are not what the model reads


@dataclass
class Observation:
    """What an environment of our own returns from reset and step."""
    text: str
    reward: float | None = None
    done: bool = False
    metadata: dict = field(default_factory=dict)


@dataclass
class EnvSlot:
    """An episode's environment instance; empty on the ranks of an engine that do not run it
    (`run_once`), and after the instance hung or failed."""
    instance: Any = None
    broken: bool = False
    closer: Any = None  # weakref.finalize: closes the instance if the episode is dropped unfinished

    def __getstate__(self) -> dict:  # a checkpoint keeps finished episodes; their instance is gone
        return {"instance": None, "broken": self.broken, "closer": None}


@dataclass
class EnvCall:
    """One call of an episode's environment: its reset (`action` None) or a step."""
    slot: EnvSlot
    action: str | None
    reset_kwargs: dict = field(default_factory=dict)
    seed: int | None = None


@dataclass
class EnvResult:
    text: str = ""
    reward: float = 0.0
    done: bool = False  # the episode ends: terminated, truncated, or its call failed
    error: str = ""  # "" or one of the tools' ERROR_KINDS
    message: str = ""  # the error, whole (the text the model reads is cut like any observation)
    text_cut: bool = False  # the text was cut to rollout.multi_turn.max_tool_response_length
    seconds: float = 0.0
    terminated: bool = False  # a terminal state (gymnasium's terminated; an observation's done)
    truncated: bool = False  # ended before a terminal state (gymnasium's truncated: a time limit)
    info: dict = field(default_factory=dict)  # the numbers of gymnasium's info


@dataclass
class Reading:
    """What a reset or step returned, read: the observation's text, the reward, how it ends, and
    the numbers of its info."""
    text: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict = field(default_factory=dict)


def load_environment(path: str, kwargs: dict, action_field: str = "") -> Callable[[], Any]:
    """A factory of the environment `path` names (pkg.mod.Name or path/to/file.py:Name), called with
    `kwargs` (rollout.multi_turn.environment_kwargs); one instance is built now, to fail here, on
    every rank before the first collective, with one line: a missing class, a constructor that
    raises, a class without reset/step, an action model the text cannot fill."""
    where = f"{SETTING}={path}"
    target = import_target(path, where)
    if not callable(target):
        raise ToolConfigError(f"{where}: expected a class (or a function returning an environment), "
                              f"got {type(target).__name__}")

    def build() -> Any:
        return target(**kwargs)
    try:
        probe = build()
    except Exception as e:
        raise ToolConfigError(f"{where}: constructing it with rollout.multi_turn.environment_kwargs={kwargs} "
                              f"raised {type(e).__name__}: {' '.join(str(e).split())}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(probe, m, None))]
    if missing:
        raise ToolConfigError(f"{where}: an environment needs reset and step methods; it has no {' or '.join(missing)}")
    try:
        action_builder(probe, action_field)
    except ValueError as e:
        raise ToolConfigError(f"{where}: {e}") from None
    _close_quietly(probe)
    return build


def action_builder(env: Any, action_field: str = "") -> Callable[[str], Any]:
    """How a turn's text becomes the argument of `env.step`: the text itself, or the pydantic model
    `step` is annotated with (OpenEnv's Action subclasses), filled from the text."""
    try:
        hints = typing.get_type_hints(type(env).step)
    except Exception:  # annotations that do not resolve: the text as it is
        hints = {}
    params = [p for p in inspect.signature(env.step).parameters.values() if p.name != "self"]
    model = hints.get(params[0].name) if params else None
    fields = getattr(model, "model_fields", None)
    if not inspect.isclass(model) or not isinstance(fields, dict):
        return lambda text: text
    if action_field:
        if action_field not in fields:
            raise ValueError(f"rollout.multi_turn.environment_action_field={action_field!r}: {model.__name__} has "
                             f"no such field; its fields: {sorted(fields)}")
        name = action_field
    else:
        required = [n for n, f in fields.items() if f.is_required()]
        texts = [n for n in required if fields[n].annotation is str]
        if len(required) != 1 or len(texts) != 1:
            raise ValueError(f"{model.__name__} (the action type of step) needs {required or 'no field'}; name the "
                             f"one the model's text fills with rollout.multi_turn.environment_action_field")
        name = texts[0]
    return lambda text: model(**{name: text})


def read_observation(obs: Any) -> tuple[str, float, bool]:
    """(text, reward, done) of an observation object or string; ValueError if it is not one."""
    if isinstance(obs, str):
        return obs, 0.0, False
    if not hasattr(obs, "done"):
        raise ValueError(f"returned {type(obs).__name__}, not an observation (a string, an object with done, "
                         f"reward and its text, or gymnasium's tuple)")
    return observation_text(obs), finite_reward(getattr(obs, "reward", None), "an observation whose reward"), bool(obs.done)


def observation_text(obs: Any) -> str:
    """The text the model reads of an observation: a string, its `text`, or its fields other than
    done/reward/metadata (its one string field, or all of them as JSON); a dict as JSON."""
    if isinstance(obs, str):
        return obs
    text = getattr(obs, "text", None)
    if isinstance(text, str):
        return text
    if hasattr(obs, "model_dump"):  # an OpenEnv observation: the fields the model reads
        rest = {k: v for k, v in obs.model_dump().items() if k not in NOT_TEXT}
    elif dataclasses.is_dataclass(obs) and not isinstance(obs, type):
        rest = {k: v for k, v in dataclasses.asdict(obs).items() if k not in NOT_TEXT}
    elif isinstance(obs, dict):
        return json.dumps(obs, default=str, sort_keys=True)
    else:
        raise ValueError(f"returned {type(obs).__name__}, whose text cannot be read (give it a `text` string)")
    strings = [v for v in rest.values() if isinstance(v, str)]
    return strings[0] if len(rest) == 1 and strings else json.dumps(rest, default=str, sort_keys=True)


def finite_reward(reward: Any, what: str) -> float:
    number = 0.0 if reward is None else float(reward) if isinstance(reward, numbers.Real) else None
    if number is None or not math.isfinite(number):
        raise ValueError(f"returned {what} is {reward!r}, not a finite number")
    return number


def info_numbers(info: Any) -> dict[str, float]:
    """The finite numbers (bools as 0/1) of gymnasium's info dict, by key; the rest is not logged."""
    if not isinstance(info, dict):
        return {}
    return {str(k): float(v) for k, v in info.items()
            if isinstance(v, numbers.Real) and math.isfinite(float(v))}


def read_returned(returned: Any, reset: bool) -> Reading:
    """What `reset` (reset=True) or `step` returned, in any of the protocol's shapes; ValueError if none."""
    if not isinstance(returned, tuple):
        text, reward, done = read_observation(returned)
        return Reading(text, 0.0 if reset else reward, terminated=done)
    shapes = "(observation, info)" if reset else "(observation, reward, terminated, truncated, info)"
    if reset and len(returned) == 2:
        obs, info = returned
        return Reading(observation_text(obs), info=info_numbers(info))
    if not reset and len(returned) == 5:
        obs, reward, terminated, truncated, info = returned
    elif not reset and len(returned) == 4:  # gym before 0.26: done, a time limit said in info
        obs, reward, done, info = returned
        truncated = bool(done) and isinstance(info, dict) and bool(info.get("TimeLimit.truncated", False))
        terminated = bool(done) and not truncated
    else:
        raise ValueError(f"returned a tuple of {len(returned)}, not gymnasium's {shapes}")
    return Reading(observation_text(obs), finite_reward(reward, "a reward that"), bool(terminated), bool(truncated),
                   info_numbers(info))


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


class Environments:
    """Builds, steps and closes the episodes' environment instances, each call in a fresh daemon
    thread (a hung environment never holds up the job or its exit) within `timeout_s`."""

    def __init__(self, factory: Callable[[], Any], *, timeout_s: float, max_text_chars: int, truncate_side: str,
                 action_field: str = ""):
        self.factory, self.timeout_s, self.action_field = factory, timeout_s, action_field
        self.max_text_chars, self.truncate_side = max_text_chars, truncate_side
        self.close_errors = 0
        self._builders: dict[type, Callable[[str], Any]] = {}  # per environment class: text -> action
        self.usercode = UserCode("spmdsplit-environments")

    @property
    def stuck(self) -> int:
        """How many threads of timed-out calls are still running."""
        return self.usercode.stuck

    def start(self, calls: Sequence[EnvCall]) -> concurrent.futures.Future:
        """All calls at once, each in a thread of its own; a future of one EnvResult per call, in
        order, never an exception."""
        async def one(call: EnvCall) -> EnvResult:
            outcome = await self.usercode.within(lambda: self.usercode.call(self._work, call), self.timeout_s)
            if outcome.error:  # only a timeout: _work answers every fault of the environment itself
                call.slot.broken = True  # the instance may be mid-call: never used or closed again
                result = self._error("timeout", f"the environment did not answer within {self.timeout_s:g} s")
            else:
                result = outcome.value
            result.seconds = outcome.seconds
            return result

        async def all_calls() -> list[EnvResult]:
            return list(await asyncio.gather(*(one(c) for c in calls)))
        if not calls:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result([])
            return done
        return self.usercode.submit(all_calls())

    def run(self, calls: Sequence[EnvCall]) -> list[EnvResult]:
        return self.start(calls).result()

    def _work(self, call: EnvCall) -> EnvResult:
        """One call, in its thread; the episode's instance closed here when the episode ends (unless
        the call overran meanwhile: then it is left alone)."""
        what = "reset" if call.action is None else "step"
        try:
            result = self._call(call)
        except _NotObservation as e:  # user code's garbage or fault: contained, counted
            result = self._error("not_text", f"{what} {e}")
        except Exception as e:
            result = self._error("exception", f"{what} raised {type(e).__name__}: {' '.join(str(e).split())}")
        if result.error or result.done:
            self.release(call.slot)
        return result

    def _call(self, call: EnvCall) -> EnvResult:
        slot = call.slot
        if call.action is None:
            slot.instance = self.factory()
            slot.closer = weakref.finalize(slot, _close_quietly, slot.instance)
            kwargs = dict(call.reset_kwargs)
            if call.seed is not None and _accepts(slot.instance.reset, "seed"):
                kwargs.setdefault("seed", call.seed)
            returned = slot.instance.reset(**kwargs)
        else:
            if slot.instance is None or slot.broken:
                raise RuntimeError("the episode's environment is gone")
            kind = type(slot.instance)
            if kind not in self._builders:
                self._builders[kind] = action_builder(slot.instance, self.action_field)
            returned = slot.instance.step(self._builders[kind](call.action))
        try:
            read = read_returned(returned, reset=call.action is None)
        except ValueError as e:
            raise _NotObservation(str(e)) from None
        text, cut = truncate(read.text, self.max_text_chars, self.truncate_side)
        return EnvResult(text, read.reward, read.terminated or read.truncated, text_cut=cut, terminated=read.terminated,
                         truncated=read.truncated, info=read.info)

    def release(self, slot: EnvSlot) -> None:
        """Closes the episode's instance now (a broken one is left alone: it may be mid-call)."""
        instance, slot.instance = slot.instance, None
        if slot.closer is not None:
            slot.closer.detach()
        if instance is not None and not slot.broken:
            self.close_errors += not _close_quietly(instance)

    def _error(self, kind: str, message: str) -> EnvResult:
        text, cut = truncate(f"Error: environment: {message}", self.max_text_chars, self.truncate_side)
        return EnvResult(text, error=kind, message=message, done=True, text_cut=cut)


class _NotObservation(ValueError):
    pass


def _close_quietly(instance: Any) -> bool:
    close = getattr(instance, "close", None)
    if not callable(close):
        return True
    try:
        close()
        return True
    except Exception:
        return False
