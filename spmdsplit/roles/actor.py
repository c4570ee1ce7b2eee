"""The policy (and, frozen, the reference policy): log-probs of rollouts and the PPO update."""

from __future__ import annotations

import torch

from spmdsplit import algo
from spmdsplit.batch import Batch
from spmdsplit.roles.common import forward_response, run_ppo_updates
from spmdsplit.roles.micro_batches import Extent, in_row_order, micro_batches, plan_micro_batches


class Actor:
    """remove_padding: each micro-batch's valid tokens packed into one sequence (model.use_remove_padding).
    loss_horizon: the response width `seq-mean-token-sum-norm` (Dr. GRPO) divides by, a constant
    (data.max_response_length): rollouts are cut to their longest response, so the width of the
    rows a rank holds says nothing (None: that width, for callers without a horizon)."""

    def __init__(self, engine, cfg, temperature: float, device, rollout_n: int = 1, remove_padding: bool = False,
                 loss_horizon: int | None = None):
        self.engine, self.cfg, self.temperature, self.device = engine, cfg, temperature, device
        self.rollout_n = rollout_n
        self.remove_padding = remove_padding
        self.loss_horizon = loss_horizon

    def _log_probs(self, micro: Batch, entropy: str, extent: Extent | None = None):
        """(log-probs, entropy or None) of the response tokens; entropy: none | grad | detached
        (see algo.logprobs_and_entropy). Divided by the sampling temperature: the log-probs must
        be those of the distribution the rollout actually sampled from."""
        def head(logits, tokens):
            return algo.logprobs_and_entropy(logits, tokens, self.temperature, entropy)
        return forward_response(self.engine, micro, head, self.remove_padding, response_only=True, extent=extent)

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> torch.Tensor:
        cfg = self.cfg
        bins = plan_micro_batches(batch, cfg.use_dynamic_bsz, cfg.log_prob_micro_batch_size_per_gpu,
                                  cfg.log_prob_max_token_len_per_gpu, self.engine.group, self.device)
        parts = [self._log_probs(micro, "none", extent)[0] for micro, _, extent in micro_batches(batch, bins)]
        return in_row_order(parts, bins, len(batch))

    def update_policy(self, batch: Batch, seed: int) -> dict[str, float]:
        cfg = self.cfg
        self.engine.model.train()
        counts = {"horizon": self.loss_horizon}
        policy_loss = algo.get_policy_loss_fn(cfg.policy_loss.loss_mode)  # vanilla: PPO's dual clip

        def micro_loss(micro: Batch, num_tokens, num_seqs, extent: Extent):
            mask = micro["response_mask"]
            counts.update(num_tokens=num_tokens, num_seqs=num_seqs)
            # verl's rule: no entropy graph when its coefficient is 0 (it is still logged).
            log_prob, entropy = self._log_probs(micro, "grad" if cfg.entropy_coeff else "detached", extent)
            pg_loss, pg_metrics = policy_loss(
                micro["old_log_probs"], log_prob, micro["advantages"], mask, cfg.loss_agg_mode, cfg,
                # algorithm.rollout_correction.rollout_is (programs/actor.py apply_rollout_correction)
                rollout_is_weights=micro["rollout_is_weights"] if "rollout_is_weights" in micro else None,
                **counts,
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
        metrics["actor/grad_norm"] = metrics.pop("grad_norm")
        metrics["actor/lr"] = metrics.pop("lr")
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return metrics
