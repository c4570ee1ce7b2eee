"""Agent harnesses that drive the model themselves, through the OpenAI API (rollout.agent.harness):
the rollout engine served on the generating rank's 127.0.0.1 (spmdsplit/serving/), each prompt row
an episode of the user's harness, which gets a client (or the base URL) naming its episode and the
row, calls the model as often as it likes, and returns the episode's reward.

    async def harness(client: openai.AsyncOpenAI, row: dict) -> float | dict   # or (base_url, row)

`row`: the prompt's text (`prompt`, as the tokenizer decodes the row's prompt), `prompt_ids`,
`data_source`, `ground_truth`, `extra_info`, `uid`. The result: a number, or a dict with "reward"
(or verl's "score"); it becomes the row's score as an environment's reward does
(extra_info["environment_reward"]). The episode's trained row is what the server recorded of its
calls (serving/episodes.py): the first call's prompt as the row's prompt, its completions trained,
what the harness put between them masked out; a call that does not extend the row before it starts
another, which is counted (agent/harness/rows_dropped) and not trained yet: one row per episode.
Its calls and faults are counted as the agent loop's turns and tool errors are (num_turns,
tool/calls, tool/errors/exception|timeout|not_text).

Harnesses are user code: each episode runs on the harness's event loop (spmdsplit/usercode.py)
bounded by rollout.agent.harness_timeout_s, rollout.agent.max_concurrency at a time; one that
raises, overruns or returns what is not a reward scores 0 and is counted by kind (tool/errors/exception,
timeout, not_text); a batch in which
every episode failed stops in one line naming the harness.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import math
import numbers
from typing import Any, Callable

import torch

from spmdsplit.batch import Batch
from spmdsplit.rewards.rule import ENVIRONMENT_REWARD
from spmdsplit.rollout.base import AroundEngine, episodes_batch
from spmdsplit.serving.episodes import Episodes, Row
from spmdsplit.agent.loop import EveryEpisodeFailed
from spmdsplit.agent.tools import ERROR_KINDS
from spmdsplit.usercode import EXCEPTION, TIMEOUT, UserCode

SETTING = "rollout.agent.harness"
# How long the engine, found idle, waits for more calls to batch with the first (EngineDriver): a
# harness's episodes call at nearly the same time, spread over milliseconds by HTTP. 2 ms: a batch of
# 128 echo episodes took 1.7-2.2 s in one process, 2.1-2.6 s at 10 ms, 1.9-2.5 s at 0.
GATHER_S = 0.002
NOT_A_REWARD = "not_a_reward"  # the harness returned what is not a number nor a dict with one
# Its faults counted as the tools' are (tool/errors/<kind>): what it raised, an overrun, garbage.
ERROR_KIND = {EXCEPTION: "exception", TIMEOUT: "timeout", NOT_A_REWARD: "not_text"}


class EveryHarnessEpisodeFailed(EveryEpisodeFailed):
    """Every episode of a rank's batch failed in the harness: nothing to train on."""


def harness_reward(result: Any) -> float:
    """The episode's reward from what the harness returned; ValueError if it is none."""
    value = result.get("reward", result.get("score")) if isinstance(result, dict) else result
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"returned {result!r}: expected a finite number, or a dict with 'reward'")
    return float(value)


def takes_client(fn: Callable) -> bool:
    """Whether the harness takes an `openai.AsyncOpenAI` (its first parameter is not `base_url`)."""
    params = list(inspect.signature(fn).parameters)
    return not params or params[0] != "base_url"


class HarnessRollout(AroundEngine):
    """The rollout engine behind the OpenAI server, each row an episode of the harness. The server's
    driver owns the engine from the first generation on; the engine's sleeps and weight loads
    happen with it paused."""

    def __init__(self, engine, tokenizer, harness: Callable, agent_cfg, max_response_length: int,
                 max_turns: int = 0, sampling=None, val_sampling=None):
        from spmdsplit.serving import OpenAIServer

        self.engine, self.tokenizer, self.harness, self.cfg = engine, tokenizer, harness, agent_cfg
        self.budget, self.max_turns = max_response_length, max_turns
        self.episodes = Episodes()
        # One server for training's sampling, one for validation's (rollout.val_kwargs), never
        # both unpaused: each has its own driver, and one engine takes one driver at a time.
        self.servers = {validate: OpenAIServer(engine, tokenizer, "policy", s, port=0, validate=validate,
                                               episodes=self.episodes, gather_s=GATHER_S)
                        for validate, s in ((False, sampling), (True, val_sampling))}
        self.usercode = UserCode("spmdsplit-harness")
        # A harness's blocking work (an environment's step) goes to the loop's default executor
        # (asyncio.to_thread): as many threads as episodes run at once, where asyncio's default
        # (min(32, cores + 4): 6 here) made 128 episodes' 0.2 s steps queue for 13 s a batch.
        self.usercode.loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
            agent_cfg.max_concurrency, thread_name_prefix="spmdsplit-harness"))
        self.client_arg = takes_client(harness)
        self.client = None  # made on the harness's loop at the first episode

    def generate(self, prompts: Batch, validate: bool = False) -> Batch:
        """Every row's episode at once (max_concurrency at a time); the rows they made."""
        server = self.servers[validate]
        if server.port is None:
            server.start()
        else:
            server.resume()
        # Each row's prompt as its ids (left padding off): what the harness is given, and the row's
        # prompt where its episode made no call.
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"])]
        try:
            outcomes, ids = self._run(prompts, prompt_ids, server)
        finally:
            server.pause()  # the engine is the trainer's again (a sleep, new weights)
        rows, rewards, errors, counts = [], [], [], []
        for i, (episode, outcome) in enumerate(zip(ids, outcomes)):
            made, record = self.episodes.close(episode)
            error, reward = outcome.error, 0.0
            if error is None:
                try:
                    reward = harness_reward(outcome.value)
                except ValueError:
                    error = NOT_A_REWARD
            if error is not None:
                errors.append(f"{error}: {outcome.message if outcome.error else repr(outcome.value)}")
            rows.append(made[0] if made else Row(prompt_ids[i]))
            rewards.append(reward)
            counts.append((len(record.calls), ERROR_KIND.get(error), max(len(made) - 1, 0)))
        if errors and len(errors) == len(rows):
            raise EveryHarnessEpisodeFailed.of(SETTING, errors)
        return self._batch(prompts, rows, rewards, counts)

    def _run(self, prompts: Batch, prompt_ids: list[list[int]], server) -> tuple[list, list[str]]:
        texts = self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
        ids = [self.episodes.open(self.budget, self.max_turns) for _ in texts]

        def job(i: int):
            row = {"prompt": texts[i], "prompt_ids": prompt_ids[i],
                   "uid": prompts["uid"][i] if "uid" in prompts else None,
                   **{k: prompts[k][i] for k in ("data_source", "ground_truth", "extra_info") if k in prompts}}
            url = f"http://127.0.0.1:{server.port}/episodes/{ids[i]}/v1"

            async def run():
                if not self.client_arg:
                    return await self.usercode.call(self.harness, url, row)
                return await self.usercode.call(self.harness, self._client().with_options(base_url=url), row)
            return run
        outcomes = self.usercode.map([job(i) for i in range(len(ids))], self.cfg.harness_timeout_s,
                                     self.cfg.max_concurrency).result()
        return outcomes, ids

    def _client(self):
        """One `openai.AsyncOpenAI` for every episode, on the harness's loop (each episode gets a copy
        naming its base_url, sharing the connections): one client per episode cost more than the
        episode's calls here."""
        if self.client is None:
            import openai

            self.client = openai.AsyncOpenAI(base_url="http://127.0.0.1", api_key="spmdsplit", max_retries=0)
        return self.client

    def _batch(self, prompts: Batch, made: list[Row], rewards: list[float], counts: list[tuple]) -> Batch:
        """The rows as a batch: each episode's first call's prompt as its prompt (left-padded to the
        widest), its response, mask and log-probs; the reward in extra_info; the agent loop's counts
        (num_turns: 1 + its calls, tool_calls: its calls, tool_errors: the harness's fault by kind)
        and the rows it made beyond the trained one (harness_rows_dropped)."""
        pad = self.tokenizer.pad_token_id
        width = max(len(r.prompt_ids) for r in made)
        input_ids = torch.full((len(made), width), pad, dtype=torch.long)
        attention = torch.zeros((len(made), width), dtype=torch.long)
        for i, r in enumerate(made):
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids):] = 1
        device = prompts["input_ids"].device
        own = Batch({"input_ids": input_ids.to(device), "attention_mask": attention.to(device)}, dict(prompts.non_tensors))
        batch = episodes_batch(own, made, pad)
        infos = prompts["extra_info"] if "extra_info" in prompts else [None] * len(made)
        batch["extra_info"] = [{**(info or {}), ENVIRONMENT_REWARD: reward} for info, reward in zip(infos, rewards)]
        errors = torch.zeros((len(made), len(ERROR_KINDS)), dtype=torch.long)
        for i, (_, kind, _) in enumerate(counts):
            if kind is not None:
                errors[i, ERROR_KINDS.index(kind)] = 1
        batch["num_turns"] = torch.tensor([1 + calls for calls, _, _ in counts], device=device)
        batch["tool_calls"] = torch.tensor([calls for calls, _, _ in counts], device=device)
        batch["tool_errors"] = errors.to(device)
        batch["harness_rows_dropped"] = torch.tensor([dropped for _, _, dropped in counts], device=device)
        return batch

    def close(self) -> None:
        if self.client is not None:
            self.usercode.submit(self.client.close()).result()
        for server in self.servers.values():
            if server.port is not None:
                server.stop()
        self.usercode.close()
