"""Environments written for TRL (`GRPOTrainer(environment_factory=...)`), run as tool-calling
episodes of the agent loop (rollout.multi_turn.environment, docs/environments.md).

The shape, as TRL's users write it:

    __init__(self)                  no arguments
    reset(self, **row) -> str|None  at an episode's start; its text is what the model reads first
    any other public method         a tool: typed arguments and a Google-style docstring
    get_reward(self) -> float       optional: the episode's reward, read once the episode has ended

How it runs here (one instance per episode, every call user code run by spmdsplit/usercode.py):
- `reset` gets the row's `extra_info.environment_kwargs` (the rule of gym-style environments), and
  its text opens the response as a user message, as a gym environment's first observation does.
  TRL appends it to the prompt's last user message instead; our prompts are tokens before the
  episode starts, and re-rendering them would break token in, token out.
- The tools' schemas are transformers' `get_json_schema` of each method, as TRL builds them; the
  prompt is rendered with them, and each turn's calls are read by the job's parser
  (rollout.multi_turn.format). A call runs its method on the episode's instance within
  rollout.multi_turn.tool_timeout_s; `str()` of what it returns, or what it raised written as TRL
  writes it (`{'error': message}`), is the tool message the model reads next. A turn without a
  call ends the episode, as it ends a tool agent's.
- Faults are counted under the tools' error kinds. A call that overruns leaves the instance
  mid-call: it is never called again, and the episode's later calls are answered with an error.
- `get_reward()` is called once when the episode ends; its value reaches the reward as a gym
  environment's does (`extra_info.environment_reward`). Without `get_reward` the row is scored by
  the job's reward function. A `get_reward` that raises, overruns or returns what is not a finite
  number is counted, and the episode's reward is 0.0 (not the reward function's: the row's
  data_source scorer knows nothing of the environment's task).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from spmdsplit.agent.environments import SETTING, EnvCall, EnvResult, EnvSlot
from spmdsplit.agent.tools import Call, ToolConfigError, ToolResult, Tool, check_arguments, make_tool, truncate
from spmdsplit.usercode import TIMEOUT, UserCode, error_line

STYLES = ("auto", "gym", "trl")  # rollout.multi_turn.environment_style
NOT_TOOLS = ("reset", "get_reward")  # TRL's public methods that are not tools


def is_trl_style(target: Any, style: str = "auto") -> bool:
    """Whether the environment `target` names runs as TRL's shape: as rollout.multi_turn.environment_style
    says, or (auto) a class without a `step` method, or with a `get_reward` (a TRL class may have a
    tool named step). A factory function is gym-style unless the style says trl."""
    if style != "auto":
        return style == "trl"
    return inspect.isclass(target) and (not callable(getattr(target, "step", None))
                                        or callable(getattr(target, "get_reward", None)))


def tool_names(instance: Any) -> list[str]:
    """The public methods of an environment that are its tools (TRL's rule: bound methods not
    starting with "_", but reset and get_reward), read without evaluating its properties."""
    names = []
    for name in sorted(dir(type(instance))):
        if name.startswith("_") or name in NOT_TOOLS:
            continue
        attr = inspect.getattr_static(instance, name)
        if inspect.isfunction(attr) or isinstance(attr, classmethod):
            names.append(name)
    return names


@dataclass
class MethodCall(EnvCall):
    """A tool call of a TRL-style environment's episode: the parsed call, to run on the episode's
    instance (the loop sends every EnvCall to the job's environments)."""
    call: Call | None = None

    @property
    def name(self) -> str:
        return self.call.name


def load_trl_environments(target: Any, path: str, kwargs: dict, *, timeout_s: float, max_text_chars: int,
                          truncate_side: str) -> TrlEnvironments:
    """The environments of a TRL-style class; one instance is built now, to fail here, on every
    rank before the first collective, with one line: a constructor that raises, no reset, no tool,
    a method whose schema cannot be built."""
    where = f"{SETTING}={path}"

    def build() -> Any:
        return target(**kwargs)
    try:
        probe = build()
    except Exception as e:
        hint = (" (a TRL-style environment is built with no arguments: clear them with "
                "rollout.multi_turn.environment_kwargs={})" if kwargs else "")
        raise ToolConfigError(f"{where}: constructing it with rollout.multi_turn.environment_kwargs={kwargs} raised "
                              f"{error_line(e)}{hint}") from None
    if not callable(getattr(probe, "reset", None)):
        raise ToolConfigError(f"{where}: a TRL-style environment needs a reset method")
    tools = []
    for name in tool_names(probe):
        try:
            tools.append(make_tool(getattr(probe, name)))
        except ValueError as e:
            raise ToolConfigError(f"{where}: method {name}: {' '.join(str(e).split())}") from None
    if not tools:
        raise ToolConfigError(f"{where}: a TRL-style environment needs at least one public method (its tools) besides "
                              f"reset and get_reward")
    return TrlEnvironments(build, tools, has_reward=callable(getattr(probe, "get_reward", None)), timeout_s=timeout_s,
                           max_text_chars=max_text_chars, truncate_side=truncate_side)


class TrlEnvironments:
    """Builds each episode's instance and runs its reset, its tool calls and its get_reward, each
    call in a fresh daemon thread (spmdsplit/usercode.py) within `timeout_s`. The loop talks to it
    as to gym-style Environments (`start`), and `tool_calling` tells it that its episodes' turns
    are tool calls."""

    tool_calling = True

    def __init__(self, factory: Callable[[], Any], tools: Sequence[Tool], *, has_reward: bool, timeout_s: float,
                 max_text_chars: int, truncate_side: str):
        self.factory, self.has_reward = factory, has_reward
        self.tools = {t.name: t for t in tools}
        self.schemas = [t.schema for t in tools]  # for the parser and the rows' prompts
        self.timeout_s, self.max_text_chars, self.truncate_side = timeout_s, max_text_chars, truncate_side
        self.close_errors = 0  # as Environments': TRL environments are never closed
        self.usercode = UserCode("spmdsplit-trl-environments")

    @property
    def stuck(self) -> int:
        """How many threads of timed-out calls are still running."""
        return self.usercode.stuck

    @staticmethod
    def bind(slot: EnvSlot, calls: Sequence[Call]) -> list[MethodCall]:
        """A turn's parsed calls, to run on the episode's instance."""
        return [MethodCall(slot, c.name, call=c) for c in calls]

    def start(self, calls: Sequence[EnvCall]) -> concurrent.futures.Future:
        """All calls at once, an episode's in order (they share its instance): a future of one
        answer per call, in order, never an exception. A reset (an EnvCall) is answered with an
        EnvResult, a tool call (a MethodCall) with a ToolResult."""
        async def episode(group: list[int]) -> list:
            return [await self._answer(calls[i]) for i in group]

        async def all_calls() -> list:
            groups: dict[int, list[int]] = {}
            for i, c in enumerate(calls):
                groups.setdefault(id(c.slot), []).append(i)
            answers: list = [None] * len(calls)
            for group, results in zip(groups.values(), await asyncio.gather(*(episode(g) for g in groups.values()))):
                for i, r in zip(group, results):
                    answers[i] = r
            return answers
        if not calls:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result([])
            return done
        return self.usercode.submit(all_calls())

    def run(self, calls: Sequence[EnvCall]) -> list:
        return self.start(calls).result()

    async def _answer(self, call: EnvCall):
        """The call's answer, even when the fault is this module's rather than the environment's."""
        try:
            return await self._one(call)
        except Exception as e:
            call.slot.broken = True
            if isinstance(call, MethodCall):
                return _error("exception", f"{call.name} failed: {error_line(e)}")
            return self._reset_error("exception", f"reset failed: {error_line(e)}")

    async def _one(self, call: EnvCall):
        if not isinstance(call, MethodCall):
            return await self._reset(call)
        result = await self._method(call)
        result.text, result.truncated = truncate(result.text, self.max_text_chars, self.truncate_side)
        return result

    async def _reset(self, call: EnvCall) -> EnvResult:
        slot = call.slot

        def reset() -> Any:
            slot.instance = self.factory()
            return slot.instance.reset(**call.reset_kwargs)
        outcome = await self.usercode.within(lambda: self.usercode.call(reset), self.timeout_s)
        if outcome.error or not (outcome.value is None or isinstance(outcome.value, str)):
            slot.broken = True  # never called again: its get_reward neither (the fault is counted here)
            kind, why = ((outcome.error, outcome.message) if outcome.error else
                         ("not_text", f"returned {type(outcome.value).__name__}, not a string or None"))
            result = self._reset_error(kind, f"reset {why}")
            result.seconds = outcome.seconds
            return result
        text, cut = truncate(outcome.value or "", self.max_text_chars, self.truncate_side)
        return EnvResult(text, text_cut=cut, seconds=outcome.seconds)

    def _reset_error(self, kind: str, message: str) -> EnvResult:
        """A failed reset's answer, as a gym environment's: it ends the episode."""
        text, cut = truncate(f"Error: environment: {message}", self.max_text_chars, self.truncate_side)
        return EnvResult(text, error=kind, message=message, done=True, text_cut=cut)

    async def _method(self, call: MethodCall) -> ToolResult:
        c, slot = call.call, call.slot
        if c.parse_error or not isinstance(c.arguments, dict):
            return _error("bad_call", f"bad tool call: {c.parse_error or 'its arguments could not be read'}")
        tool = self.tools.get(c.name)
        if tool is None:
            return _error("unknown_tool", f"Tool {c.name} not found.")
        problem = check_arguments(tool, c.arguments)
        if problem:
            return _error("bad_arguments", problem)
        if slot.instance is None or slot.broken:
            return _error("exception", "the episode's environment is gone (an earlier call of it overran or failed)")
        method = getattr(slot.instance, c.name)
        outcome = await self.usercode.within(lambda: self.usercode.call(method, **c.arguments), self.timeout_s)
        if outcome.error == TIMEOUT:
            slot.broken = True  # mid-call: never called again
            return _error(TIMEOUT, f"{c.name} did not return within {self.timeout_s:g} s")
        if outcome.error:
            return _error(outcome.error, str(outcome.exception))
        return ToolResult(str(outcome.value), seconds=outcome.seconds)

    def rewards(self, slots: Sequence[EnvSlot | None]) -> list[tuple[float | None, str]]:
        """Each ended episode's (reward, error kind): get_reward()'s value (None for an episode
        without an instance of this kind, or when the class has no get_reward); a fault gives 0.0
        and its kind. Called once per episode, all at once; the instances are dropped after."""
        async def one(slot: EnvSlot | None) -> tuple[float | None, str]:
            if slot is None or not self.has_reward:
                return None, ""
            instance, slot.instance = slot.instance, None
            if instance is None or slot.broken:  # its fault is counted already
                return 0.0, ""
            outcome = await self.usercode.within(lambda: self.usercode.call(instance.get_reward), self.timeout_s)
            if outcome.error:
                return 0.0, outcome.error
            return (float(outcome.value), "") if _finite(outcome.value) else (0.0, "not_text")

        async def all_slots() -> list:
            return list(await asyncio.gather(*(one(s) for s in slots)))
        return self.usercode.submit(all_slots()).result() if slots else []


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


def _error(kind: str, message: str) -> ToolResult:
    """A failed call's tool message, written as TRL writes one: str() of {"error": message}."""
    return ToolResult(str({"error": message}), error=kind)
