"""The agent loop: multi-turn, tool-using episodes, run by the rollout group's engine (HF or vLLM)
in every placement, behind the same contract as a single-turn engine (inference/base.Engine).

For each prompt: generate until the model ends its turn (its EOS, or a parser's stop token); if the
turn holds tool calls, run them, append their responses, generate again; stop at an answer without
a call, at rollout.multi_turn.max_assistant_turns, or at the response's token budget
(data.max_response_length, policy and tool tokens together, as verl counts it). The live episodes
of a turn generate together, one engine call per turn; the calls of a turn, every episode's,
run at the same time (tools.Tools.run), off this thread. An engine of several ranks (vLLM's tensor
parallel) runs each turn's calls once, on its first rank, and hands every rank the same results
(`run_once`): its ranks must continue the same contexts, and a tool's side effects happen once.
With rollout.continuous the stream (spmdsplit/generation/continuous.py) drives the same episodes a turn at a
time instead of `generate`: it calls take_turn / add_tool_responses / turn_seed / turn_stop_ids /
finish per episode, and each episode's calls run while the others generate.

Token in, token out: the engine continues token ids; the policy's tokens and their log-probs are
kept as sampled; only tool responses and template glue are tokenised (chat.ToolChat), and they
get response_mask 0 and log-prob 0: conditioned on, never trained on.
"""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from spmdsplit.agent.chat import ToolChat
from spmdsplit.agent.environments import EnvCall, EnvResult, Environments, EnvSlot
from spmdsplit.agent.parsers import ToolParser
from spmdsplit.agent.tools import ERROR_KINDS, Tools
from spmdsplit.batch import Batch
from spmdsplit.data.parquet import ENVIRONMENT_AGENT
from spmdsplit.rewards.rule import ENVIRONMENT_REWARD
from spmdsplit.inference.base import AroundEngine, episodes_batch
from spmdsplit.seeds import nth_seed, reset_seed


# Each row: its environment ended it in a terminal state, or before one (a time limit).
ENV_END_KEYS = ("env_terminated", "env_truncated")


class EveryEpisodeFailed(RuntimeError):
    """Every episode of a rank's batch failed: nothing to train on."""

    @classmethod
    def of(cls, what: str, errors: list[str]) -> EveryEpisodeFailed:
        """The one line: `what` failed (the setting and its value), how many episodes of each error
        kind, the first error; `errors`: one "kind: message" per episode."""
        kinds = Counter(e.split(":", 1)[0] for e in errors)
        return cls(f"{what}: every one of this rank's {len(errors)} episodes failed "
                   f"({', '.join(f'{k}: {n}' for k, n in sorted(kinds.items()))}); the first: "
                   f"{' '.join(errors[0].split(':', 1)[1].split())}")


def check_some_episode_ran(episodes: list, environment: str) -> None:
    """A batch whose every environment episode failed (a reset that raised or returned what is not
    an observation, a hung step, ...) stops here in one line naming the environment and the error
    kinds, not later as a numeric error of another pool (every response empty, nothing to whiten).
    A batch with any episode that ran trains on what it has: the failures are counted."""
    ran = [e for e in episodes if e.env is not None]
    if ran and all(e.env_error for e in ran):
        raise EveryEpisodeFailed.of(f"rollout.multi_turn.environment={environment}", [e.env_error for e in ran])


@dataclass
class Episode:
    context: list[int]  # the prompt's tokens and the response so far: what the engine continues
    agent: str
    row_kwargs: dict  # extra_info.tools_kwargs
    seed: int | None
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    tool_turns: int = 0
    errors: list[int] = field(default_factory=lambda: [0] * len(ERROR_KINDS))
    tool_calls: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    tool_scores: dict = field(default_factory=dict)
    done: bool = False
    env: EnvSlot | None = None  # an environment's episode (rollout.multi_turn.environment)
    env_reset: EnvCall | None = None  # its reset, until it has run
    env_rewards: list[float] = field(default_factory=list)  # each step's reward
    env_terminated: bool = False  # the environment ended it in a terminal state
    env_truncated: bool = False  # the environment ended it before one (gymnasium's truncated)
    env_info: dict = field(default_factory=dict)  # the numbers of its info, the latest of each key
    env_error: str = ""  # what ended it, when a call of its environment failed

    def append(self, ids: list[int], policy: bool, log_probs: list[float] | None = None) -> None:
        self.context += ids
        self.response_ids += ids
        self.response_mask += [int(policy)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)

    @property
    def num_turns(self) -> int:
        """verl's count: the prompt, every assistant turn and every round of tool responses."""
        return 1 + self.assistant_turns + self.tool_turns


class AgentLoop(AroundEngine):
    """A rollout engine (HFEngine, VLLMEngine: anything with `continue_ids`) driven turn by turn."""

    def __init__(self, engine, tokenizer, eos_ids: list[int], tools: Tools, parser: ToolParser, multi_turn,
                 max_response_length: int, default_agent: str, run_once: Callable | None = None,
                 environments: Environments | None = None, seed: int = 0):
        """`run_once(fn)`: fn() run once for all the engine's ranks, each given its result (the
        engine's `run_on_first_rank`); None for an engine of one rank: fn() here. `environments`:
        rollout.multi_turn.environment's, for the rows of the environment agent; `seed`: the
        trainer's, which the environments' reset seeds derive from."""
        self.engine, self.tokenizer, self.tools, self.parser = engine, tokenizer, tools, parser
        self.environments, self.seed = environments, seed
        self.environment = multi_turn.environment or "(the embedded echo task's)"  # named in errors
        self.env_reward = multi_turn.environment_reward
        self.run_once = run_once or (lambda fn: fn())
        self.eos_ids = list(eos_ids)
        stops = [tokenizer.convert_tokens_to_ids(t) for t in parser.stop_tokens]
        self.stop_ids = self.eos_ids + [s for s in stops if s not in self.eos_ids]
        self.chat = ToolChat(tokenizer)
        self.max_turns = multi_turn.max_assistant_turns or 0  # 0/None: only the budget ends an episode
        self.max_turn_length = multi_turn.max_turn_length or max_response_length
        self.max_parallel_calls = multi_turn.max_parallel_calls
        self.budget = max_response_length
        self.default_agent = default_agent

    def generate(self, prompts: Batch, validate: bool = False) -> Batch:
        episodes = self.start(prompts)
        if self.environments is not None:  # the environments' resets: their first observations
            self.run_calls([(e, self.opening_calls(e), "") for e in episodes])
        while live := [e for e in episodes if not e.done]:
            calling = []
            for uses_tools in (True, False):  # the two kinds of turn end (turn_stop_ids)
                group = [e for e in live if self.calls_tools(e) is uses_tools]
                if not group:
                    continue
                seeds = [self.turn_seed(e) for e in group] if group[0].seed is not None else None
                outputs = self.engine.continue_ids([e.context for e in group], [self.turn_budget(e) for e in group],
                                                   self.turn_stop_ids(group[0]), seeds=seeds, validate=validate)
                for episode, (ids, log_probs) in zip(group, outputs):
                    calls, turn_end = self.take_turn(episode, ids, log_probs)
                    calling.append((episode, calls, turn_end))
            self.run_calls(calling)
        return self.finish(prompts, episodes)

    def run_calls(self, calling: list) -> None:
        """Every episode's calls of a turn, all at once: one Tools.start for the tools' and one
        Environments.start for the environments' (one timer, not one an episode); each episode
        then gets its answers. (episode, calls, turn_end) with no calls are skipped."""
        calling = [c for c in calling if c[1]]

        def run_all() -> list[list]:
            calls = [call for _, episode_calls, _ in calling for call in episode_calls]
            steps = [c for c in calls if isinstance(c, EnvCall)]
            answers = iter(self.tools.start([c for c in calls if not isinstance(c, EnvCall)]).result())
            observations = iter(self.environments.start(steps).result() if steps else [])
            return [[next(observations) if isinstance(c, EnvCall) else next(answers) for c in episode_calls]
                    for _, episode_calls, _ in calling]
        for (episode, calls, turn_end), results in zip(calling, self.run_once(run_all)):
            self.add_responses(episode, calls, results, turn_end)

    def start_calls(self, calls: list) -> concurrent.futures.Future:
        """One episode's calls started now, off this thread: a future of their answers (the
        continuous stream's way; batch mode's turns run all episodes' calls together, run_calls)."""
        if calls and isinstance(calls[0], EnvCall):
            return self.environments.start(calls)
        return self.tools.start(calls)

    def add_responses(self, episode: Episode, calls: list, results: list, turn_end: str) -> None:
        if isinstance(results[0], EnvResult):  # a gym environment's answer, or a TRL one's reset (not its tools')
            self.add_observation(episode, calls[0], results[0], turn_end)
        else:
            self.add_tool_responses(episode, calls, results, turn_end)

    def opening_calls(self, episode: Episode) -> list:
        """An environment's episode's reset, before its first turn ([] for any other, or once run)."""
        call, episode.env_reset = episode.env_reset, None
        return [call] if call is not None else []

    def resumable(self, episode: Episode | None) -> bool:
        """Whether the episode can be checkpointed as it is: not while an environment holds its
        state (an environment cannot be saved; such an episode starts again from its prompt), nor
        a TRL-style one's ever (its reward is read from the instance when it is handed over)."""
        return episode is None or episode.env is None or episode.done and not self.calls_tools(episode)

    def turn_stop_ids(self, episode: Episode) -> list[int]:
        """What ends the episode's turn: a single-turn agent's answer and an environment's action
        end at the EOS only (a parser's stop token, "@", is text to them)."""
        return self.stop_ids if self.calls_tools(episode) else self.eos_ids

    def calls_tools(self, episode: Episode) -> bool:
        """Whether the episode's turns are tool calls: a tool agent's, or a TRL-style environment's
        (trl_env.py: its methods are the tools; its reset opens the episode as a gym one's does)."""
        return episode.agent == "tool_agent" or (episode.env is not None and
                                                 getattr(self.environments, "tool_calling", False))

    def out_of_turns(self, episode: Episode) -> bool:
        """Whether the episode may take no further turn: the response's budget is spent, or
        rollout.multi_turn.max_assistant_turns is reached."""
        return len(episode.response_ids) >= self.budget or bool(self.max_turns and episode.assistant_turns >= self.max_turns)

    def turn_budget(self, episode: Episode) -> int:
        """How many tokens the episode's next turn may have: what is left of the response's
        budget, at most rollout.multi_turn.max_turn_length."""
        return min(self.budget - len(episode.response_ids), self.max_turn_length)

    @staticmethod
    def turn_seed(episode: Episode) -> int | None:
        """The seed of the episode's next turn: its row's, hashed with the turn's number."""
        return None if episode.seed is None else nth_seed(episode.seed, episode.assistant_turns)

    def start(self, prompts: Batch) -> list[Episode]:
        ids, mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu().bool()
        agents = prompts["agent_name"] if "agent_name" in prompts else [None] * len(prompts)
        extra = prompts["extra_info"] if "extra_info" in prompts else [{}] * len(prompts)
        seeds = prompts["sample_seed"].tolist() if "sample_seed" in prompts else [None] * len(prompts)
        uids = prompts["uid"] if "uid" in prompts else [str(i) for i in range(len(prompts))]
        episodes = [Episode(row[keep].tolist(), agent or self.default_agent, (info or {}).get("tools_kwargs") or {}, seed)
                    for row, keep, agent, info, seed in zip(ids, mask, agents, extra, seeds)]
        for e, info, uid in zip(episodes, extra, uids):
            if e.agent == ENVIRONMENT_AGENT:
                kwargs = (info or {}).get("environment_kwargs")
                e.env = EnvSlot()
                e.env_reset = EnvCall(e.env, None, dict(kwargs) if isinstance(kwargs, dict) else {},
                                      reset_seed(str(uid), self.seed))
        return episodes

    def take_turn(self, episode: Episode, ids: list[int], log_probs: list[float]):
        """Appends a policy turn; returns its tool calls ([] when the episode ends here) and the
        text of the token that ended it."""
        episode.append(ids, policy=True, log_probs=log_probs)
        episode.assistant_turns += 1
        if episode.env is not None and not self.calls_tools(episode):
            # Every action is stepped, the last one too (the environment scores it), and a turn cut
            # at rollout.multi_turn.max_turn_length is an action as well: the environment says when
            # its episode is done, or the response's budget or max_assistant_turns does.
            stopped = bool(ids) and ids[-1] in self.eos_ids
            action = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
            return [EnvCall(episode.env, action)], (self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if stopped else "")
        stopped = bool(ids) and ids[-1] in self.stop_ids
        if not stopped or self.out_of_turns(episode) or not self.calls_tools(episode):
            episode.done = True
            return [], ""
        text = self.tokenizer.decode(ids[:-1] if ids[-1] in self.eos_ids else ids, skip_special_tokens=False)
        calls = self.parser.calls(text, episode.row_kwargs)[: self.max_parallel_calls]
        if not calls:
            episode.done = True
        elif episode.env is not None:  # run on the episode's own environment instance
            calls = self.environments.bind(episode.env, calls)
        return calls, self.tokenizer.decode(ids[-1:], skip_special_tokens=False)

    def add_tool_responses(self, episode: Episode, calls, results, turn_end: str) -> None:
        episode.tool_calls += len(results)
        for call, r in zip(calls, results):
            if r.error:
                episode.errors[ERROR_KINDS.index(r.error)] += 1
            episode.tool_rewards.append(r.reward)  # verl's tool agent keeps every step reward, errors' 0.0 too
            if r.score is not None:  # calc_reward's value, per tool, as verl's rollout_reward_scores
                episode.tool_scores = {**episode.tool_scores, call.name: r.score}
        ids = self.chat.tool_turn_ids([r.text for r in results], turn_end)
        if len(episode.response_ids) + len(ids) >= self.budget:  # no room left to answer: ends here, as verl's
            episode.done = True
            return
        episode.append(ids, policy=False)
        episode.tool_turns += 1

    def add_observation(self, episode: Episode, call: EnvCall, result, turn_end: str) -> None:
        """An environment's answer: the reset's first observation opens the response, a step's
        reward is kept and its observation follows the turn as a user message; the episode ends
        when the environment says done, fails, or the turn was its last."""
        if result.error:
            episode.errors[ERROR_KINDS.index(result.error)] += 1
            episode.env_error = episode.env_error or f"{result.error}: {result.message}"
        if call.action is not None:
            episode.tool_calls += 1
            episode.env_rewards.append(result.reward)
        episode.env_terminated, episode.env_truncated = result.terminated, result.truncated
        episode.env_info.update(result.info)
        if result.error or result.done or self.out_of_turns(episode):
            episode.done = True
            return
        ids = (self.chat.opening_ids(result.text) if call.action is None
               else self.chat.tool_turn_ids([result.text], turn_end, role="user"))
        if len(episode.response_ids) + len(ids) >= self.budget:
            episode.done = True
            return
        episode.append(ids, policy=False)
        episode.tool_turns += call.action is not None

    def episode_reward(self, episode: Episode) -> float:
        """An environment's episode's reward (rollout.multi_turn.environment_reward): its steps'
        sum, or the last step's."""
        if not episode.env_rewards:
            return 0.0
        return episode.env_rewards[-1] if self.env_reward == "last" else sum(episode.env_rewards)

    def end_episodes(self, episodes: list[Episode]) -> list[bool]:
        """Whether each episode's reward is its environment's: a gym-style one's always; a TRL-style
        one's when its class has get_reward, read now (once per episode, on the engine's first rank)
        into env_rewards, a fault counted."""
        final = getattr(self.environments, "rewards", None)
        if final is None:
            return [e.env is not None for e in episodes]
        outcomes = self.run_once(lambda: final([e.env for e in episodes]))
        for e, (reward, error) in zip(episodes, outcomes):
            if error:
                e.errors[ERROR_KINDS.index(error)] += 1
            if reward is not None:
                e.env_rewards.append(reward)
        return [reward is not None for reward, _ in outcomes]

    def finish(self, prompts: Batch, episodes: list[Episode], validate: bool = False) -> Batch:
        check_some_episode_ran(episodes, self.environment)
        scored = self.end_episodes(episodes)
        batch = episodes_batch(prompts, episodes, self.tokenizer.pad_token_id)
        device = prompts["input_ids"].device
        batch["num_turns"] = torch.tensor([e.num_turns for e in episodes], device=device)
        batch["tool_calls"] = torch.tensor([e.tool_calls for e in episodes], device=device)
        batch["tool_errors"] = torch.tensor([e.errors for e in episodes] or torch.zeros(0, len(ERROR_KINDS)),
                                            dtype=torch.long, device=device)
        if self.environments is not None:  # how each episode ended (0 for a tool agent's rows)
            for key in ENV_END_KEYS:
                batch[key] = torch.tensor([getattr(e, key) for e in episodes], dtype=torch.long, device=device)
        if "extra_info" in batch:
            # What verl's reward managers add to a tool agent's extra_info: each row its own dict
            # (rollout.n repeats one), so the scorer sees this episode's numbers.
            batch["extra_info"] = [{**(info or {}), "num_turns": e.num_turns, "tool_rewards": e.tool_rewards,
                                    "rollout_reward_scores": e.tool_scores,
                                    **({ENVIRONMENT_REWARD: self.episode_reward(e), "environment_rewards": e.env_rewards,
                                        "environment_info": e.env_info} if owned else {})}
                                   for info, e, owned in zip(batch["extra_info"], episodes, scored)]
        return batch
