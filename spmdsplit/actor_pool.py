"""The actor pool's program: roll out, score the rollout under the policy and the reference, and
update the policy once the critic pool's advantages are in. Messages: spmdsplit/messages.py."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from spmdsplit import algo
from spmdsplit.balance import balanced_group_order, seqlen_metrics, slice_sums
from spmdsplit.batch import Batch
from spmdsplit.data.prompts import PromptDataset, collate_prompts
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.exchange import PendingSend, row_ranges
from spmdsplit.groups import critic_pool_generates
from spmdsplit.messages import PoolChannel, check_rows
from spmdsplit.metrics import PhaseTimer, rollout_correction_metrics, rollout_probs_diff_metrics
from spmdsplit.placement import Pools
from spmdsplit.roles.build import ActorPoolRoles, compute_dtypes
from spmdsplit.rollout import row_seeds
from spmdsplit.staleness import check_weights_version, weights_needed
from spmdsplit.weight_sync import WeightBroadcast


class ActorPool:
    def __init__(self, cfg, pools: Pools, roles: ActorPoolRoles, channel: PoolChannel, timer: PhaseTimer,
                 dataset: PromptDataset, tokenizer, handoff, weights: WeightBroadcast | None = None,
                 sampler: DynamicSampling | None = None):
        self.cfg, self.pools, self.channel, self.timer = cfg, pools, channel, timer
        self.actor, self.ref, self.rollout = roles.actor, roles.ref, roles.rollout
        self.dataset, self.tokenizer, self.handoff = dataset, tokenizer, handoff
        self.weights = weights  # the broadcast to engines elsewhere (a rollout pool, rollout.ranks=all's)
        self.sampler = sampler  # algorithm.filter_groups, when this pool generates
        self.chunks = cfg.rollout.stream_chunks
        self.sends = PendingSend()  # this step's sends to the critic pool, waited for at its end
        self.rollout_metrics: dict[str, float] = {}
        self.tokens_per_rank: dict[str, list[list[int]]] = {}  # pool -> [before, after] balancing, per rank

    def roll_out(self, step: int) -> Batch:
        """gen (chunk by chunk, each sent on at once), or the rows from a rollout pool of its own
        -> old_log_prob -> ref [-> log-probs sent]."""
        phase, channel = self.timer.phase, self.channel
        self.tokens_per_rank = {}  # this step's, for the balance metrics
        parts = self.receive_generated(step) if self.pools.placement.rollout_apart else self.generate_step(step)
        # Each chunk is as wide as its longest response (rollout/base.py): pad them to one width.
        rollout = Batch.concat(parts, pad_to_widest=True)
        self.rollout_metrics = self.sampler.pop_metrics(step) if self.sampler else {}
        corr = self.cfg.algorithm.rollout_correction
        if (corr.rollout_is or corr.bypass_mode) and "rollout_log_probs" not in rollout:
            raise RuntimeError("algorithm.rollout_correction needs the engine's rollout_log_probs, and this "
                               f"rollout.name={self.cfg.rollout.name} engine returned none")
        if corr.bypass_mode:
            # verl's bypass mode: the engine's log-probs are PPO's old policy; no recomputation.
            rollout["old_log_probs"] = rollout["rollout_log_probs"]
        else:
            with phase("old_log_prob", step):
                rollout["old_log_probs"] = self.actor.compute_log_prob(rollout)
            self.correct_for_the_engine(rollout)
        with phase("ref", step):
            rollout["ref_log_prob"] = self.ref.compute_log_prob(rollout)
        self.handoff()  # blocking mode: the critic pool starts its values only now
        if self.cfg.algorithm.use_kl_in_reward:  # the critic pool needs them for the KL penalty
            for c, part in enumerate(rollout.split(len(parts[0]))):
                self.sends.add(channel.send_log_probs(step, c, part))
        return rollout

    def generate_step(self, step: int) -> list[Batch]:
        """The rollout group on this pool: the engines wake with the policy's weights and generate
        the step's prompts chunk by chunk, each sent on to the critic pool at once."""
        phase, channel = self.timer.phase, self.channel
        if self.chunks > 1:  # the step's prompts, generated chunk by chunk
            shares = engine_shares(self.cfg, self.dataset, self.tokenizer, step, generating_ranks(self.cfg, self.pools))
        with phase("sync_weights", step) as event:
            self.wake_rollout()
            event.update(self.timer.device_in_use())  # the engine's share included (tools/gpu_check.py)
        parts = []
        for c in range(self.chunks):
            with phase("gen", step, chunk=c):
                if self.chunks == 1:  # the whole step (dynamic sampling's generation batches included)
                    parts.append(generate_step_rows(self.cfg, self.dataset, self.tokenizer, self.rollout, self.pools,
                                                    step, self.sampler))
                else:
                    parts.append(shares.chunk(c, self.chunks).generate(self.rollout, self.pools.device))
            if c == self.chunks - 1:
                # Before the last rows go out: vLLM's sleep synchronises the device, which on
                # NCCL would wait for the critic pool to take a pending send.
                with phase("rollout_sleep", step):
                    self.rollout.sleep()
            if not self.weights:
                parts[-1] = self.balance(step, c, parts[-1])
                self.sends.add(channel.send_rollout(step, c, parts[-1]))
        if self.weights:  # rollout.ranks=all: the critic pool generated the rest of the rows
            self.sends.add(channel.send_generated(step, parts[0]))
            return self.receive_generated(step)
        return parts

    def receive_generated(self, step: int) -> list[Batch]:
        """Rows generated elsewhere (a rollout pool, or rollout.ranks=all's critic pool), balanced
        once this pool holds all of them, then sent on to the critic pool."""
        with self.timer.phase("exchange/generated", step) as stats:
            rows = self.channel.recv_generated(step, stats)
        if "weights_version" in rows:
            check_weights_version(rows, step, self.cfg.rollout.staleness)
        rows = self.balance(step, 0, rows)
        self.sends.add(self.channel.send_rollout(step, 0, rows))
        return [rows]

    def update(self, step: int, rollout: Batch) -> dict[str, float]:
        """Advantages in -> update_actor. Returns the actor's metrics."""
        advantages = []
        for c in range(self.chunks):
            with self.timer.phase("exchange/advantages", step, chunk=c) as stats:
                advantages.append(self.channel.recv_advantages(step, c, stats))
        advantages = Batch.concat(advantages, pad_to_widest=True)
        check_rows(advantages, rollout, "advantages")
        # The critic pool's ranks padded their rows to their own widest response, not this rank's.
        rollout["advantages"] = advantages.with_width(rollout["responses"].shape[1])["advantages"]
        self.handoff()  # blocking mode: the actor updates only after the critic did
        metrics = {}
        if step > self.cfg.trainer.critic_warmup:  # the first steps train only the critic
            with self.timer.phase("update_actor", step):
                metrics = self.actor.update_policy(rollout, seed=self.cfg.trainer.seed * 7919 + step)
        self.sends.wait()
        self.sends = PendingSend()
        if self.pools.placement.rollout_apart and weights_needed(self.cfg, step):
            with self.timer.phase("sync_weights", step):  # the weights of this update, to the rollout pool
                self.push_weights()
        metrics.update(self.rollout_metrics)
        if self.tokens_per_rank:
            metrics.update(self.balance_metrics())
        return metrics

    def correct_for_the_engine(self, rollout: Batch) -> None:
        """The engine's own log-probs against the actor's (every engine returns them): verl's
        training/rollout_probs_diff_* and rollout_corr/* metrics, and, with
        algorithm.rollout_correction.rollout_is, the truncated importance weights the policy loss
        takes (a column of the rows, so they follow them into every micro-batch)."""
        if "rollout_log_probs" not in rollout:
            return
        corr, group, device = self.cfg.algorithm.rollout_correction, self.pools.actor_group, self.pools.device
        engine, actor, mask = rollout["rollout_log_probs"], rollout["old_log_probs"], rollout["response_mask"]
        self.rollout_metrics.update(rollout_probs_diff_metrics(engine, actor, mask, group, device))
        self.rollout_metrics.update(rollout_correction_metrics(actor, engine, mask, corr.rollout_is,
                                                               corr.rollout_is_threshold, group, device))
        if corr.rollout_is:
            rollout["rollout_is_weights"] = algo.compute_rollout_is_weights(actor, engine, mask, corr.rollout_is,
                                                                            corr.rollout_is_threshold)

    def balance(self, step: int, chunk: int, part: Batch) -> Batch:
        """trainer.balance_batch: this rank's rows of the chunk, exchanged within the actor pool
        so that the chunk's global order is the balanced one (spmdsplit/balance.py). The order
        cuts the chunk's prompt groups into lcm(actor pool, critic pool) parts of equal count, so
        both pools' contiguous slices of it (row_ranges) are even. Rows keep their `row_index`."""
        if not self.cfg.trainer.balance_batch:
            return part
        placement, n = self.pools.placement, self.cfg.rollout.n
        with self.timer.phase("balance", step, chunk=chunk):
            # Every actor rank holds equal whole groups (config.check_against_pools), so one
            # all_gather over the pool gives every rank the chunk's token counts in global order.
            # Over the pool's meeting group (gloo, the long timeout): ranks come here straight
            # from generating (their long tails differ) or from rows another pool sent.
            mine = part["attention_mask"].sum(1).view(-1, n).sum(1).cpu()
            gathered = [torch.empty_like(mine) for _ in placement.actor_ranks]
            dist.all_gather(gathered, mine, group=self.pools.actor_meet)
            group_tokens = torch.cat(gathered).tolist()
            parts = math.lcm(len(placement.actor_ranks), len(placement.critic_ranks))
            groups = balanced_group_order(group_tokens, parts)
            balanced = self.channel.balance(step, chunk, part, [g * n + i for g in groups for i in range(n)],
                                            self.pools.actor_group)
        for pool, ranks in (("actor", placement.actor_ranks), ("critic", placement.critic_ranks)):
            before = slice_sums(group_tokens, len(ranks))
            after = slice_sums([group_tokens[g] for g in groups], len(ranks))
            totals = self.tokens_per_rank.setdefault(pool, [[0] * len(ranks), [0] * len(ranks)])
            for total, chunk_sums in zip(totals, (before, after)):
                total[:] = [a + b for a, b in zip(total, chunk_sums)]
        return balanced

    def balance_metrics(self) -> dict[str, float]:
        """verl's global_seqlen/* of the step for the actor pool (the policy's data-parallel ranks,
        verl's meaning) and, when the critic pool is another, global_seqlen/critic/*."""
        metrics = seqlen_metrics(*self.tokens_per_rank["actor"], "global_seqlen")
        if not self.pools.placement.colocated:
            metrics.update(seqlen_metrics(*self.tokens_per_rank["critic"], "global_seqlen/critic"))
        return metrics

    # ------------------------------------------------------------------ pieces

    def push_weights(self) -> None:
        """A rollout pool of its own: every actor rank gathers the whole stream from the shards
        and broadcasts its share of the buckets (spmdsplit/weight_sync.py)."""
        self.wait_for_weight_receivers()
        self.weights.push(self.actor.engine.iter_full_weights(compute_dtypes(self.cfg, self.pools.device)[0]))

    def wake_rollout(self, broadcast: bool = True) -> None:
        """The rollout engine wakes with the policy's current weights, streamed from the shards
        (and, with rollout.ranks=all, broadcast on to the critic pool's engines by the first rank)."""
        if broadcast and self.weights:
            self.wait_for_weight_receivers()
        weights = self.actor.engine.iter_full_weights(self.rollout.dtype)
        if broadcast and self.weights and self.pools.rank in self.weights.sources:
            weights = self.weights.send(weights)
        self.rollout.wake_up(weights)

    def wait_for_weight_receivers(self) -> None:
        """The sources meet the engines they feed (busy generating or updating for as long as
        they are), then the pool meets, all under the long timeout: the stream's gathers from the
        shards are the pool's collectives, and none may wait for the receivers."""
        if self.pools.rank in self.weights.sources:
            self.weights.ready()
        self.pools.meet("actor")

    def generate_validation(self, step: int, val_rows: list[dict]) -> int:
        """Responses to the validation set, with the policy's current weights, to the critic pool."""
        with self.timer.phase("sync_weights", step):
            self.wake_rollout(broadcast=False)  # only the actor pool generates validation responses
        num_rows = generate_validation_rows(self.cfg, self.pools, self.rollout, self.channel, self.timer,
                                            self.tokenizer, step, val_rows)
        with self.timer.phase("rollout_sleep", step):
            self.rollout.sleep()  # one wake for every batch of the set
        return num_rows


def generate_validation_rows(cfg, pools: Pools, rollout_engine, channel: PoolChannel, timer: PhaseTimer, tokenizer,
                             step: int, val_rows: list[dict]) -> int:
    """On the ranks of the rollout group, its engines awake: responses to the validation set
    (rollout.val_kwargs, greedy by default), sent to the critic group to score. The set is cut to
    a multiple of both pool sizes so every rank holds equal rows; returns the number of responses."""
    placement = pools.placement
    n = cfg.rollout.val_kwargs.n
    rows = usable_val_rows(val_rows, placement)
    ranks = list(placement.rollout_ranks)
    ranges = row_ranges(len(rows), len(ranks))  # equal: usable_val_rows cut them so
    peers = engine_peers(cfg, pools.rank)
    per_batch = max(1, cfg.data.train_batch_size // len(ranks))  # training-sized batches

    def val_prompts(rank: int, offset: int) -> Batch:
        start, end = ranges[ranks.index(rank)]
        first = start + offset
        prompts = collate_prompts(rows[first:min(end, first + per_batch)], tokenizer,
                                  cfg.data.max_prompt_length, step, first, truncation=cfg.data.truncation)
        prompts = prompts.repeat_interleave(n)
        prompts["row_index"] = torch.arange(first * n, first * n + len(prompts), dtype=torch.int64)
        return prompts

    parts = []
    with timer.phase("val_gen", step):
        for offset in range(0, len(rows) // len(ranks), per_batch):
            shares = EngineShares([val_prompts(rank, offset) for rank in peers], peers.index(pools.rank))
            parts.append(shares.generate(rollout_engine, pools.device, validate=True))
    # Validation rows are not balanced: scoring them is cheap next to a training step.
    channel.send_val_rollout(step, Batch.concat(parts, pad_to_widest=True), len(rows) * n).wait()
    return len(rows) * n


def generating_ranks(cfg, pools: Pools) -> list[int]:
    """The ranks that generate a training step's rollout, in the order of its global batch."""
    placement = pools.placement
    if placement.rollout_apart:
        return list(placement.rollout_ranks)
    if critic_pool_generates(cfg, placement):
        return list(placement.actor_ranks) + list(placement.critic_ranks)
    return list(placement.actor_ranks)


def engine_peers(cfg, rank: int) -> list[int]:
    """The ranks that run one rollout engine together, `rank` among them: a vLLM tensor-parallel
    group (consecutive ranks inside one pool, checked by config.check_rollout_placement), else
    `rank` alone."""
    tp = cfg.rollout.tensor_model_parallel_size if cfg.rollout.name == "vllm" else 1
    first = rank // tp * tp
    return list(range(first, first + tp))


class EngineShares:
    """The prompts of every rank of one engine, and which share is this rank's. A tensor-parallel
    engine's ranks must all be given the same prompts and seeds (vLLM's collectives run in
    lockstep), so each generates all its peers' shares together and keeps its own rows: every
    rank still holds its own share of the batch, as the actor's data parallelism expects."""

    def __init__(self, shares: list[Batch], mine: int, baselines: tuple[int, int] | None = None):
        """`baselines`: (rollout.n, data.max_response_length) when the estimator compares each
        response with its prompt's greedy one (ReMax)."""
        self.shares, self.mine, self.baselines = shares, mine, baselines

    def chunk(self, c: int, chunks: int) -> "EngineShares":
        return EngineShares([share.split(len(share) // chunks)[c] for share in self.shares], self.mine,
                            self.baselines)

    def generate(self, rollout_engine, device, validate: bool = False) -> Batch:
        prompts = Batch.concat(self.shares)
        rollout = generate_rows(rollout_engine, prompts, device, validate)
        if self.baselines and not validate:
            rollout.update(greedy_baselines(rollout_engine, prompts.to(device), *self.baselines))
        first = sum(len(share) for share in self.shares[: self.mine])
        return rollout.slice(first, first + len(self.shares[self.mine]))


def greedy_baselines(rollout_engine, prompts: Batch, n: int, width: int) -> Batch:
    """ReMax (Li et al. 2023): each prompt's greedy response, on every row of its group, for the
    critic group to score as the row's `reward_baselines`. As wide as data.max_response_length, so
    that chunks and batches of other response widths concatenate (Batch.concat pads one width)."""
    greedy = rollout_engine.generate(prompts.index(list(range(0, len(prompts), n))), greedy=True)

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1])).repeat_interleave(n, dim=0)

    return Batch({"baseline_responses": per_row(greedy["responses"]),
                  "baseline_response_mask": per_row(greedy["response_mask"])})


def generate_step_rows(cfg, dataset: PromptDataset, tokenizer, rollout_engine, pools: Pools, step: int,
                       sampler: DynamicSampling | None = None) -> Batch:
    """This rank's rows of step `step`, on whichever pool it generates: its share of the step's
    prompts, or with algorithm.filter_groups its share of the kept groups of as many generation
    batches as it takes (spmdsplit/dynamic_sampling.py)."""
    generating = generating_ranks(cfg, pools)

    def generate(batch: int) -> Batch:  # this rank's rows of generation batch `batch`
        return engine_shares(cfg, dataset, tokenizer, batch, generating).generate(rollout_engine, pools.device)

    return sampler.fill(step, generate) if sampler else generate(step)


def engine_shares(cfg, dataset: PromptDataset, tokenizer, step: int, generating: list[int]) -> EngineShares:
    """The step's prompts of this rank's engine (`step_prompts` of each of its peers)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    peers = engine_peers(cfg, rank)
    remax = "reward_baselines" in algo.get_adv_estimator(cfg.algorithm.adv_estimator).inputs
    return EngineShares([step_prompts(cfg, dataset, tokenizer, step, generating, peer) for peer in peers],
                        peers.index(rank), (cfg.rollout.n, cfg.data.max_response_length) if remax else None)


def step_prompts(cfg, dataset: PromptDataset, tokenizer, step: int, generating: list[int], rank: int) -> Batch:
    """Rank `rank`'s share of the step's prompts, each repeated rollout.n times in a row (one group
    per prompt, sharing its uid); groups never straddle ranks since the batch divides. `row_index`
    is each response's place in the step's global batch."""
    n = cfg.rollout.n
    part, parts = generating.index(rank), len(generating)
    rows = dataset.shard(step, part, parts)
    first_row = dataset.batch_size * (step - 1) + part * len(rows)
    prompts = collate_prompts(rows, tokenizer, cfg.data.max_prompt_length, step, first_row,
                              truncation=cfg.data.truncation).repeat_interleave(n)
    first_response = part * len(rows) * n
    prompts["row_index"] = torch.arange(first_response, first_response + len(prompts), dtype=torch.int64)
    # Engines that can seed each row (vLLM) sample it the same whichever rank generates it, next
    # to whichever rows, on any pool size (rollout.per_row_seed says what that costs on GPU).
    if cfg.rollout.per_row_seed:
        prompts["sample_seed"] = row_seeds(cfg.trainer.seed, step, prompts["row_index"])
    return prompts


def generate_rows(rollout_engine, prompts: Batch, device, validate: bool = False) -> Batch:
    rollout = rollout_engine.generate(prompts.to(device), validate=validate)
    rollout["row_index"] = prompts["row_index"].to(device)  # where each row sits in the global batch
    return rollout


def usable_val_rows(val_rows: list[dict], placement) -> list[dict]:
    unit = math.lcm(len(placement.rollout_ranks), len(placement.critic_ranks))
    rows = val_rows[: len(val_rows) // unit * unit]
    if not rows:
        raise ValueError(f"validation needs at least {unit} rows (one per rank of each pool), got {len(val_rows)}")
    return rows
