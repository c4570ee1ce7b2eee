"""The seeds a run derives from trainer.seed, each formula in one place."""

from __future__ import annotations


def update_seed(seed: int, step: int) -> int:
    """The shuffle of step `step`'s mini-batches, the same on every rank of a pool (actor and critic)."""
    return seed * 7919 + step
