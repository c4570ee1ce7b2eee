"""Which weights each batch is generated with, when the rollout group has a pool of its own.

With `rollout.staleness=s`, batch k is generated with the weights after update k-1-s (the initial
weights are update 0): s = 0 is on-policy, and s >= 1 lets the rollout pool generate batch k+s
while the other pools train on batch k. The actor pool sends the weights of update k exactly when
the rollout pool will use them, so both sides follow one rule, written here.
"""

from __future__ import annotations

from spmdsplit.batch import Batch


def validates_after(cfg, step: int) -> bool:
    """Whether validation runs after `step` (0: before training)."""
    trainer = cfg.trainer
    if step == 0:
        return trainer.val_before_train
    return trainer.val_freq > 0 and (step % trainer.val_freq == 0 or step == trainer.total_steps)


def weights_needed(cfg, step: int) -> bool:
    """Whether the rollout pool needs the weights of update `step` (>= 1): to generate batch
    step+1+s, or to validate after that step. With rollout.continuous every update but the last
    (and the last, to validate): the engine takes each version as soon as it is sent, so the
    batches still being generated get fresher tokens."""
    if cfg.rollout.continuous:
        return step < cfg.trainer.total_steps or validates_after(cfg, step)
    return step + 1 + cfg.rollout.staleness <= cfg.trainer.total_steps or validates_after(cfg, step)


def next_version_sent(cfg, version: int) -> int | None:
    """The next update after `version` whose weights the actor pool sends, or None."""
    return next((k for k in range(version + 1, cfg.trainer.total_steps + 1) if weights_needed(cfg, k)), None)


def check_weights_version(rows: Batch, step: int, staleness: int) -> None:
    """The rows of batch `step` must come from the weights of update step-1-s .. step-1 (each row
    carries its `weights_version`): a one-line error otherwise, never training on them."""
    versions = rows["weights_version"]
    if "token_weights_version" in rows:  # continuous generation: every token's, not the row's oldest only
        versions = rows["token_weights_version"][rows["response_mask"].bool()]
    low, high = max(0, step - 1 - staleness), step - 1
    if versions.numel() and (versions.min().item() < low or versions.max().item() > high):
        raise RuntimeError(
            f"step {step}: rows generated with the weights of update {versions.min().item()}..{versions.max().item()}, "
            f"but rollout.staleness={staleness} allows updates {low}..{high}")
