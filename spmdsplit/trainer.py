"""The PPO loop: each step's phases of the programs on this rank, in the order of the message
schedule (spmdsplit/messages.py); validation and a checkpoint when due. What a rank runs is built
by spmdsplit/builder.py, what goes into a checkpoint is spmdsplit/checkpoint_manager.py's, what rank 0
logs spmdsplit/reporting.py's.

    actor pool : gen ──rollout──► old_log_prob, ref ──(log-probs)──►   ◄──advantages── update_actor ──► gen(k+1)
    critic pool:     ──rollout──► values, reward ───(log-probs)──► adv ──advantages──► update_critic ───────────►

Each rank runs the programs of the role groups on its pool (colocate runs the rollout group's, the
actor's and the critic's; a rollout pool of its own runs only its own, ahead of the others by
rollout.staleness). The pools meet only at the point-to-point messages, so old/ref log-probs run
beside values/rewards, update_actor beside update_critic, and the critic update may run on while
the actor pool starts the next rollout. Sends are non-blocking: a pool never waits for its data to
be picked up. `placement.overlap=false` adds pool hand-offs that make the phases run one after
another (verl's blocking calls), to measure what overlapping gains.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from spmdsplit.builder import Rank
from spmdsplit.staleness import validates_after
from spmdsplit.generation.validation import validation_set


class Trainer:
    def __init__(self, cfg, parts: Rank):
        """`parts`: what this rank runs (builder.build)."""
        self.cfg, self.programs, self.start_step = cfg, parts.programs, parts.start_step
        self.rank, self.placement = parts.pools.rank, parts.pools.placement
        self.channel, self.timer, self.profiler, self.val_set = parts.channel, parts.timer, parts.profiler, parts.val_set
        self.stop_vote, self.score_target, self.stop_budget = parts.stop_vote, parts.score_target, parts.stop_budget
        self.reports, self.checkpoints, self.dumps = parts.reports, parts.checkpoints, parts.dumps
        self.sampler, self.tokenizer = parts.sampler, parts.tokenizer

    # ------------------------------------------------------------------ the loop

    def fit(self) -> bool:
        """Runs the remaining steps, up to trainer.total_steps or the step after the target score was
        reached (trainer.stop_at_score); False when it stopped early on request (after checkpointing)."""
        total_steps = self.cfg.trainer.total_steps
        for program in self.programs.by_group().values():
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
        """This rank's programs, phase by phase, in the message schedule's order (a program absent
        here is skipped); the pool's first rank reports their metrics."""
        step_start = time.time()
        rollout, actor, critic, reward = (self.programs.rollout, self.programs.actor, self.programs.critic,
                                          self.programs.reward)
        reported: dict[str, dict] = {}  # each program's metrics of the step, by role group
        for chunk in range(self.cfg.rollout.stream_chunks):  # chunk c goes on while chunk c+1 generates
            if rollout:
                rollout.generate_chunk(step, chunk)  # and sends it to the actor group
            if actor:
                actor.receive_rows(step, chunk)  # balanced, and sent on to the critic (and reward) group
        if rollout:
            reported["rollout"] = rollout.after_hand_over(step)  # generating ahead, the next weights
        if actor:
            actor.compute_log_probs(step)  # old and reference log-probs
        if reward:  # a reward pool of its own; else the critic's program scores
            reported["reward"] = reward.score(step)
        if critic:
            critic.compute_advantages(step)  # values, scores, advantages back to the actor group
            reported["critic"] = critic.update(step)
        if actor:
            reported["actor"] = actor.update(step)  # and the new weights to a rollout pool
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
        programs = self.programs.by_group().values()
        for program in programs:  # the rollout group's, where it runs here
            program.validate(step, val_set)
        scored = [program.score_validation(step, val_set) for program in programs]
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
            for program in self.programs.by_group().values():
                program.export(trainer.output_dir, self.tokenizer)
        if trainer.timeline:
            self.reports.timeline(trainer.timeline, self.timer)
        self.reports.close()
        self.dumps.close()
        for program in self.programs.by_group().values():
            program.close()
        if self.sampler is not None:
            self.sampler.close()
        # Every rank is done with every message before any leaves: from here on a rank that is
        # gone has finished, not failed (spmdsplit/failure.py).
        dist.barrier(group=self.channel.control_group)
