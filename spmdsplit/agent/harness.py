"""Agent harnesses that drive the model themselves, through the OpenAI API (rollout.agent.harness):
the rollout engine served on the generating rank's 127.0.0.1 (spmdsplit/serving/), each prompt row
an episode of the user's harness, which gets a client (or the base URL) naming its episode and the
row, calls the model as often as it likes, and returns the episode's reward.

    async def harness(client: openai.AsyncOpenAI, row: dict) -> float | dict   # or (base_url, row)

`row`: the prompt's text (`prompt`, as the tokenizer decodes the row's prompt), `prompt_ids`,
`data_source`, `ground_truth`, `extra_info`, `uid`. The result: a number, or a dict with "reward"
(or verl's "score"); it becomes the row's score as an environment's reward does
(extra_info["environment_reward"]). The episode's trained rows are what the server recorded of its
calls (serving/episodes.py): the first call's prompt as a row's prompt, its completions trained,
what the harness put between them masked out; a call that does not extend the row before it starts
another row of the episode. An episode trains rollout.agent.rows_per_episode rows: its first ones,
then empty rows (no token trained) where it made fewer; rows beyond are counted
(agent/harness/rows_dropped). Each row says which of its episode's it is (`episode_row`: 0 the
first, -1 an empty one): the advantage is the episode's, on every row of it (algo.compute_advantage).
A chat call with `tools` gets the model's calls as `tool_calls`, read in the job's format
(rollout.multi_turn.format, agent/parsers.py ServedToolCalls); the harness runs the tools.
Its calls and faults are counted as the agent loop's turns and tool errors are (num_turns,
tool/calls, tool/errors/exception|timeout|not_text).

Batch mode runs a batch's episodes at once and the server's driver steps the engine; continuous
generation (spmdsplit/generation/continuous.py) starts them one by one and steps the engine itself, between
its weight loads (`begin`, `step`, `end`, `cancel`: an episode holding tokens too old to train on is
given up and played again).

Harnesses are user code: each episode runs on the harness's event loop (spmdsplit/usercode.py)
bounded by rollout.agent.harness_timeout_s, rollout.agent.max_concurrency at a time (continuous:
a batch's worth); one that
raises, overruns or returns what is not a reward scores 0 and is counted by kind (tool/errors/exception,
timeout, not_text); a batch in which
every episode failed stops in one line naming the harness.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from spmdsplit.batch import Batch
from spmdsplit.rewards.rule import ENVIRONMENT_REWARD
from spmdsplit.inference.base import AroundEngine, episodes_batch
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


def prompt_ids_of(prompts: Batch) -> list[list[int]]:
    """Each row's prompt as its ids (the left padding off)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"])]


def endpoint_port(port: int, local_rank: int) -> int:
    """The port of a rank's endpoint (rollout.agent.port: 0 for any)."""
    return port + local_rank if port else 0


def takes_client(fn: Callable) -> bool:
    """Whether the harness takes an `openai.AsyncOpenAI` (its first parameter is not `base_url`)."""
    params = list(inspect.signature(fn).parameters)
    return not params or params[0] != "base_url"


@dataclass(eq=False)
class Playing:
    """An episode running under continuous generation: its harness's outcome to come, the row's
    prompt ids (its row where it makes no call), and the version of its first token sampled, as the
    server's driver saw it (`seen`: SteppedDriver.first_version)."""

    episode: str
    prompt_ids: list[int]
    outcome: concurrent.futures.Future
    seen: dict[str, int]

    def first_version(self) -> int | None:
        return self.seen.get(self.episode)


@dataclass
class Ended:
    """An episode's end: its rows (at least one: its prompt alone where it made no call), its
    reward, its fault (`error`: a usercode kind or NOT_A_REWARD, with `message`), its calls."""

    rows: list[Row]
    reward: float
    error: str | None
    message: str
    calls: int


class HarnessRunner(AroundEngine):
    """The rollout engine behind the OpenAI server, each row an episode of the harness (a
    validation row's sampled with val_sampling). In batch mode the server's driver owns the engine
    from the first generation on (the engine's sleeps and weight loads happen with it paused);
    under continuous generation (`stepped`) the stream steps the engine itself (`step`), between
    its weight loads, and starts episodes one by one (`begin`).

    A tensor-parallel engine (`peers`: the gloo group of its ranks, batch mode) is given the same
    rows on each of its ranks: the harness runs once, on the engine's first rank (`first`), whose
    lockstep driver trades each call to the other ranks' engines; the episodes' ends then go to
    them over the same trades (LockstepDriver.post), so every rank hands over the same rows, as the
    agent loop's ranks do."""

    def __init__(self, engine, tokenizer, harness: Callable, agent_cfg, max_response_length: int,
                 max_turns: int = 0, sampling=None, val_sampling=None, stepped: bool = False,
                 tool_format: str = "hermes", port: int = 0, peers=None, first: bool = True):
        from spmdsplit.agent.parsers import ServedToolCalls
        from spmdsplit.serving import OpenAIServer

        self.engine, self.tokenizer, self.harness, self.cfg = engine, tokenizer, harness, agent_cfg
        self.budget, self.max_turns = max_response_length, max_turns
        self.episodes = Episodes()
        # Set by every call the server takes and every episode's end: what the stream waits on.
        self.signal = threading.Event() if stepped else None
        # One server, one driver for the engine: each episode says which sampling its calls take, so
        # training's and validation's calls share the engine's steps (and a tensor-parallel engine's
        # ranks trade over one stream of steps).
        self.server = OpenAIServer(engine, tokenizer, "policy", sampling, port=port, episodes=self.episodes,
                                   gather_s=GATHER_S, stepped=self.signal, tool_reader=ServedToolCalls(tool_format),
                                   val_sampling=val_sampling, peers=peers)
        self.first = first
        self.usercode = UserCode("spmdsplit-harness")
        # A harness's blocking work (an environment's step) goes to the loop's default executor
        # (asyncio.to_thread): as many threads as episodes run at once, where asyncio's default
        # (min(32, cores + 4): 6 here) made 128 episodes' 0.2 s steps queue for 13 s a batch.
        self.usercode.loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
            agent_cfg.max_concurrency, thread_name_prefix="spmdsplit-harness"))
        self.client_arg = takes_client(harness)
        self.client = None  # made on the harness's loop at the first episode
        self.held = 0  # requests in the engine at the last step (continuous)

    # ---- batch mode

    def generate(self, prompts: Batch, validate: bool = False) -> Batch:
        """Every row's episode at once (max_concurrency at a time); the rows they made."""
        if self.server.port is None:
            self.server.start()
        else:
            self.server.resume()
        try:
            ended = self._play(prompts, validate) if self.first else self.server.driver.posted()
        finally:
            self.server.pause()  # the engine is the trainer's again (a sleep, new weights)
        return self.finish(prompts, ended, validate)

    def _play(self, prompts: Batch, validate: bool) -> list[Ended]:
        prompt_ids = prompt_ids_of(prompts)
        ids = [self.episodes.open(self.budget, self.max_turns, validate) for _ in prompt_ids]
        jobs = [self._job(prompts, i, prompt_ids[i], ids[i]) for i in range(len(ids))]
        outcomes = self.usercode.map(jobs, self.cfg.harness_timeout_s, self.cfg.max_concurrency).result()
        ended = [self._end(*args) for args in zip(ids, prompt_ids, outcomes)]
        if hasattr(self.server.driver, "post"):  # the engine's other ranks wait for them (before the pause)
            self.server.driver.post(ended)
        return ended

    # ---- continuous generation (spmdsplit/generation/continuous.py)

    def begin(self, prompt: Batch, validate: bool) -> Playing:
        """The episode of one prompt row, its harness started; the stream steps the engine for it."""
        if self.server.port is None:
            self.server.start()
        prompt_ids = prompt_ids_of(prompt)[0]
        episode = self.episodes.open(self.budget, self.max_turns, validate)
        job = self._job(prompt, 0, prompt_ids, episode)
        outcome = self.usercode.submit(self.usercode.within(job, self.cfg.harness_timeout_s))
        outcome.add_done_callback(lambda _: self.signal.set())
        return Playing(episode, prompt_ids, outcome, self.server.driver.first_version)

    def step(self, version: int) -> list | None:
        """One engine step over every call the episodes made (training's and validation's sampling
        side by side), each token recorded with `version`; None where no call waits for one."""
        driver = self.server.driver
        if not driver.enter():
            return None
        try:
            deltas = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the calls in it fail (their harnesses hear of it); the stream goes on
            driver.fail(e)
            return []
        self.held = driver.held
        driver.settle(deltas, version)
        return deltas

    def wait(self, timeout_s: float) -> None:
        """Until an episode makes a call or ends (`timeout_s` at most)."""
        self.signal.wait(timeout_s)
        self.signal.clear()

    def end(self, playing: Playing) -> Ended:
        """A finished episode's row and reward (its harness returned, failed or overran)."""
        playing.seen.pop(playing.episode, None)
        return self._end(playing.episode, playing.prompt_ids, playing.outcome.result())

    def cancel(self, playing: Playing) -> None:
        """An episode given up (its first tokens too old to train on): its harness cancelled, its
        later calls refused."""
        playing.outcome.cancel()
        playing.seen.pop(playing.episode, None)
        if self.episodes.is_open(playing.episode):
            self.episodes.close(playing.episode)

    @staticmethod
    def resumable(episode) -> bool:
        """Whether a checkpoint keeps the response: not while its harness runs (a harness's state
        cannot be saved: its episode starts again from its prompt)."""
        return not isinstance(episode, Playing)

    # ---- both

    def finish(self, prompts: Batch, ended: list[Ended], validate: bool = False) -> Batch:
        """The episodes' rows as a batch; EveryHarnessEpisodeFailed if none ran."""
        errors = [f"{e.error}: {e.message}" for e in ended if e.error is not None]
        if errors and len(errors) == len(ended):
            raise EveryHarnessEpisodeFailed.of(SETTING, errors)
        return self._batch(prompts, ended, validate)

    def _end(self, episode: str, prompt_ids: list[int], outcome) -> Ended:
        made, record = self.episodes.close(episode)
        error, reward, message = outcome.error, 0.0, outcome.message if outcome.error else ""
        if error is None:
            try:
                reward = harness_reward(outcome.value)
            except ValueError:
                error, message = NOT_A_REWARD, repr(outcome.value)
        return Ended(made or [Row(prompt_ids)], reward, error, message, len(record.calls))

    def _job(self, prompts: Batch, i: int, prompt_ids: list[int], episode: str) -> Callable:
        """Row `i`'s episode as a job for the harness's loop: the harness called with its client (or
        base URL) naming the episode, and the row."""
        row = {"prompt": self.tokenizer.decode(prompt_ids, skip_special_tokens=False), "prompt_ids": prompt_ids,
               "uid": prompts["uid"][i] if "uid" in prompts else None,
               **{k: prompts[k][i] for k in ("data_source", "ground_truth", "extra_info") if k in prompts}}
        url = f"http://127.0.0.1:{self.server.port}/episodes/{episode}/v1"

        async def run():
            if not self.client_arg:
                return await self.usercode.call(self.harness, url, row)
            return await self.usercode.call(self.harness, self._client().with_options(base_url=url), row)
        return run

    def _client(self):
        """One `openai.AsyncOpenAI` for every episode, on the harness's loop (each episode gets a copy
        naming its base_url, sharing the connections): one client per episode cost more than the
        episode's calls here."""
        if self.client is None:
            import openai

            self.client = openai.AsyncOpenAI(base_url="http://127.0.0.1", api_key="spmdsplit", max_retries=0)
        return self.client

    def _batch(self, prompts: Batch, ended: list[Ended], validate: bool) -> Batch:
        """The rows as a batch, `slots` per episode (rollout.agent.rows_per_episode; validation
        scores an episode once: its first row): its rows in the order made, then empty ones (its
        first prompt, no response). Each row's prompt is its first call's (left-padded to the
        widest); its response, mask and log-probs; the reward in extra_info; the agent loop's counts
        (num_turns: 1 + its calls, tool_calls: its calls, tool_errors: the harness's fault by kind)
        and the rows it made beyond its slots (harness_rows_dropped), on each of its rows. With
        more than one slot, `episode_row` (which of its episode's rows: 0 the first, -1 an empty
        one) and, under continuous generation, each row's own token versions."""
        slots = 1 if validate else self.cfg.rows_per_episode
        episode_of = [i for i in range(len(ended)) for _ in range(slots)]
        episode_row = [j if j < len(e.rows) else -1 for e in ended for j in range(slots)]
        made = [ended[i].rows[j] if j >= 0 else Row(ended[i].rows[0].prompt_ids) for i, j in zip(episode_of, episode_row)]
        if slots > 1:
            prompts = prompts.index(episode_of)
            ended = [ended[i] for i in episode_of]
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
        batch["extra_info"] = [{**(info or {}), ENVIRONMENT_REWARD: e.reward} for info, e in zip(infos, ended)]
        errors = torch.zeros((len(made), len(ERROR_KINDS)), dtype=torch.long)
        for i, e in enumerate(ended):
            if e.error is not None:
                errors[i, ERROR_KINDS.index(ERROR_KIND[e.error])] = 1
        batch["num_turns"] = torch.tensor([1 + e.calls for e in ended], device=device)
        batch["tool_calls"] = torch.tensor([e.calls for e in ended], device=device)
        batch["tool_errors"] = errors.to(device)
        batch["harness_rows_dropped"] = torch.tensor([max(len(e.rows) - slots, 0) for e in ended], device=device)
        if slots > 1:
            batch["episode_row"] = torch.tensor(episode_row, dtype=torch.int64, device=device)
            if self.signal is not None:  # continuous generation: every row's tokens, their versions
                width = batch["responses"].shape[1]
                oldest = [min(r.versions or e.rows[0].versions or [0]) for r, e in zip(made, ended)]  # empty: its episode's
                batch["token_weights_version"] = torch.tensor([(r.versions + [0] * width)[:width] for r in made],
                                                              dtype=torch.int64, device=device)
                batch["weights_version"] = torch.tensor(oldest, dtype=torch.int64, device=device)
        return batch

    def close(self) -> None:
        if self.client is not None:
            self.usercode.submit(self.client.close()).result()
        if self.server.port is not None:
            self.server.stop()
        self.usercode.close()
