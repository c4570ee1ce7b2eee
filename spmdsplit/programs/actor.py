"""The actor group's program: roll out (the rollout group's engines on this pool generate, or the rows
come from its pool of their own), score the rollout under the policy and the reference, and update
the policy once the critic group's advantages are in. Messages: spmdsplit/messages.py."""

from __future__ import annotations

from spmdsplit.batch import Batch
from spmdsplit.batch_balancer import BatchBalancer
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.exchange import PendingSend
from spmdsplit.generation import Generator
from spmdsplit.groups import Pools
from spmdsplit.messages import PoolChannel, receive_for
from spmdsplit.batch_metrics import rollout_correction_metrics, token_staleness
from spmdsplit.timing import PhaseTimer
from spmdsplit.roles.actor import add_rollout_is_weights, old_from_forward
from spmdsplit.roles.build import ActorRoles
from spmdsplit.programs import Program
from spmdsplit.staleness import check_weights_version, weights_needed
from spmdsplit.weight_sync import PolicyWeights


class ActorProgram(Program):
    def __init__(self, cfg, pools: Pools, roles: ActorRoles, channel: PoolChannel, timer: PhaseTimer, handoff,
                 dataset: PromptDataset, generator: Generator | None, weights: PolicyWeights,
                 balancer: BatchBalancer | None):
        """`generator`: the rollout group's engine here (None: a rollout pool of its own generates);
        `weights`: the policy's to engines; `balancer`: trainer.balance_batch's row order."""
        self.cfg, self.pools, self.channel, self.timer, self.handoff = cfg, pools, channel, timer, handoff
        self.actor, self.ref, self.dataset = roles.actor, roles.ref, dataset
        self.generator, self.weights, self.balancer = generator, weights, balancer
        self.sends = PendingSend()  # this step's sends to the critic pool, waited for at its end
        self.rollout_batch: Batch | None = None  # this step's rollout, from roll_out to update
        self.rollout_metrics: dict[str, float] = {}

    @property
    def engine(self):
        """What a checkpoint saves of this group: the policy (the reference is frozen)."""
        return self.actor.engine

    def start(self, step: int) -> None:
        """A rollout pool of its own starts with the policy's weights."""
        if self.pools.placement.apart("rollout"):
            self.weights.push(step - 1)

    def roll_out(self, step: int) -> None:
        """gen (chunk by chunk, each sent on at once), or the rows from elsewhere -> old_log_prob
        -> ref [-> log-probs sent]."""
        parts = self.generate(step) if self.generator else [self.receive_generated(step)]
        rollout = Batch.concat(parts, pad_to_widest=True)  # each chunk as wide as its longest response
        self.rollout_metrics = self.generator.pop_metrics(step) if self.generator else {}
        corr = self.cfg.algorithm.rollout_correction
        if (corr.rollout_is or corr.bypass_mode) and "rollout_log_probs" not in rollout:
            raise RuntimeError("algorithm.rollout_correction needs the engine's rollout_log_probs, and this "
                               f"rollout.name={self.cfg.rollout.name} engine returned none")
        if corr.bypass_mode:  # verl's bypass mode: the engine's log-probs are PPO's old policy
            rollout["old_log_probs"] = rollout["rollout_log_probs"]
        elif not old_from_forward(self.cfg, step):  # else the update's own forward gives them
            with self.timer.phase("old_log_prob", step):
                rollout["old_log_probs"] = self.actor.compute_log_prob(rollout)
            self.rollout_metrics.update(rollout_correction_metrics(rollout, corr, self.pools.group("actor"), self.pools.device))
            add_rollout_is_weights(rollout, corr)
        self.rollout_metrics.update(token_staleness(rollout, step, self.pools.group("actor"), self.pools.device))
        with self.timer.phase("ref", step):
            rollout["ref_log_prob"] = self.ref.compute_log_prob(rollout)
        self.handoff()  # blocking mode: the critic pool starts its values only now
        if self.cfg.algorithm.use_kl_in_reward:  # the critic pool needs them for the KL penalty
            for c, part in enumerate(rollout.split(len(parts[0]))):
                self.sends.add(self.channel.send_log_probs(step, c, part))
        self.rollout_batch = rollout

    def generate(self, step: int) -> list[Batch]:
        """The rollout group on this pool: its engines wake with the policy's weights and generate
        the step; each chunk goes on to the critic pool at once (with rollout.ranks=all this rank's
        share goes to the actor pool, which then holds every rank's rows)."""
        self.generator.wake(step)
        if self.pools.placement.critic_pool_generates:
            [rows] = self.generator.rows(step)
            self.sends.add(self.channel.send_generated(step, rows))
            return [self.receive_generated(step)]
        parts = []
        for c, rows in enumerate(self.generator.rows(step)):
            parts.append(self.balancer(step, c, rows) if self.balancer else rows)
            self.sends.add(self.channel.send_rollout(step, c, parts[-1]))
        return parts

    def receive_generated(self, step: int) -> Batch:
        """Rows generated elsewhere, balanced once this pool holds all of them, sent on to the critic."""
        with self.timer.phase("exchange/generated", step) as stats:
            rows = self.channel.recv_generated(step, stats)
        if "weights_version" in rows:
            check_weights_version(rows, step, self.cfg.rollout.staleness)
        if self.balancer:
            rows = self.balancer(step, 0, rows)
        self.sends.add(self.channel.send_rollout(step, 0, rows))
        return rows

    def update(self, step: int) -> dict[str, float]:
        """Advantages in -> update_actor [-> weights to a rollout pool]. Returns the actor's metrics."""
        rollout = self.rollout_batch
        rollout["advantages"] = receive_for(rollout, self.channel.recv_advantages, "advantages", step,
                                            self.cfg.rollout.stream_chunks, self.timer, "exchange/advantages")["advantages"]
        self.handoff()  # blocking mode: the actor updates only after the critic did
        metrics, old_from_update = {}, old_from_forward(self.cfg, step)
        if step > self.cfg.trainer.critic_warmup:  # the first steps train only the critic
            with self.timer.phase("update_actor", step):
                metrics = self.actor.update_policy(rollout, self.cfg.trainer.seed * 7919 + step, old_from_update)
        if old_from_update:  # the metrics of the old log-probs the update's forward gave
            corr, group = self.cfg.algorithm.rollout_correction, self.pools.group("actor")
            self.rollout_metrics.update(rollout_correction_metrics(rollout, corr, group, self.pools.device))
        self.sends.wait()
        self.sends = PendingSend()
        if self.pools.placement.apart("rollout") and weights_needed(self.cfg, step):
            with self.timer.phase("sync_weights", step):  # the weights of this update, to the rollout pool
                self.weights.push(step)
        metrics.update(self.rollout_metrics)
        # For rank 0's perf/throughput: this rank's shard x the actor ranks, an estimate where the shards
        # differ (verl's perf/total_num_tokens is the exact sum; this one costs no collective).
        metrics["perf/total_num_tokens"] = rollout["attention_mask"].sum().item() * len(self.pools.placement.ranks("actor"))
        if self.balancer:
            metrics.update(self.balancer.pop_metrics())
        return metrics

    def validate(self, step: int, val_rows: list[dict]) -> None:
        """The rollout group on this pool: responses to the validation set with the policy's
        current weights (only this pool generates them), to the reward group."""
        if self.generator:  # else a rollout pool of its own generates them
            self.generator.wake(step, broadcast=False)
            self.generator.validate(step, val_rows, self.channel)

    def state(self, step: int) -> dict:
        """The data position: a step takes one generation batch (dynamic sampling keeps its own count)."""
        sampler = self.generator.sampler if self.generator else None
        return self.dataset.state(sampler.next_gen_batch - 1 if sampler else step)

    def load_state(self, state: dict, same_layout: bool) -> None:
        warning = self.dataset.check_state(state)
        if warning and self.pools.rank == 0:
            print(f"spmdsplit: warning: {warning}", flush=True)

    def export(self, output_dir: str, tokenizer) -> None:
        """The trained policy as a Hugging Face folder, written by the actor group's first rank."""
        placement = self.pools.placement
        self.actor.engine.save_hf(output_dir, tokenizer, is_writer=self.pools.rank == placement.ranks("actor")[0],
                                  merge=self.cfg.model.lora_merge)
