"""Which rows go into which micro-batch: a fixed number of rows each, or a token budget each
(verl's `use_dynamic_bsz`), the same number of micro-batches on every rank of a pool.

A plan is a list of bins, one per micro-batch, each the row indices (into the rank's batch) it
holds; an empty bin is a *dummy* micro-batch. Everything here is a pure function of the row
lengths except `agree_on_count`, the one all-reduce over the pool's group.

What a micro-batch's forward must know of its shape (where its rows' tokens begin and end: its
`Extent`) comes to the host once for the whole batch (`row_shapes`, one read), not per
micro-batch: on a GPU each read of a device value waits for all the work queued before it.

Why every rank of a pool must run the same number of micro-batches: FSDP2 all-gathers each
layer's weights in every forward (and reduce-scatters in every backward), ZeRO-3 the same, so a
rank that ran one forward fewer would leave the others waiting in a collective forever. Token
budgets bin each rank's rows differently, so the pool agrees on the largest count, ranks with
fewer bins split theirs, and a rank with fewer rows than bins runs dummy micro-batches whose
output is thrown away (and whose loss is multiplied by 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from spmdsplit.batch import Batch


def fixed_bins(num_rows: int, rows_per_micro: int) -> list[list[int]]:
    """Consecutive runs of `rows_per_micro` rows (the last may be shorter), as `Batch.split`."""
    return [list(range(i, min(i + rows_per_micro, num_rows))) for i in range(0, num_rows, rows_per_micro)]


def token_budget_bins(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: rows longest first, each into the first bin it fits in, so no bin
    holds more than `max_tokens` tokens. A row longer than the budget gets a bin of its own (it
    must run somewhere; the budget caps what is *packed together*, not a single row)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[row] <= max_tokens:
                bins[b].append(row)
                loads[b] += lengths[row]
                break
        else:
            bins.append([row])
            loads.append(lengths[row])
    return [sorted(b) for b in bins]


def split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """`bins` made into exactly `count` (>= len(bins)) bins: the heaviest bin of two or more rows
    is halved by tokens (longest first into the lighter half) until there are enough, then empty
    (dummy) bins make up the rest. Splitting never makes a bin heavier, so the budget still holds."""
    if count < len(bins):
        raise ValueError(f"cannot make {len(bins)} micro-batches into {count}")
    bins = [list(b) for b in bins]

    def load(b):
        return sum(lengths[i] for i in b)

    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=load)
        bins.remove(heaviest)
        halves: list[list[int]] = [[], []]
        for row in sorted(heaviest, key=lambda i: -lengths[i]):
            min(halves, key=load).append(row)
        bins += [sorted(h) for h in halves]
    return bins + [[] for _ in range(count - len(bins))]


def agree_on_count(local: int, group, device) -> int:
    """The largest number of micro-batches any rank of the pool plans: one all-reduce(MAX) over the
    pool's group (never the world: the other pool is busy with other work and would not join)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    count = torch.tensor([local], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def plan_bins(lengths: Sequence[int], dynamic: bool, rows_per_micro: int, max_tokens: int,
              group, device) -> list[list[int]]:
    """Bins of rows of these token lengths: with `dynamic`, by token budget, else
    `rows_per_micro` rows each; as many on every rank of the pool. Fixed bins agree too (one
    all-reduce of one number): ranks holding unequal rows (an inference pass over unequal shares)
    would otherwise run unequal counts and hang the pool."""
    bins = token_budget_bins(lengths, max_tokens) if dynamic else fixed_bins(len(lengths), rows_per_micro)
    return split_to_count(bins, lengths, agree_on_count(len(bins), group, device))


def plan_micro_batches(batch: Batch, dynamic: bool, rows_per_micro: int, max_tokens: int,
                       group, device) -> list[list[int]]:
    """`plan_bins` of a rank's rollout rows; a row's tokens: its attention-mask sum."""
    return plan_bins(batch["attention_mask"].sum(-1).tolist(), dynamic, rows_per_micro, max_tokens, group, device)


@dataclass(frozen=True)
class Extent:
    """The shape of a micro-batch's tokens, on the host: what its forward slices and packs by
    (roles/forward.py forward_response), so that the forward reads nothing from the device."""

    first: int  # the first column any row's prompt uses (P - 1 if none does)
    width: int  # the response columns its longest response reaches (at least 1)
    lengths: tuple[int, ...]  # each row's valid tokens (attention mask)
    response_tokens: int  # valid tokens in the response columns (attention mask)


def row_shapes(batch: Batch) -> list[list[int]]:
    """Per row [valid tokens, first prompt column used (P - 1 if none), response columns reached
    (0 if none), valid response tokens]: one read of the device for the whole batch."""
    mask = batch["attention_mask"].bool()
    R = batch["responses"].shape[1]
    P = mask.shape[1] - R
    columns = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask[:, :P], columns[:P], P - 1).amin(-1, keepdim=True)
    reached = torch.where(mask[:, P:], columns[:R] + 1, 0).amax(-1, keepdim=True)
    return torch.cat([mask.sum(-1, keepdim=True), first, reached, mask[:, P:].sum(-1, keepdim=True)], -1).tolist()


def extent_of(shapes: Sequence[Sequence[int]]) -> Extent:
    """The extent of a micro-batch of rows of these `row_shapes` (at least one row)."""
    return Extent(first=min(s[1] for s in shapes), width=max(1, max(s[2] for s in shapes)),
                  lengths=tuple(s[0] for s in shapes), response_tokens=sum(s[3] for s in shapes))


def dummy_micro_batch(batch: Batch) -> tuple[Batch, Extent]:
    """One row shaped like `batch`'s tensor columns, all zeros but two real tokens: the prompt's
    last and the response's first (so the response mask counts one token and no loss divides by
    zero), and its extent. What it computes is thrown away or multiplied by 0; it runs only so
    that this rank joins the pool's collectives."""
    tensors = {k: v.new_zeros((1, *v.shape[1:])) for k, v in batch.tensors.items()}
    P = tensors["input_ids"].shape[1] - tensors["responses"].shape[1]
    tensors["attention_mask"][0, P - 1 : P + 1] = 1
    tensors["position_ids"][0, P] = 1
    tensors["response_mask"][0, 0] = 1
    return Batch(tensors), Extent(first=P - 1, width=1, lengths=(2,), response_tokens=1)


def micro_batches(batch: Batch, bins: list[list[int]]) -> Iterator[tuple[Batch, bool, Extent]]:
    """(micro-batch, is_dummy, its extent) for each bin, in order. The rows are put in the bins'
    order once and each micro-batch is a slice of that: one gather per column for the whole
    batch (the row index it takes is copied to the device, which the host waits for), none per
    micro-batch; the extents come from one read of the rows' shapes."""
    shapes = row_shapes(batch)
    order = [i for rows in bins for i in rows]
    ordered = batch if order == list(range(len(batch))) else batch.index(order)
    start = 0
    for rows in bins:
        if rows:
            yield ordered.slice(start, start + len(rows)), False, extent_of([shapes[i] for i in rows])
            start += len(rows)
        else:
            dummy, extent = dummy_micro_batch(batch)
            yield dummy, True, extent


def in_row_order(outputs: list[torch.Tensor], bins: list[list[int]], num_rows: int) -> torch.Tensor:
    """The per-row outputs of the micro-batches (one tensor per bin, dummies' included) as one
    tensor in the batch's own row order, the dummies' dropped."""
    real = [(out, rows) for out, rows in zip(outputs, bins) if rows]
    if not real:
        return torch.zeros(0) if not outputs else outputs[0][:0]
    stacked = torch.cat([out for out, _ in real])
    order = torch.tensor([i for _, rows in real for i in rows], device=stacked.device)
    result = torch.empty_like(stacked)
    result[order] = stacked
    assert len(result) == num_rows, (len(result), num_rows)
    return result
