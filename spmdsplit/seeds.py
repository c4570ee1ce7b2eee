"""The seeds a run derives, each formula in one place, named for what it seeds: from trainer.seed
(the update's mini-batch shuffle, each rank's sampling generator, the generated rows, an engine's
own, an environment's reset), from data's seeds (the epochs' prompt order, the validation set's),
and from a seed already drawn (`nth_seed`: a turn's, a choice's, a continuation's). A run's tokens
follow from these numbers: a change to one changes every run (tools.refactor.preset_fingerprint shows it)."""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1
# Validation rows are seeded apart from the training rows of the same step.
VALIDATION_SEED_SALT = 0x5EED_7A11
# The validation set's seed is the training set's + this (the synthetic task's, reasoning-gym's):
# disjoint entries.
VALIDATION_DATA_SEED_OFFSET = 1_000_003


def splitmix64(x: int) -> int:
    """A 64-bit mixer, under every hashed seed here."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def nth_seed(seed: int, n: int) -> int:
    """The `n`-th seed drawn from `seed`, in [0, 2**63): a row's from its step's (row_seeds), an
    engine's own requests' (SeedSequence), an episode's turn from its row's (agent/loop.py), a
    request's other choices (serving/protocol.py), a continuation after a pause (serving/driver.py)."""
    return splitmix64(seed ^ n) >> 1


def update_seed(seed: int, step: int) -> int:
    """The shuffle of step `step`'s mini-batches, the same on every rank of a pool (actor and critic)."""
    return seed * 7919 + step


def sampling_seed(seed: int, rank: int, after_step: int = 0) -> int:
    """The rank's torch generator (checkpoint_manager.seed_sampling): it differs between ranks (else every
    shard draws the same responses); a resume that cannot restore the RNG state (other pool sizes)
    seeds from the step too."""
    return seed * 1000 + 7 + rank + 7919 * after_step


def row_seeds(trainer_seed: int, step: int, global_row_index: torch.Tensor) -> torch.Tensor:
    """One sampling seed per rollout row [B] (int64, in [0, 2**63)), a pure function of the trainer
    seed, the step and the row's index in the step's global batch: a row samples the same tokens
    whichever rank generates it, next to whichever other rows, on any pool size. Hashed (splitmix64)
    so neighbouring rows and steps get unrelated seeds."""
    base = splitmix64(splitmix64(trainer_seed & _MASK64) ^ (step & _MASK64))
    seeds = [nth_seed(base, i) for i in global_row_index.tolist()]
    return torch.tensor(seeds, dtype=torch.int64)


def engine_seeds(trainer_seed: int, step: int, engine_index: int, global_row_index: torch.Tensor) -> torch.Tensor:
    """rollout.per_row_seed=false: one seed per engine per step, the same on every rank of the engine
    (a pure function of the trainer seed, the step and the engine's index), each row seeded by it
    plus the row's index in the step's batch. Every row still has a seed of its own, and must:
    vLLM 0.32's CUDA sampler (the V2 model runner's, v1/worker/gpu/sample/gumbel.py) draws a row's
    noise from a hash of (its seed, its position), so rows sharing a seed would sample alike. Unlike
    row_seeds, a row's tokens depend on which engine generates it: runs on other layouts differ."""
    base = splitmix64(splitmix64(splitmix64(trainer_seed & _MASK64) ^ (step & _MASK64)) ^ (engine_index & _MASK64)) >> 1
    return torch.tensor([(base + i) & (_MASK64 >> 1) for i in global_row_index.tolist()], dtype=torch.int64)


def sample_seeds(trainer_seed: int, step: int, row_index: torch.Tensor, engine_index: int | None = None,
                 validation: bool = False) -> torch.Tensor:
    """Each generated row's sampling seed (generation/shares.py sample_seeds): the row's own (row_seeds), or
    with `engine_index` (rollout.per_row_seed=false) one per engine per step (engine_seeds);
    validation rows apart from the training rows of the same step."""
    seed = trainer_seed ^ (VALIDATION_SEED_SALT if validation else 0)
    if engine_index is None:
        return row_seeds(seed, step, row_index)
    return engine_seeds(seed, step, engine_index, row_index)


def engine_own_seed(trainer_seed: int, engine_index: int) -> int:
    """A vLLM engine's own seed: its LLM's, and the base of its SeedSequence."""
    return trainer_seed * 1009 + engine_index


class SeedSequence:
    """An engine's own seeds for requests that come without one (a caller outside the trainer's
    step: a bench, a test, a tool of its own): the i-th request submitted gets
    nth_seed(splitmix64(base), i). The ranks of a tensor-parallel engine submit the same requests in
    the same order, so they draw alike; no global generator is read, so nothing a user's code does
    (a tool or an environment on the engine's first rank calling np.random or torch.rand) moves it."""

    def __init__(self, base: int):
        self.base, self.drawn = splitmix64(base & _MASK64), 0

    def next(self) -> int:
        self.drawn += 1
        return nth_seed(self.base, self.drawn)


def reset_seed(uid: str, trainer_seed: int) -> int:
    """The seed of a prompt's environment: the same for the rollout.n episodes of one prompt (GRPO
    compares them on one task), another for every prompt and run. Below 2**32: numpy's legacy
    seeding (np.random.seed, RandomState) and GEM's environments take no larger one."""
    return int.from_bytes(hashlib.sha256(f"{trainer_seed}/{uid}".encode()).digest()[:4], "big")


def epoch_order_seed(data_seed: int, epoch: int) -> int:
    """The shuffle of epoch `epoch`'s prompts (data.shuffle; data/prompts.py PromptDataset)."""
    return data_seed * 100003 + epoch


def validation_data_seed(seed: int) -> int:
    """The validation set's seed from the training set's (the synthetic task's, reasoning-gym's)."""
    return seed + VALIDATION_DATA_SEED_OFFSET
