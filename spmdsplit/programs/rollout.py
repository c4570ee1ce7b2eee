"""The rollout group's program, when it has a pool of its own (placement.roles.rollout): it
generates every step's prompts with the newest weights the staleness allows and hands the rows to
the actor pool; it generates the validation responses for the critic group. Messages and their
order: spmdsplit/messages.py.

With `rollout.staleness=s`, batch k is generated with the weights after update k-1-s (version
max(0, k-1-s)). Step k here: post batch k (generated earlier when s >= 1), generate the batches
up to k+s that are not generated yet, then take the weights of update k from the actor pool. So
with s >= 1 batch k+s is generated while the other pools train on batch k, and the only wait is
for the weights: the actor pool sends them after its update, which the next batch needs anyway.
The batches generated ahead stay here until their step (a checkpoint keeps them: exact resume).
The engine never sleeps here: it shares its device with no training (generation.Generator).
"""

from __future__ import annotations

import torch

from spmdsplit.batch import Batch
from spmdsplit.exchange import PendingSend
from spmdsplit.generation import Generator
from spmdsplit.messages import PoolChannel
from spmdsplit.programs import Program
from spmdsplit.staleness import validates_after, weights_needed


class RolloutProgram(Program):
    engine = None  # nothing trained: a checkpoint keeps the batches generated ahead

    def __init__(self, cfg, generator: Generator, channel: PoolChannel):
        self.cfg, self.generator, self.channel = cfg, generator, channel
        self.staleness, self.total_steps = cfg.rollout.staleness, cfg.trainer.total_steps
        self.version = -1  # the update whose weights the engine holds (0: the initial weights)
        self.ahead: dict[int, Batch] = {}  # batches generated, not yet handed over (at most s)
        self.sends = PendingSend()

    def start(self, step: int) -> None:
        """Before the first step (1, or the one after a checkpoint): the weights the actor pool
        holds (the batches the checkpoint kept are in self.ahead already)."""
        self.take_weights(step - 1, step)

    def step(self, step: int) -> dict[str, float]:
        """Batch `step` out, the batches up to step+s generated, the weights of update `step` in."""
        batch = self.ahead.pop(step) if step in self.ahead else self.generate(step)
        self.sends.add(self.channel.send_generated(step, batch))
        last_ahead = max(self.ahead, default=step)
        for ahead in range(last_ahead + 1, min(step + self.staleness, self.total_steps) + 1):
            self.ahead[ahead] = self.generate(ahead)
        if weights_needed(self.cfg, step) and not validates_after(self.cfg, step):  # else validate takes them
            self.take_weights(step, step)
        self.sends.wait()
        return self.generator.pop_metrics(step)  # dynamic sampling's train/num_gen_batches

    def validate(self, step: int, val_rows: list[dict]) -> None:
        """The validation responses, with the weights of update `step`, to the critic group."""
        if self.version < step:
            self.take_weights(step, step)
        self.generator.validate(step, val_rows, self.channel)

    def generate(self, batch: int) -> Batch:
        """This rank's share of batch `batch`'s prompts, with the weights it holds now."""
        [rows] = self.generator.rows(batch)
        rows["weights_version"] = torch.full((len(rows),), self.version, dtype=torch.int64,
                                           device=self.generator.pools.device)
        return rows

    def take_weights(self, version: int, step: int) -> None:
        """The weights of update `version`, from the actor pool's broadcast."""
        self.generator.wake(step)
        self.version = version

    def state(self, step: int) -> dict:
        """The batches generated ahead (rollout.staleness), each rank its own rows of them."""
        return {"ahead": {batch: rows.to("cpu") for batch, rows in self.ahead.items()}}

    def load_state(self, state: dict, same_layout: bool) -> None:
        # Another rollout pool size cuts the batches into other shares: they are generated again,
        # with the checkpoint's weights (within the staleness bound, not the same rows).
        device = self.generator.pools.device
        self.ahead = {b: rows.to(device) for b, rows in state["ahead"].items()} if same_layout else {}
