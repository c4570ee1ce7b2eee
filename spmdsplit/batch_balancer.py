"""The actor pool's side of trainer.balance_batch: each chunk's token counts gathered over the pool,
the rows moved to the balanced order, and the step's token sums per rank before and after kept for
verl's global_seqlen/* metrics. The math (the order, the sums) is spmdsplit/balanced_order.py; the rows'
exchange is messages.PoolChannel.balance."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from spmdsplit.balanced_order import balanced_group_order, seqlen_metrics, slice_sums
from spmdsplit.batch import Batch
from spmdsplit.config import rows_per_prompt
from spmdsplit.messages import ROWS_TO, PoolChannel
from spmdsplit.groups import Pools
from spmdsplit.timing import PhaseTimer


class BatchBalancer:
    def __init__(self, cfg, pools: Pools, channel: PoolChannel, timer: PhaseTimer):
        # a prompt group: its rows (rollout.n responses, each rollout.agent.rows_per_episode rows)
        self.pools, self.channel, self.timer, self.n = pools, channel, timer, rows_per_prompt(cfg)
        # role group -> [before, after] balancing, per rank: the step's sums so far, chunk by chunk
        self.tokens_per_rank: dict[str, list[list[int]]] = {}

    def __call__(self, step: int, chunk: int, part: Batch) -> Batch:
        """This rank's rows of the chunk, exchanged within the actor pool so that the chunk's global
        order is the balanced one. The order cuts the chunk's prompt groups into the lcm of the pool
        sizes of the actor and of the groups the rows go to (messages.ROWS_TO) in parts of equal
        count, so every pool's contiguous slices of it (row_ranges) are even. Rows keep their
        `row_index`."""
        placement, n = self.pools.placement, self.n
        with self.timer.phase("balance", step, chunk=chunk):
            # Every actor rank holds equal whole groups (preflight.check_against_pools), so one
            # all_gather over the pool gives every rank the chunk's token counts in global order.
            # Over the pool's meeting group (gloo, the long timeout): ranks come here straight
            # from generating (their long tails differ) or from rows another pool sent.
            mine = part["attention_mask"].sum(1).view(-1, n).sum(1).cpu()
            gathered = [torch.empty_like(mine) for _ in placement.ranks("actor")]
            dist.all_gather(gathered, mine, group=self.pools.meet_group("actor"))
            group_tokens = torch.cat(gathered).tolist()
            parts = math.lcm(*(len(placement.ranks(g)) for g in ("actor", *ROWS_TO)))
            groups = balanced_group_order(group_tokens, parts)
            balanced = self.channel.balance(step, chunk, part, [g * n + i for g in groups for i in range(n)],
                                            self.pools.group("actor"))
        for group in ("actor", "critic"):
            ranks = placement.ranks(group)
            before = slice_sums(group_tokens, len(ranks))
            after = slice_sums([group_tokens[g] for g in groups], len(ranks))
            totals = self.tokens_per_rank.setdefault(group, [[0] * len(ranks), [0] * len(ranks)])
            for total, chunk_sums in zip(totals, (before, after)):
                total[:] = [a + b for a, b in zip(total, chunk_sums)]
        return balanced

    def pop_metrics(self) -> dict[str, float]:
        """verl's global_seqlen/* of the step for the actor pool (the policy's data-parallel ranks,
        verl's meaning) and, when the critic pool is another, global_seqlen/critic/*; the next
        step's sums start from zero."""
        tokens, self.tokens_per_rank = self.tokens_per_rank, {}
        if not tokens:
            return {}
        metrics = seqlen_metrics(*tokens["actor"], "global_seqlen")
        if not self.pools.placement.together("actor", "critic"):
            metrics.update(seqlen_metrics(*tokens["critic"], "global_seqlen/critic"))
        return metrics
