"""The PPO step loop, as each pool lives it.

    actor pool : gen ──rollout──► old_log_prob, ref ──(log-probs)──►   ◄──advantages── update_actor ──► gen(k+1)
    critic pool:     ──rollout──► values, reward ───(log-probs)──► adv ──advantages──► update_critic ───────────►

Each rank runs only its pool's branches (in colocate placement, every rank runs all of them, one
after another). The pools meet only at the point-to-point exchanges, so old/ref log-probs run
beside values/rewards, update_actor beside update_critic, and the critic update may run on while
the actor pool starts the next rollout. Sends are non-blocking: a pool never waits for its data
to be picked up. `placement.overlap=false` adds pool hand-offs that make the phases run one after
another (verl's blocking calls), to measure what overlapping gains.
"""

from __future__ import annotations

import math
import os
import shutil
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from spmdsplit import algo, checkpoint
from spmdsplit.batch import Batch
from spmdsplit.data.prompts import PromptDataset, collate_prompts
from spmdsplit.distributed import pool_reduce_metrics, pool_sum
from spmdsplit.exchange import recv_object, recv_rows, row_ranges, send_object, send_rows
from spmdsplit.metrics import MetricsLogger, PhaseTimer, compute_data_metrics, write_timeline
from spmdsplit.models import eos_token_ids, load_tokenizer
from spmdsplit.placement import Pools
from spmdsplit.preempt import StopVote
from spmdsplit.roles.build import build_actor_pool, build_critic_pool

# One tag per kind of message, so messages of different phases between the same two ranks never mix.
TAG_ROLLOUT, TAG_LOG_PROBS, TAG_ADVANTAGES, TAG_CRITIC_METRICS, TAG_VAL_ROLLOUT, TAG_VAL_METRICS = 11, 12, 13, 14, 15, 16
TAG_CHECKPOINT = 17
ROLLOUT_KEYS = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                "data_source", "ground_truth", "uid")


class Trainer:
    def __init__(self, cfg, pools: Pools, rows: dict[str, list[dict]], resume_from: str | None = None):
        """`rows`: the prompt rows of each split ("train", and "val" when validating);
        `resume_from`: a complete checkpoint folder to continue from (checkpoint.find_resume)."""
        self.cfg, self.pools = cfg, pools
        self.device = pools.device
        self.rank = pools.rank
        self.placement = pools.placement
        self.actor_ranks = list(self.placement.actor_ranks)
        self.critic_ranks = list(self.placement.critic_ranks)
        assert self.actor_ranks[0] == 0, "world rank 0 logs and must be in the actor pool"
        self.batch_size = cfg.data.train_batch_size  # prompts per step
        self.rows_per_step = self.batch_size * cfg.rollout.n  # n responses of each prompt, side by side
        self.stream_chunks = cfg.rollout.stream_chunks
        self.val_rows = rows.get("val", [])
        # Critic-free estimators (GRPO, RLOO, REINFORCE++) train no value model: the critic pool
        # then hosts only the reward.
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        self.timer = PhaseTimer(self.rank, self.device)
        # verl's blocking calls, for comparison; meaningless when the roles share ranks anyway.
        self.blocking = not cfg.placement.overlap and not self.placement.colocated
        self.handoff_group = dist.new_group(ranks=list(range(self.placement.world_size))) if self.blocking else None
        self.stop_vote = StopVote()

        self.model_path = cfg.model.path  # train.py has resolved "" to the embedded model
        self.tokenizer = load_tokenizer(self.model_path, cfg.model.trust_remote_code)
        eos_ids = eos_token_ids(self.model_path, self.tokenizer)
        if pools.is_actor:
            roles = build_actor_pool(cfg, pools, self.tokenizer, eos_ids)
            self.actor, self.ref, self.rollout = roles.actor, roles.ref, roles.rollout
            self.dataset = PromptDataset(rows["train"], self.batch_size, cfg.data.shuffle, cfg.data.seed)
        if pools.is_critic:
            roles = build_critic_pool(cfg, pools, self.tokenizer, eos_ids)
            self.reward, self.kl_ctrl = roles.reward, roles.kl_ctrl
            if roles.critic is not None:
                self.critic = roles.critic
        self.seed_sampling()
        self.start_step = 1
        self.unlogged: dict[int, dict] = {}  # rank 0: step -> {"actor": ..., "critic": ...} until both are in
        self.critic_metrics_received = 0
        self.sent_metrics = None  # the critic pool's first rank: its last metrics send in flight
        if resume_from:
            self.load_checkpoint(resume_from)
        self.logger = MetricsLogger(cfg.trainer.log_dir, cfg.trainer.total_steps, cfg.trainer.progress_bar,
                                    first_step=self.start_step) if self.rank == 0 else None

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
        cfg, P, phase = self.cfg, self.pools, self.timer.phase
        A, C, chunks = self.actor_ranks, self.critic_ranks, self.stream_chunks
        use_kl_in_reward = cfg.algorithm.use_kl_in_reward
        step_start = time.time()

        # ---- actor pool: roll out, chunk by chunk, each chunk sent on as soon as it is generated;
        #      then score the whole rollout under the policy and the reference
        if P.is_actor:
            prompts = self.prompts_for(step)
            with phase("sync_weights", step):
                self.rollout.load_weights(self.actor.engine.iter_full_weights(self.rollout.dtype))
            parts, sends = [], []
            for c, chunk_prompts in enumerate(prompts.split(len(prompts) // chunks)):
                with phase("gen", step, chunk=c):
                    parts.append(self.rollout.generate(chunk_prompts))
                sends.append(self.send_chunk(parts[-1].select(ROLLOUT_KEYS), A, C, TAG_ROLLOUT, c))
            rollout = Batch.concat(parts)
            with phase("old_log_prob", step):
                rollout["old_log_probs"] = self.actor.compute_log_prob(rollout)
            with phase("ref", step):
                rollout["ref_log_prob"] = self.ref.compute_log_prob(rollout)
            self.handoff()  # blocking mode: the critic starts values only now
            if use_kl_in_reward:
                log_probs = rollout.select(["old_log_probs", "ref_log_prob"]).split(len(parts[0]))
                sends += [self.send_chunk(part, A, C, TAG_LOG_PROBS, c) for c, part in enumerate(log_probs)]

        # ---- critic pool: values and rewards of each chunk as it arrives, meanwhile
        if P.is_critic:
            parts = []
            for c in range(chunks):
                part = self.recv_chunk(A, C, TAG_ROLLOUT, c, "exchange/rollout", step)
                if c == 0:
                    self.handoff()
                if self.use_critic:
                    with phase("values", step, chunk=c):
                        part["values"] = self.critic.compute_values(part)
                with phase("reward", step, chunk=c):
                    part["token_level_scores"], _ = self.reward.compute(part)
                if use_kl_in_reward:
                    part.update(self.recv_chunk(A, C, TAG_LOG_PROBS, c, "exchange/log_probs", step))
                parts.append(part)
            batch = Batch.concat(parts)
            with phase("adv", step):
                critic_metrics = self.compute_advantage(batch)
            advantages = batch.select(["advantages"]).split(len(parts[0]))  # back in the chunks they came in
            sent_advantages = [self.send_chunk(part, C, A, TAG_ADVANTAGES, c) for c, part in enumerate(advantages)]
            if self.use_critic:
                with phase("update_critic", step):
                    critic_metrics.update(self.critic.update_critic(batch, seed=cfg.trainer.seed * 7919 + step))
            critic_metrics.update(compute_data_metrics(batch, P.critic_group, self.device))
            self.handoff()  # blocking mode: the actor updates only after the critic did
            for sent in sent_advantages:
                sent.wait()
            if self.rank == C[0]:
                if not P.is_actor:  # colocated, rank 0 reports every phase itself
                    critic_metrics.update(self.timer.pop_timings())
                self.send_critic_metrics(step, critic_metrics)

        # ---- actor pool: the policy update, as soon as the advantages are in
        if P.is_actor:
            rollout.update(Batch.concat([self.recv_chunk(C, A, TAG_ADVANTAGES, c, "exchange/advantages", step)
                                         for c in range(chunks)]))
            if self.rank == 0:
                # What the critic pool has surely sent by now: this step's metrics if rank 0 is
                # its first rank too, else the previous step's (sent before these advantages).
                self.receive_critic_metrics(upto=step if C[0] == 0 else step - 1)
            self.handoff()
            actor_metrics = {}
            if step > cfg.trainer.critic_warmup:  # the first steps train only the critic
                with phase("update_actor", step):
                    actor_metrics = self.actor.update_policy(rollout, seed=cfg.trainer.seed * 7919 + step)
            for sent in sends:
                sent.wait()
            if self.rank == 0:
                timings = {**self.timer.pop_timings(), "timing_s/step": time.time() - step_start}
                self.record(step, "actor", {**actor_metrics, **timings, **self.throughput(rollout, timings)})

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> None:
        """Responses to the validation set (sampled as rollout.val_kwargs says, greedy by default),
        scored by the critic pool's reward; rank 0 logs verl's val-core/<data_source>/reward/mean@n.
        The set is cut to a multiple of both pool sizes, so every rank holds equal rows."""
        cfg, P, A, C = self.cfg, self.pools, self.actor_ranks, self.critic_ranks
        n = cfg.rollout.val_kwargs.n
        unit = math.lcm(len(A), len(C))
        rows = self.val_rows[: len(self.val_rows) // unit * unit]
        if not rows:
            raise ValueError(f"validation needs at least {unit} rows (one per rank of each pool), got {len(self.val_rows)}")
        num_rows = len(rows) * n
        if P.is_actor:
            with self.timer.phase("sync_weights", step):
                self.rollout.load_weights(self.actor.engine.iter_full_weights(self.rollout.dtype))
            start, end = row_ranges(len(rows), len(A))[P.rank_in("actor")]
            per_batch = max(1, self.batch_size // len(A))  # generate in training-sized batches
            parts = []
            with self.timer.phase("val_gen", step):
                for first in range(start, end, per_batch):
                    prompts = collate_prompts(rows[first:min(end, first + per_batch)], self.tokenizer,
                                              cfg.data.max_prompt_length, step, first, truncation=cfg.data.truncation)
                    parts.append(self.rollout.generate(prompts.repeat_interleave(n).to(self.device), validate=True))
            sent = send_rows(Batch.concat(parts).select(ROLLOUT_KEYS), A, C, num_rows, TAG_VAL_ROLLOUT, self.device)
        if P.is_critic:
            batch = recv_rows(A, C, num_rows, TAG_VAL_ROLLOUT, self.device)
            with self.timer.phase("val_reward", step):
                _, scores = self.reward.compute(batch)
            sources = sorted({r["data_source"] for r in rows})
            sums = {f"val-core/{ds}/reward/mean@{n}": 0.0 for ds in sources}
            counts = dict.fromkeys(sums, 0.0)
            for ds, score in zip(batch["data_source"], scores.tolist()):
                sums[f"val-core/{ds}/reward/mean@{n}"] += score
                counts[f"val-core/{ds}/reward/mean@{n}"] += 1
            metrics = pool_reduce_metrics(sums, counts, P.critic_group, self.device)
            if self.rank == C[0]:
                send_object(metrics, dst=0, tag=TAG_VAL_METRICS, device=self.device).wait()
        if P.is_actor:
            sent.wait()
        if self.rank == 0:
            self.logger.log_scalars(step, recv_object(C[0], TAG_VAL_METRICS, self.device))

    # ------------------------------------------------------------------ exchanges

    def send_chunk(self, part: Batch, src, dst, tag: int, chunk: int):
        """Chunk c of the global batch is chunk c of every source rank, laid end to end; each
        chunk moves as its own exchange, under its own tag."""
        return send_rows(part, src, dst, self.rows_per_step // self.stream_chunks, tag * 1000 + chunk, self.device)

    def recv_chunk(self, src, dst, tag: int, chunk: int, name: str, step: int) -> Batch:
        with self.timer.phase(name, step, chunk=chunk) as args:
            return recv_rows(src, dst, self.rows_per_step // self.stream_chunks, tag * 1000 + chunk, self.device, stats=args)

    # ------------------------------------------------------------------ pieces of the step

    def prompts_for(self, step: int) -> Batch:
        """This rank's share of the step's prompts, each repeated rollout.n times in a row (one
        group per prompt, sharing its uid); groups never straddle ranks since the batch divides."""
        part, parts = self.pools.rank_in("actor"), len(self.actor_ranks)
        rows = self.dataset.shard(step, part, parts)
        first_row = self.dataset.batch_size * (step - 1) + part * len(rows)
        prompts = collate_prompts(rows, self.tokenizer, self.cfg.data.max_prompt_length, step, first_row,
                                  truncation=self.cfg.data.truncation)
        return prompts.repeat_interleave(self.cfg.rollout.n).to(self.device)

    def compute_advantage(self, batch: Batch) -> dict[str, float]:
        alg = self.cfg.algorithm
        reduce_sum = pool_sum(self.pools.critic_group)  # statistics of the whole global batch
        metrics = {}
        if alg.use_kl_in_reward:
            batch["token_level_rewards"], metrics = algo.apply_kl_penalty(
                batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                batch["response_mask"], self.kl_ctrl, alg.kl_penalty, reduce_sum=reduce_sum,
            )
        else:
            batch["token_level_rewards"] = batch["token_level_scores"]
        rewards, mask, groups = batch["token_level_rewards"], batch["response_mask"], batch["uid"]
        est = alg.adv_estimator
        if est == "gae":
            adv, ret = algo.compute_gae_advantage_return(rewards, batch["values"], mask, alg.gamma, alg.lam, reduce_sum=reduce_sum)
        elif est == "grpo":
            adv, ret = algo.compute_grpo_outcome_advantage(rewards, mask, groups, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
        elif est == "rloo":
            adv, ret = algo.compute_rloo_outcome_advantage(rewards, mask, groups)
        elif est == "reinforce_plus_plus":
            adv, ret = algo.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, alg.gamma, reduce_sum=reduce_sum)
        elif est == "reinforce_plus_plus_baseline":
            adv, ret = algo.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, groups, reduce_sum=reduce_sum)
        else:
            raise ValueError(f"algorithm.adv_estimator={est!r} is not supported")
        batch["advantages"], batch["returns"] = adv, ret
        return metrics

    def handoff(self) -> None:
        """Blocking mode only: both pools meet here, so one pool's phase ends before the other's
        next one starts. A barrier over the world on purpose: it is the thing being measured."""
        if self.blocking:
            dist.barrier(group=self.handoff_group)

    def throughput(self, rollout: Batch, timings: dict) -> dict[str, float]:
        step_time = timings["timing_s/step"]
        tokens = rollout["attention_mask"].sum().item() * len(self.actor_ranks)  # rank 0's shard x shards
        return {"perf/time_per_step": step_time, "perf/throughput": tokens / step_time / self.placement.world_size}

    def send_critic_metrics(self, step: int, metrics: dict) -> None:
        # Not waited for here: rank 0 picks them up during the next step, and waiting would
        # stall this pool until then. The previous send is surely done once this step ran.
        if self.sent_metrics is not None:
            self.sent_metrics.wait()
        self.sent_metrics = send_object((step, metrics), dst=0, tag=TAG_CRITIC_METRICS, device=self.device)

    def receive_critic_metrics(self, upto: int) -> None:
        """Rank 0 logs step k once the critic pool's metrics of step k arrived, which in split
        placement is during step k+1: waiting for them at the end of step k would stop the actor
        pool from starting the next rollout while the critic still updates."""
        while self.critic_metrics_received < upto:
            step, metrics = recv_object(self.critic_ranks[0], TAG_CRITIC_METRICS, self.device)
            assert step == self.critic_metrics_received + 1, f"critic metrics of step {step} out of order"
            self.critic_metrics_received = step
            self.record(step, "critic", metrics)

    def record(self, step: int, side: str, metrics: dict) -> None:
        parts = self.unlogged.setdefault(step, {})
        parts[side] = metrics
        if len(parts) == 2:
            self.logger.log(step, {**parts["critic"], **parts["actor"]})
            del self.unlogged[step]

    def finish(self, completed: bool) -> None:
        cfg, P = self.cfg, self.pools
        self.timer.record_peak_memory()
        if self.sent_metrics is not None:
            self.sent_metrics.wait()
        if P.is_actor and cfg.trainer.output_dir and completed:  # a stopped run's weights are in its checkpoint
            self.actor.engine.save_hf(cfg.trainer.output_dir, self.tokenizer, is_writer=self.rank == self.actor_ranks[0])
        if cfg.trainer.timeline:
            # After the last step, outside any pool's work: one gather of every rank's events.
            events = [None] * self.placement.world_size if self.rank == 0 else None
            dist.gather_object(self.timer.events, events, dst=0)
            if self.rank == 0:
                roles = ["+".join(sorted(self.placement.roles_of(r))) for r in range(self.placement.world_size)]
                write_timeline(cfg.trainer.timeline, events, roles)
        if self.logger:
            self.logger.close()

    # ------------------------------------------------------------------ checkpoints

    def my_pools(self) -> list[str]:
        return [pool for pool, member in (("actor", self.pools.is_actor), ("critic", self.pools.is_critic)) if member]

    def trained_engine(self, pool: str):
        if pool == "actor":
            return self.actor.engine
        return self.critic.engine if self.use_critic else None

    def rank_state(self, pool: str, step: int) -> dict:
        state = {"step": step, "rng": checkpoint.rng_state(self.device)}
        if pool == "actor":
            # The data order is a function of (seed, step), so the step is the data position;
            # the rest is there to notice a different dataset on resume.
            state["data"] = {"prompts_consumed": step * self.batch_size, "dataset_rows": len(self.dataset.rows),
                             "seed": self.cfg.data.seed, "shuffle": self.cfg.data.shuffle}
        else:
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
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
            send_object(step, dst=0, tag=TAG_CHECKPOINT, device=self.device).wait()
        if self.rank == 0:
            self.receive_critic_metrics(upto=step)  # a resumed run logs from step + 1 on
            if C[0] != 0:
                assert recv_object(C[0], TAG_CHECKPOINT, self.device) == step
            meta = {"step": step, "world_size": self.placement.world_size, "actor_ranks": self.actor_ranks,
                    "critic_ranks": self.critic_ranks, "time": time.time(),
                    "config": OmegaConf.to_container(cfg, resolve=True)}
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
                self.kl_ctrl.load_state_dict(state["kl_ctrl"])
            elif state["data"]["dataset_rows"] != len(self.dataset.rows) and self.rank == 0:
                print(f"spmdsplit: warning: the checkpoint was trained on {state['data']['dataset_rows']} prompts, "
                      f"the data now has {len(self.dataset.rows)}: the data order differs from the stopped run", flush=True)
        if self.rank == 0:
            note = "" if same_layout else (" (the pools have other sizes now: weights and optimizer are resharded, "
                                           "sampling is reseeded, so the run will not repeat the stopped one exactly)")
            print(f"spmdsplit: resuming from {path} at step {step + 1}{note}", flush=True)
        self.start_step = step + 1
        self.critic_metrics_received = step
