"""The PPO loop: wires the role groups' programs (spmdsplit/rollout_pool.py for a rollout pool of
its own, spmdsplit/actor_pool.py, spmdsplit/critic_pool.py), logs, validates and checkpoints.

    actor pool : gen ──rollout──► old_log_prob, ref ──(log-probs)──►   ◄──advantages── update_actor ──► gen(k+1)
    critic pool:     ──rollout──► values, reward ───(log-probs)──► adv ──advantages──► update_critic ───────────►

Each rank runs the programs of the role groups on its pool, in order: a rollout pool's step, the
actor's roll-out, the critic's step, the actor's update (colocate runs all but the first; a rollout
pool of its own runs only the first, ahead of the others by rollout.staleness). The pools
meet only at the point-to-point messages listed in spmdsplit/messages.py, so old/ref log-probs
run beside values/rewards, update_actor beside update_critic, and the critic update may run on
while the actor pool starts the next rollout. Sends are non-blocking: a pool never waits for its
data to be picked up. `placement.overlap=false` adds pool hand-offs that make the phases run one
after another (verl's blocking calls), to measure what overlapping gains.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from spmdsplit import checkpoint
from spmdsplit.actor_pool import ActorPool, generating_ranks, usable_val_rows
from spmdsplit.batch import Batch
from spmdsplit.critic_pool import CriticPool, Generator
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.groups import ProcessGroups, critic_pool_generates
from spmdsplit.messages import PoolChannel
from spmdsplit.metrics import MetricsLogger, PhaseTimer, write_timeline
from spmdsplit.models import eos_token_ids, load_tokenizer
from spmdsplit.preempt import StopVote
from spmdsplit.roles.build import build_actor_pool, build_critic_pool, build_rollout_engine, build_rule_reward
from spmdsplit.rollout_pool import RolloutPool
from spmdsplit.staleness import validates_after
from spmdsplit.weight_sync import WeightBroadcast


class Trainer:
    def __init__(self, cfg, groups: ProcessGroups, rows: dict[str, list[dict]], resume_from: str | None = None):
        """`groups`: every process group of the job (spmdsplit/groups.py); `rows`: the prompt rows
        of each split ("train", and "val" when validating); `resume_from`: a complete checkpoint
        folder to continue from (checkpoint.find_resume)."""
        self.cfg, self.pools = cfg, groups.pools
        pools = groups.pools
        self.device, self.rank, self.placement = pools.device, pools.rank, pools.placement
        self.actor_ranks = list(self.placement.actor_ranks)
        self.critic_ranks = list(self.placement.critic_ranks)
        assert self.actor_ranks[0] == 0, "world rank 0 logs and must be in the actor pool"
        self.batch_size = cfg.data.train_batch_size  # prompts per step
        self.val_rows = rows.get("val", [])
        self.timer = PhaseTimer(self.rank, self.device)
        self.channel = PoolChannel(self.placement, self.device, self.batch_size * cfg.rollout.n,
                                   cfg.rollout.stream_chunks, groups.bulk, groups.control, pools.meet)
        val_responses = (len(usable_val_rows(self.val_rows, self.placement)) * cfg.rollout.val_kwargs.n
                         if self.val_rows else 0)
        self.channel.connect(generated=critic_pool_generates(cfg, self.placement) or self.placement.rollout_apart,
                             num_val_rows=val_responses,
                             balance_group=pools.actor_group if cfg.trainer.balance_batch else None)
        self.stop_vote = StopVote(groups.stop)
        # The hand-off barrier spans the actor and critic pools on purpose: it is the thing measured.
        handoff = (lambda: dist.barrier(group=groups.handoff)) if groups.handoff else (lambda: None)

        # Engines outside the actor pool (a rollout pool of its own, or rollout.ranks=all's on the
        # critic pool) get the policy's weights by a bucketed broadcast.
        weights = None
        if groups.weight_sources:
            weights = WeightBroadcast(groups.weight_sources, groups.weights, self.device, cfg.rollout.weight_bucket_mb)

        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # "" resolved by train.py
        eos_ids = eos_token_ids(cfg.model.path, self.tokenizer)
        # Prompts are taken a generation batch at a time: the step's, or dynamic sampling's.
        self.dataset = PromptDataset(rows["train"], cfg.data.gen_batch_size or self.batch_size, cfg.data.shuffle,
                                     cfg.data.seed)
        self.sampler = self.build_sampler(groups, eos_ids)  # algorithm.filter_groups, on generating ranks
        self.actor_pool = self.critic_pool = self.rollout_pool = None
        if pools.in_rollout_pool:
            self.rollout_pool = RolloutPool(cfg, pools, build_rollout_engine(cfg, pools, self.tokenizer, eos_ids),
                                            weights, self.channel, self.timer, self.dataset, self.tokenizer,
                                            self.sampler)
        if pools.is_actor:
            self.actor_pool = ActorPool(cfg, pools, build_actor_pool(cfg, pools, self.tokenizer, eos_ids),
                                        self.channel, self.timer, self.dataset, self.tokenizer, handoff, weights,
                                        None if self.placement.rollout_apart else self.sampler)
        if pools.is_critic:
            generator = None
            if critic_pool_generates(cfg, self.placement):
                generator = Generator(cfg, pools, build_rollout_engine(cfg, pools, self.tokenizer, eos_ids), weights,
                                      self.channel, self.timer, self.dataset, self.tokenizer, self.sampler)
            self.critic_pool = CriticPool(cfg, pools, build_critic_pool(cfg, pools, self.tokenizer, eos_ids),
                                          self.channel, self.timer, handoff, generator)
        self.seed_sampling()
        self.start_step = 1
        # Rank 0: step -> {"actor": ..., "critic": ...[, "rollout": ...]} until every pool's part is in.
        self.unlogged: dict[int, dict] = {}
        self.sides = ("actor", "critic", "rollout") if self.placement.rollout_apart else ("actor", "critic")
        self.metrics_received = dict.fromkeys(self.sides[1:], 0)  # the other pools' parts, taken up to this step
        self.ahead: dict = {}  # a rollout pool's rank: the batches a resumed checkpoint kept
        self.tracking_runs: dict[str, str] = {}  # wandb / MLflow runs a resumed job goes on in
        if resume_from:
            self.load_checkpoint(resume_from)
        # wandb records the resolved config with the run, as verl's tracking does.
        self.logger = MetricsLogger(cfg.trainer, OmegaConf.to_container(cfg, resolve=True), first_step=self.start_step,
                                    run_ids=self.tracking_runs) if self.rank == 0 else None

    def build_sampler(self, groups: ProcessGroups, eos_ids: list[int]) -> DynamicSampling | None:
        """DAPO's dynamic sampling on the ranks that generate, over their group: a rollout pool's,
        the actor pool's, or with rollout.ranks=all the one over both pools (groups.py)."""
        pools, placement = self.pools, self.placement
        generating = generating_ranks(self.cfg, pools)
        if not self.cfg.algorithm.filter_groups.enable or self.rank not in generating:
            return None
        if placement.rollout_apart:
            group, count_group = pools.rollout_group, pools.rollout_group
        elif groups.generating is not None:
            group, count_group = groups.generating, groups.generating
        else:  # the counts over the pool's meeting group: its ranks' generation ends at different times
            group, count_group = pools.actor_group, pools.actor_meet
        return DynamicSampling(self.cfg, build_rule_reward(self.cfg, self.tokenizer, eos_ids), generating, group,
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
        if self.placement.rollout_apart:  # the rollout pool's engines start with the actor's weights
            if self.actor_pool:
                self.actor_pool.push_weights()
            if self.rollout_pool:
                self.rollout_pool.start(self.start_step, self.ahead)
        if validates_after(self.cfg, 0) and self.start_step == 1:
            self.validate(0)
        for step in range(self.start_step, trainer.total_steps + 1):
            self.stop_vote.cast()
            self.train_step(step)
            if validates_after(self.cfg, step):  # the rule the weight schedule follows too
                self.validate(step)
            stop = self.stop_vote.outcome()
            if stop or (trainer.save_freq > 0 and (step % trainer.save_freq == 0 or step == trainer.total_steps)):
                self.save_checkpoint(step)
            if stop and step < trainer.total_steps:
                last = step
                break
        completed = last == trainer.total_steps
        if self.rank == 0:
            self.receive_pool_metrics(upto=last)
        self.finish(completed)
        return completed

    def train_step(self, step: int) -> None:
        step_start = time.time()
        if self.rollout_pool:
            self.rollout_pool.step(step)
            generated = self.rollout_pool.pop_metrics(step)  # every rank's, to keep none
            if self.rank == self.placement.rollout_ranks[0]:
                self.channel.send_rollout_metrics(step, {**self.timer.pop_timings(), **generated})
        if self.actor_pool:
            rollout = self.actor_pool.roll_out(step)
        if self.critic_pool:
            critic_metrics = self.critic_pool.step(step)
            if self.rank == self.critic_ranks[0]:
                if not self.pools.is_actor:  # colocated, rank 0 reports every phase itself
                    critic_metrics.update(self.timer.pop_timings())
                self.channel.send_critic_metrics(step, critic_metrics)
        if self.actor_pool:
            actor_metrics = self.actor_pool.update(step, rollout)
            if self.rank == 0:
                # The critic pool sent step k-1's metrics before step k's advantages (step k's
                # own when rank 0 is its first rank too): taking them now never waits.
                self.receive_pool_metrics(upto=step - 1)
                if self.critic_ranks[0] == 0:
                    self.receive_pool_metrics(upto=step, sides=("critic",))
                timings = {**self.timer.pop_timings(), "timing_s/step": time.time() - step_start}
                self.record(step, "actor", {**actor_metrics, **timings, **self.throughput(rollout, timings)})

    def validate(self, step: int) -> None:
        """Responses to the validation set from the rollout group's engines (a rollout pool's, with
        the newest weights, or the actor pool's), scored by the critic group's reward; rank 0 logs
        verl's val-core/<data_source>/reward/mean@n."""
        if self.rollout_pool:
            self.rollout_pool.validate(step, self.val_rows)
        elif self.actor_pool and not self.placement.rollout_apart:
            self.actor_pool.generate_validation(step, self.val_rows)
        if self.critic_pool:
            rows = usable_val_rows(self.val_rows, self.placement)
            num_rows = len(rows) * self.cfg.rollout.val_kwargs.n
            metrics = self.critic_pool.score_validation(step, num_rows, sorted({r["data_source"] for r in rows}))
            if self.rank == self.critic_ranks[0]:
                self.channel.send_val_metrics(step, metrics)
        if self.rank == 0:
            self.receive_pool_metrics(upto=step, sides=("critic",))  # sent before the validation metrics
            self.logger.log_scalars(step, self.channel.recv_val_metrics(step))

    # ------------------------------------------------------------------ rank 0's bookkeeping

    def throughput(self, rollout: Batch, timings: dict) -> dict[str, float]:
        step_time = timings["timing_s/step"]
        tokens = rollout["attention_mask"].sum().item() * len(self.actor_ranks)  # rank 0's shard x shards
        return {"perf/time_per_step": step_time, "perf/throughput": tokens / step_time / self.placement.world_size}

    def receive_pool_metrics(self, upto: int, sides: tuple[str, ...] | None = None) -> None:
        """Rank 0 logs step k once the other pools' metrics of step k arrived, which in split
        placement is during step k+1: waiting for them at the end of step k would stop the actor
        pool from starting the next rollout while the critic still updates (or the rollout pool
        still generates ahead)."""
        for side in sides or self.sides[1:]:
            while self.metrics_received[side] < upto:
                step = self.metrics_received[side] + 1
                recv = self.channel.recv_critic_metrics if side == "critic" else self.channel.recv_rollout_metrics
                self.record(step, side, recv(step))
                self.metrics_received[side] = step

    def record(self, step: int, side: str, metrics: dict) -> None:
        parts = self.unlogged.setdefault(step, {})
        parts[side] = metrics
        if len(parts) == len(self.sides):
            self.logger.log(step, {k: v for side in reversed(self.sides) for k, v in parts[side].items()})
            del self.unlogged[step]

    def finish(self, completed: bool) -> None:
        cfg = self.cfg
        self.timer.record_peak_memory()
        self.channel.close()
        if self.rollout_pool:
            self.rollout_pool.finish()
        if self.actor_pool and cfg.trainer.output_dir and completed:  # a stopped run's weights are in its checkpoint
            self.actor_pool.actor.engine.save_hf(cfg.trainer.output_dir, self.tokenizer,
                                                 is_writer=self.rank == self.actor_ranks[0])
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

    def my_pools(self) -> list[str]:
        P = self.pools
        return [pool for pool, member in (("actor", P.is_actor), ("critic", P.is_critic),
                                          ("rollout", P.in_rollout_pool)) if member]

    def pool_group(self, pool: str):
        return self.pools.rollout_group if pool == "rollout" else self.pools.group(pool)

    def trained_engine(self, pool: str):
        if pool == "rollout":
            return None
        if pool == "actor":
            return self.actor_pool.actor.engine
        critic = self.critic_pool.critic
        return critic.engine if critic is not None else None

    def rank_state(self, pool: str, step: int) -> dict:
        state = {"step": step, "rng": checkpoint.rng_state(self.device)}
        if pool == "actor":
            # The data order is a function of (seed, generation batch), so the step is the data
            # position (dynamic sampling keeps its own below); the rest is there to notice a
            # different dataset on resume.
            taken = self.sampler.next_gen_batch - 1 if self.sampler else step
            state["data"] = {"prompts_consumed": taken * self.dataset.batch_size, "dataset_rows": len(self.dataset.rows),
                             "seed": self.cfg.data.seed, "shuffle": self.cfg.data.shuffle}
        elif pool == "critic":
            state["kl_ctrl"] = self.critic_pool.kl_ctrl.state_dict()
        else:  # the batches generated ahead (rollout.staleness), each rank its own rows of them
            state["ahead"] = {batch: rows.to("cpu") for batch, rows in self.rollout_pool.ahead.items()}
        if self.sampler:  # dynamic sampling's data position (and where the steps generated ahead began)
            state["dynamic_sampling"] = self.sampler.state_dict()
        return state

    def save_checkpoint(self, step: int) -> None:
        """Each pool writes its part inside its own group; world rank 0 publishes the whole once
        the critic pool's first rank (and a rollout pool's) says its part is on disk (see
        spmdsplit/checkpoint.py)."""
        cfg, C = self.cfg, self.critic_ranks
        R = list(self.placement.rollout_ranks) if self.placement.rollout_apart else []
        root = cfg.trainer.default_local_dir
        partial = checkpoint.partial_dir(root, step)
        for pool in self.my_pools():
            group, leader = self.pool_group(pool), self.placement.ranks_of(pool)[0]
            folder = os.path.join(partial, pool)
            with self.timer.phase(f"save_checkpoint/{pool}", step):
                if self.rank == leader:  # a crash may have left a half of this step behind
                    shutil.rmtree(folder, ignore_errors=True)
                    os.makedirs(folder)
                dist.barrier(group=group)
                checkpoint.save_rank_state(os.path.join(folder, f"rank_{self.rank}.pt"), self.rank_state(pool, step))
                engine = self.trained_engine(pool)
                if engine is not None:
                    engine.save_checkpoint(os.path.join(folder, "engine"))
                dist.barrier(group=group)  # every rank's files are written
        if (self.rank == C[0] and C[0] != 0) or (R and self.rank == R[0]):
            self.channel.send_checkpoint_written(step)
        waits_for = ([C[0]] if C[0] != 0 else []) + R[:1]
        if self.rank == 0:
            self.receive_pool_metrics(upto=step)  # a resumed run logs from step + 1 on
            for leader in waits_for:
                self.channel.recv_checkpoint_written(step, leader)
            meta = {"step": step, "world_size": self.placement.world_size, "actor_ranks": self.actor_ranks,
                    "critic_ranks": self.critic_ranks, "rollout_ranks": list(self.placement.rollout_ranks),
                    "time": time.time(),
                    "config": OmegaConf.to_container(cfg, resolve=True), "tracking_runs": self.logger.run_ids()}
            path = checkpoint.publish(root, step, meta, cfg.trainer.max_ckpt_to_keep)
            print(f"spmdsplit: checkpoint of step {step} written to {path}", flush=True)
        if waits_for and self.pools.is_actor:
            # Rank 0 waited for the other pools' parts (a large critic's save may take minutes);
            # the actor pool's next collectives need it, so the pool waits for it here instead.
            self.pools.meet("actor")

    def load_checkpoint(self, path: str) -> None:
        meta = checkpoint.read_meta(path)
        step = meta["step"]
        same_layout = (meta["actor_ranks"] == self.actor_ranks and meta["critic_ranks"] == self.critic_ranks
                       and meta.get("rollout_ranks", meta["actor_ranks"]) == list(self.placement.rollout_ranks))
        for pool in self.my_pools():
            folder = os.path.join(path, pool)
            engine = self.trained_engine(pool)
            if engine is not None:
                engine.load_checkpoint(os.path.join(folder, "engine"))  # DCP reshards if the pool size changed
            mine = os.path.join(folder, f"rank_{self.rank}.pt")
            if pool == "rollout" and not os.path.isdir(folder):
                continue  # written without a rollout pool of its own: nothing generated ahead
            state = checkpoint.load_rank_state(mine if same_layout else os.path.join(folder, f"rank_{meta[f'{pool}_ranks'][0]}.pt"))
            if same_layout:
                checkpoint.set_rng_state(state["rng"], self.device)
            else:
                self.seed_sampling(after_step=step)
            if self.sampler and "dynamic_sampling" in state:
                # Batches generated ahead and kept (the same layout) are past the position; else
                # they are generated again from where the first of them began.
                self.sampler.load_state_dict(state["dynamic_sampling"], keep_ahead=same_layout)
            if pool == "critic":
                self.critic_pool.kl_ctrl.load_state_dict(state["kl_ctrl"])
            elif pool == "rollout":
                # Another rollout pool size cuts the batches into other shares: they are generated
                # again, with the checkpoint's weights (within the staleness bound, not the same rows).
                self.ahead = {b: rows.to(self.device) for b, rows in state["ahead"].items()} if same_layout else {}
            elif state["data"]["dataset_rows"] != len(self.dataset.rows) and self.rank == 0:
                print(f"spmdsplit: warning: the checkpoint was trained on {state['data']['dataset_rows']} prompts, "
                      f"the data now has {len(self.dataset.rows)}: the data order differs from the stopped run", flush=True)
        if self.sampler and meta["config"]["algorithm"].get("filter_groups", {}).get("enable") is not True:
            # Dynamic sampling turned on at a resume: the stopped run took train_batch_size prompts a step.
            self.sampler.next_gen_batch = step * self.batch_size // self.dataset.batch_size + 1
        if self.rank == 0:
            note = "" if same_layout else (" (the pools have other sizes now: weights and optimizer are resharded, "
                                           "sampling is reseeded, so the run will not repeat the stopped one exactly)")
            print(f"spmdsplit: resuming from {path} at step {step + 1}{note}", flush=True)
        self.start_step = step + 1
        self.metrics_received = dict.fromkeys(self.sides[1:], step)
        self.tracking_runs = meta.get("tracking_runs", {})
