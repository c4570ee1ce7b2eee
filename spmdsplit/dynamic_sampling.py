"""DAPO's dynamic sampling (verl's algorithm.filter_groups): a prompt group whose responses all
score the same carries no GRPO signal (its advantages are all 0), so it is dropped, and the ranks
that generate keep generating batches of `data.gen_batch_size` prompts until the kept groups fill
a training batch of `data.train_batch_size`; the surplus of the last batch is cut off, as verl
cuts it.

It runs where the rows are generated (the actor pool, a rollout pool of its own, or every rank
with rollout.ranks=all), so a rollout pool generates the extra batches ahead, while the other
pools train. The filter's scores come from the rule reward on the generating ranks (the critic
group scores the kept rows again for training; a rule score is cheap next to generating). Each
response is decoded once, here: the rows carry their texts (roles/reward.py RESPONSE_TEXT) to
the critic group, whose rule reward reads them instead of decoding again.

The data position is the number of generation batches taken: `next_gen_batch` (1-based), which
equals the step without filtering. The checkpoint keeps it, and where each step generated ahead
began, so a resume, even onto other pool sizes, takes the same prompts.

Which groups are kept is a global decision with verl's order: generation batch by batch, and in
a batch the generating ranks in order (each holds whole groups). One all_gather of counts per
generation batch tells every rank where its kept groups fall in that order; the first
`train_batch_size` are the step's, and one all_to_all (exchange.regroup_rows) hands each rank its
even, contiguous share, so everything after sees the batch it would see without filtering.
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.distributed import world_rank
from spmdsplit.exchange import Message, regroup_rows
from spmdsplit.messages import FILTER_GROUPS
from spmdsplit.roles.reward import RESPONSE_TEXT

# The filter's metrics that are the row's total reward, not a number the scorer returned (verl's names).
SEQUENCE_REWARDS = ("seq_reward", "seq_final_reward")


class NoSpreadError(RuntimeError):
    """algorithm.filter_groups.max_num_gen_batches batches did not fill the training batch."""


def groups_with_spread(values: list[float], uids: list) -> tuple[list, list[bool]]:
    """(each group's uid in order of first row, whether its rows' values differ). A group of one
    row is kept, as verl keeps it. verl tests np.std(values) > 0, whose rounding can keep a group
    of equal non-dyadic scores (three times 0.1 has a std of 1e-17); max > min means what it
    intends: the responses did not all score the same."""
    by_uid: dict = {}
    for uid, value in zip(uids, values):
        by_uid.setdefault(uid, []).append(value)
    order = list(by_uid)
    return order, [len(by_uid[u]) == 1 or max(by_uid[u]) > min(by_uid[u]) for u in order]


class DynamicSampling:
    def __init__(self, cfg, scorer, ranks: list[int], group, device, count_group=None):
        """`scorer`: the rule reward (roles/reward.py RuleReward); `ranks`: the generating ranks, in
        the order of the step's global batch; `group`: their process group; `count_group`: the
        one the counts go over (default `group`; the actor pool's meeting group, whose timeout is
        the long one, as its ranks come to it from generating)."""
        fg = cfg.algorithm.filter_groups
        self.metric, self.max_num_gen_batches = fg.metric, fg.max_num_gen_batches
        self.train_groups, self.n = cfg.data.train_batch_size, cfg.rollout.n
        self.gen_groups = cfg.data.gen_batch_size or cfg.data.train_batch_size
        self.scorer, self.ranks, self.group = scorer, list(ranks), group
        self.count_group = group if count_group is None else count_group
        self.me = self.ranks.index(world_rank())
        self.device = self.group_device(group, device)  # for the rows' all_to_all
        self.count_device = self.group_device(self.count_group, device)
        self.next_gen_batch = 1  # the data position: the next generation batch to take
        self.first_gen_batch: dict[int, int] = {}  # step -> its first generation batch, for the steps ahead
        self.step_metrics: dict[int, dict[str, float]] = {}  # step -> its train/num_gen_batches, ...
        self.kept: list[Batch] = []  # the step being filled: this rank's kept groups so far
        self.kept_before = self.num_gen_batches = 0  # kept groups on every rank, generation batches taken

    def close(self) -> None:
        """At the job's end: its rule reward's workers and loop."""
        self.scorer.close()

    @staticmethod
    def group_device(group, device) -> torch.device:
        """Where a group's tensors live: on the host for gloo, on the device for NCCL."""
        gloo = group is None or not dist.is_initialized() or dist.get_backend(group) == "gloo"
        return torch.device("cpu") if gloo else device

    # A step's filling, as a stage of the row source's loop:
    #     begin(step); while wants_more(step): add(rows of generation batch next_gen_batch); take(step)

    def begin(self, step: int) -> None:
        self.first_gen_batch[step] = self.next_gen_batch
        self.kept, self.kept_before, self.num_gen_batches = [], 0, 0

    def wants_more(self, step: int) -> bool:
        """Whether the kept groups do not fill the step yet; raises once max_num_gen_batches did not."""
        if self.kept_before >= self.train_groups:
            return False
        if self.max_num_gen_batches > 0 and self.num_gen_batches >= self.max_num_gen_batches:
            raise NoSpreadError(
                f"step {step}: {self.num_gen_batches} generation batches of {self.gen_groups} prompts gave only "
                f"{self.kept_before} of the {self.train_groups} prompt groups whose responses differ in "
                f"'{self.metric}' (algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches}); "
                "the task may be too hard or too easy for the policy: raise the limit (0 = no limit), "
                "or raise data.gen_batch_size")
        return True

    def add(self, rows: Batch) -> None:
        """This rank's rows of generation batch `next_gen_batch`: its groups with a spread kept."""
        rows[RESPONSE_TEXT] = self.scorer.texts(rows)  # decoded once, for the filter and for training
        self.next_gen_batch += 1
        self.num_gen_batches += 1
        uids, keep = groups_with_spread(self.metric_values(rows), rows["uid"])
        counts = self.all_counts(sum(keep))
        first = self.kept_before + sum(counts[: self.me])  # my first kept group's place in verl's order
        places = {u: first + i for i, u in enumerate(u for u, k in zip(uids, keep) if k)}
        mine = [i for i, u in enumerate(rows["uid"]) if u in places]
        if mine:
            part = rows.index(mine)
            part["kept_place"] = torch.tensor([places[u] for u in part["uid"]], dtype=torch.int64,
                                              device=part["responses"].device)
            self.kept.append(part)
        self.kept_before += sum(counts)

    def take(self, step: int) -> Batch:
        """This rank's share of step `step`'s rows, once wants_more said no."""
        self.step_metrics[step] = {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/filter_groups/kept_ratio": self.kept_before / (self.num_gen_batches * self.gen_groups),
        }
        kept, self.kept = self.kept, []
        return self.share(step, kept)

    def metric_values(self, rows: Batch) -> list[float]:
        """Each row's value of the filter's metric: its total reward, or a number its scorer returned."""
        # "score" is the scorer's own (before DAPO's overlong shaping), as verl's extras hold it
        _, scores, extras = self.scorer.compute_with_extras(rows, shaped=self.metric != "score")
        if self.metric in ("score", *SEQUENCE_REWARDS):  # seq_final_reward == seq_reward: no KL in the reward (config)
            return scores.tolist()
        values = extras.get(self.metric)
        if values is None or any(math.isnan(v) for v in values):
            raise ValueError(f"algorithm.filter_groups.metric={self.metric}: the reward function did not return "
                             f"'{self.metric}' for every row (it returned {sorted(extras) or 'a plain score'}); "
                             f"use seq_reward or one of those keys")
        return values

    def all_counts(self, kept_groups: int) -> list[int]:
        """Every generating rank's count of kept groups in this generation batch, in rank order."""
        if len(self.ranks) == 1:
            return [kept_groups]
        mine = torch.tensor([kept_groups], dtype=torch.int64, device=self.count_device)
        every = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(every, mine, group=self.count_group)
        return [int(c) for c in torch.cat(every).tolist()]

    def share(self, step: int, kept: list[Batch]) -> Batch:
        """The first train_batch_size kept groups, cut into the generating ranks' even, contiguous
        shares (each rank's part of the global batch, as without filtering); `row_index` is each
        row's place in the step's batch again."""
        rows = Batch.concat(kept, pad_to_widest=True)
        places = rows["kept_place"].tolist() if len(rows) else []
        per_rank = self.train_groups // len(self.ranks)
        destination = [p // per_rank if p < self.train_groups else -1 for p in places]
        plan = (step, self.first_gen_batch[step], self.next_gen_batch)  # the same on every rank, or a ProtocolError
        pieces = regroup_rows(Message(FILTER_GROUPS, step, 0), rows, destination, self.ranks, self.group, self.device,
                              fingerprint=hash(plan) & (2**62 - 1))
        mine = Batch.concat(pieces, pad_to_widest=True)
        # In verl's order (the pieces came source by source); a group's rows keep theirs.
        keys = list(zip(mine["kept_place"].tolist(), mine["row_index"].tolist()))
        mine = mine.index(sorted(range(len(mine)), key=keys.__getitem__))
        first_row = self.me * per_rank * self.n
        mine["row_index"] = torch.arange(first_row, first_row + len(mine), dtype=torch.int64,
                                         device=mine["row_index"].device)
        del mine.tensors["kept_place"]
        return mine

    def pop_metrics(self, step: int) -> dict[str, float]:
        self.first_gen_batch.pop(step, None)
        return self.step_metrics.pop(step, {})

    def state_dict(self) -> dict:
        return {"next_gen_batch": self.next_gen_batch, "first_gen_batch": dict(self.first_gen_batch),
                "step_metrics": dict(self.step_metrics)}

    def load_state_dict(self, state: dict, keep_ahead: bool) -> None:
        """`keep_ahead`: the batches generated ahead come back with the checkpoint; else they are
        generated again, from the position where the first of them began."""
        self.next_gen_batch = state["next_gen_batch"]
        self.first_gen_batch = dict(state["first_gen_batch"])
        self.step_metrics = dict(state["step_metrics"])
        if not keep_ahead and self.first_gen_batch:
            self.next_gen_batch = min(self.first_gen_batch.values())
            self.first_gen_batch, self.step_metrics = {}, {}
