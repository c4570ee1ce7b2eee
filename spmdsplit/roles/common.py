"""What the actor and the critic share: the forward over a rollout and the PPO mini-batch loop."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from spmdsplit.batch import Batch
from spmdsplit.distributed import pool_reduce_metrics, pool_sum


def forward_response(model, batch: Batch, response_only: bool = False):
    """Model output at the positions that *predict* each response token (one to the left), so
    column t of the result scores response token t: log-prob of it, or the value of the state
    before it.

    response_only: compute the head only on the last R + 1 positions (transformers'
    `logits_to_keep`), not on the prompt's: at a 152k vocabulary the LM head's output is the
    largest tensor of the forward. Causal LMs take it; the critic's token-classification head
    does not (and its one-wide output is small), so it leaves it off.
    """
    R = batch["responses"].shape[1]
    extra = {"logits_to_keep": R + 1} if response_only else {}
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        **extra,
    )
    return out.logits[:, -R - 1 : -1]


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


def run_ppo_updates(engine, batch: Batch, cfg, rollout_n: int, seed: int, device,
                    micro_loss: Callable[[Batch, torch.Tensor, torch.Tensor], dict]):
    """The PPO update loop (epochs x mini-batches x micro-batches with gradient accumulation into
the sharded gradients, or, with `cfg.no_sync_accumulation`, into whole ones reduced once).

    `micro_loss(micro, num_tokens, num_seqs)` runs forward + `engine.backward` on one micro-batch
    and returns (loss_shares, pieces): loss_shares {name: this micro-batch's share of the
    mini-batch loss} (shares add up, over micro-batches and ranks, to the mini-batch loss) and
    pieces {name: (local_mean, local_weight)} for token-weighted metrics. Returns pool-wide means,
    losses averaged over optimizer steps, and grad_norm / lr.
    """
    mini_rows = cfg.ppo_mini_batch_size * rollout_n // engine.dp_size  # mini-batches count prompts, as in verl
    loss_sums: dict[str, float] = {}
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    steps = []
    for mini in minibatches(batch, mini_rows, cfg.ppo_epochs, cfg.shuffle, seed):
        num_tokens, num_seqs = global_counts(mini, engine.group, device)
        micros = mini.split(cfg.ppo_micro_batch_size_per_gpu)
        for k, micro in enumerate(micros):
            # By default every micro-batch's backward reduces (FSDP2: reduce-scatters) its gradient,
            # so no rank holds more than its shard; no_sync_accumulation reduces once, on the last.
            with engine.grad_sync(not cfg.no_sync_accumulation or k == len(micros) - 1):
                loss_shares, pieces = micro_loss(micro, num_tokens, num_seqs)
            for name, share in loss_shares.items():
                loss_sums[name] = loss_sums.get(name, 0.0) + float(share)
            for name, (value, weight) in pieces.items():
                sums[name] = sums.get(name, 0.0) + float(value) * float(weight)
                weights[name] = weights.get(name, 0.0) + float(weight)
        steps.append(engine.step())
    engine.scheduler.step()  # once per trainer step, as verl: lr_warmup_steps counts trainer steps
    # Shares summed over the pool give each mini-batch's loss once: weighting each rank's sum by
    # steps / pool size makes the pool-wide mean the loss averaged over optimizer steps.
    sums.update(loss_sums)
    weights.update({name: len(steps) / engine.dp_size for name in loss_sums})
    metrics = pool_reduce_metrics(sums, weights, engine.group, device)
    metrics["grad_norm"] = sum(s["grad_norm"] for s in steps) / len(steps)
    metrics["lr"] = steps[-1]["lr"]
    return metrics
