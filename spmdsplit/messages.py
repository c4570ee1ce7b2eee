"""The conversation between the pools: every message, in order. Names are role groups: a message
goes from the ranks of one role group to those of another, wherever the placement put them (two
groups on one pool talk to themselves, and such a message never touches the wire). `generating`:
the ranks that generate a step, a rollout pool of its own, or with rollout.ranks=all the actor's
and the critic's.

Two links, each a process group over the whole world (spmdsplit/groups.py creates them):

  bulk    the backend's group (NCCL on GPUs, gloo on CPU): rows of the global batch, raw tensors
  control a gloo group, beside NCCL on GPUs as on CPU: small pickled objects, each pool's first
          rank -> world rank 0 (which logs)

Both wait `trainer.pool_wait_timeout_s`, not `trainer.dist_timeout_s`: a pool that is only busy
(generating a large validation set, a long update) is not dead. A dead rank is found by the
failure watch (spmdsplit/failure.py) and the launcher, not by this timeout.

At start-up every pair of ranks that a bulk message below joins exchanges one small message, in
this order (`PoolChannel.connect`): NCCL connects a pair at its first message and blocks until
both are there, which must not happen inside the first step.

Per training step k, with N = rollout.stream_chunks and s = rollout.staleness:

  link     from -> to         message                  when
  (group)  actor -> rollout   the policy's weights     only with a rollout pool of its own
                              (version v = k-1)        (spmdsplit/weight_sync.py: bucket i from
                                                       actor rank i mod |actor|), after update k-1
                                                       and before the rollout pool posts GENERATED
                                                       k, whenever it will generate again or
                                                       validate (it receives them at validation
                                                       k-1 if there is one, else at k); at start-up
                                                       the actor sends the version it holds
  bulk     rollout -> actor   GENERATED k              only with a rollout pool of its own: batch k,
                                                       generated with the weights of version
                                                       max(0, k-1-s) during step k-s (each row says
                                                       its version; the actor checks it), posted at
                                                       step k right after that step's weights arrived
  (group)  actor[0] -> critic the policy's weights     only with rollout.ranks=all: a broadcast,
                                                       then every rank generates its share of the
                                                       step's prompts
  bulk     generating -> actor GENERATED k, chunk c    with rollout.ranks=all: the generated rows
                                                       into the actor pool's partition; where the
                                                       engines share the actor pool, each rank's
                                                       chunk c to itself (never on the wire), as
                                                       soon as it is generated
  (actor's actor <-> actor    BALANCE k, chunk c       only with trainer.balance_batch: once the
   group)                                              actor pool holds chunk c (after GENERATED
                                                       with rollout.ranks=all or a rollout pool),
                                                       its rows move between the actor pool's ranks
                                                       into the balanced order (spmdsplit/balanced_order.py),
                                                       after one all_gather of token counts over
                                                       the pool's meeting group: two all_to_all
                                                       over the actor pool's group (any two of its
                                                       ranks may send each other here, which NCCL
                                                       runs only as a grouped call); then
  (the     generating <->     FILTER_GROUPS k          only with algorithm.filter_groups (DAPO's
   gener-  generating                                  dynamic sampling): after each generation batch
   ating                                               one all_gather of kept-group counts, and once
   ranks'                                              the step is full one all_to_all that hands
   group)                                              each generating rank its share of the kept
                                                       groups (spmdsplit/dynamic_sampling.py); it
                                                       comes before GENERATED / BALANCE / ROWS
  bulk     actor -> critic    ROWS k, chunk c          each chunk as soon as it is generated
                                                       (and balanced), c = 0 .. N-1
  bulk     actor -> reward    ROWS k, chunk c          only with reward on a pool of its own, right
                                                       after the critic's copy of the chunk
  bulk     reward -> critic   SCORES k, chunk 0..N-1   only with reward on a pool of its own: each
                                                       chunk's token_level_scores (and ReMax's
                                                       reward_baselines), sent once every ROWS
                                                       chunk is in (with the critic on the actor's
                                                       ranks the two directions between a pair of
                                                       ranks must not interleave)
  bulk     actor -> critic    LOG_PROBS k, chunk 0..N-1 after all ROWS chunks; only with
                                                       algorithm.use_kl_in_reward
  bulk     critic -> actor    ADVANTAGES k, chunk 0..N-1 after GAE, before update_critic
  control  pool[0] -> 0       POOL_METRICS k           from the first rank of every pool but world
                                                       rank 0's, naming its pool, after the pool's
                                                       step k; rank 0 takes them during step k+1,
                                                       so it never waits for them
Validation at step k (after the step, before any checkpoint):
  bulk     rollout -> reward  VAL_ROWS k
  control  reward[0] -> 0     VAL_METRICS k            rank 0 first takes POOL_METRICS <= k
Checkpoint at step k:
  control  pool[0] -> 0       CHECKPOINT_WRITTEN k     from the first rank of every pool but world
                                                       rank 0's; rank 0 first takes POOL_METRICS <= k

With rollout.continuous (a rollout pool of its own; spmdsplit/generation/sources.py ContinuousSource) the
rollout pool posts GENERATED k as soon as its share of batch k is complete (each row's tokens carry
their versions: `token_weights_version`, within k-1-s .. k-1, checked), and the weights go after
every update but the last (staleness.weights_needed), each announced first:
  (weights_ actor -> rollout   WEIGHTS_READY v          a MAX all-reduce of v over a gloo group of
   ready)                                              both pools (weight_sync.WeightsReady): the
                                                       actor ranks join it right before the push of
                                                       version v; each rollout rank posts it ahead
                                                       and looks at it between two engine steps,
                                                       then takes the push. It ends its step k once
                                                       it holds version k, generating meanwhile.

Between two ranks each link is one ordered stream, both directions on it: NCCL matches
point-to-point messages in the order they were posted and ignores tags, so the receiver posts its
receives in exactly the order above, and every header is checked (spmdsplit/exchange.py). A send
completes only once its receive is posted, so no phase above has two ranks send each other on a
link: each bulk message goes one way (the reward pool's SCORES go to the critic, which sends it
nothing), and the one exchange where any rank of a pool sends any other (BALANCE) is a collective.
Every multi-rank test runs under these rules (tests/support/nccl_p2p.py).

A receive from another pool ends with the receiving pool meeting (`Pools.meet`, a barrier over a
gloo group of the pool's ranks with the long timeout) before its next collective: its ranks get
their rows from different ranks of the other pool, at different times, and the pool's own
collectives (FSDP, trainer.dist_timeout_s) must not be the ones that wait for the slowest.

Rows that come back (advantages, log-probs, scores) carry `row_index`, the row's place in the
step's global batch as generated (its identity: balancing reorders the rows but never renumbers
them), and are checked against the rows held: a routing slip is an error, never training on the
wrong rows. In colocate placement every message a rank sends goes to itself and never touches the
wire, but BALANCE (rows between the ranks of the one pool, a collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.distributed import world_rank
from spmdsplit.exchange import (Link, Message, PendingSend, ProtocolError, recv_rows, reorder_rows, row_pairs,
                                send_rows)
from spmdsplit.placement import Placement
from spmdsplit.roles.reward import RESPONSE_TEXT, VERDICT_TEXT

GENERATED, BALANCE, ROWS, LOG_PROBS, ADVANTAGES = "GENERATED", "BALANCE", "ROWS", "LOG_PROBS", "ADVANTAGES"
SCORES, VAL_ROWS = "SCORES", "VAL_ROWS"
POOL_METRICS, VAL_METRICS, CHECKPOINT_WRITTEN = "POOL_METRICS", "VAL_METRICS", "CHECKPOINT_WRITTEN"
FILTER_GROUPS = "FILTER_GROUPS"  # a collective among the generating ranks (spmdsplit/dynamic_sampling.py)

# The role groups that take every step's rows (ROWS), each rank of their pools an equal share:
# balancing cuts the rows for them all, and the batch must divide over each (preflight.check_against_pools).
ROWS_TO = ("critic", "reward")
# What the critic and reward groups need of the step's rows (the rest stays with the actor pool). Everything a
# reward function is called with travels: `extra_info` too (verl's scorers for code and tool
# answers read it), for training and validation rows alike, in every placement.
ROW_KEYS = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids",
            "data_source", "ground_truth", "extra_info", "uid", "row_index")
# A multi-turn rollout's per-row counts and, with an environment, how each episode ended
# (spmdsplit/agent/loop.py), for the critic pool's data metrics and the dumps.
AGENT_KEYS = ("num_turns", "tool_calls", "tool_errors", "env_terminated", "env_truncated", "harness_rows_dropped",
              "episode_row")
# ReMax's greedy response of each row's prompt (generation.shares.greedy_baselines), scored by the reward group.
BASELINE_KEYS = ("baseline_responses", "baseline_response_mask")
# The update whose weights generated each row, where a rollout pool of its own says so (the dumps' column).
VERSION_KEYS = ("weights_version",)
# The response texts dynamic sampling decoded for its filter: the reward group's rule reward reads
# them instead of decoding the rows again.
TEXT_KEYS = (RESPONSE_TEXT,)
LOG_PROB_KEYS = ("old_log_probs", "ref_log_prob", "row_index")


def row_columns(part: Batch) -> Batch:
    """What of the rows goes to the critic and reward groups: ROW_KEYS, AGENT_KEYS when the rollout was
    multi-turn (every row of a step is, or none), BASELINE_KEYS with ReMax, TEXT_KEYS with dynamic sampling,
    VERSION_KEYS from a rollout pool of its own."""
    optional = AGENT_KEYS + BASELINE_KEYS + TEXT_KEYS + VERSION_KEYS
    return part.select(ROW_KEYS + tuple(k for k in optional if k in part))
ADVANTAGE_KEYS = ("advantages", "row_index")
SCORE_KEYS = ("token_level_scores", "row_index")  # + reward_baselines with ReMax


def receive_for(held: Batch, recv, what: str, step: int, chunks: int, timer, phase: str) -> Batch:
    """Every chunk of a step's reply about the rows this rank holds (advantages, log-probs), each
    receive timed as `phase`, checked against `held` (check_rows) and padded to its width: the
    other pool's ranks padded their rows to their own widest response, not this rank's."""
    parts = []
    for c in range(chunks):
        with timer.phase(phase, step, chunk=c) as stats:
            parts.append(recv(step, c, stats))
    received = Batch.concat(parts, pad_to_widest=True)
    check_rows(received, held, what)
    return received.with_width(held["responses"].shape[1])


def check_rows(received: Batch, held: Batch, what: str) -> None:
    """Rows that came back must be the rows this rank holds, in the same order."""
    if not torch.equal(received["row_index"].cpu(), held["row_index"].cpu()):
        raise ProtocolError(
            f"rank {world_rank()}: {what} arrived for rows "
            f"{received['row_index'].tolist()[:8]}..., but this rank holds rows {held['row_index'].tolist()[:8]}..."
        )


class PoolChannel:
    """Every message between the pools goes through here, under the names of the table above.
    `bulk_group`, `control_group`: the two links' groups over the world (spmdsplit/groups.py)."""

    def __init__(self, placement: Placement, generating: list[int], device: torch.device, rows_per_step: int,
                 chunks: int, bulk_group, control_group, meet=lambda group: None):
        self.bulk = Link([GENERATED, ROWS, SCORES, LOG_PROBS, ADVANTAGES, VAL_ROWS], bulk_group, device, "bulk")
        self.control_group = control_group
        self.control = Link([POOL_METRICS, VAL_METRICS, CHECKPOINT_WRITTEN], self.control_group, "cpu", "control")
        self.placement = placement
        self.ranks = placement.layout
        # Who sends GENERATED (Placement.generating_ranks): a rollout pool of its own, or with
        # rollout.ranks=all every actor and critic rank; else the actor's ranks, each to itself.
        self.generating = generating
        self.scored_apart = placement.apart("reward")  # ROWS to the reward group too, SCORES back
        self.rows_per_step, self.chunk_rows = rows_per_step, rows_per_step // chunks
        self.meet = meet  # Pools.meet: see "A receive from another pool" above
        self.metrics_in_flight: dict[int, PendingSend] = {}  # step -> this pool's POOL_METRICS send

    def connect(self, num_val_rows: int, balance_group=None) -> None:
        """Every rank, once, at start-up: each pair of ranks that the bulk messages below will
        join exchanges a first message now, in the order of the schedule (Link.connect says why).
        `num_val_rows`: validation
        responses per run (0: none); `balance_group`: with trainer.balance_batch, the actor pool's
        group on its ranks, whose all_to_all is run once too (NCCL connects its pairs then)."""
        actor, critic, reward = self.ranks["actor"], self.ranks["critic"], self.ranks["reward"]
        pairs = row_pairs(self.generating, actor, self.rows_per_step)  # GENERATED (none where each rank sends itself)
        pairs += row_pairs(actor, critic, self.chunk_rows)  # ROWS, LOG_PROBS
        if self.scored_apart:
            pairs += row_pairs(actor, reward, self.chunk_rows)  # ROWS
            pairs += row_pairs(reward, critic, self.chunk_rows)  # SCORES
        pairs += row_pairs(critic, actor, self.chunk_rows)  # ADVANTAGES
        if num_val_rows:
            pairs += row_pairs(self.ranks["rollout"], reward, num_val_rows)  # VAL_ROWS
        self.bulk.connect(pairs)
        if balance_group is not None and len(actor) > 1:  # BALANCE
            token = torch.zeros(len(actor), device=self.bulk.device)
            dist.all_to_all_single(torch.empty_like(token), token, group=balance_group)

    def _send(self, msg: Message, rows: Batch, src: str, dst: str, num_rows: int) -> PendingSend:
        return send_rows(self.bulk, msg, rows, self.generating if src == "generating" else self.ranks[src],
                         self.ranks[dst], num_rows)

    def _recv(self, msg: Message, src: str, dst: str, num_rows: int, stats: dict | None = None) -> Batch:
        """Rows from `src` to this rank of `dst`; when they came from another pool, `dst`'s pool
        meets before its next collective."""
        sources = self.generating if src == "generating" else self.ranks[src]
        rows = recv_rows(self.bulk, msg, sources, self.ranks[dst], num_rows, stats)
        if set(sources) - set(self.ranks[dst]):
            self.meet(dst)
        return rows

    # ---- rows generated outside the actor pool's own engines (a rollout pool of its own, or
    #      rollout.ranks=all: actor pool first, then critic pool) move into the actor pool's
    #      partition of the same global order

    def send_generated(self, step: int, chunk: int, generated: Batch) -> PendingSend:
        return self._send(Message(GENERATED, step, chunk), generated, "generating", "actor", self.chunk_rows)

    def recv_generated(self, step: int, chunk: int, stats: dict | None = None) -> Batch:
        return self._recv(Message(GENERATED, step, chunk), "generating", "actor", self.chunk_rows, stats)

    # ---- trainer.balance_batch: the actor pool's rows of a chunk (of the step, with
    #      rollout.ranks=all) into the balanced order, among the actor pool's ranks

    def balance(self, step: int, chunk: int, part: Batch, order: list[int], actor_group) -> Batch:
        return reorder_rows(Message(BALANCE, step, chunk), part, self.ranks["actor"], order, actor_group,
                            self.bulk.device)

    # ---- a training step, rows chunk by chunk (chunk c of the global batch is chunk c of every
    #      actor rank, laid end to end, so each chunk is an exchange of its own)

    def send_step_rows(self, step: int, chunk: int, part: Batch) -> PendingSend:
        """To the critic group, then (on a pool of its own) the reward group."""
        msg, rows = Message(ROWS, step, chunk), row_columns(part)
        sent = self._send(msg, rows, "actor", "critic", self.chunk_rows)
        if self.scored_apart:
            sent.add(self._send(msg, rows, "actor", "reward", self.chunk_rows))
        return sent

    def recv_step_rows(self, step: int, chunk: int, stats: dict | None = None, to: str = "critic") -> Batch:
        return self._recv(Message(ROWS, step, chunk), "actor", to, self.chunk_rows, stats)

    def send_scores(self, step: int, chunk: int, part: Batch) -> PendingSend:
        keys = SCORE_KEYS + tuple(k for k in ("reward_baselines", VERDICT_TEXT) if k in part)
        return self._send(Message(SCORES, step, chunk), part.select(keys), "reward", "critic", self.chunk_rows)

    def recv_scores(self, step: int, chunk: int, stats: dict | None = None) -> Batch:
        return self._recv(Message(SCORES, step, chunk), "reward", "critic", self.chunk_rows, stats)

    def send_log_probs(self, step: int, chunk: int, part: Batch) -> PendingSend:
        return self._send(Message(LOG_PROBS, step, chunk), part.select(LOG_PROB_KEYS), "actor", "critic",
                          self.chunk_rows)

    def recv_log_probs(self, step: int, chunk: int, stats: dict | None = None) -> Batch:
        return self._recv(Message(LOG_PROBS, step, chunk), "actor", "critic", self.chunk_rows, stats)

    def send_advantages(self, step: int, chunk: int, part: Batch) -> PendingSend:
        return self._send(Message(ADVANTAGES, step, chunk), part.select(ADVANTAGE_KEYS), "critic", "actor",
                          self.chunk_rows)

    def recv_advantages(self, step: int, chunk: int, stats: dict | None = None) -> Batch:
        return self._recv(Message(ADVANTAGES, step, chunk), "critic", "actor", self.chunk_rows, stats)

    # ---- validation

    def send_val_rows(self, step: int, batch: Batch, num_rows: int) -> PendingSend:
        return self._send(Message(VAL_ROWS, step), row_columns(batch), "rollout", "reward", num_rows)

    def recv_val_rows(self, step: int, num_rows: int) -> Batch:
        return self._recv(Message(VAL_ROWS, step), "rollout", "reward", num_rows)

    # ---- control: each pool's first rank tells world rank 0

    def send_pool_metrics(self, step: int, pool: str, metrics: dict) -> None:
        """Not waited for: rank 0 takes step k's during step k+1, and waiting would stall this pool
        until then (a rollout pool's next weights come only after rank 0's update). A send two
        steps old is surely taken."""
        for old in [s for s in self.metrics_in_flight if s <= step - 2]:
            self.metrics_in_flight.pop(old).wait()
        self.metrics_in_flight[step] = self.control.send_object((pool, metrics), 0, Message(POOL_METRICS, step))

    def recv_pool_metrics(self, step: int, pool: str) -> dict:
        sent_by, metrics = self.control.recv_object(self.placement.pools[pool][0], Message(POOL_METRICS, step))
        if sent_by != pool:
            raise ProtocolError(f"rank 0 expected pool {pool}'s metrics of step {step}, got pool {sent_by}'s")
        return metrics

    def send_val_metrics(self, step: int, metrics: dict) -> None:
        self.control.send_object(metrics, 0, Message(VAL_METRICS, step)).wait()

    def recv_val_metrics(self, step: int) -> dict:
        return self.control.recv_object(self.ranks["reward"][0], Message(VAL_METRICS, step))

    def send_checkpoint_written(self, step: int) -> None:
        self.control.send_object(step, 0, Message(CHECKPOINT_WRITTEN, step)).wait()

    def recv_checkpoint_written(self, step: int, pool: str) -> None:
        self.control.recv_object(self.placement.pools[pool][0], Message(CHECKPOINT_WRITTEN, step))

    def close(self) -> None:
        for sent in self.metrics_in_flight.values():
            sent.wait()
