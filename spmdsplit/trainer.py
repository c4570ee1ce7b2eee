"""The PPO loop: wires the actor pool's program (spmdsplit/actor_pool.py) and the critic pool's
(spmdsplit/critic_pool.py), logs, validates and checkpoints.

    actor pool : gen ──rollout──► old_log_prob, ref ──(log-probs)──►   ◄──advantages── update_actor ──► gen(k+1)
    critic pool:     ──rollout──► values, reward ───(log-probs)──► adv ──advantages──► update_critic ───────────►

Each rank runs only its pool's program; in colocate placement every rank runs both, one after
another (the actor pool's roll-out, the critic pool's step, the actor pool's update). The pools
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
from spmdsplit.actor_pool import ActorPool, usable_val_rows
from spmdsplit.batch import Batch
from spmdsplit.critic_pool import CriticPool, Generator
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.groups import ProcessGroups, critic_pool_generates
from spmdsplit.messages import PoolChannel
from spmdsplit.metrics import MetricsLogger, PhaseTimer, write_timeline
from spmdsplit.models import eos_token_ids, load_tokenizer
from spmdsplit.preempt import StopVote
from spmdsplit.roles.build import build_actor_pool, build_critic_pool, build_rollout_engine
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
                                   cfg.rollout.stream_chunks, groups.bulk, groups.control)
        val_responses = (len(usable_val_rows(self.val_rows, self.placement)) * cfg.rollout.val_kwargs.n
                         if self.val_rows else 0)
        self.channel.connect(generated=critic_pool_generates(cfg, self.placement), num_val_rows=val_responses,
                             balanced=cfg.trainer.balance_batch)
        self.stop_vote = StopVote(groups.stop)
        # The hand-off barrier is over the world on purpose: it is the thing being measured.
        handoff = (lambda: dist.barrier(group=groups.handoff)) if groups.handoff else (lambda: None)

        # rollout.ranks=all: the critic pool generates too, its engines fed by a broadcast.
        weights = None
        if critic_pool_generates(cfg, self.placement):
            weights = WeightBroadcast(self.actor_ranks[0], groups.weights, self.device, cfg.rollout.weight_bucket_mb)

        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # "" resolved by train.py
        eos_ids = eos_token_ids(cfg.model.path, self.tokenizer)
        self.dataset = PromptDataset(rows["train"], self.batch_size, cfg.data.shuffle, cfg.data.seed)
        self.actor_pool = self.critic_pool = None
        if pools.is_actor:
            self.actor_pool = ActorPool(cfg, pools, build_actor_pool(cfg, pools, self.tokenizer, eos_ids),
                                        self.channel, self.timer, self.dataset, self.tokenizer, handoff, weights)
        if pools.is_critic:
            generator = None
            if weights is not None:
                generator = Generator(cfg, pools, build_rollout_engine(cfg, pools, self.tokenizer, eos_ids), weights,
                                      self.channel, self.timer, self.dataset, self.tokenizer)
            self.critic_pool = CriticPool(cfg, pools, build_critic_pool(cfg, pools, self.tokenizer, eos_ids),
                                          self.channel, self.timer, handoff, generator)
        self.seed_sampling()
        self.start_step = 1
        self.unlogged: dict[int, dict] = {}  # rank 0: step -> {"actor": ..., "critic": ...} until both are in
        self.critic_metrics_received = 0
        self.tracking_runs: dict[str, str] = {}  # wandb / MLflow runs a resumed job goes on in
        if resume_from:
            self.load_checkpoint(resume_from)
        # wandb records the resolved config with the run, as verl's tracking does.
        self.logger = MetricsLogger(cfg.trainer, OmegaConf.to_container(cfg, resolve=True), first_step=self.start_step,
                                    run_ids=self.tracking_runs) if self.rank == 0 else None

    def seed_sampling(self, after_step: int = 0) -> None:
        """Sampling must differ between ranks (else every shard draws the same responses); a
        resume that cannot restore the RNG state (other pool sizes) seeds from the step too."""
        torch.manual_seed(self.cfg.trainer.seed * 1000 + 7 + self.rank + 7919 * after_step)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> bool:
        """Runs the remaining steps; False when it stopped early on request (after checkpointing)."""
        trainer = self.cfg.trainer
        last = trainer.total_steps
        if trainer.val_before_train and self.start_step == 1:
            self.validate(0)
        for step in range(self.start_step, trainer.total_steps + 1):
            self.stop_vote.cast()
            self.train_step(step)
            if trainer.val_freq > 0 and (step % trainer.val_freq == 0 or step == trainer.total_steps):
                self.validate(step)
            stop = self.stop_vote.outcome()
            if stop or (trainer.save_freq > 0 and (step % trainer.save_freq == 0 or step == trainer.total_steps)):
                self.save_checkpoint(step)
            if stop and step < trainer.total_steps:
                last = step
                break
        completed = last == trainer.total_steps
        if self.rank == 0:
            self.receive_critic_metrics(upto=last)
        self.finish(completed)
        return completed

    def train_step(self, step: int) -> None:
        step_start = time.time()
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
                self.receive_critic_metrics(upto=step if self.critic_ranks[0] == 0 else step - 1)
                timings = {**self.timer.pop_timings(), "timing_s/step": time.time() - step_start}
                self.record(step, "actor", {**actor_metrics, **timings, **self.throughput(rollout, timings)})

    def validate(self, step: int) -> None:
        """Responses to the validation set from the actor pool, scored by the critic pool's reward;
        rank 0 logs verl's val-core/<data_source>/reward/mean@n."""
        if self.actor_pool:
            num_rows = self.actor_pool.generate_validation(step, self.val_rows)
        if self.critic_pool:
            rows = usable_val_rows(self.val_rows, self.placement)
            num_rows = len(rows) * self.cfg.rollout.val_kwargs.n
            metrics = self.critic_pool.score_validation(step, num_rows, sorted({r["data_source"] for r in rows}))
            if self.rank == self.critic_ranks[0]:
                self.channel.send_val_metrics(step, metrics)
        if self.rank == 0:
            self.receive_critic_metrics(upto=step)  # sent before the validation metrics
            self.logger.log_scalars(step, self.channel.recv_val_metrics(step))

    # ------------------------------------------------------------------ rank 0's bookkeeping

    def throughput(self, rollout: Batch, timings: dict) -> dict[str, float]:
        step_time = timings["timing_s/step"]
        tokens = rollout["attention_mask"].sum().item() * len(self.actor_ranks)  # rank 0's shard x shards
        return {"perf/time_per_step": step_time, "perf/throughput": tokens / step_time / self.placement.world_size}

    def receive_critic_metrics(self, upto: int) -> None:
        """Rank 0 logs step k once the critic pool's metrics of step k arrived, which in split
        placement is during step k+1: waiting for them at the end of step k would stop the actor
        pool from starting the next rollout while the critic still updates."""
        while self.critic_metrics_received < upto:
            step = self.critic_metrics_received + 1
            self.record(step, "critic", self.channel.recv_critic_metrics(step))
            self.critic_metrics_received = step

    def record(self, step: int, side: str, metrics: dict) -> None:
        parts = self.unlogged.setdefault(step, {})
        parts[side] = metrics
        if len(parts) == 2:
            self.logger.log(step, {**parts["critic"], **parts["actor"]})
            del self.unlogged[step]

    def finish(self, completed: bool) -> None:
        cfg = self.cfg
        self.timer.record_peak_memory()
        self.channel.close()
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
        return [pool for pool, member in (("actor", self.pools.is_actor), ("critic", self.pools.is_critic)) if member]

    def trained_engine(self, pool: str):
        if pool == "actor":
            return self.actor_pool.actor.engine
        critic = self.critic_pool.critic
        return critic.engine if critic is not None else None

    def rank_state(self, pool: str, step: int) -> dict:
        state = {"step": step, "rng": checkpoint.rng_state(self.device)}
        if pool == "actor":
            # The data order is a function of (seed, step), so the step is the data position;
            # the rest is there to notice a different dataset on resume.
            state["data"] = {"prompts_consumed": step * self.batch_size, "dataset_rows": len(self.dataset.rows),
                             "seed": self.cfg.data.seed, "shuffle": self.cfg.data.shuffle}
        else:
            state["kl_ctrl"] = self.critic_pool.kl_ctrl.state_dict()
        return state

    def save_checkpoint(self, step: int) -> None:
        """Each pool writes its half inside its own group; world rank 0 publishes the whole once
        the critic pool's first rank says its half is on disk (see spmdsplit/checkpoint.py)."""
        cfg, P, C = self.cfg, self.pools, self.critic_ranks
        root = cfg.trainer.default_local_dir
        partial = checkpoint.partial_dir(root, step)
        for pool in self.my_pools():
            group, leader = P.group(pool), self.placement.ranks_of(pool)[0]
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
        if self.rank == C[0] and C[0] != 0:
            self.channel.send_checkpoint_written(step)
        if self.rank == 0:
            self.receive_critic_metrics(upto=step)  # a resumed run logs from step + 1 on
            if C[0] != 0:
                self.channel.recv_checkpoint_written(step)
            meta = {"step": step, "world_size": self.placement.world_size, "actor_ranks": self.actor_ranks,
                    "critic_ranks": self.critic_ranks, "time": time.time(),
                    "config": OmegaConf.to_container(cfg, resolve=True), "tracking_runs": self.logger.run_ids()}
            path = checkpoint.publish(root, step, meta, cfg.trainer.max_ckpt_to_keep)
            print(f"spmdsplit: checkpoint of step {step} written to {path}", flush=True)

    def load_checkpoint(self, path: str) -> None:
        meta = checkpoint.read_meta(path)
        step = meta["step"]
        same_layout = meta["actor_ranks"] == self.actor_ranks and meta["critic_ranks"] == self.critic_ranks
        for pool in self.my_pools():
            folder = os.path.join(path, pool)
            engine = self.trained_engine(pool)
            if engine is not None:
                engine.load_checkpoint(os.path.join(folder, "engine"))  # DCP reshards if the pool size changed
            mine = os.path.join(folder, f"rank_{self.rank}.pt")
            state = checkpoint.load_rank_state(mine if same_layout else os.path.join(folder, f"rank_{meta[f'{pool}_ranks'][0]}.pt"))
            if same_layout:
                checkpoint.set_rng_state(state["rng"], self.device)
            else:
                self.seed_sampling(after_step=step)
            if pool == "critic":
                self.critic_pool.kl_ctrl.load_state_dict(state["kl_ctrl"])
            elif state["data"]["dataset_rows"] != len(self.dataset.rows) and self.rank == 0:
                print(f"spmdsplit: warning: the checkpoint was trained on {state['data']['dataset_rows']} prompts, "
                      f"the data now has {len(self.dataset.rows)}: the data order differs from the stopped run", flush=True)
        if self.rank == 0:
            note = "" if same_layout else (" (the pools have other sizes now: weights and optimizer are resharded, "
                                           "sampling is reseeded, so the run will not repeat the stopped one exactly)")
            print(f"spmdsplit: resuming from {path} at step {step + 1}{note}", flush=True)
        self.start_step = step + 1
        self.critic_metrics_received = step
        self.tracking_runs = meta.get("tracking_runs", {})
