"""The actor group's program: take the rollout group's rows (GENERATED, from this pool's own engines or
from the pools that generate), balanced and sent on to the critic group chunk by chunk; score them
under the policy and the reference; update the policy once the critic group's advantages are in,
and push its weights to engines outside this pool. It trains; it never generates.
Messages: spmdsplit/messages.py."""

from __future__ import annotations

from spmdsplit.batch import Batch
from spmdsplit.batch_balancer import BatchBalancer
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.exchange import PendingSend
from spmdsplit.groups import Pools
from spmdsplit.messages import PoolChannel, receive_for
from spmdsplit.batch_metrics import rollout_correction_metrics, token_staleness
from spmdsplit.timing import PhaseTimer
from spmdsplit.roles.actor import add_rollout_is_weights, old_from_forward
from spmdsplit.roles.build import ActorRoles
from spmdsplit.programs import Program
from spmdsplit.staleness import check_weights_version, weights_needed
from spmdsplit.seeds import update_seed
from spmdsplit.weight_sync import PolicyWeights


class ActorProgram(Program):
    def __init__(self, cfg, pools: Pools, roles: ActorRoles, channel: PoolChannel, timer: PhaseTimer, handoff,
                 dataset: PromptDataset, sampler: DynamicSampling | None, weights: PolicyWeights,
                 balancer: BatchBalancer | None):
        """`sampler`: dynamic sampling where this pool generates (its data position); `weights`:
        the policy's, to engines; `balancer`: trainer.balance_batch's row order."""
        self.cfg, self.pools, self.channel, self.timer, self.handoff = cfg, pools, channel, timer, handoff
        self.actor, self.ref, self.dataset, self.sampler = roles.actor, roles.ref, dataset, sampler
        self.weights, self.balancer = weights, balancer
        self.sends = PendingSend()  # this step's sends to the critic pool, waited for at its end
        self.parts: list[Batch] = []  # this step's rows, chunk by chunk, until compute_log_probs
        self.rollout_batch: Batch | None = None  # this step's rollout, from compute_log_probs to update
        self.rollout_metrics: dict[str, float] = {}

    @property
    def engine(self):
        """What a checkpoint saves of this group: the policy (the reference is frozen)."""
        return self.actor.engine

    def start(self, step: int) -> None:
        """A rollout pool of its own starts with the policy's weights."""
        if self.pools.placement.apart("rollout"):
            self.weights.push(step - 1)

    def receive_rows(self, step: int, chunk: int) -> None:
        """Chunk `chunk` of the step's rows in (this rank's share of every generating rank's),
        balanced once this pool holds all of them, sent on to the critic group at once."""
        with self.timer.phase("exchange/generated", step, chunk=chunk) as stats:
            rows = self.channel.recv_generated(step, chunk, stats)
        if "weights_version" in rows:
            check_weights_version(rows, step, self.cfg.rollout.staleness)
        if self.balancer:
            rows = self.balancer(step, chunk, rows)
        self.sends.add(self.channel.send_step_rows(step, chunk, rows))
        self.parts.append(rows)

    def compute_log_probs(self, step: int) -> None:
        """The step's rows under the policy before the update (old_log_prob) and under the
        reference (ref) [-> both sent to the critic group, for the KL penalty in the reward]."""
        parts, self.parts = self.parts, []
        rollout = Batch.concat(parts, pad_to_widest=True)  # each chunk as wide as its longest response
        self.rollout_metrics = {}
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

    def update(self, step: int) -> dict[str, float]:
        """Advantages in -> update_actor [-> weights to a rollout pool]. Returns the actor's metrics."""
        rollout = self.rollout_batch
        rollout["advantages"] = receive_for(rollout, self.channel.recv_advantages, "advantages", step,
                                            self.cfg.rollout.stream_chunks, self.timer, "exchange/advantages")["advantages"]
        self.handoff()  # blocking mode: the actor updates only after the critic did
        metrics, old_from_update = {}, old_from_forward(self.cfg, step)
        if step > self.cfg.trainer.critic_warmup:  # the first steps train only the critic
            with self.timer.phase("update_actor", step):
                metrics = self.actor.update_policy(rollout, update_seed(self.cfg.trainer.seed, step), old_from_update)
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

    def state(self, step: int) -> dict:
        """The data position: a step takes one generation batch (dynamic sampling keeps its own count)."""
        return self.dataset.state(self.sampler.next_gen_batch - 1 if self.sampler else step)

    def load_state(self, state: dict, same_layout: bool) -> None:
        warning = self.dataset.check_state(state)
        if warning and self.pools.rank == 0:
            print(f"spmdsplit: warning: {warning}", flush=True)

    def export(self, output_dir: str, tokenizer) -> None:
        """The trained policy as a Hugging Face folder, written by the actor group's first rank."""
        placement = self.pools.placement
        self.actor.engine.save_hf(output_dir, tokenizer, is_writer=self.pools.rank == placement.ranks("actor")[0],
                                  merge=self.cfg.model.lora_merge)
