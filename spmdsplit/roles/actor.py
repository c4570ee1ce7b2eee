"""The policy (and, frozen, the reference policy): log-probs of rollouts and the PPO update."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from spmdsplit import algo, lora
from spmdsplit.batch import Batch
from spmdsplit.roles.forward import forward_response
from spmdsplit.roles.ppo_updates import run_ppo_updates
from spmdsplit.roles.micro_batches import Extent, in_row_order, micro_batches, plan_micro_batches


# The rows' places (1-based: a dummy micro-batch zeroes every column, so 0 marks one) while the
# one-pass update shuffles and bins them: where each micro-batch's detached log-probs go back.
UPDATE_ROW = "update_row"


def update_is_one_pass(cfg) -> bool:
    """Whether the update's forward gives the old log-probs (actor.old_log_prob_from_update) and
    every micro-batch's forward in the update runs under the weights it starts from:
    one epoch over one mini-batch (actor.ppo_mini_batch_size = data.train_batch_size, as
    ppo_mini_batch_size must divide it), so the optimizer steps once, after the last backward.
    Then the forward's log-probs, detached, are exactly a separate old-log-prob pass's, up to
    float rounding (docs/algorithms.md, "Old log-probs from the update's own forward")."""
    actor = cfg.actor
    return actor.old_log_prob_from_update and actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == cfg.data.train_batch_size


@dataclass(frozen=True)
class OldFromForward:
    """The update takes its old log-probs from its own forward (`update_is_one_pass`), and the
    truncated importance weights of algorithm.rollout_correction.rollout_is (None: none) from them,
    in the loss, instead of from a separate pass before it."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0


def old_from_forward(cfg, step: int) -> OldFromForward | None:
    """Whether step `step`'s old log-probs are the update's own forward (`update_is_one_pass`):
    not where something needs them before the update (the critic pool's KL penalty in the reward;
    a step of the critic's warm-up, which runs no update), nor in bypass mode (the engine's
    log-probs stand in for them)."""
    corr = cfg.algorithm.rollout_correction
    if (corr.bypass_mode or cfg.algorithm.use_kl_in_reward or step <= cfg.trainer.critic_warmup
            or not update_is_one_pass(cfg)):
        return None
    return OldFromForward(corr.rollout_is, corr.rollout_is_threshold)


def add_rollout_is_weights(rollout: Batch, corr) -> None:
    """algorithm.rollout_correction.rollout_is (`corr`) with the old log-probs of a pass before the
    update: the truncated importance weights the policy loss takes, as a column of the rows, so
    they follow them into every micro-batch (from the update's own forward, the loss computes them:
    update_policy's old_and_weights)."""
    if corr.rollout_is and "rollout_log_probs" in rollout:
        rollout["rollout_is_weights"] = algo.compute_rollout_is_weights(
            rollout["old_log_probs"], rollout["rollout_log_probs"], rollout["response_mask"], corr.rollout_is,
            corr.rollout_is_threshold)


class Actor:
    """remove_padding: each micro-batch's valid tokens packed into one sequence (model.use_remove_padding).
    loss_horizon: the response width `seq-mean-token-sum-norm` (Dr. GRPO) divides by, a constant
    (data.max_response_length): rollouts are cut to their longest response, so the width of the
    rows a rank holds says nothing (None: that width, for callers without a horizon).
    base_only: the reference of a LoRA policy, which is the policy's own engine with its adapter
    disabled (PEFT's switch, a flag on each adapted layer: no weights move)."""

    def __init__(self, engine, cfg, temperature: float, device, rollout_n: int = 1, remove_padding: bool = False,
                 loss_horizon: int | None = None, base_only: bool = False):
        self.engine, self.cfg, self.temperature, self.device = engine, cfg, temperature, device
        self.rollout_n = rollout_n
        self.remove_padding = remove_padding
        self.loss_horizon = loss_horizon
        self.base_only = base_only

    def _log_probs(self, micro: Batch, entropy: str, extent: Extent | None = None):
        """(log-probs, entropy or None) of the response tokens; entropy: none | grad | detached
        (see algo.logprobs_and_entropy). Divided by the sampling temperature: the log-probs must
        be those of the distribution the rollout actually sampled from. With logits_chunk_size, the
        LM head and this run a chunk of tokens at a time (roles/lm_head.py): no inner chunks then."""
        chunk = self.cfg.logits_chunk_size
        inner = None if chunk else algo.CHUNK_ELEMENTS

        def head(logits, tokens):
            return algo.logprobs_and_entropy(logits, tokens, self.temperature, entropy, chunk_elements=inner)
        return forward_response(self.engine, micro, head, self.remove_padding, response_only=True, extent=extent,
                                chunk=chunk)

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> torch.Tensor:
        cfg = self.cfg
        bins = plan_micro_batches(batch, cfg.use_dynamic_bsz, cfg.log_prob_micro_batch_size_per_gpu,
                                  cfg.log_prob_max_token_len_per_gpu, self.engine.group, self.device)
        with lora.adapter_disabled(self.engine.model) if self.base_only else contextlib.nullcontext():
            parts = [self._log_probs(micro, "none", extent)[0] for micro, _, extent in micro_batches(batch, bins)]
        return in_row_order(parts, bins, len(batch))

    def update_policy(self, batch: Batch, seed: int, old_from_forward: OldFromForward | None = None
                      ) -> dict[str, float]:
        """The PPO update over `batch`'s rows. old_from_forward: `batch` has no old_log_probs; the
        update's forward gives them (detached) and, once it is done, they are `batch`'s column."""
        cfg = self.cfg
        self.engine.model.train()
        counts = {"horizon": self.loss_horizon}
        policy_loss = algo.get_policy_loss_fn(cfg.policy_loss.loss_mode)  # vanilla: PPO's dual clip
        forward_log_probs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, detached log-probs)
        rollout = batch
        if old_from_forward:  # a column of the update's own copy, so each micro-batch carries its rows' places
            batch = Batch({**rollout.tensors, UPDATE_ROW: torch.arange(1, len(rollout) + 1, device=self.device)},
                          dict(rollout.non_tensors))

        def old_and_weights(micro: Batch, log_prob: torch.Tensor):
            """PPO's old log-probs and the rollout-correction weights of this micro-batch."""
            if not old_from_forward:
                # algorithm.rollout_correction.rollout_is (add_rollout_is_weights)
                return micro["old_log_probs"], micro["rollout_is_weights"] if "rollout_is_weights" in micro else None
            # The weights the rollout is scored against are the ones this forward runs under: its
            # log-probs are the old ones (ratio 1, gradient that of the ratio), as TRL's GRPO.
            old_log_probs = log_prob.detach()
            forward_log_probs.append((micro[UPDATE_ROW], old_log_probs))
            if old_from_forward.rollout_is is None:
                return old_log_probs, None
            return old_log_probs, algo.compute_rollout_is_weights(
                old_log_probs, micro["rollout_log_probs"], micro["response_mask"], old_from_forward.rollout_is,
                old_from_forward.rollout_is_threshold)

        def micro_loss(micro: Batch, num_tokens, num_seqs, extent: Extent):
            mask = micro["response_mask"]
            counts.update(num_tokens=num_tokens, num_seqs=num_seqs)
            # verl's rule: no entropy graph when its coefficient is 0 (it is still logged).
            log_prob, entropy = self._log_probs(micro, "grad" if cfg.entropy_coeff else "detached", extent)
            old_log_probs, rollout_is_weights = old_and_weights(micro, log_prob)
            pg_loss, pg_metrics = policy_loss(
                old_log_probs, log_prob, micro["advantages"], mask, cfg.loss_agg_mode, cfg,
                rollout_is_weights=rollout_is_weights, **counts,
            )
            entropy_share = algo.agg_loss(entropy, mask, cfg.loss_agg_mode, **counts)
            loss = pg_loss - cfg.entropy_coeff * entropy_share
            # The numbers stay tensors: run_ppo_updates sums them on the device and reads them once a step.
            shares = {"actor/pg_loss": pg_loss}
            if cfg.use_kl_loss:
                kl = algo.kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
                kl_share = algo.agg_loss(kl, mask, cfg.loss_agg_mode, **counts)
                loss = loss + cfg.kl_loss_coef * kl_share
                shares["actor/kl_loss"] = kl_share
            n = mask.sum()
            # the loss's metrics are means over this micro-batch's tokens: weighted by its token count
            pieces = {name: (value, n) for name, value in pg_metrics.items()}
            pieces["actor/entropy"] = (algo.masked_mean(entropy.detach(), mask), n)
            return loss, shares, pieces

        metrics = run_ppo_updates(self.engine, batch, cfg, self.rollout_n, seed, self.device, micro_loss)
        if old_from_forward:
            rollout["old_log_probs"] = _in_place_of_rows(forward_log_probs, len(rollout))
        metrics["actor/grad_norm"] = metrics.pop("grad_norm")
        metrics["actor/lr"] = metrics.pop("lr")
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return metrics


def _in_place_of_rows(pieces: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int) -> torch.Tensor:
    """The micro-batches' [b, R] outputs, each with its rows' 1-based places, as one [num_rows, R]
    tensor in row order; a dummy micro-batch's (place 0) dropped."""
    places = torch.cat([rows for rows, _ in pieces])
    values = torch.cat([out for _, out in pieces])
    real = places > 0
    result = values.new_zeros((num_rows, values.shape[1]))
    result[places[real] - 1] = values[real]
    return result
