"""The PPO update loop the actor and the critic share: epochs x mini-batches x micro-batches, each
micro-batch's loss a share of one pool-wide mean, its metrics summed on the device."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from spmdsplit.batch import Batch
from spmdsplit.distributed import pool_reduce_metrics, pool_sum
from spmdsplit.roles.micro_batches import micro_batches, plan_micro_batches


def minibatches(batch: Batch, mini_batch_rows: int, epochs: int, shuffle: bool, seed: int) -> Iterator[Batch]:
    """ppo_epochs passes over the rank's rows, cut into mini-batches (one optimizer step each).
    The shuffle is seeded identically on every rank so the pool stays in lockstep."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        rows = torch.randperm(len(batch), generator=generator) if shuffle else torch.arange(len(batch))
        shuffled = batch.index(rows)
        yield from shuffled.split(mini_batch_rows)


def global_counts(mini: Batch, group, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid tokens and non-empty rows of the whole pool's mini-batch: the denominators that make
    the loss of every micro-batch on every rank a share of one pool-wide mean."""
    mask = mini["response_mask"]
    local = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).to(device=device, dtype=torch.float64)
    num_tokens, num_seqs = pool_sum(group)(local)
    return num_tokens, num_seqs


class DeviceSums:
    """Running float64 sums of metrics, and of their weights, as 0-d tensors on `device`: adding
    queues an addition on the device and reads nothing back. float64, as the Python floats they
    replace: added in the same order, the sums are those floats bit for bit."""

    def __init__(self, device):
        self.zero = torch.zeros((), dtype=torch.float64, device=device)
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def add(self, name: str, value) -> None:
        """`value` (a tensor or a number) added to `name`'s sum."""
        self.sums[name] = self.sums.get(name, self.zero) + _float64(value)

    def add_weighted(self, name: str, value, weight) -> None:
        """`value * weight` added to `name`'s sum, `weight` to its weight."""
        weight = _float64(weight)
        self.sums[name] = self.sums.get(name, self.zero) + _float64(value) * weight
        self.weights[name] = self.weights.get(name, self.zero) + weight


def _float64(value):
    return value.detach().double() if torch.is_tensor(value) else float(value)


def run_ppo_updates(engine, batch: Batch, cfg, rollout_n: int, seed: int, device, micro_loss: Callable[..., tuple]):
    """The PPO update loop (epochs x mini-batches x micro-batches with gradient accumulation into
the sharded gradients, or, with `cfg.no_sync_accumulation`, into whole ones reduced once).

    Micro-batches: `cfg.ppo_micro_batch_size_per_gpu` rows each, or with `cfg.use_dynamic_bsz`
    at most `cfg.ppo_max_token_len_per_gpu` tokens each, as many on every rank of the pool
    (roles/micro_batches.py); a dummy micro-batch's loss is multiplied by 0 and its numbers dropped.

    `micro_loss(micro, num_tokens, num_seqs, extent)` runs the forward of one micro-batch (`extent`:
    its shape, for forward_response) and returns (loss, loss_shares, pieces): the loss to
    backpropagate, loss_shares {name: this micro-batch's share of the mini-batch loss} (shares add
    up, over micro-batches and ranks, to the mini-batch loss) and pieces {name: (local_mean,
    local_weight)} for token-weighted metrics; the numbers are tensors (or Python numbers), never
    read here. Returns pool-wide means, losses averaged over optimizer steps, and grad_norm / lr.
    """
    mini_rows = cfg.ppo_mini_batch_size * rollout_n // engine.dp_size  # mini-batches count prompts, as in verl
    # The metrics' running sums stay on the device, float64 as the Python floats they once were
    # (each addition rounds as Python's did, so the numbers are the same bit for bit): a
    # micro-batch adds to them without reading anything back, and the step reads them once, in
    # the pool's reduction (on a GPU every read waits for all the work queued before it).
    sums = DeviceSums(device)
    loss_names: set[str] = set()
    steps = []
    for mini in minibatches(batch, mini_rows, cfg.ppo_epochs, cfg.shuffle, seed):
        num_tokens, num_seqs = global_counts(mini, engine.group, device)
        bins = plan_micro_batches(mini, cfg.use_dynamic_bsz, cfg.ppo_micro_batch_size_per_gpu,
                                  cfg.ppo_max_token_len_per_gpu, engine.group, device)
        for k, (micro, dummy, extent) in enumerate(micro_batches(mini, bins)):
            # By default every micro-batch's backward reduces (FSDP2: reduce-scatters) its gradient,
            # so no rank holds more than its shard; no_sync_accumulation reduces once, on the last.
            with engine.grad_sync(not cfg.no_sync_accumulation or k == len(bins) - 1):
                loss, loss_shares, pieces = micro_loss(micro, num_tokens, num_seqs, extent)
                # A dummy runs forward and backward only to join the pool's collectives: a zero
                # gradient, and its numbers count 0 (their names still go in, so that every rank
                # reduces the same metrics even if it ran nothing but dummies).
                engine.backward(loss * 0 if dummy else loss)
            loss_names.update(loss_shares)
            for name, share in loss_shares.items():
                sums.add(name, 0.0 if dummy else share)
            for name, (value, weight) in pieces.items():
                sums.add_weighted(name, 0.0 if dummy else value, 0.0 if dummy else weight)
        steps.append(engine.step())
    engine.scheduler.step()  # once per trainer step, as verl: lr_warmup_steps counts trainer steps
    # Shares summed over the pool give each mini-batch's loss once: weighting each rank's sum by
    # steps / pool size makes the pool-wide mean the loss averaged over optimizer steps.
    for name in loss_names:
        sums.weights[name] = sums.zero + len(steps) / engine.dp_size
    metrics = pool_reduce_metrics(sums.sums, sums.weights, engine.group, device)
    metrics["grad_norm"] = sum(s["grad_norm"] for s in steps) / len(steps)
    metrics["lr"] = steps[-1]["lr"]
    return metrics
