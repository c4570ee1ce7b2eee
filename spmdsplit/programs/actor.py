"""The actor group's program: roll out (the rollout group's engines on this pool generate, or the rows
come from its pool of their own), score the rollout under the policy and the reference, and update
the policy once the critic group's advantages are in. Messages: spmdsplit/messages.py."""

from __future__ import annotations

from spmdsplit import algo
from spmdsplit.batch import Batch
from spmdsplit.batch_balancer import BatchBalancer
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.exchange import PendingSend
from spmdsplit.generation import engine_shares, generate_step_rows, generate_validation_rows
from spmdsplit.groups import generating_ranks
from spmdsplit.messages import PoolChannel, check_rows
from spmdsplit.metrics import PhaseTimer, rollout_correction_metrics, rollout_probs_diff_metrics
from spmdsplit.placement import Pools
from spmdsplit.programs import Program
from spmdsplit.roles.actor import OldFromForward, update_is_one_pass
from spmdsplit.roles.build import ActorRoles, compute_dtypes
from spmdsplit.staleness import check_weights_version, weights_needed
from spmdsplit.weight_sync import WeightBroadcast


class ActorProgram(Program):
    def __init__(self, cfg, pools: Pools, roles: ActorRoles, channel: PoolChannel, timer: PhaseTimer,
                 dataset: PromptDataset, tokenizer, handoff, weights: WeightBroadcast | None = None,
                 sampler: DynamicSampling | None = None):
        self.cfg, self.pools, self.channel, self.timer = cfg, pools, channel, timer
        self.actor, self.ref, self.rollout = roles.actor, roles.ref, roles.rollout
        self.dataset, self.tokenizer, self.handoff = dataset, tokenizer, handoff
        self.weights = weights  # the broadcast to engines elsewhere (a rollout pool, rollout.ranks=all's)
        self.sampler = sampler  # algorithm.filter_groups, when this pool generates
        self.chunks = cfg.rollout.stream_chunks
        self.sends = PendingSend()  # this step's sends to the critic pool, waited for at its end
        self.rollout_batch: Batch | None = None  # this step's rollout, from roll_out to update
        self.rollout_metrics: dict[str, float] = {}
        # trainer.balance_batch: the rows' order over the actor pool by tokens (spmdsplit/batch_balancer.py)
        self.balancer = BatchBalancer(cfg, pools, channel, timer) if cfg.trainer.balance_batch else None

    @property
    def engine(self):
        """What a checkpoint saves of this group: the policy (the reference is frozen)."""
        return self.actor.engine

    def roll_out(self, step: int) -> None:
        """gen (chunk by chunk, each sent on at once), or the rows from a rollout pool of its own
        -> old_log_prob -> ref [-> log-probs sent]."""
        phase, channel = self.timer.phase, self.channel
        parts = self.receive_generated(step) if self.pools.placement.apart("rollout") else self.generate_step(step)
        # Each chunk is as wide as its longest response (rollout/base.py): pad them to one width.
        rollout = Batch.concat(parts, pad_to_widest=True)
        self.rollout_metrics = self.sampler.pop_metrics(step) if self.sampler else {}
        corr = self.cfg.algorithm.rollout_correction
        if (corr.rollout_is or corr.bypass_mode) and "rollout_log_probs" not in rollout:
            raise RuntimeError("algorithm.rollout_correction needs the engine's rollout_log_probs, and this "
                               f"rollout.name={self.cfg.rollout.name} engine returned none")
        if corr.bypass_mode:
            # verl's bypass mode: the engine's log-probs are PPO's old policy; no recomputation.
            rollout["old_log_probs"] = rollout["rollout_log_probs"]
        elif not self.old_from_forward(step):  # else the update's own forward gives them
            with phase("old_log_prob", step):
                rollout["old_log_probs"] = self.actor.compute_log_prob(rollout)
            self.apply_rollout_correction(rollout)
        with phase("ref", step):
            rollout["ref_log_prob"] = self.ref.compute_log_prob(rollout)
        self.handoff()  # blocking mode: the critic pool starts its values only now
        if self.cfg.algorithm.use_kl_in_reward:  # the critic pool needs them for the KL penalty
            for c, part in enumerate(rollout.split(len(parts[0]))):
                self.sends.add(channel.send_log_probs(step, c, part))
        self.rollout_batch = rollout

    def generate_step(self, step: int) -> list[Batch]:
        """The rollout group on this pool: the engines wake with the policy's weights and generate
        the step's prompts chunk by chunk, each sent on to the critic pool at once."""
        phase, channel = self.timer.phase, self.channel
        if self.chunks > 1:  # the step's prompts, generated chunk by chunk
            shares = engine_shares(self.cfg, self.dataset, self.tokenizer, step, generating_ranks(self.cfg, self.pools.placement))
        with phase("sync_weights", step) as event:
            self.wake_rollout()
            event.update(self.timer.device_in_use())  # the engine's share included (tools/gpu_check.py)
        parts = []
        for c in range(self.chunks):
            with phase("gen", step, chunk=c):
                if self.chunks == 1:  # the whole step (dynamic sampling's generation batches included)
                    parts.append(generate_step_rows(self.cfg, self.dataset, self.tokenizer, self.rollout, self.pools,
                                                    step, self.sampler))
                else:
                    parts.append(shares.chunk(c, self.chunks).generate(self.rollout, self.pools.device))
            if c == self.chunks - 1:
                # Before the last rows go out: vLLM's sleep synchronises the device, which on
                # NCCL would wait for the critic pool to take a pending send.
                with phase("rollout_sleep", step):
                    self.rollout.sleep()
            if not self.weights:
                if self.balancer:
                    parts[-1] = self.balancer(step, c, parts[-1])
                self.sends.add(channel.send_rollout(step, c, parts[-1]))
        if self.weights:  # rollout.ranks=all: the critic pool generated the rest of the rows
            self.sends.add(channel.send_generated(step, parts[0]))
            return self.receive_generated(step)
        return parts

    def receive_generated(self, step: int) -> list[Batch]:
        """Rows generated elsewhere (a rollout pool, or rollout.ranks=all's critic pool), balanced
        once this pool holds all of them, then sent on to the critic pool."""
        with self.timer.phase("exchange/generated", step) as stats:
            rows = self.channel.recv_generated(step, stats)
        if "weights_version" in rows:
            check_weights_version(rows, step, self.cfg.rollout.staleness)
        if self.balancer:
            rows = self.balancer(step, 0, rows)
        self.sends.add(self.channel.send_rollout(step, 0, rows))
        return [rows]

    def update(self, step: int) -> dict[str, float]:
        """Advantages in -> update_actor. Returns the actor's metrics."""
        rollout, advantages = self.rollout_batch, []
        for c in range(self.chunks):
            with self.timer.phase("exchange/advantages", step, chunk=c) as stats:
                advantages.append(self.channel.recv_advantages(step, c, stats))
        advantages = Batch.concat(advantages, pad_to_widest=True)
        check_rows(advantages, rollout, "advantages")
        # The critic pool's ranks padded their rows to their own widest response, not this rank's.
        rollout["advantages"] = advantages.with_width(rollout["responses"].shape[1])["advantages"]
        self.handoff()  # blocking mode: the actor updates only after the critic did
        metrics, old_from_forward = {}, self.old_from_forward(step)
        if step > self.cfg.trainer.critic_warmup:  # the first steps train only the critic
            with self.timer.phase("update_actor", step):
                metrics = self.actor.update_policy(rollout, self.cfg.trainer.seed * 7919 + step, old_from_forward)
        if old_from_forward:  # the metrics of the old log-probs the update's forward gave
            self.apply_rollout_correction(rollout, weights=False)
        self.sends.wait()
        self.sends = PendingSend()
        if self.pools.placement.apart("rollout") and weights_needed(self.cfg, step):
            with self.timer.phase("sync_weights", step):  # the weights of this update, to the rollout pool
                self.push_weights()
        metrics.update(self.rollout_metrics)
        metrics.update(self.token_count())
        if self.balancer:
            metrics.update(self.balancer.pop_metrics())
        return metrics

    def old_from_forward(self, step: int) -> OldFromForward | None:
        """Whether this step's old log-probs are the update's own forward (roles/actor.py
        update_is_one_pass): not where something needs them before the update (the critic pool's
        KL penalty in the reward; a step of the critic's warm-up, which runs no update), nor in
        bypass mode (the engine's log-probs stand in for them)."""
        cfg, corr = self.cfg, self.cfg.algorithm.rollout_correction
        if (corr.bypass_mode or cfg.algorithm.use_kl_in_reward or step <= cfg.trainer.critic_warmup
                or not update_is_one_pass(cfg)):
            return None
        return OldFromForward(corr.rollout_is, corr.rollout_is_threshold)

    def apply_rollout_correction(self, rollout: Batch, weights: bool = True) -> None:
        """The engine's own log-probs against the actor's (every engine returns them): verl's
        training/rollout_probs_diff_* and rollout_corr/* metrics, and, with
        algorithm.rollout_correction.rollout_is and `weights`, the truncated importance weights the
        policy loss takes (a column of the rows, so they follow them into every micro-batch)."""
        if "rollout_log_probs" not in rollout:
            return
        corr, group, device = self.cfg.algorithm.rollout_correction, self.pools.group("actor"), self.pools.device
        engine, actor, mask = rollout["rollout_log_probs"], rollout["old_log_probs"], rollout["response_mask"]
        self.rollout_metrics.update(rollout_probs_diff_metrics(engine, actor, mask, group, device))
        self.rollout_metrics.update(rollout_correction_metrics(actor, engine, mask, corr.rollout_is,
                                                               corr.rollout_is_threshold, group, device))
        if corr.rollout_is and weights:
            rollout["rollout_is_weights"] = algo.compute_rollout_is_weights(actor, engine, mask, corr.rollout_is,
                                                                            corr.rollout_is_threshold)

    # ------------------------------------------------------------------ pieces

    def push_weights(self) -> None:
        """A rollout pool of its own: each bucket of the stream is gathered from the actor ranks'
        shards to the one that broadcasts it (spmdsplit/weight_sync.py)."""
        self.wait_for_weight_receivers()
        dtype = compute_dtypes(self.cfg, self.pools.device)[0]
        self.weights.push(self.actor.engine.iter_weight_shards(dtype), self.pools.group("actor"))

    def wake_rollout(self, broadcast: bool = True) -> None:
        """The rollout engine wakes with the policy's current weights, streamed from the shards
        (and, with rollout.ranks=all, broadcast on to the critic pool's engines by the first rank)."""
        if broadcast and self.weights:
            self.wait_for_weight_receivers()
        weights = self.actor.engine.iter_full_weights(self.rollout.dtype)
        if broadcast and self.weights and self.pools.rank in self.weights.sources:
            weights = self.weights.send(weights)
        self.rollout.wake_up(weights)

    def wait_for_weight_receivers(self) -> None:
        """The sources meet the engines they feed (busy generating or updating for as long as
        they are), then the pool meets, all under the long timeout: the stream's gathers from the
        shards are the pool's collectives, and none may wait for the receivers."""
        if self.pools.rank in self.weights.sources:
            self.weights.ready()
        self.pools.meet("actor")

    def validate(self, step: int, val_rows: list[dict]) -> int:
        """The rollout group on this pool: responses to the validation set, with the policy's
        current weights, to the reward group."""
        with self.timer.phase("sync_weights", step):
            self.wake_rollout(broadcast=False)  # only the actor pool generates validation responses
        num_rows = generate_validation_rows(self.cfg, self.pools, self.rollout, self.channel, self.timer,
                                            self.tokenizer, step, val_rows)
        with self.timer.phase("rollout_sleep", step):
            self.rollout.sleep()  # one wake for every batch of the set
        return num_rows

    def state(self, step: int) -> dict:
        """The data position: the order is a function of (seed, generation batch), so the step is
        the position (dynamic sampling keeps its own); the rest is there to notice a different
        dataset on resume."""
        taken = self.sampler.next_gen_batch - 1 if self.sampler else step
        return {"data": {"prompts_consumed": taken * self.dataset.batch_size, "dataset_rows": len(self.dataset.rows),
                         "seed": self.cfg.data.seed, "shuffle": self.cfg.data.shuffle}}

    def load_state(self, state: dict, same_layout: bool) -> None:
        if state["data"]["dataset_rows"] != len(self.dataset.rows) and self.pools.rank == 0:
            print(f"spmdsplit: warning: the checkpoint was trained on {state['data']['dataset_rows']} prompts, "
                  f"the data now has {len(self.dataset.rows)}: the data order differs from the stopped run", flush=True)

    # ------------------------------------------------------------------ what the trainer calls (Program)

    def start(self, step: int) -> None:
        """A rollout pool of its own starts with the policy's weights (its program's start takes them)."""
        if self.pools.placement.apart("rollout"):
            self.push_weights()

    def export(self, output_dir: str, tokenizer) -> None:
        """The trained policy as a Hugging Face folder, written by the actor group's first rank."""
        placement = self.pools.placement
        self.actor.engine.save_hf(output_dir, tokenizer, is_writer=self.pools.rank == placement.ranks("actor")[0])

    def token_count(self) -> dict[str, float]:
        """The step's tokens (prompts and responses), for rank 0's perf/throughput: this rank's
        shard times the actor ranks, an estimate where the shards differ (verl's
        perf/total_num_tokens is the exact sum; this one costs no collective)."""
        tokens = self.rollout_batch["attention_mask"].sum().item() * len(self.pools.placement.ranks("actor"))
        return {"perf/total_num_tokens": tokens}
