"""Prompts for each step: a fixed dataset, shuffled per epoch with a seed, cut into global
batches, of which each rank of the rollout pool takes its contiguous share of rows; and the
prompt-length rules (verl's data.filter_overlong_prompts and data.truncation)."""

from __future__ import annotations

import random

import torch

from spmdsplit.batch import Batch
from spmdsplit.config import TRUNCATIONS
from spmdsplit.data.parquet import ENVIRONMENT_AGENT, DataError, render_prompt
from spmdsplit.exchange import row_ranges
from spmdsplit.seeds import epoch_order_seed

EXAMPLES = 5  # the too-long prompts an error names


class PromptDataset:
    def __init__(self, rows: list[dict], batch_size: int, shuffle: bool, seed: int):
        if len(rows) < batch_size:
            raise ValueError(f"the dataset has {len(rows)} rows, fewer than data.train_batch_size={batch_size}")
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.steps_per_epoch = len(rows) // batch_size  # the incomplete tail batch of an epoch is skipped

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(epoch_order_seed(self.seed, epoch)).shuffle(order)
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

    def state(self, batches_taken: int) -> dict:
        """The data position for a checkpoint: the order is a function of (seed, batch), so the
        batches taken are the position; the rest is there to notice a different dataset on resume."""
        return {"data": {"prompts_consumed": batches_taken * self.batch_size, "dataset_rows": len(self.rows),
                         "seed": self.seed, "shuffle": self.shuffle}}

    def check_state(self, state: dict) -> str | None:
        """A warning when the checkpoint was trained on another number of prompts, else None."""
        if state["data"]["dataset_rows"] == len(self.rows):
            return None
        return (f"the checkpoint was trained on {state['data']['dataset_rows']} prompts, the data now has "
                f"{len(self.rows)}: the data order differs from the stopped run")


def prompt_texts(rows: list[dict], tokenizer) -> list[str]:
    """Each row's prompt as the model sees it (chat messages rendered by the chat template)."""
    return [render_prompt(r["prompt"], tokenizer, r.get("tools"), r.get("agent_name") != ENVIRONMENT_AGENT) for r in rows]


def prompt_lengths(rows: list[dict], tokenizer, chunk: int = 1024) -> list[int]:
    """Each row's prompt length in tokens, tokenising `chunk` rows at a time."""
    lengths = []
    for start in range(0, len(rows), chunk):
        enc = tokenizer(
            prompt_texts(rows[start : start + chunk], tokenizer), add_special_tokens=False, return_attention_mask=False
        )
        lengths += [len(ids) for ids in enc["input_ids"]]
    return lengths


def filter_overlong_prompts(rows: list[dict], tokenizer, max_prompt_length: int) -> tuple[list[dict], int]:
    """verl's data.filter_overlong_prompts: keeps the rows whose rendered prompt has at most
    `max_prompt_length` tokens. Returns (kept rows, how many were dropped)."""
    lengths = prompt_lengths(rows, tokenizer)
    kept = [r for r, n in zip(rows, lengths) if n <= max_prompt_length]
    return kept, len(rows) - len(kept)


def check_truncation(truncation: str) -> None:
    """data.truncation's value where it did not come through load_config (a config built in code)."""
    if truncation not in TRUNCATIONS:
        raise DataError(f"data.truncation={truncation!r}: expected one of {list(TRUNCATIONS)}")


def check_prompt_lengths(rows: list[dict], lengths: list[int], max_prompt_length: int, first_row: int = 0,
                         key: str = "") -> None:
    """data.truncation=error's rule: a prompt longer than `max_prompt_length` tokens stops the job,
    with the first EXAMPLES of them (row, tokens) and their files' rows. Checked as a file's rows
    are loaded (sources.build_rows, `key` the data key), before any training, and as each step's
    prompts are collated (`first_row`: the first row's place in the step's batch)."""
    too_long = [(first_row + i, n) for i, n in enumerate(lengths) if n > max_prompt_length]
    if not too_long:
        return
    sources = [rows[row - first_row].get("source_row") for row, _ in too_long[:EXAMPLES]]
    where = f" from {sources}" if any(sources) else ""
    raise DataError(
        f"{key + ': ' if key else ''}{len(too_long)} prompt(s) longer than data.max_prompt_length={max_prompt_length} "
        f"(row, tokens): {too_long[:EXAMPLES]}{where}; raise data.max_prompt_length, drop them when the data "
        f"is loaded with data.filter_overlong_prompts=true, or cut them with data.truncation=left|right"
    )


def _row_name(row: dict, global_row: int) -> str:
    return row.get("source_row") or f"row {global_row}"


def collate_prompts(
    rows: list[dict], tokenizer, max_prompt_length: int, step: int, first_row: int, truncation: str = "error"
) -> Batch:
    """Tokenises and left-pads prompts to `max_prompt_length`; carries what the reward needs.

    Chat-message prompts go through the tokenizer's chat template. A prompt longer than
    `max_prompt_length` tokens is cut per `truncation` (verl's data.truncation): `left` keeps its
    last tokens, `right` its first, `error` stops with the rows' numbers."""
    check_truncation(truncation)
    ids = tokenizer(prompt_texts(rows, tokenizer), add_special_tokens=False)["input_ids"]
    empty = [_row_name(r, first_row + i) for i, (r, t) in enumerate(zip(rows, ids)) if not t]
    if empty:
        raise DataError(f"{len(empty)} prompt(s) have no tokens after tokenisation: {empty[:5]}")
    if truncation == "error":
        check_prompt_lengths(rows, [len(t) for t in ids], max_prompt_length, first_row)
    if truncation == "left":
        ids = [t[-max_prompt_length:] for t in ids]
    elif truncation == "right":
        ids = [t[:max_prompt_length] for t in ids]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), max_prompt_length), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), max_prompt_length), dtype=torch.long)
    for i, t in enumerate(ids):  # left padding: every prompt ends at the last column
        if t:
            input_ids[i, max_prompt_length - len(t) :] = torch.tensor(t, dtype=torch.long)
            attention_mask[i, max_prompt_length - len(t) :] = 1
    return Batch(
        {"input_ids": input_ids, "attention_mask": attention_mask},
        {
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
            "extra_info": [r.get("extra_info") or {} for r in rows],
            "index": [r.get("index") for r in rows],
            "uid": [f"{step}-{first_row + i}" for i in range(len(rows))],
            "agent_name": [r.get("agent_name") for r in rows],
        },
    )
