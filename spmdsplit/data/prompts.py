"""Prompts for each step: a fixed dataset, shuffled per epoch with a seed, cut into global
batches, of which each rank of the rollout pool takes its contiguous share of rows."""

from __future__ import annotations

import random

import torch

from spmdsplit.batch import Batch
from spmdsplit.exchange import row_ranges


class PromptDataset:
    def __init__(self, rows: list[dict], batch_size: int, shuffle: bool, seed: int):
        if len(rows) < batch_size:
            raise ValueError(f"the dataset has {len(rows)} rows, fewer than data.train_batch_size={batch_size}")
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.steps_per_epoch = len(rows) // batch_size  # the incomplete tail batch of an epoch is skipped

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 100003 + epoch).shuffle(order)
        return order

    def global_batch(self, step: int) -> list[dict]:
        """The rows of training step `step` (1-based): a pure function of the step, so any rank,
        and a resumed job, gets the same rows without talking to anyone."""
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        order = self._order(epoch)
        return [self.rows[i] for i in order[index * self.batch_size : (index + 1) * self.batch_size]]

    def shard(self, step: int, part: int, num_parts: int) -> list[dict]:
        start, end = row_ranges(self.batch_size, num_parts)[part]
        return self.global_batch(step)[start:end]


def collate_prompts(rows: list[dict], tokenizer, max_prompt_length: int, step: int, first_row: int) -> Batch:
    """Tokenises and left-pads prompts to `max_prompt_length`; carries what the reward needs."""
    texts = [r["prompt"] for r in rows]
    enc = tokenizer(texts, add_special_tokens=False)
    too_long = [(first_row + i, len(ids)) for i, ids in enumerate(enc["input_ids"]) if len(ids) > max_prompt_length]
    if too_long:
        raise ValueError(
            f"{len(too_long)} prompt(s) longer than data.max_prompt_length={max_prompt_length} "
            f"(row, tokens): {too_long[:5]}; raise data.max_prompt_length"
        )
    enc = tokenizer(
        texts, add_special_tokens=False, padding="max_length", max_length=max_prompt_length, return_tensors="pt"
    )
    return Batch(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"].long()},
        {
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
            "uid": [f"{step}-{first_row + i}" for i in range(len(rows))],
        },
    )
