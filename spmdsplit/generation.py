"""Generation, in one place for every rank that generates: the actor pool's ranks (the rollout group
with the actor), a rollout pool of its own, and with rollout.ranks=all the critic pool's ranks too.
Each takes its share of a step's prompts (or of dynamic sampling's generation batches), generates
it with its engine (a tensor-parallel engine's ranks together), and keeps its own rows; validation
responses go to the reward group to score. Messages: spmdsplit/messages.py."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from spmdsplit import algo
from spmdsplit.batch import Batch
from spmdsplit.data.prompts import PromptDataset, collate_prompts
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.exchange import row_ranges
from spmdsplit.messages import PoolChannel
from spmdsplit.timing import PhaseTimer
from spmdsplit.groups import Pools
from spmdsplit.rollout import row_seeds


def generate_validation_rows(cfg, pools: Pools, rollout_engine, channel: PoolChannel, timer: PhaseTimer, tokenizer,
                             step: int, val_rows: list[dict]) -> int:
    """On the ranks of the rollout group, its engines awake: responses to the validation set
    (rollout.val_kwargs, greedy by default), sent to the reward group to score. The set is cut to
    a multiple of both groups' pool sizes so every rank holds equal rows; returns the number of responses."""
    placement = pools.placement
    n = cfg.rollout.val_kwargs.n
    rows = usable_val_rows(val_rows, placement)
    ranks = list(placement.ranks("rollout"))
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


def engine_peers(cfg, rank: int) -> list[int]:
    """The ranks that run one rollout engine together, `rank` among them: a vLLM tensor-parallel
    group (consecutive ranks inside one pool, checked by preflight.check_rollout_placement), else
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
    generating = pools.placement.generating_ranks

    def generate(batch: int) -> Batch:  # this rank's rows of generation batch `batch`
        return engine_shares(cfg, dataset, tokenizer, batch, generating).generate(rollout_engine, pools.device)

    return sampler.fill(step, generate) if sampler else generate(step)


def engine_shares(cfg, dataset: PromptDataset, tokenizer, step: int, generating) -> EngineShares:
    """The step's prompts of this rank's engine (`step_prompts` of each of its peers)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    peers = engine_peers(cfg, rank)
    remax = "reward_baselines" in algo.get_adv_estimator(cfg.algorithm.adv_estimator).inputs
    return EngineShares([step_prompts(cfg, dataset, tokenizer, step, generating, peer) for peer in peers],
                        peers.index(rank), (cfg.rollout.n, cfg.data.max_response_length) if remax else None)


def step_prompts(cfg, dataset: PromptDataset, tokenizer, step: int, generating, rank: int) -> Batch:
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
    unit = math.lcm(len(placement.ranks("rollout")), len(placement.ranks("reward")))
    rows = val_rows[: len(val_rows) // unit * unit]
    if not rows:
        raise ValueError(f"validation needs at least {unit} rows (one per rank of each pool), got {len(val_rows)}")
    return rows


def counted(weights: Iterator[tuple[str, torch.Tensor]], event: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, its tensors' bytes added up in event["bytes"] as the engine takes them (the
    timeline's sync_weights: the whole policy, or a LoRA adapter)."""
    event["bytes"] = 0
    for name, tensor in weights:
        event["bytes"] += tensor.nbytes
        yield name, tensor


class Generator:
    """The rollout group's engine on this rank, the one way every generating place runs it (the
    actor pool, a rollout pool of its own, rollout.ranks=all's critic pool): wake it with the
    policy's weights from its source (`pull`: the actor pool's own shards, or the broadcast from
    them), generate a step's rows chunk by chunk (dynamic sampling's generation batches and agent
    episodes inside), and put the engine to sleep where it shares the device with training. The
    program that owns it sends the rows on: which message, to whom, is the program's."""

    def __init__(self, cfg, pools: Pools, engine, pull, timer: PhaseTimer, dataset: PromptDataset, tokenizer,
                 sampler: DynamicSampling | None = None):
        """`pull(broadcast)` -> the weights' stream (weight_sync: PolicyWeights.pull on the actor
        pool, WeightBroadcast.pull elsewhere); `sampler`: algorithm.filter_groups, on every
        generating rank, decided with the others."""
        self.cfg, self.pools, self.engine, self.pull, self.timer = cfg, pools, engine, pull, timer
        self.dataset, self.tokenizer, self.sampler = dataset, tokenizer, sampler
        # A rollout pool's device is the engine's alone: it wakes once and takes every later
        # version in place (a sleep and a wake would unmap and map its whole share each time).
        self.shares_device = pools.placement.engines_share_device
        self.chunks = cfg.rollout.stream_chunks
        self.awake = False

    def wake(self, step: int, broadcast: bool = True) -> None:
        """The policy's current weights into the engine (`broadcast=False`: for this pool's engines
        alone, as validation on the actor pool)."""
        with self.timer.phase("sync_weights", step) as event:
            weights = counted(self.pull() if broadcast else self.pull(broadcast=False), event)
            event["engine"] = "update_weights" if self.awake else "wake_up"
            if self.awake:
                self.engine.update_weights(weights)
            else:
                self.engine.wake_up(weights)
                self.awake = True
            event.update(self.timer.device_in_use())  # the engine's share included (tools/gpu_check.py)

    def rows(self, step: int) -> Iterator[Batch]:
        """This rank's rows of step `step`, chunk by chunk (rollout.stream_chunks), each as soon as
        it is generated. Before the last one goes out, an engine that shares its device sleeps:
        vLLM's sleep synchronises the device, which on NCCL would wait for the other pool to take a
        pending send of the rows; and the pool meets (gloo, the long timeout): each rank generated
        on its own, for as long as its rows took (long tails, an agent's tools), and the pool's next
        device collective (the tokens' staleness, the old log-probs' all-gather) would otherwise
        wait for the slowest under trainer.dist_timeout_s, where NCCL's watchdog kills the job."""
        if self.chunks > 1:
            shares = engine_shares(self.cfg, self.dataset, self.tokenizer, step, self.pools.placement.generating_ranks)
        for c in range(self.chunks):
            with self.timer.phase("gen", step, chunk=c):
                if self.chunks == 1:  # the whole step (dynamic sampling's generation batches included)
                    rows = generate_step_rows(self.cfg, self.dataset, self.tokenizer, self.engine, self.pools, step,
                                              self.sampler)
                else:
                    rows = shares.chunk(c, self.chunks).generate(self.engine, self.pools.device)
            if c == self.chunks - 1:
                self.sleep(step)
                self.pools.meet()
            yield rows

    def validate(self, step: int, val_rows: list[dict], channel: PoolChannel) -> int:
        """Responses to the validation set with the weights the engine holds, to the reward group;
        one wake for every batch of the set. Returns the number of responses."""
        num_rows = generate_validation_rows(self.cfg, self.pools, self.engine, channel, self.timer, self.tokenizer,
                                            step, val_rows)
        self.sleep(step)
        self.pools.meet()  # as after a step's rows: each rank's share took its own time
        return num_rows

    def sleep(self, step: int) -> None:
        if self.shares_device:
            with self.timer.phase("rollout_sleep", step):
                self.engine.sleep()
            self.awake = False

    def pop_metrics(self, step: int) -> dict[str, float]:
        """Dynamic sampling's metrics of the step (train/num_gen_batches, ...), where it runs."""
        return self.sampler.pop_metrics(step) if self.sampler else {}
