"""The PPO loop: builds the programs of the role groups on this rank's pool (spmdsplit/programs/),
steps them in the schedule's order, validates and checkpoints when due. What goes into a checkpoint
is spmdsplit/checkpointing.py's, what rank 0 logs spmdsplit/reporting.py's; the loop calls the
programs only through spmdsplit/programs' Program and its SCHEDULE.

    actor pool : gen ──rollout──► old_log_prob, ref ──(log-probs)──►   ◄──advantages── update_actor ──► gen(k+1)
    critic pool:     ──rollout──► values, reward ───(log-probs)──► adv ──advantages──► update_critic ───────────►

Each rank runs the programs of the role groups on its pool, each step in the order of
Program.SCHEDULE: the rollout group's rows chunk by chunk (wherever it generates) taken by the
actor group and sent on, the actor's roll-out, a reward pool's scores, the critic's step, the
actor's update (colocate runs the rollout group's, the actor's and the critic's; a rollout pool of
its own runs only its own, ahead of the others by rollout.staleness). The pools meet only at the
point-to-point messages listed in spmdsplit/messages.py, so old/ref log-probs run beside
values/rewards, update_actor beside update_critic, and the critic update may run on while the
actor pool starts the next rollout. Sends are non-blocking: a pool never waits for its data to be
picked up. `placement.overlap=false` adds pool hand-offs that make the phases run one after another
(verl's blocking calls), to measure what overlapping gains.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from spmdsplit import checkpoint, lora
from spmdsplit.checkpointing import CheckpointManager, seed_sampling
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dumps import Dumps, RowDump
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.batch_balancer import BatchBalancer
from spmdsplit.generation import EngineWeights, validation_set
from spmdsplit.groups import ProcessGroups
from spmdsplit.messages import PoolChannel
from spmdsplit.timing import PhaseTimer, StepProfiler
from spmdsplit.models import compute_dtypes, eos_token_ids, load_tokenizer
from spmdsplit.preempt import StopVote
from spmdsplit.programs import Program, own_programs
from spmdsplit.programs.actor import ActorProgram
from spmdsplit.programs.critic import CriticProgram
from spmdsplit.programs.reward import RewardProgram
from spmdsplit.programs.rollout import RolloutProgram
from spmdsplit.reporting import Reports
from spmdsplit.roles.build import (build_actor_roles, build_critic_roles, build_reward, build_rollout_roles,
                                   build_rule_reward)
from spmdsplit.row_sources import BatchSource, ContinuousSource
from spmdsplit.score_target import ScoreTarget
from spmdsplit.staleness import validates_after
from spmdsplit.stop_budget import StopBudget, signal_delay_s
from spmdsplit.weight_sync import PolicyWeights, WeightBroadcast, WeightsReady


class Trainer:
    def __init__(self, cfg, groups: ProcessGroups, rows: dict[str, list[dict]], resume_from: str | None = None):
        """`groups`: every process group of the job (spmdsplit/groups.py); `rows`: the prompt rows
        of each split ("train", and "val" when validating); `resume_from`: a complete checkpoint
        folder to continue from (checkpoint.find_resume)."""
        self.cfg, self.pools = cfg, groups.pools
        pools = groups.pools
        self.device, self.rank, self.placement = pools.device, pools.rank, pools.placement
        assert self.placement.pool_at(0) == self.placement.pool_of("actor"), "world rank 0 logs, as the actor"
        self.batch_size = cfg.data.train_batch_size  # prompts per step
        # The validation set as every rank uses it, or None: the run has no validation rows.
        self.val_set = validation_set(cfg, self.placement, rows["val"]) if rows.get("val") else None
        self.timer = PhaseTimer(self.rank, self.device)
        self.profiler = StepProfiler(cfg.trainer.profile_steps, cfg.trainer.profile_dir, self.rank, self.device)
        self.channel = PoolChannel(self.placement, list(self.placement.generating_ranks), self.device,
                                   self.batch_size * cfg.rollout.n, cfg.rollout.stream_chunks, groups.bulk,
                                   groups.control, pools.meet)
        self.channel.connect(num_val_rows=self.val_set.responses if self.val_set else 0,
                             balance_group=pools.group("actor") if cfg.trainer.balance_batch else None)
        self.stop_vote = StopVote(groups.stop)
        # trainer.stop_at_score: the critic group's ranks hold the score and say when it is reached
        self.score_target = ScoreTarget(cfg.trainer.stop_at_score, cfg.trainer.stop_at_score_window)
        # Rank 0 warns once if Slurm's warning before the time limit is shorter than a clean stop.
        self.stop_budget = StopBudget(signal_delay_s if self.rank == 0 else None)
        # The hand-off barrier spans the actor and critic pools on purpose: it is the thing measured.
        # device_ids: torch's barrier on an NCCL group all-reduces one element on a device it picks
        # (distributed_c10d.barrier: device_ids, else init_process_group's device_id, which we do
        # not pass, else the current device, with a warning); named here, it is this rank's.
        on_device = [self.device.index] if self.device.type == "cuda" else None
        self.handoff = ((lambda: dist.barrier(group=groups.handoff, device_ids=on_device)) if groups.handoff
                        else (lambda: None))
        # Engines outside the actor pool (a rollout pool of its own, or rollout.ranks=all's on the
        # critic pool) get the policy's weights by a bucketed broadcast.
        self.weights = None
        if self.placement.weight_sources:
            self.weights = WeightBroadcast(self.placement.weight_sources, groups.weights, self.device,
                                           cfg.rollout.weight_bucket_mb)

        # rollout.continuous: the actor pool announces each version before it pushes it, and the
        # rollout pool looks for that between engine steps.
        self.weights_ready = WeightsReady(groups.weights_ready) if groups.weights_ready is not None else None

        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # "" resolved by train.py
        self.eos_ids = eos_token_ids(cfg.model.path, self.tokenizer)
        # Prompts are taken a generation batch at a time: the step's, or dynamic sampling's.
        self.dataset = PromptDataset(rows["train"], cfg.data.gen_batch_size or self.batch_size, cfg.data.shuffle,
                                     cfg.data.seed)
        self.sampler = self.build_sampler(groups)  # algorithm.filter_groups, on generating ranks
        self.timer.record_peak_memory("memory_before_models")  # the baseline a rank's peak is read against
        builders = {"rollout": self.build_rollout, "actor": self.build_actor, "critic": self.build_critic,
                    "reward": self.build_reward}
        self.policy_weights = None  # on actor ranks: the policy's weights to every engine (build_actor)
        # verl's trainer.rollout_data_dir / validation_data_dir, where the scored rows are
        self.dumps = Dumps(rollout=self.build_dump(cfg.trainer.rollout_data_dir, "critic"),
                           validation=self.build_dump(cfg.trainer.validation_data_dir, "reward"))
        self.programs = {group: builders[group]() for group in own_programs(self.placement, self.rank)}
        seed_sampling(cfg.trainer.seed, self.rank)
        # A resumed run goes on after the checkpoint's step, in its wandb / MLflow runs.
        resumed = checkpoint.read_meta(resume_from) if resume_from else {"step": 0}
        self.start_step = resumed["step"] + 1
        self.reports = Reports(cfg, self.placement, self.rank, self.channel, after_step=resumed["step"],
                               run_ids=resumed.get("tracking_runs", {}))
        self.checkpoints = CheckpointManager(cfg, pools, self.channel, self.timer, self.programs, self.sampler,
                                             self.dataset, self.reports, self.score_target)
        if resume_from:
            self.checkpoints.load(resume_from)

    # ------------------------------------------------------------------ the programs on this rank

    def build_rollout(self) -> RolloutProgram:
        """The rollout group's program on this rank, over its row source; its engine's weights come
        from the actor's shards on the actor pool (built first: BUILD_ORDER), else by broadcast."""
        cfg, pools = self.cfg, self.pools
        roles = build_rollout_roles(cfg, pools, self.tokenizer, self.eos_ids)
        pull = self.policy_weights.pull if self.policy_weights else self.weights.pull
        weights = EngineWeights(roles.engine, pull, self.timer, self.placement.engines_share_device)
        if cfg.rollout.continuous:
            source = ContinuousSource(cfg, pools, roles.engine, roles.agent, weights, self.weights_ready, self.timer,
                                      self.dataset, self.tokenizer, self.eos_ids)
        else:
            source = BatchSource(cfg, pools, roles.generates, weights, self.timer, self.dataset, self.tokenizer,
                                 self.sampler)
        return RolloutProgram(source, self.channel)

    def build_actor(self) -> ActorProgram:
        cfg, pools = self.cfg, self.pools
        roles = build_actor_roles(cfg, pools, self.tokenizer, self.eos_ids)
        self.policy_weights = PolicyWeights(roles.actor.engine, compute_dtypes(cfg, self.device)[0], self.weights,
                                            pools, adapter=lora.engines_take_adapter(cfg), merge=cfg.model.lora_merge,
                                            ready=self.weights_ready)
        # trainer.balance_batch: the rows' order over the actor pool by tokens (spmdsplit/batch_balancer.py)
        balancer = BatchBalancer(cfg, pools, self.channel, self.timer) if cfg.trainer.balance_batch else None
        return ActorProgram(cfg, pools, roles, self.channel, self.timer, self.handoff, self.dataset, self.sampler,
                            self.policy_weights, balancer)

    def build_critic(self) -> CriticProgram:
        cfg, pools = self.cfg, self.pools
        roles = build_critic_roles(cfg, pools)
        reward = None if self.placement.apart("reward") else build_reward(cfg, pools, self.tokenizer, self.eos_ids)
        return CriticProgram(cfg, pools, roles, self.channel, self.timer, self.handoff, reward, self.dumps)

    def build_reward(self) -> RewardProgram:
        reward = build_reward(self.cfg, self.pools, self.tokenizer, self.eos_ids)
        return RewardProgram(self.cfg, self.pools, reward, self.channel, self.timer, self.dumps)

    def build_dump(self, folder: str, group: str) -> RowDump | None:
        """A dump of the rows `group` holds scored, on its ranks: each decodes its own, its pool's
        first rank writes."""
        if not folder or self.rank not in self.placement.ranks(group):
            return None
        return RowDump(folder, self.tokenizer, self.eos_ids, self.pools.meet_group(group),
                       writer=self.rank == self.placement.ranks(group)[0])

    def build_sampler(self, groups: ProcessGroups) -> DynamicSampling | None:
        """DAPO's dynamic sampling on the ranks that generate, over their group: a rollout pool's,
        the actor pool's, or with rollout.ranks=all the one over both pools (groups.py)."""
        pools, placement = self.pools, self.placement
        generating = list(placement.generating_ranks)
        if not self.cfg.algorithm.filter_groups.enable or self.rank not in generating:
            return None
        if groups.generating is not None:  # rollout.ranks=all over two pools: created with the long timeout
            group = count_group = groups.generating
        else:  # one pool generates (the actor's or a rollout pool): the counts over its meeting group, whose
            # timeout is the long one, as its ranks' generation (a long tail, an agent's tools) ends when it ends
            group, count_group = pools.group("rollout"), pools.meet_group("rollout")
        return DynamicSampling(self.cfg, build_rule_reward(self.cfg, self.tokenizer, self.eos_ids), generating, group,
                               self.device, count_group)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> bool:
        """Runs the remaining steps, up to trainer.total_steps or the step after the target score was
        reached (trainer.stop_at_score); False when it stopped early on request (after checkpointing)."""
        total_steps = self.cfg.trainer.total_steps
        for program in self.programs.values():
            program.start(self.start_step)
        if validates_after(self.cfg, 0) and self.start_step == 1:
            self.validate(0)
        self.stop_budget.start()
        last, completed = total_steps, True
        for step in range(self.start_step, total_steps + 1):
            self.stop_vote.cast(target_reached=self.score_target.reached)
            with self.profiler.step(step):  # trainer.profile_steps
                self.train_step(step)
            if validates_after(self.cfg, step):  # the rule the weight schedule follows too
                self.validate(step)
            requested, reached = self.stop_vote.outcome()
            self.stop_budget.lap("step")
            if self.checkpoints.due(step, requested, last=reached or step == total_steps):
                self.checkpoints.save(step)
                self.stop_budget.lap("checkpoint")
            if (requested or reached) and step < total_steps:
                last, completed = step, reached
                break
        self.finish(last, completed)
        return completed

    def train_step(self, step: int) -> None:
        """This rank's programs, phase by phase; the pool's first rank reports their metrics."""
        step_start = time.time()
        reported: dict[str, dict] = {}

        def run(phase, *args) -> None:
            if phase.group in self.programs:
                metrics = getattr(self.programs[phase.group], phase.method)(step, *args)
                reported.setdefault(phase.group, {}).update(metrics or {})

        schedule = Program.SCHEDULE
        for chunk in range(self.cfg.rollout.stream_chunks):
            for phase in schedule.per_chunk:
                run(phase, chunk)
        for phase in schedule.after:
            run(phase)
        if "critic" in reported and self.score_target.add(step, reported["critic"]["critic/score/mean"]):
            if self.rank == self.placement.ranks("critic")[0]:
                target = self.score_target
                print(f"spmdsplit: the mean score of steps {step - target.window + 1}-{step} is {target.mean():.4f}, "
                      f"reaching trainer.stop_at_score={target.threshold}: the run ends after step {step + 1}",
                      flush=True)
        self.reports.step(step, reported, self.timer.pop_timings(), step_start)

    def validate(self, step: int) -> None:
        """Responses to the validation set from the rollout group's engines (a rollout pool's, with
        the newest weights, or the actor pool's), scored by the reward group; rank 0 logs verl's
        val-core/<data_source>/reward/mean@n."""
        val_set = self.val_set or validation_set(self.cfg, self.placement, [])  # none: the error says so
        for program in self.programs.values():  # the rollout group's, where it runs here
            program.validate(step, val_set)
        scored = [program.score_validation(step, val_set) for program in self.programs.values()]
        self.reports.validation(step, next((m for m in scored if m is not None), None))  # one program scores here

    def finish(self, last: int, completed: bool) -> None:
        """After step `last` (the last one, when `completed`): rank 0 logs the steps up to it,
        every rank lets go of what it holds, the trained policy is exported."""
        trainer = self.cfg.trainer
        self.reports.receive(upto=last)
        self.profiler.stop()  # a job stopped inside trainer.profile_steps: what it profiled
        self.timer.record_peak_memory()
        self.channel.close()
        if trainer.output_dir and completed:  # a stopped run's weights are in its checkpoint
            for program in self.programs.values():
                program.export(trainer.output_dir, self.tokenizer)
        if trainer.timeline:
            self.reports.timeline(trainer.timeline, self.timer)
        self.reports.close()
        self.dumps.close()
        for program in self.programs.values():
            program.close()
        if self.sampler is not None:
            self.sampler.close()
        # Every rank is done with every message before any leaves: from here on a rank that is
        # gone has finished, not failed (spmdsplit/failure.py).
        dist.barrier(group=self.channel.control_group)
