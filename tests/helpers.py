"""Helpers only tests use, kept out of the runtime package (`spmdsplit/` holds what a job runs):
whole models read on one rank, to compare an engine's sharded model with."""

from __future__ import annotations

import torch

from spmdsplit.models import ModelSource


def load_value_model(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code=False):
    """A whole critic on `device`: the policy's backbone with a one-output token-classification head."""
    return ModelSource("value", path, dtype, seed, trust_remote_code).read(device)


def load_reward_model(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code: bool = False):
    """The reward model, one output (`num_labels=1`). A checkpoint that has no such head (a plain
    causal LM) gets a fresh one, equal wherever it is read thanks to the seed."""
    return ModelSource("reward", path, dtype, seed, trust_remote_code).read(device)
