"""The conversation between the pools: every message, in order. A is the actor pool, C the pool of
the critic group (A itself when they share ranks), R a rollout pool of its own (placement.roles;
without one, the rollout group sits on A and R means A).

Two links, each a process group over the whole world (spmdsplit/groups.py creates them):

  bulk    the backend's group (NCCL on GPUs, gloo on CPU): rows of the global batch, raw tensors
  control a gloo group, beside NCCL on GPUs as on CPU: small pickled objects, the first rank of
          the critic pool C[0] and of a rollout pool R[0] -> world rank 0 (which logs)

Both wait `trainer.pool_wait_timeout_s`, not `trainer.dist_timeout_s`: a pool that is only busy
(generating a large validation set, a long update) is not dead. A dead rank is found by the
failure watch (spmdsplit/failure.py) and the launcher, not by this timeout.

At start-up every pair of ranks that a bulk message below joins exchanges one small message, in
this order (`PoolChannel.connect`): NCCL connects a pair at its first message and blocks until
both are there, which must not happen inside the first step.

Per training step k, with N = rollout.stream_chunks and s = rollout.staleness:

  link     from -> to   message                        when
  (group)  A -> R       the policy's weights           only with a rollout pool of its own
                        (version v = k-1)              (spmdsplit/weight_sync.py: bucket i from
                                                       actor rank i mod |A|), after update k-1 and
                                                       before R posts GENERATED k, whenever R will
                                                       generate again or validate (R receives it at
                                                       validation k-1 if there is one, else at k);
                                                       at start-up A sends the version it holds
  bulk     R -> A       GENERATED k                    only with a rollout pool of its own: batch k,
                                                       generated with the weights of version
                                                       max(0, k-1-s) during step k-s (each row says
                                                       its version; A checks it), posted at step k
                                                       right after that step's weights arrived
  (group)  A[0] -> C    the policy's weights           only with rollout.ranks=all: a broadcast,
                                                       then every rank generates its share of the
                                                       step's prompts
  bulk     A, C -> A    GENERATED k                    only with rollout.ranks=all: the generated
                                                       rows into the actor pool's partition
  (A's     A <-> A      BALANCE k, chunk c             only with trainer.balance_batch: once the
   group)                                              actor pool holds chunk c (after GENERATED
                                                       with rollout.ranks=all or a rollout pool),
                                                       its rows move between the actor pool's ranks
                                                       into the balanced order (spmdsplit/balance.py),
                                                       after one all_gather of token counts over
                                                       the pool's meeting group: two all_to_all
                                                       over the actor pool's group (any two of its
                                                       ranks may send each other here, which NCCL
                                                       runs only as a grouped call); then
  (the     G <-> G      FILTER_GROUPS k                only with algorithm.filter_groups (DAPO's dynamic
   gener-                                              sampling; G = the generating ranks: R, or A, or A
   ating                                               and C with rollout.ranks=all): after each
   ranks'                                              generation batch one all_gather of kept-group
   group)                                              counts, and once the step is full one all_to_all
                                                       that hands each generating rank its share of the
                                                       kept groups (spmdsplit/dynamic_sampling.py); it
                                                       comes before GENERATED / BALANCE / ROLLOUT
  bulk     A -> C       ROLLOUT k, chunk c             each chunk as soon as it is generated
                                                       (and balanced), c = 0 .. N-1
  bulk     A -> C       LOG_PROBS k, chunk 0 .. N-1    after all ROLLOUT chunks; only with
                                                       algorithm.use_kl_in_reward
  bulk     C -> A       ADVANTAGES k, chunk 0 .. N-1   after GAE, before update_critic
  control  C[0] -> 0    CRITIC_METRICS k               after update_critic; rank 0 takes it
                                                       during step k+1, so it never waits for it
  control  R[0] -> 0    ROLLOUT_METRICS k              only with a rollout pool of its own, after
                                                       its step k; rank 0 takes it during step k+1
Validation at step k (after the step, before any checkpoint):
  bulk     R -> C       VAL_ROLLOUT k                  (R is A without a rollout pool of its own)
  control  C[0] -> 0    VAL_METRICS k                  rank 0 first takes CRITIC_METRICS <= k
Checkpoint at step k:
  control  C[0] -> 0    CHECKPOINT_WRITTEN k           rank 0 first takes CRITIC_METRICS <= k
  control  R[0] -> 0    CHECKPOINT_WRITTEN k           only with a rollout pool of its own (whose
                                                       part holds the batches it generated ahead)

Between two ranks each link is one ordered stream, both directions on it: NCCL matches
point-to-point messages in the order they were posted and ignores tags, so the receiver posts its
receives in exactly the order above, and every header is checked (spmdsplit/exchange.py). A send
completes only once its receive is posted, so no phase above has two ranks send each other on a
link: each bulk message goes one way, and the one exchange where any rank of a pool sends any
other (BALANCE) is a collective. Every multi-rank test runs under these rules (tests/nccl_p2p.py).

A receive from another pool ends with the receiving pool meeting (`Pools.meet`, a barrier over a
gloo group of the pool's ranks with the long timeout) before its next collective: its ranks get
their rows from different ranks of the other pool, at different times, and the pool's own
collectives (FSDP, trainer.dist_timeout_s) must not be the ones that wait for the slowest.

Rows that come back (advantages, log-probs) carry `row_index`, the row's place in the step's
global batch as generated (its identity: balancing reorders the rows but never renumbers them),
and are checked against the rows held: a routing slip is an error, never training on the wrong
rows. In colocate placement every message a rank sends goes to itself and never touches the wire,
but BALANCE (rows between the ranks of the one pool, a collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.exchange import (Link, Message, PendingSend, ProtocolError, recv_rows, reorder_rows, row_pairs,
                                send_rows)
from spmdsplit.placement import Placement

GENERATED, BALANCE, ROLLOUT, LOG_PROBS, ADVANTAGES = "GENERATED", "BALANCE", "ROLLOUT", "LOG_PROBS", "ADVANTAGES"
VAL_ROLLOUT = "VAL_ROLLOUT"
CRITIC_METRICS, VAL_METRICS, CHECKPOINT_WRITTEN = "CRITIC_METRICS", "VAL_METRICS", "CHECKPOINT_WRITTEN"
ROLLOUT_METRICS = "ROLLOUT_METRICS"
FILTER_GROUPS = "FILTER_GROUPS"  # a collective among the generating ranks (spmdsplit/dynamic_sampling.py)

# What the critic pool needs of a rollout (the rest stays with the actor pool). Everything a
# reward function is called with travels: `extra_info` too (verl's scorers for code and tool
# answers read it), for training and validation rows alike, in every placement.
ROLLOUT_KEYS = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                "data_source", "ground_truth", "extra_info", "uid", "row_index")
# A multi-turn rollout's per-row counts (spmdsplit/agent/loop.py), for the critic pool's data metrics.
AGENT_KEYS = ("num_turns", "tool_calls", "tool_errors")
# ReMax's greedy response of each row's prompt (actor_pool.greedy_baselines), scored by the critic pool.
BASELINE_KEYS = ("baseline_responses", "baseline_response_mask")
LOG_PROB_KEYS = ("old_log_probs", "ref_log_prob", "row_index")


def rollout_columns(part: Batch) -> Batch:
    """What of a rollout goes to the critic pool: ROLLOUT_KEYS, AGENT_KEYS when the rollout was
    multi-turn (every row of a step is, or none), BASELINE_KEYS with ReMax."""
    return part.select(ROLLOUT_KEYS + tuple(k for k in AGENT_KEYS + BASELINE_KEYS if k in part))
ADVANTAGE_KEYS = ("advantages", "row_index")


def check_rows(received: Batch, held: Batch, what: str) -> None:
    """Rows that came back must be the rows this rank holds, in the same order."""
    if not torch.equal(received["row_index"].cpu(), held["row_index"].cpu()):
        raise ProtocolError(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: {what} arrived for rows "
            f"{received['row_index'].tolist()[:8]}..., but this rank holds rows {held['row_index'].tolist()[:8]}..."
        )


class PoolChannel:
    """Every message between the pools goes through here, under the names of the table above.
    `bulk_group`, `control_group`: the two links' groups over the world (spmdsplit/groups.py)."""

    def __init__(self, placement: Placement, device: torch.device, rows_per_step: int, chunks: int,
                 bulk_group, control_group, meet=lambda pool: None):
        self.bulk = Link([GENERATED, ROLLOUT, LOG_PROBS, ADVANTAGES, VAL_ROLLOUT], bulk_group, device, "bulk")
        self.control_group = control_group
        self.control = Link([CRITIC_METRICS, VAL_METRICS, CHECKPOINT_WRITTEN, ROLLOUT_METRICS], self.control_group,
                            "cpu", "control")
        self.A, self.C, self.R = list(placement.actor_ranks), list(placement.critic_ranks), list(placement.rollout_ranks)
        # Who sends GENERATED: a rollout pool of its own, or with rollout.ranks=all every rank
        # (set by connect); without either there is no such message.
        self.G = self.R if placement.rollout_apart else self.A + self.C
        self.rows_per_step, self.chunk_rows = rows_per_step, rows_per_step // chunks
        self.meet = meet  # Pools.meet: see "A receive from another pool" above
        self.metrics_in_flight = PendingSend()
        self.rollout_metrics_in_flight = PendingSend()

    def connect(self, generated: bool, num_val_rows: int, balance_group=None) -> None:
        """Every rank, once, at start-up: each pair of ranks that the bulk messages below will
        join exchanges a first message now, in the order of the schedule (Link.connect says why).
        `generated`: rollout.ranks=all or a rollout pool of its own; `num_val_rows`: validation
        responses per run (0: none); `balance_group`: with trainer.balance_batch, the actor pool's
        group on its ranks, whose all_to_all is run once too (NCCL connects its pairs then)."""
        pairs = row_pairs(self.G, self.A, self.rows_per_step) if generated else []
        pairs += row_pairs(self.A, self.C, self.chunk_rows)  # ROLLOUT, LOG_PROBS
        pairs += row_pairs(self.C, self.A, self.chunk_rows)  # ADVANTAGES
        if num_val_rows:
            pairs += row_pairs(self.R, self.C, num_val_rows)  # VAL_ROLLOUT
        self.bulk.connect(pairs)
        if balance_group is not None and len(self.A) > 1:  # BALANCE
            token = torch.zeros(len(self.A), device=self.bulk.device)
            dist.all_to_all_single(torch.empty_like(token), token, group=balance_group)

    # ---- rows generated outside the actor pool's own engines (a rollout pool of its own, or
    #      rollout.ranks=all: actor pool first, then critic pool) move into the actor pool's
    #      partition of the same global order

    def send_generated(self, step: int, generated: Batch) -> PendingSend:
        return send_rows(self.bulk, Message(GENERATED, step), generated, self.G, self.A, self.rows_per_step)

    def recv_generated(self, step: int, stats: dict | None = None) -> Batch:
        return self._then_meet(recv_rows(self.bulk, Message(GENERATED, step), self.G, self.A, self.rows_per_step, stats),
                               self.G, self.A, "actor")

    # ---- trainer.balance_batch: the actor pool's rows of a chunk (of the step, with
    #      rollout.ranks=all) into the balanced order, among the actor pool's ranks

    def balance(self, step: int, chunk: int, part: Batch, order: list[int], actor_group) -> Batch:
        return reorder_rows(Message(BALANCE, step, chunk), part, self.A, order, actor_group, self.bulk.device)

    # ---- a training step, rows chunk by chunk (chunk c of the global batch is chunk c of every
    #      actor rank, laid end to end, so each chunk is an exchange of its own)

    def send_rollout(self, step: int, chunk: int, part: Batch) -> PendingSend:
        return send_rows(self.bulk, Message(ROLLOUT, step, chunk), rollout_columns(part), self.A, self.C, self.chunk_rows)

    def recv_rollout(self, step: int, chunk: int, stats: dict | None = None) -> Batch:
        return self._then_meet(recv_rows(self.bulk, Message(ROLLOUT, step, chunk), self.A, self.C, self.chunk_rows, stats),
                               self.A, self.C, "critic")

    def send_log_probs(self, step: int, chunk: int, part: Batch) -> PendingSend:
        return send_rows(self.bulk, Message(LOG_PROBS, step, chunk), part.select(LOG_PROB_KEYS), self.A, self.C, self.chunk_rows)

    def recv_log_probs(self, step: int, chunk: int, stats: dict | None = None) -> Batch:
        return self._then_meet(recv_rows(self.bulk, Message(LOG_PROBS, step, chunk), self.A, self.C, self.chunk_rows, stats),
                               self.A, self.C, "critic")

    def send_advantages(self, step: int, chunk: int, part: Batch) -> PendingSend:
        return send_rows(self.bulk, Message(ADVANTAGES, step, chunk), part.select(ADVANTAGE_KEYS), self.C, self.A, self.chunk_rows)

    def recv_advantages(self, step: int, chunk: int, stats: dict | None = None) -> Batch:
        return self._then_meet(recv_rows(self.bulk, Message(ADVANTAGES, step, chunk), self.C, self.A, self.chunk_rows, stats),
                               self.C, self.A, "actor")

    # ---- validation

    def send_val_rollout(self, step: int, batch: Batch, num_rows: int) -> PendingSend:
        return send_rows(self.bulk, Message(VAL_ROLLOUT, step), rollout_columns(batch), self.R, self.C, num_rows)

    def recv_val_rollout(self, step: int, num_rows: int) -> Batch:
        return self._then_meet(recv_rows(self.bulk, Message(VAL_ROLLOUT, step), self.R, self.C, num_rows),
                               self.R, self.C, "critic")

    def _then_meet(self, rows: Batch, sources: list[int], pool_ranks: list[int], pool: str) -> Batch:
        """Rows that came from another pool: the receiving pool meets before its next collective."""
        if set(sources) - set(pool_ranks):
            self.meet(pool)
        return rows

    # ---- control: the critic pool's first rank tells world rank 0

    def send_critic_metrics(self, step: int, metrics: dict) -> None:
        # Not waited for: rank 0 takes them during the next step, and waiting would stall this
        # pool until then. The previous send is surely done once a whole step ran.
        self.metrics_in_flight.wait()
        self.metrics_in_flight = self.control.send_object(metrics, 0, Message(CRITIC_METRICS, step))

    def recv_critic_metrics(self, step: int) -> dict:
        return self.control.recv_object(self.C[0], Message(CRITIC_METRICS, step))

    def send_rollout_metrics(self, step: int, metrics: dict) -> None:
        # Not waited for, not even the previous one: rank 0 takes step k's during step k+1, after
        # its update, whose weights this pool may take only after sending (validation).
        self.rollout_metrics_in_flight.add(self.control.send_object(metrics, 0, Message(ROLLOUT_METRICS, step)))

    def recv_rollout_metrics(self, step: int) -> dict:
        return self.control.recv_object(self.R[0], Message(ROLLOUT_METRICS, step))

    def send_val_metrics(self, step: int, metrics: dict) -> None:
        self.control.send_object(metrics, 0, Message(VAL_METRICS, step)).wait()

    def recv_val_metrics(self, step: int) -> dict:
        return self.control.recv_object(self.C[0], Message(VAL_METRICS, step))

    def send_checkpoint_written(self, step: int) -> None:
        self.control.send_object(step, 0, Message(CHECKPOINT_WRITTEN, step)).wait()

    def recv_checkpoint_written(self, step: int, src: int) -> None:
        """From `src`: the critic pool's first rank, or a rollout pool's."""
        self.control.recv_object(src, Message(CHECKPOINT_WRITTEN, step))

    def close(self) -> None:
        self.metrics_in_flight.wait()
        self.rollout_metrics_in_flight.wait()
