"""Helpers only tests use, kept out of the runtime package (`spmdsplit/` holds what a job runs):
whole models read on one rank, to compare an engine's sharded model with."""

from __future__ import annotations

import torch

from spmdsplit.batch import Batch
from spmdsplit.models import ModelSource


def load_value_model(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code=False):
    """A whole critic on `device`: the policy's backbone with a one-output token-classification head."""
    return ModelSource("value", path, dtype, seed, trust_remote_code).read(device)


def load_reward_model(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code: bool = False):
    """The reward model, one output (`num_labels=1`). A checkpoint that has no such head (a plain
    causal LM) gets a fresh one, equal wherever it is read thanks to the seed."""
    return ModelSource("reward", path, dtype, seed, trust_remote_code).read(device)


def full_weights(engine) -> dict[str, torch.Tensor]:
    """Every weight of an engine, whole, as a copy: what a test compares updates by (the runtime
    streams them, `iter_full_weights`, and never holds them all)."""
    return {name: tensor.clone() for name, tensor in engine.iter_full_weights()}


class PlainEngine:
    """The engine's interface without FSDP, for single-process tests."""

    def __init__(self, model):
        self.model, self.group = model.eval(), None

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def ppo_rows(prompts, responses, prompt_mask, response_mask, generator: torch.Generator) -> Batch:
    """A rollout ready for an update: left-padded prompts and right-padded responses [B, P] and
    [B, R] with their masks, joined as the rollout joins them, and random old log-probs,
    advantages, values and returns (drawn from `generator`, in that order)."""
    from spmdsplit.rollout.base import position_ids_from_mask

    rows, R = responses.shape
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "old_log_probs": -2.0 - torch.rand(rows, R, generator=generator),
        "advantages": torch.randn(rows, R, generator=generator) * response_mask,
        "values": torch.randn(rows, R, generator=generator) * 0.1 * response_mask,
        "returns": torch.randn(rows, R, generator=generator) * response_mask,
    })
