"""The PPO loop: builds the programs of the role groups on this rank's pool (spmdsplit/programs/),
steps them in the schedule's order, logs, validates and checkpoints.

    actor pool : gen ──rollout──► old_log_prob, ref ──(log-probs)──►   ◄──advantages── update_actor ──► gen(k+1)
    critic pool:     ──rollout──► values, reward ───(log-probs)──► adv ──advantages──► update_critic ───────────►

Each rank runs the programs of the role groups on its pool, each step in the order of
programs.STEP_PHASES: a rollout pool's step, the actor's roll-out, a reward pool's scores, the
critic's step, the actor's update (colocate runs the actor's and the critic's; a rollout pool of its
own runs only its own, ahead of the others by rollout.staleness). The pools meet only at the
point-to-point messages listed in spmdsplit/messages.py, so old/ref log-probs run beside
values/rewards, update_actor beside update_critic, and the critic update may run on while the
actor pool starts the next rollout. Sends are non-blocking: a pool never waits for its data to be
picked up. `placement.overlap=false` adds pool hand-offs that make the phases run one after another
(verl's blocking calls), to measure what overlapping gains.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from spmdsplit import checkpoint
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.batch_balancer import BatchBalancer
from spmdsplit.generation import Generator, usable_val_rows
from spmdsplit.groups import ProcessGroups
from spmdsplit.messages import PoolChannel
from spmdsplit.metrics import MetricsLogger, PhaseTimer, StepProfiler, write_timeline
from spmdsplit.models import eos_token_ids, load_tokenizer
from spmdsplit.placement import ROLE_GROUPS
from spmdsplit.preempt import StopVote
from spmdsplit.programs import HOSTED, STEP_PHASES, own_programs
from spmdsplit.programs.actor import ActorProgram
from spmdsplit.programs.critic import CriticProgram
from spmdsplit.programs.reward import RewardProgram
from spmdsplit.programs.rollout import RolloutProgram
from spmdsplit.roles.build import (build_actor_roles, build_critic_roles, build_reward, build_rollout_engine,
                                   build_rule_reward, compute_dtypes)
from spmdsplit.staleness import validates_after
from spmdsplit.stop_budget import StopBudget, signal_delay_s
from spmdsplit.weight_sync import PolicyWeights, WeightBroadcast

# When two groups (or their pools) report the same metric, rank 0 logs the one of the group first here.
REPORT_ORDER = ("actor", "critic", "reward", "rollout")


def merge_reports(parts: dict[str, dict], first) -> dict:
    """The parts' metrics as one dict; of two parts reporting a key, the one with the lower
    `first(name)` wins."""
    return {k: v for name in sorted(parts, key=first, reverse=True) for k, v in parts[name].items()}


class Trainer:
    def __init__(self, cfg, groups: ProcessGroups, rows: dict[str, list[dict]], resume_from: str | None = None):
        """`groups`: every process group of the job (spmdsplit/groups.py); `rows`: the prompt rows
        of each split ("train", and "val" when validating); `resume_from`: a complete checkpoint
        folder to continue from (checkpoint.find_resume)."""
        self.cfg, self.pools = cfg, groups.pools
        pools = groups.pools
        self.device, self.rank, self.placement = pools.device, pools.rank, pools.placement
        assert self.placement.pool_at(0) == self.placement.pool_of("actor"), "world rank 0 logs, as the actor"
        self.my_pool = self.placement.pool_at(self.rank)
        self.batch_size = cfg.data.train_batch_size  # prompts per step
        self.val_rows = rows.get("val", [])
        self.timer = PhaseTimer(self.rank, self.device)
        self.profiler = StepProfiler(cfg.trainer.profile_steps, cfg.trainer.profile_dir, self.rank, self.device)
        self.channel = PoolChannel(self.placement, list(self.placement.generating_ranks), self.device,
                                   self.batch_size * cfg.rollout.n, cfg.rollout.stream_chunks, groups.bulk,
                                   groups.control, pools.meet)
        val_responses = (len(usable_val_rows(self.val_rows, self.placement)) * cfg.rollout.val_kwargs.n
                         if self.val_rows else 0)
        self.channel.connect(generated=self.placement.generated_elsewhere,
                             num_val_rows=val_responses,
                             balance_group=pools.group("actor") if cfg.trainer.balance_batch else None)
        self.stop_vote = StopVote(groups.stop)
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
        if groups.weight_sources:
            self.weights = WeightBroadcast(groups.weight_sources, groups.weights, self.device,
                                           cfg.rollout.weight_bucket_mb)

        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # "" resolved by train.py
        self.eos_ids = eos_token_ids(cfg.model.path, self.tokenizer)
        # Prompts are taken a generation batch at a time: the step's, or dynamic sampling's.
        self.dataset = PromptDataset(rows["train"], cfg.data.gen_batch_size or self.batch_size, cfg.data.shuffle,
                                     cfg.data.seed)
        self.sampler = self.build_sampler(groups)  # algorithm.filter_groups, on generating ranks
        builders = {"rollout": self.build_rollout, "actor": self.build_actor, "critic": self.build_critic,
                    "reward": self.build_reward}
        self.programs = {group: builders[group]() for group in own_programs(self.placement, self.rank)}
        self.seed_sampling()
        self.start_step = 1
        # Rank 0: step -> {pool: its metrics} until every pool's part is in.
        self.unlogged: dict[int, dict] = {}
        # The pools other than rank 0's (each one's first rank reports to rank 0), and rank 0's count
        # of their metrics taken, step by step.
        self.other_pools = [pool for pool in self.placement.pools if pool != self.placement.pool_at(0)]
        self.metrics_received = dict.fromkeys(self.other_pools, 0)
        self.tracking_runs: dict[str, str] = {}  # wandb / MLflow runs a resumed job goes on in
        if resume_from:
            self.load_checkpoint(resume_from)
        # wandb records the resolved config with the run, as verl's tracking does.
        self.logger = MetricsLogger(cfg.trainer, OmegaConf.to_container(cfg, resolve=True), first_step=self.start_step,
                                    run_ids=self.tracking_runs) if self.rank == 0 else None

    # ------------------------------------------------------------------ the programs on this rank

    def build_generator(self, engine, pull) -> Generator:
        """The rollout group's engine on this rank, woken with the weights `pull` gives."""
        return Generator(self.cfg, self.pools, engine, pull, self.timer, self.dataset, self.tokenizer, self.sampler)

    def build_rollout(self) -> RolloutProgram:
        engine = build_rollout_engine(self.cfg, self.pools, self.tokenizer, self.eos_ids)
        return RolloutProgram(self.cfg, self.build_generator(engine, self.weights.pull), self.channel)

    def build_actor(self) -> ActorProgram:
        cfg, pools = self.cfg, self.pools
        roles = build_actor_roles(cfg, pools, self.tokenizer, self.eos_ids)
        weights = PolicyWeights(roles.actor.engine, compute_dtypes(cfg, self.device)[0], self.weights, pools)
        generator = self.build_generator(roles.rollout, weights.pull) if roles.rollout is not None else None
        # trainer.balance_batch: the rows' order over the actor pool by tokens (spmdsplit/batch_balancer.py)
        balancer = BatchBalancer(cfg, pools, self.channel, self.timer) if cfg.trainer.balance_batch else None
        return ActorProgram(cfg, pools, roles, self.channel, self.timer, self.handoff, self.dataset, generator,
                            weights, balancer)

    def build_critic(self) -> CriticProgram:
        cfg, pools = self.cfg, self.pools
        generator = None
        if self.placement.critic_pool_generates:  # rollout.ranks=all: the rollout group spans this pool
            engine = build_rollout_engine(cfg, pools, self.tokenizer, self.eos_ids)
            generator = self.build_generator(engine, self.weights.pull)
        roles = build_critic_roles(cfg, pools)
        reward = None if self.placement.apart("reward") else build_reward(cfg, pools, self.tokenizer, self.eos_ids)
        return CriticProgram(cfg, pools, roles, self.channel, self.timer, self.handoff, reward, generator)

    def build_reward(self) -> RewardProgram:
        reward = build_reward(self.cfg, self.pools, self.tokenizer, self.eos_ids)
        return RewardProgram(self.cfg, self.pools, reward, self.channel, self.timer)

    def running(self, group: str):
        """The program on this rank that does `group`'s work: its own, or its host's when it shares
        the host's pool (the actor's generates, the critic's scores); None off its pool."""
        if group in HOSTED and not self.placement.apart(group):
            return self.programs.get(HOSTED[group])
        return self.programs.get(group)

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

    def seed_sampling(self, after_step: int = 0) -> None:
        """Sampling must differ between ranks (else every shard draws the same responses); a
        resume that cannot restore the RNG state (other pool sizes) seeds from the step too."""
        torch.manual_seed(self.cfg.trainer.seed * 1000 + 7 + self.rank + 7919 * after_step)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> bool:
        """Runs the remaining steps; False when it stopped early on request (after checkpointing)."""
        trainer = self.cfg.trainer
        last = trainer.total_steps
        if self.placement.apart("rollout"):  # the rollout pool's engines start with the actor's weights
            if "actor" in self.programs:
                self.programs["actor"].start(self.start_step)
            if "rollout" in self.programs:
                self.programs["rollout"].start(self.start_step)
        if validates_after(self.cfg, 0) and self.start_step == 1:
            self.validate(0)
        self.stop_budget.start()
        for step in range(self.start_step, trainer.total_steps + 1):
            self.stop_vote.cast()
            with self.profiler.step(step):  # trainer.profile_steps
                self.train_step(step)
            if validates_after(self.cfg, step):  # the rule the weight schedule follows too
                self.validate(step)
            stop = self.stop_vote.outcome()
            self.stop_budget.lap("step")
            if stop or (trainer.save_freq > 0 and (step % trainer.save_freq == 0 or step == trainer.total_steps)):
                self.save_checkpoint(step)
                self.stop_budget.lap("checkpoint")
            if stop and step < trainer.total_steps:
                last = step
                break
        completed = last == trainer.total_steps
        if self.rank == 0:
            self.receive_pool_metrics(upto=last)
        self.finish(completed)
        return completed

    def train_step(self, step: int) -> None:
        """This rank's programs, phase by phase; the pool's first rank reports their metrics."""
        step_start = time.time()
        reported: dict[str, dict] = {}
        for group, phase in STEP_PHASES:
            if group in self.programs:
                reported.setdefault(group, {}).update(getattr(self.programs[group], phase)(step) or {})
        metrics = merge_reports(reported, REPORT_ORDER.index)
        timings = self.timer.pop_timings()
        if self.rank == 0:
            # The other pools sent step k-1's metrics before step k's advantages: taking them now never waits.
            self.receive_pool_metrics(upto=step - 1)
            timings["timing_s/step"] = time.time() - step_start
            self.record(step, self.my_pool, {**metrics, **timings, **self.throughput(timings)})
        elif self.rank == self.placement.pools[self.my_pool][0]:
            self.channel.send_pool_metrics(step, self.my_pool, {**metrics, **timings})

    def validate(self, step: int) -> None:
        """Responses to the validation set from the rollout group's engines (a rollout pool's, with
        the newest weights, or the actor pool's), scored by the reward group; rank 0 logs verl's
        val-core/<data_source>/reward/mean@n."""
        generator = self.running("rollout")
        if generator:
            generator.validate(step, self.val_rows)
        scorer = self.running("reward")
        if scorer:
            rows = usable_val_rows(self.val_rows, self.placement)
            num_rows = len(rows) * self.cfg.rollout.val_kwargs.n
            metrics = scorer.score_validation(step, num_rows, sorted({r["data_source"] for r in rows}))
            if self.rank == self.placement.ranks("reward")[0]:
                self.channel.send_val_metrics(step, metrics)
        if self.rank == 0:
            self.receive_pool_metrics(upto=step)  # sent before the validation metrics
            self.logger.log_scalars(step, self.channel.recv_val_metrics(step))

    # ------------------------------------------------------------------ rank 0's bookkeeping

    def throughput(self, timings: dict) -> dict[str, float]:
        step_time = timings["timing_s/step"]
        rollout = self.programs["actor"].rollout_batch  # rank 0's shard x shards
        tokens = rollout["attention_mask"].sum().item() * len(self.placement.ranks("actor"))
        return {"perf/time_per_step": step_time, "perf/throughput": tokens / step_time / self.placement.world_size}

    def receive_pool_metrics(self, upto: int) -> None:
        """Rank 0 logs step k once the other pools' metrics of step k arrived, which in split
        placement is during step k+1: waiting for them at the end of step k would stop the actor
        pool from starting the next rollout while the critic still updates (or the rollout pool
        still generates ahead)."""
        for pool in self.metrics_received:
            while self.metrics_received[pool] < upto:
                step = self.metrics_received[pool] + 1
                self.record(step, pool, self.channel.recv_pool_metrics(step, pool))
                self.metrics_received[pool] = step

    def record(self, step: int, pool: str, metrics: dict) -> None:
        parts = self.unlogged.setdefault(step, {})
        parts[pool] = metrics
        if len(parts) == len(self.placement.pools):
            self.logger.log(step, merge_reports(parts, lambda pool: min(
                REPORT_ORDER.index(g) for g in self.placement.groups_on(pool))))
            del self.unlogged[step]

    def finish(self, completed: bool) -> None:
        cfg = self.cfg
        self.profiler.stop()  # a job stopped inside trainer.profile_steps: what it profiled
        self.timer.record_peak_memory()
        self.channel.close()
        if "actor" in self.programs and cfg.trainer.output_dir and completed:  # a stopped run's weights are in its checkpoint
            self.programs["actor"].engine.save_hf(cfg.trainer.output_dir, self.tokenizer,
                                                  is_writer=self.rank == self.placement.ranks("actor")[0])
        if cfg.trainer.timeline:
            # After the last step, outside any pool's work: one gather of every rank's events.
            events = [None] * self.placement.world_size if self.rank == 0 else None
            dist.gather_object(self.timer.events, events, dst=0, group=self.channel.control_group)
            if self.rank == 0:
                roles = [self.placement.pool_label(r) for r in range(self.placement.world_size)]
                write_timeline(cfg.trainer.timeline, events, roles)
        if self.logger:
            self.logger.close()
        # Every rank is done with every message before any leaves: from here on a rank that is
        # gone has finished, not failed (spmdsplit/failure.py).
        dist.barrier(group=self.channel.control_group)

    # ------------------------------------------------------------------ checkpoints

    def rank_state(self, group: str, step: int) -> dict:
        state = {"step": step, "rng": checkpoint.rng_state(self.device), **self.programs[group].state(step)}
        if self.sampler:  # dynamic sampling's data position (and where the steps generated ahead began)
            state["dynamic_sampling"] = self.sampler.state_dict()
        return state

    def save_checkpoint(self, step: int) -> None:
        """Each role group's program writes its part inside its pool's group; world rank 0 publishes
        the whole once every other pool's first rank says its parts are on disk (see
        spmdsplit/checkpoint.py)."""
        cfg, placement = self.cfg, self.placement
        root = cfg.trainer.default_local_dir
        partial = checkpoint.partial_dir(root, step)
        for group, program in self.programs.items():
            leader = placement.ranks(group)[0]
            folder = os.path.join(partial, group)
            with self.timer.phase(f"save_checkpoint/{group}", step):
                if self.rank == leader:  # a crash may have left a half of this step behind
                    shutil.rmtree(folder, ignore_errors=True)
                    os.makedirs(folder)
                # The pool's gloo meeting group, not its NCCL one: a wait for files on the host,
                # under the long timeout (one rank's write of a large part may outlast
                # trainer.dist_timeout_s), and no device picked for a barrier (the first GPU run
                # warned of it here).
                self.pools.meet(group)
                checkpoint.save_rank_state(os.path.join(folder, f"rank_{self.rank}.pt"), self.rank_state(group, step))
                if program.engine is not None:  # its waits on the meeting group too: the long timeout
                    program.engine.save_checkpoint(os.path.join(folder, "engine"), self.pools.meet_group(group))
                self.pools.meet(group)  # every rank's files are written
        if self.my_pool in self.other_pools and self.rank == placement.pools[self.my_pool][0]:
            self.channel.send_checkpoint_written(step)
        if self.rank == 0:
            self.receive_pool_metrics(upto=step)  # a resumed run logs from step + 1 on
            for pool in self.other_pools:
                self.channel.recv_checkpoint_written(step, pool)
            meta = {"step": step, "world_size": placement.world_size,
                    "ranks": {group: list(placement.ranks(group)) for group in ROLE_GROUPS}, "time": time.time(),
                    "config": OmegaConf.to_container(cfg, resolve=True), "tracking_runs": self.logger.run_ids()}
            path = checkpoint.publish(root, step, meta, cfg.trainer.max_ckpt_to_keep)
            print(f"spmdsplit: checkpoint of step {step} written to {path}", flush=True)
        if self.other_pools and self.my_pool not in self.other_pools:
            # Rank 0 waited for the other pools' parts (a large critic's save may take minutes);
            # its pool's next collectives need it, so the pool waits for it here instead.
            self.pools.meet("actor")

    def load_checkpoint(self, path: str) -> None:
        meta = checkpoint.read_meta(path)
        step = meta["step"]
        saved = checkpoint.saved_ranks(meta)
        same_layout = saved == {group: list(self.placement.ranks(group)) for group in ROLE_GROUPS}
        for group, program in self.programs.items():
            folder = os.path.join(path, group)
            if program.engine is None and not os.path.isdir(folder):
                continue  # written without this group's pool apart: nothing generated ahead, nothing kept
            if program.engine is not None:
                # DCP reshards if the pool size changed; its waits run on the meeting group, as on save
                program.engine.load_checkpoint(os.path.join(folder, "engine"), self.pools.meet_group(group))
            mine = os.path.join(folder, f"rank_{self.rank}.pt")
            state = checkpoint.load_rank_state(mine if same_layout else os.path.join(folder, f"rank_{saved[group][0]}.pt"))
            if same_layout:
                checkpoint.set_rng_state(state["rng"], self.device)
            else:
                self.seed_sampling(after_step=step)
            if self.sampler and "dynamic_sampling" in state:
                # Batches generated ahead and kept (the same layout) are past the position; else
                # they are generated again from where the first of them began.
                self.sampler.load_state_dict(state["dynamic_sampling"], keep_ahead=same_layout)
            program.load_state(state, same_layout)
        if self.sampler and meta["config"]["algorithm"].get("filter_groups", {}).get("enable") is not True:
            # Dynamic sampling turned on at a resume: the stopped run took train_batch_size prompts a step.
            self.sampler.next_gen_batch = step * self.batch_size // self.dataset.batch_size + 1
        if self.rank == 0:
            note = "" if same_layout else (" (the pools have other sizes now: weights and optimizer are resharded, "
                                           "sampling is reseeded, so the run will not repeat the stopped one exactly)")
            print(f"spmdsplit: resuming from {path} at step {step + 1}{note}", flush=True)
        self.start_step = step + 1
        self.metrics_received = dict.fromkeys(self.metrics_received, step)
        self.tracking_runs = meta.get("tracking_runs", {})
