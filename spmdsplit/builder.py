"""What a rank runs, built: the parts every program shares (the pools' channel, the timer, the
prompt dataset, dynamic sampling, the dumps, the weights' links) and the programs of the role
groups on this rank's pool, each given what it needs as arguments; then the loop's own parts
(reports, checkpoints, the stop vote). spmdsplit/trainer.py runs what `build` returns.

The build order is part of the behaviour: collectives (the channel's connections), the models'
memory and the RNG all follow it, the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch.distributed as dist

from spmdsplit import checkpoint_files, lora
from spmdsplit.batch_balancer import BatchBalancer
from spmdsplit.checkpoint_manager import CheckpointManager, seed_sampling
from spmdsplit.config import rows_per_prompt
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dumps import Dumps, RowDump
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.generation.sources import BatchSource, ContinuousSource
from spmdsplit.generation.validation import ValidationSet, validation_set
from spmdsplit.generation.weights import EngineWeights
from spmdsplit.groups import Pools, ProcessGroups
from spmdsplit.messages import PoolChannel
from spmdsplit.models import compute_dtypes, eos_token_ids, load_tokenizer
from spmdsplit.placement import Placement
from spmdsplit.preempt import StopVote
from spmdsplit.programs import Program
from spmdsplit.programs.actor import ActorProgram
from spmdsplit.programs.critic import CriticProgram
from spmdsplit.programs.reward import RewardProgram
from spmdsplit.programs.rollout import RolloutProgram
from spmdsplit.reporting import Reports
from spmdsplit.roles.build import (build_actor_roles, build_critic_roles, build_reward, build_rollout_roles,
                                   build_rule_reward)
from spmdsplit.stop_at_score import ScoreTarget
from spmdsplit.stop_budget import StopBudget, signal_delay_s
from spmdsplit.timing import PhaseTimer, StepProfiler
from spmdsplit.weight_sync import PolicyWeights, WeightBroadcast, WeightsReady


@dataclass
class Programs:
    """This rank's programs, a field per role group (None where the group has no program here), in
    the order they are built, started, validated and closed: the actor before the rollout group,
    whose engines take the policy's weights from the actor's stream (and are built after its
    models, as on a GPU an engine's memory is what the training models leave); the rollout group
    before the critic where rollout.ranks=all puts both on the critic pool, for the same reason
    reversed: its engine is sized before the critic's model exists."""

    actor: ActorProgram | None = None
    rollout: RolloutProgram | None = None
    critic: CriticProgram | None = None
    reward: RewardProgram | None = None

    def by_group(self) -> dict[str, Program]:
        """The programs present, by role group, in the order above."""
        return {f.name: program for f in fields(self) if (program := getattr(self, f.name)) is not None}


# The role groups whose work their host's program does when they share its pool: the reward
# group's scorers (cheap next to the critic's values, and read by its advantages right after).
HOSTED = {"reward": "critic"}


def runs_program(placement: Placement, rank: int, group: str) -> bool:
    """Whether `group` runs a program of its own on `rank`: the rollout group wherever it
    generates, a hosted group only on a pool apart from its host's."""
    if group == "rollout":
        return rank in placement.generating_ranks
    return rank in placement.ranks(group) and (group not in HOSTED or placement.apart(group))


@dataclass
class Rank:
    """Everything the loop runs on this rank."""

    programs: Programs
    pools: Pools
    channel: PoolChannel
    val_set: ValidationSet | None  # the validation set as every rank uses it; None: no validation rows
    timer: PhaseTimer
    profiler: StepProfiler
    stop_vote: StopVote
    score_target: ScoreTarget
    stop_budget: StopBudget
    dumps: Dumps
    sampler: DynamicSampling | None
    reports: Reports
    checkpoints: CheckpointManager
    tokenizer: object
    start_step: int  # 1, or the step after the checkpoint resumed from


def build(cfg, groups: ProcessGroups, rows: dict[str, list[dict]], resume_from: str | None) -> Rank:
    """This rank's parts. `groups`: every process group of the job (spmdsplit/groups.py); `rows`:
    the prompt rows of each split ("train", and "val" when validating); `resume_from`: a complete
    checkpoint folder to continue from (checkpoint_files.find_resume), loaded here."""
    pools = groups.pools
    device, rank, placement = pools.device, pools.rank, pools.placement
    assert placement.pool_at(0) == placement.pool_of("actor"), "world rank 0 logs, as the actor"
    batch_size = cfg.data.train_batch_size  # prompts per step
    val_set = validation_set(cfg, placement, rows["val"]) if rows.get("val") else None
    timer = PhaseTimer(rank, device)
    profiler = StepProfiler(cfg.trainer.profile_steps, cfg.trainer.profile_dir, rank, device)
    channel = PoolChannel(placement, list(placement.generating_ranks), device, batch_size * rows_per_prompt(cfg),
                          cfg.rollout.stream_chunks, groups.bulk, groups.control, pools.meet)
    channel.connect(num_val_rows=val_set.responses if val_set else 0,
                    balance_group=pools.group("actor") if cfg.trainer.balance_batch else None)
    stop_vote = StopVote(groups.stop)
    # trainer.stop_at_score: the critic group's ranks hold the score and say when it is reached
    score_target = ScoreTarget(cfg.trainer.stop_at_score, cfg.trainer.stop_at_score_window)
    # Rank 0 warns once if Slurm's warning before the time limit is shorter than a clean stop.
    stop_budget = StopBudget(signal_delay_s if rank == 0 else None)
    handoff = hand_off(groups, device)
    # Engines outside the actor pool (a rollout pool of its own, or rollout.ranks=all's on the
    # critic pool) get the policy's weights by a bucketed broadcast.
    broadcast = (WeightBroadcast(placement.weight_sources, groups.weights, device, cfg.rollout.weight_bucket_mb)
                 if placement.weight_sources else None)
    # rollout.continuous: the actor pool announces each version before it pushes it, and the
    # rollout pool looks for that between engine steps.
    weights_ready = WeightsReady(groups.weights_ready) if groups.weights_ready is not None else None

    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # "" resolved by train.py
    eos_ids = eos_token_ids(cfg.model.path, tokenizer)
    # Prompts are taken a generation batch at a time: the step's, or dynamic sampling's.
    dataset = PromptDataset(rows["train"], cfg.data.gen_batch_size or batch_size, cfg.data.shuffle, cfg.data.seed)
    sampler = build_sampler(cfg, groups, tokenizer, eos_ids)  # algorithm.filter_groups, on generating ranks
    timer.record_peak_memory("memory_before_models")  # the baseline a rank's peak is read against
    # verl's trainer.rollout_data_dir / validation_data_dir, where the scored rows are
    dumps = Dumps(rollout=build_dump(cfg.trainer.rollout_data_dir, "critic", pools, tokenizer, eos_ids),
                  validation=build_dump(cfg.trainer.validation_data_dir, "reward", pools, tokenizer, eos_ids))

    def here(group: str) -> bool:
        return runs_program(placement, rank, group)

    programs, policy_weights = Programs(), None
    if here("actor"):
        programs.actor, policy_weights = build_actor(cfg, pools, channel, timer, handoff, dataset, sampler,
                                                     broadcast, weights_ready, tokenizer, eos_ids)
    if here("rollout"):  # its engine's weights: the actor's shards on this pool, else the broadcast
        pull = policy_weights.pull if policy_weights else broadcast.pull
        programs.rollout = build_rollout(cfg, pools, channel, timer, dataset, sampler, pull, weights_ready,
                                         tokenizer, eos_ids)
    if here("critic"):
        programs.critic = build_critic(cfg, pools, channel, timer, handoff, dumps, tokenizer, eos_ids)
    if here("reward"):
        programs.reward = RewardProgram(cfg, pools, build_reward(cfg, pools, tokenizer, eos_ids), channel, timer,
                                        dumps)
    seed_sampling(cfg.trainer.seed, rank)

    # A resumed run goes on after the checkpoint's step, in its wandb / MLflow runs.
    resumed = checkpoint_files.read_meta(resume_from) if resume_from else {"step": 0}
    reports = Reports(cfg, placement, rank, channel, after_step=resumed["step"],
                      run_ids=resumed.get("tracking_runs", {}))
    checkpoints = CheckpointManager(cfg, pools, channel, timer, programs.by_group(), sampler, dataset, reports,
                                    score_target)
    if resume_from:
        checkpoints.load(resume_from)
    return Rank(programs, pools, channel, val_set, timer, profiler, stop_vote, score_target, stop_budget, dumps, sampler,
                reports, checkpoints, tokenizer, start_step=resumed["step"] + 1)


def hand_off(groups: ProcessGroups, device):
    """placement.overlap=false's hand-off between the pools (a no-op where they overlap): a barrier
    that spans the actor and critic pools on purpose, it is the thing measured. device_ids: torch's
    barrier on an NCCL group all-reduces one element on a device it picks (distributed_c10d.barrier:
    device_ids, else init_process_group's device_id, which we do not pass, else the current device,
    with a warning); named here, it is this rank's."""
    if not groups.handoff:
        return lambda: None
    on_device = [device.index] if device.type == "cuda" else None
    return lambda: dist.barrier(group=groups.handoff, device_ids=on_device)


def build_actor(cfg, pools: Pools, channel: PoolChannel, timer: PhaseTimer, handoff, dataset: PromptDataset,
                sampler: DynamicSampling | None, broadcast: WeightBroadcast | None, ready: WeightsReady | None,
                tokenizer, eos_ids) -> tuple[ActorProgram, PolicyWeights]:
    """The actor group's program, and the policy's weights as every engine takes them."""
    roles = build_actor_roles(cfg, pools, tokenizer, eos_ids)
    policy_weights = PolicyWeights(roles.actor.engine, compute_dtypes(cfg, pools.device)[0], broadcast, pools,
                                   adapter=lora.engines_take_adapter(cfg), merge=cfg.model.lora_merge, ready=ready)
    # trainer.balance_batch: the rows' order over the actor pool by tokens (spmdsplit/batch_balancer.py)
    balancer = BatchBalancer(cfg, pools, channel, timer) if cfg.trainer.balance_batch else None
    program = ActorProgram(cfg, pools, roles, channel, timer, handoff, dataset, sampler, policy_weights, balancer)
    return program, policy_weights


def build_rollout(cfg, pools: Pools, channel: PoolChannel, timer: PhaseTimer, dataset: PromptDataset,
                  sampler: DynamicSampling | None, pull, ready: WeightsReady | None, tokenizer,
                  eos_ids) -> RolloutProgram:
    """The rollout group's program on this rank, over its row source; `pull`: the policy's weights
    for its engine."""
    roles = build_rollout_roles(cfg, pools, tokenizer, eos_ids)
    weights = EngineWeights(roles.engine, pull, timer, pools.placement.engines_share_device)
    if cfg.rollout.continuous:
        source = ContinuousSource(cfg, pools, roles.engine, roles.agent, weights, ready, timer, dataset, tokenizer,
                                  eos_ids)
    else:
        source = BatchSource(cfg, pools, roles.generates, weights, timer, dataset, tokenizer, sampler)
    return RolloutProgram(source, channel)


def build_critic(cfg, pools: Pools, channel: PoolChannel, timer: PhaseTimer, handoff, dumps: Dumps, tokenizer,
                 eos_ids) -> CriticProgram:
    """The critic group's program, scoring too where the reward group shares its pool."""
    roles = build_critic_roles(cfg, pools)
    reward = None if pools.placement.apart("reward") else build_reward(cfg, pools, tokenizer, eos_ids)
    return CriticProgram(cfg, pools, roles, channel, timer, handoff, reward, dumps)


def build_dump(folder: str, group: str, pools: Pools, tokenizer, eos_ids) -> RowDump | None:
    """A dump of the rows `group` holds scored, on its ranks: each decodes its own, its pool's first
    rank writes."""
    placement = pools.placement
    if not folder or pools.rank not in placement.ranks(group):
        return None
    return RowDump(folder, tokenizer, eos_ids, pools.meet_group(group), writer=pools.rank == placement.ranks(group)[0])


def build_sampler(cfg, groups: ProcessGroups, tokenizer, eos_ids) -> DynamicSampling | None:
    """DAPO's dynamic sampling on the ranks that generate, over their group: a rollout pool's, the
    actor pool's, or with rollout.ranks=all the one over both pools (groups.py)."""
    pools = groups.pools
    generating = list(pools.placement.generating_ranks)
    if not cfg.algorithm.filter_groups.enable or pools.rank not in generating:
        return None
    if groups.generating is not None:  # rollout.ranks=all over two pools: created with the long timeout
        group = count_group = groups.generating
    else:  # one pool generates (the actor's or a rollout pool): the counts over its meeting group, whose
        # timeout is the long one, as its ranks' generation (a long tail, an agent's tools) ends when it ends
        group, count_group = pools.group("rollout"), pools.meet_group("rollout")
    return DynamicSampling(cfg, build_rule_reward(cfg, tokenizer, eos_ids), generating, group, pools.device,
                           count_group)
