"""Rows of a step spread over a pool's ranks by workload, not by count (trainer.balance_batch).

Every rank of a pool runs its passes in lockstep with the others (FSDP's collectives), so a step
takes as long as its busiest rank: the rank that happens to hold the long responses. Here the
step's prompt groups (rollout.n rows sharing a prompt, which GRPO/RLOO score together and so
never split) are cut into parts of equal group count whose token sums are as even as the
largest-differencing method of Karmarkar and Karp makes them; the parts laid end to end are the
balanced order of the rows, and the pools' contiguous slices of it (exchange.row_ranges) are
then balanced too. Pure functions, no torch.distributed: spmdsplit/batch_balancer.py, on the actor pool, gathers
the counts and moves the rows.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence


def karmarkar_karp(weights: Sequence[int], num_parts: int) -> list[list[int]]:
    """Indices of `weights` cut into `num_parts` parts of equal count (len(weights) must divide)
    with sums as even as the largest-differencing method gets them.

    Sorted by weight, the items are taken `num_parts` at a time: each such slice is a partial
    solution of `num_parts` one-item parts. Repeatedly, the two partial solutions of largest spread
    (heaviest part minus lightest) are merged by joining the heaviest part of one with the lightest
    of the other, the second heaviest with the second lightest, and so on, which cancels most of
    both spreads; one item per part per slice keeps every count equal. Deterministic (ties broken
    by creation order), so every rank computes the same parts from the same weights."""
    if num_parts <= 0 or len(weights) % num_parts:
        raise ValueError(f"cannot cut {len(weights)} items into {num_parts} parts of equal count")
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    heap, created = [], 0
    for start in range(0, len(order), num_parts):
        parts = [(weights[i], [i]) for i in order[start:start + num_parts]]
        heapq.heappush(heap, _entry(parts, created))
        created += 1
    if not heap:
        return [[] for _ in range(num_parts)]
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        heavy_first = sorted(a, key=lambda part: -part[0])
        light_first = sorted(b, key=lambda part: part[0])
        merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(heavy_first, light_first)]
        heapq.heappush(heap, _entry(merged, created))
        created += 1
    parts = [items for _, items in heap[0][2]]
    _even_out(weights, parts)
    return sorted((sorted(items) for items in parts), key=min)


def _even_out(weights: Sequence[int], parts: list[list[int]], max_swaps: int = 1000) -> None:
    """Largest differencing is a heuristic, and with equal counts it can leave the heaviest part
    well above the lightest (seen: 1.2x with 8 parts of 8 long-tailed items). Swaps one item of the
    heaviest part for one of the lightest while that narrows their gap, which keeps the counts and
    never widens the spread. In place."""
    for _ in range(max_swaps):
        sums = [sum(weights[i] for i in part) for part in parts]
        heavy, light = max(range(len(parts)), key=sums.__getitem__), min(range(len(parts)), key=sums.__getitem__)
        gap = sums[heavy] - sums[light]
        # Moving d = w_i - w_j from heavy to light leaves a gap |gap - 2d|: best where w_j is near
        # w_i - gap / 2, found by bisection among the light part's sorted weights.
        light_sorted = sorted((weights[j], b) for b, j in enumerate(parts[light]))
        keys = [w for w, _ in light_sorted]
        best = None
        for a, i in enumerate(parts[heavy]):
            at = bisect.bisect_left(keys, weights[i] - gap / 2)
            for w_j, b in light_sorted[max(at - 1, 0):at + 1]:
                d = weights[i] - w_j
                if 0 < d < gap and (best is None or abs(gap - 2 * d) < best[0]):
                    best = (abs(gap - 2 * d), a, b)
        if best is None:
            return
        _, a, b = best
        parts[heavy][a], parts[light][b] = parts[light][b], parts[heavy][a]


def _entry(parts: list[tuple[int, list[int]]], created: int):
    sums = [total for total, _ in parts]
    return (-(max(sums) - min(sums)), created, parts)  # heapq pops the largest spread first


def balanced_group_order(group_tokens: Sequence[int], num_parts: int) -> list[int]:
    """The groups of a batch in the order that makes each of `num_parts` contiguous equal slices
    carry an even share of the tokens: the Karmarkar–Karp parts laid end to end, each part's
    groups in their old order (a rank's rows stay in the order they were generated)."""
    return [g for part in karmarkar_karp(group_tokens, num_parts) for g in part]


def slice_sums(tokens_in_order: Sequence[int], num_slices: int) -> list[int]:
    """Token sum of each of `num_slices` contiguous equal slices: what each rank of a pool of that
    size carries when the rows are placed in this order."""
    size = len(tokens_in_order) // num_slices
    return [sum(tokens_in_order[i * size:(i + 1) * size]) for i in range(num_slices)]


def seqlen_metrics(before: Sequence[int], after: Sequence[int], prefix: str) -> dict[str, float]:
    """verl's balance metrics (trainer's log_seqlen_unbalance) from the tokens per rank of a step
    as generated (`before`) and as balanced (`after`): {prefix}/min, /max, /minmax_diff, /mean
    before, {prefix}/balanced_min, /balanced_max after."""
    return {f"{prefix}/min": min(before), f"{prefix}/max": max(before),
            f"{prefix}/minmax_diff": max(before) - min(before), f"{prefix}/mean": sum(before) / len(before),
            f"{prefix}/balanced_min": min(after), f"{prefix}/balanced_max": max(after)}
