"""The critic pool's program: values and rewards of the rollout as it arrives, advantages sent
back, then the critic's update (which may run on while the actor pool generates the next step).
Messages: spmdsplit/messages.py."""

from __future__ import annotations

import torch

from spmdsplit import algo
from spmdsplit.actor_pool import generate_step_rows
from spmdsplit.batch import Batch
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.distributed import pool_reduce_metrics, pool_sum
from spmdsplit.exchange import PendingSend
from spmdsplit.messages import PoolChannel, check_rows
from spmdsplit.metrics import PhaseTimer, compute_data_metrics
from spmdsplit.placement import Pools
from spmdsplit.roles.build import CriticPoolRoles
from spmdsplit.weight_sync import WeightBroadcast


class CriticPool:
    def __init__(self, cfg, pools: Pools, roles: CriticPoolRoles, channel: PoolChannel, timer: PhaseTimer, handoff,
                 generator: "Generator | None" = None):
        self.cfg, self.pools, self.channel, self.timer, self.handoff = cfg, pools, channel, timer, handoff
        self.critic, self.reward, self.kl_ctrl = roles.critic, roles.reward, roles.kl_ctrl
        self.generator = generator  # rollout.ranks=all: this rank generates its share too
        self.chunks = cfg.rollout.stream_chunks

    def step(self, step: int) -> dict[str, float]:
        """[weights in -> gen -> rows out] -> rollout in (values + reward per chunk) [-> log-probs
        in] -> adv -> advantages out -> update_critic. Returns the pool's metrics of the step."""
        phase, channel = self.timer.phase, self.channel
        if self.generator:
            generated = self.generator.generate(step)
        parts = []
        for c in range(self.chunks):
            with phase("exchange/rollout", step, chunk=c) as stats:
                part = channel.recv_rollout(step, c, stats)
            if c == 0:
                self.handoff()  # blocking mode: values start once the actor pool's log-probs are done
            if self.critic is not None:
                with phase("values", step, chunk=c):
                    part["values"] = self.critic.compute_values(part)
            with phase("reward", step, chunk=c):
                part["token_level_scores"], _ = self.reward.compute(part, keep_extras=True)
                if "baseline_responses" in part:  # ReMax
                    part["reward_baselines"] = score_baselines(self.reward, part)
            parts.append(part)
        # Each chunk is as wide as the longest response in it (rollout/base.py): pad them to one width.
        batch = Batch.concat(parts, pad_to_widest=True)
        if self.cfg.algorithm.use_kl_in_reward:  # sent after every rollout chunk, so taken after them
            log_probs = []
            for c in range(self.chunks):
                with phase("exchange/log_probs", step, chunk=c) as stats:
                    log_probs.append(channel.recv_log_probs(step, c, stats))
            log_probs = Batch.concat(log_probs, pad_to_widest=True)
            check_rows(log_probs, batch, "log-probs")
            # As wide as the actor ranks' rollouts, which need not be this rank's width.
            width = batch["responses"].shape[1]
            batch.update(log_probs.select(["old_log_probs", "ref_log_prob"]).with_width(width))
        with phase("adv", step):
            metrics = self.compute_advantage(batch)
        metrics.update(self.reward.pop_extra_metrics(self.pools.critic_group, self.pools.device))  # e.g. "acc"
        # Back in the chunks they came in, so each actor rank gets exactly its rows.
        sends = [channel.send_advantages(step, c, part) for c, part in enumerate(batch.split(len(parts[0])))]
        if self.critic is not None:
            with phase("update_critic", step):
                metrics.update(self.critic.update_critic(batch, seed=self.cfg.trainer.seed * 7919 + step))
        metrics.update(compute_data_metrics(batch, self.pools.critic_group, self.pools.device,
                                            self.cfg.data.max_response_length))
        self.handoff()  # blocking mode: the actor updates only after the critic did
        for sent in sends:
            sent.wait()
        if self.generator:
            generated.wait()
        return metrics

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
        # Every estimator gets the same keywords and takes what it uses (algo.py, "registries"),
        # plus the batch columns its registration names: values (gae), reward_baselines (remax).
        estimator = algo.get_adv_estimator(alg.adv_estimator)
        missing = [column for column in estimator.inputs if column not in batch]
        if missing:
            raise ValueError(f"algorithm.adv_estimator={alg.adv_estimator} needs the batch column(s) {missing}, "
                             "which this step's rollout did not provide")
        batch["advantages"], batch["returns"] = estimator.fn(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
            index=batch["uid"], gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            reduce_sum=reduce_sum, **{column: batch[column] for column in estimator.inputs},
        )
        return metrics

    def score_validation(self, step: int, num_rows: int, sources: list[str]) -> dict[str, float]:
        """The validation responses in, scored by the reward: verl's val-core/<data_source>/reward/mean@n.
        `sources`: every data_source of the set, so that every rank reduces the same keys."""
        n = self.cfg.rollout.val_kwargs.n
        batch = self.channel.recv_val_rollout(step, num_rows)
        with self.timer.phase("val_reward", step):
            _, scores = self.reward.compute(batch)
        sums = {f"val-core/{ds}/reward/mean@{n}": 0.0 for ds in sources}
        counts = dict.fromkeys(sums, 0.0)
        for ds, score in zip(batch["data_source"], scores.tolist()):
            sums[f"val-core/{ds}/reward/mean@{n}"] += score
            counts[f"val-core/{ds}/reward/mean@{n}"] += 1
        return pool_reduce_metrics(sums, counts, self.pools.critic_group, self.pools.device)


def score_baselines(reward, part: Batch) -> torch.Tensor:
    """ReMax's `reward_baselines`: the reward of each row's greedy response to its prompt,
    scored once per prompt group (its rows share the greedy response) by the same reward."""
    first_of = {}
    for i, uid in enumerate(part["uid"]):
        first_of.setdefault(uid, i)
    firsts = part.index(list(first_of.values()))
    P = firsts["input_ids"].shape[1] - firsts["responses"].shape[1]
    responses, mask = firsts["baseline_responses"], firsts["baseline_response_mask"]
    greedy = Batch({"responses": responses, "response_mask": mask,
                    "input_ids": torch.cat([firsts["input_ids"][:, :P], responses], dim=1),
                    "attention_mask": torch.cat([firsts["attention_mask"][:, :P], mask], dim=1)},
                   {k: firsts[k] for k in ("data_source", "ground_truth", "extra_info")})
    _, scores = reward.compute(greedy)
    group = {uid: g for g, uid in enumerate(first_of)}
    return scores[torch.tensor([group[uid] for uid in part["uid"]], device=scores.device)]


class Generator:
    """rollout.ranks=all: a critic-pool rank's share of the generation. Its engine gets the
    policy's weights from the actor pool's broadcast, generates this rank's prompts, and sends
    the rows to the actor pool, which treats them as its own (spmdsplit/messages.py)."""

    def __init__(self, cfg, pools: Pools, rollout, weights: WeightBroadcast, channel: PoolChannel, timer: PhaseTimer,
                 dataset: PromptDataset, tokenizer, sampler: DynamicSampling | None = None):
        self.cfg, self.pools, self.rollout, self.weights = cfg, pools, rollout, weights
        self.channel, self.timer, self.dataset, self.tokenizer = channel, timer, dataset, tokenizer
        self.sampler = sampler  # algorithm.filter_groups: decided with the actor pool's ranks

    def generate(self, step: int) -> PendingSend:
        with self.timer.phase("sync_weights", step):
            self.weights.ready()
            self.rollout.wake_up(self.weights.receive())
        with self.timer.phase("gen", step):
            generated = generate_step_rows(self.cfg, self.dataset, self.tokenizer, self.rollout, self.pools, step,
                                           self.sampler)
        if self.sampler:
            self.sampler.pop_metrics(step)  # the actor pool's ranks report the same numbers
        with self.timer.phase("rollout_sleep", step):
            self.rollout.sleep()  # before the rows go out (see ActorPool.roll_out)
        return self.channel.send_generated(step, generated)
