"""Every pool's metrics to world rank 0, which logs them: a step's line once every pool's part of it
is in (the pools report at their own pace: a critic pool's step k arrives during the actor pool's
step k+1), `perf/*` from the step time, the validation metrics, and at the end the timeline and
the run's one-line summary.

Each pool's first rank sends its programs' merged metrics on the control link
(spmdsplit/messages.py); rank 0 (the actor pool's first rank) records its own. The sinks are
spmdsplit/sinks.py's MetricsLogger."""

from __future__ import annotations

import time

import torch.distributed as dist
from omegaconf import OmegaConf

from spmdsplit.messages import PoolChannel
from spmdsplit.placement import ROLE_GROUPS, TRAINED, Placement
from spmdsplit.sinks import MetricsLogger
from spmdsplit.timing import PhaseTimer, write_timeline

# When two groups (or their pools) report the same metric, rank 0 logs the one of the group first
# here: the trained groups' (the actor's before the critic's), then the others in the role order.
REPORT_ORDER = (*TRAINED, *(g for g in ROLE_GROUPS if g not in TRAINED))


def merge_reports(parts: dict[str, dict], first) -> dict:
    """The parts' metrics as one dict; of two parts reporting a key, the one with the lower
    `first(name)` wins."""
    return {k: v for name in sorted(parts, key=first, reverse=True) for k, v in parts[name].items()}


def throughput(tokens: float, step_time: float, world_size: int) -> dict[str, float]:
    """verl's perf/throughput: the step's tokens per second per rank."""
    return {"perf/time_per_step": step_time, "perf/throughput": tokens / step_time / world_size}


def other_pools(placement: Placement) -> list[str]:
    """The pools other than world rank 0's: each one's first rank reports to rank 0 (its metrics,
    its part of a checkpoint written)."""
    return [pool for pool in placement.pools if pool != placement.pool_at(0)]


class Reports:
    """On every rank: its pool's metrics of each step go to rank 0 (sent by the pool's first rank);
    on rank 0 they are logged, a step once every pool's part is in."""

    def __init__(self, cfg, placement: Placement, rank: int, channel: PoolChannel, after_step: int = 0,
                 run_ids: dict[str, str] | None = None):
        """`after_step`: the step the run resumes after (0: a fresh start), the last one logged;
        `run_ids`: the wandb / MLflow runs a resumed job goes on in."""
        self.cfg, self.placement, self.rank, self.channel = cfg, placement, rank, channel
        self.my_pool = placement.pool_at(rank)
        # Rank 0: step -> {pool: its metrics} until every pool's part is in.
        self.unlogged: dict[int, dict] = {}
        # Rank 0's count of the other pools' metrics taken, step by step.
        self.received = dict.fromkeys(other_pools(placement), after_step)
        # wandb records the resolved config with the run, as verl's tracking does.
        self.logger = MetricsLogger(cfg.trainer, OmegaConf.to_container(cfg, resolve=True), first_step=after_step + 1,
                                    run_ids=run_ids or {}) if rank == 0 else None

    def step(self, step: int, parts: dict[str, dict], timings: dict[str, float], started: float) -> None:
        """This rank's programs' metrics of `step` (`parts`: by role group) and its phases' timings;
        `started`: the step's time.time() at its start."""
        metrics = merge_reports(parts, REPORT_ORDER.index)
        if self.rank == 0:
            # The other pools sent step k-1's metrics before step k's advantages: taking them now never waits.
            self.receive(upto=step - 1)
            timings["timing_s/step"] = time.time() - started
            perf = throughput(metrics["perf/total_num_tokens"], timings["timing_s/step"], self.placement.world_size)
            self.record(step, self.my_pool, {**metrics, **timings, **perf})
        elif self.rank == self.placement.pools[self.my_pool][0]:
            self.channel.send_pool_metrics(step, self.my_pool, {**metrics, **timings})

    def receive(self, upto: int) -> None:
        """Rank 0 logs step k once the other pools' metrics of step k arrived, which in split
        placement is during step k+1: waiting for them at the end of step k would stop the actor
        pool from starting the next rollout while the critic still updates (or the rollout pool
        still generates ahead). Other ranks: nothing."""
        if self.rank != 0:
            return
        for pool in self.received:
            while self.received[pool] < upto:
                step = self.received[pool] + 1
                self.record(step, pool, self.channel.recv_pool_metrics(step, pool))
                self.received[pool] = step

    def record(self, step: int, pool: str, metrics: dict) -> None:
        parts = self.unlogged.setdefault(step, {})
        parts[pool] = metrics
        if len(parts) == len(self.placement.pools):
            self.logger.log(step, merge_reports(parts, lambda pool: min(
                REPORT_ORDER.index(g) for g in self.placement.groups_on(pool))))
            del self.unlogged[step]

    def validation(self, step: int, metrics: dict[str, float] | None) -> None:
        """The reward group's first rank sends the validation metrics it scored (`metrics`); rank 0
        logs them, after the steps up to `step` (their metrics were sent first)."""
        if self.rank == self.placement.ranks("reward")[0]:
            self.channel.send_val_metrics(step, metrics)
        if self.rank == 0:
            self.receive(upto=step)
            self.logger.log_scalars(step, self.channel.recv_val_metrics(step))

    def run_ids(self) -> dict[str, str]:
        """Rank 0: the tracking runs a resumed job goes on in (saved with each checkpoint)."""
        return self.logger.run_ids()

    def timeline(self, path: str, timer: PhaseTimer) -> None:
        """trainer.timeline: after the last step, outside any pool's work, one gather of every
        rank's events on the control group; rank 0 writes them."""
        events = [None] * self.placement.world_size if self.rank == 0 else None
        dist.gather_object(timer.events, events, dst=0, group=self.channel.control_group)
        if self.rank == 0:
            roles = [self.placement.pool_label(r) for r in range(self.placement.world_size)]
            write_timeline(path, events, roles)

    def summary(self) -> None:
        """Rank 0, at the end of a completed run: did the score rise from where the random policy
        started?"""
        history, trainer = self.logger.history if self.logger else [], self.cfg.trainer
        if not history:
            return
        scores = [h["critic/score/mean"] for h in history]
        k = max(1, min(5, len(scores) // 4))
        first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
        step_times = sorted(h["timing_s/step"] for h in history[1:] or history)
        print(
            f"spmdsplit: mean score {first:.3f} (first {k} steps) -> {last:.3f} (last {k} steps); "
            f"median step {step_times[len(step_times) // 2]:.2f}s over {len(history)} steps"
            + (f" (steps {history[0]['step']}-{history[-1]['step']}: this run resumed)" if history[0]["step"] > 1
               else ""),
            flush=True,
        )
        where = [f"TensorBoard: {trainer.log_dir}"]
        if trainer.timeline:
            where.append(f"timeline: {trainer.timeline}")
        if trainer.output_dir:
            where.append(f"trained actor: {trainer.output_dir}")
        print("spmdsplit: " + "; ".join(where), flush=True)

    def close(self) -> None:
        if self.logger:
            self.logger.close()
