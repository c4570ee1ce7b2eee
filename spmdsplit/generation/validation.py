"""The validation set as every rank uses it, and the rollout group's responses to it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spmdsplit.batch import Batch
from spmdsplit.data.prompts import collate_prompts
from spmdsplit.exchange import row_ranges
from spmdsplit.generation.shares import EngineShares, peers_of, sample_seeds
from spmdsplit.groups import Pools
from spmdsplit.timing import PhaseTimer


@dataclass(frozen=True)
class ValidationSet:
    """The validation prompts as every rank uses them: cut to a multiple of both the rollout and
    the reward groups' pool sizes, so every rank holds equal rows; `n` responses to each
    (rollout.val_kwargs.n)."""

    rows: list[dict]
    n: int

    @property
    def responses(self) -> int:
        return len(self.rows) * self.n

    @property
    def sources(self) -> list[str]:
        """Every data_source of the set, so that every rank reduces the same keys."""
        return sorted({r["data_source"] for r in self.rows})


def validation_set(cfg, placement, val_rows: list[dict]) -> ValidationSet:
    unit = math.lcm(len(placement.ranks("rollout")), len(placement.ranks("reward")))
    rows = val_rows[: len(val_rows) // unit * unit]
    if not rows:
        raise ValueError(f"validation needs at least {unit} rows (one per rank of each pool), got {len(val_rows)}")
    return ValidationSet(rows, cfg.rollout.val_kwargs.n)


def validation_rows(cfg, pools: Pools, rollout_engine, timer: PhaseTimer, tokenizer, step: int,
                    val_set: ValidationSet) -> Batch:
    """On the ranks of the rollout group, its engines awake: this rank's responses to the
    validation set (rollout.val_kwargs, greedy by default), for the reward group to score."""
    n, rows = val_set.n, val_set.rows
    ranks = list(pools.placement.ranks("rollout"))
    ranges = row_ranges(len(rows), len(ranks))  # equal: validation_set cut them so
    peers = peers_of(cfg, pools.rank)
    per_batch = max(1, cfg.data.train_batch_size // len(ranks))  # training-sized batches

    def val_prompts(rank: int, offset: int) -> Batch:
        start, end = ranges[ranks.index(rank)]
        first = start + offset
        prompts = collate_prompts(rows[first:min(end, first + per_batch)], tokenizer,
                                  cfg.data.max_prompt_length, step, first, truncation=cfg.data.truncation)
        prompts = prompts.repeat_interleave(n)
        prompts["row_index"] = torch.arange(first * n, first * n + len(prompts), dtype=torch.int64)
        prompts["sample_seed"] = sample_seeds(cfg, step, prompts["row_index"], rank, validation=True)
        return prompts

    parts = []
    with timer.phase("val_gen", step):
        for offset in range(0, len(rows) // len(ranks), per_batch):
            shares = EngineShares([val_prompts(rank, offset) for rank in peers], peers.index(pools.rank))
            parts.append(shares.generate(rollout_engine, pools.device, validate=True))
    return Batch.concat(parts, pad_to_widest=True)
