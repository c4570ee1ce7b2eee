"""Small pool-scoped reductions, and this process's rank. Everything here takes the pool's group:
nothing reduces over the world, because the other pool is busy with different work and would never
join."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_rank() -> int:
    """This process's rank in the world; 0 without one (a single process: colocate on one rank,
    which exchanges with itself without a process group; a test, a tool)."""
    return dist.get_rank() if dist.is_initialized() else 0


def meet_on(group, device) -> None:
    """Every member of `group` gets here before any goes on: a one-number all-reduce on it (on a
    device group, NCCL's, the first one also builds its communicator), and the host waits for it
    (`.item()`: a collective on NCCL only queues work on the device)."""
    token = torch.ones(1, device=device)
    dist.all_reduce(token, group=group)
    token.item()


def pool_sum(group):
    """A `reduce_sum` for algo.py: sums a small tensor of statistics over the pool."""

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return reduce_sum


def pool_reduce_metrics(sums: dict, counts: dict, group, device) -> dict[str, float]:
    """Pool-wide weighted means: each metric's local sum and weight are summed over the pool in
    one all-reduce, so a rank that saw more tokens counts for more, as in a single-rank run.
    Sums and weights are Python numbers, or all of them tensors (a role's sums kept on the device
    through its micro-batches: stacked there, nothing read before the one read of the totals)."""
    keys = sorted(sums)
    if not keys:
        return {}
    values = [sums[k] for k in keys] + [counts[k] for k in keys]
    if all(torch.is_tensor(v) for v in values):
        packed = torch.stack([v.to(device=device, dtype=torch.float64) for v in values])
    else:
        packed = torch.tensor([float(v) for v in values], device=device, dtype=torch.float64)
    totals = pool_sum(group)(packed).tolist()
    n = len(keys)
    return {k: totals[i] / totals[n + i] if totals[n + i] > 0 else float("nan") for i, k in enumerate(keys)}


def pool_max_min(maxes: dict[str, float], mins: dict[str, float], group, device) -> tuple[dict, dict]:
    """Pool-wide max and min of several metrics in one MAX all-reduce (min as max of negation)."""
    max_keys, min_keys = sorted(maxes), sorted(mins)
    packed = torch.tensor([float(maxes[k]) for k in max_keys] + [-float(mins[k]) for k in min_keys], device=device, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    values = packed.tolist()
    return dict(zip(max_keys, values[: len(max_keys)])), {k: -v for k, v in zip(min_keys, values[len(max_keys) :])}
