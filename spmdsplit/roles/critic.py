"""The value model: values of rollout states and the clipped value-loss update."""

from __future__ import annotations

import torch

from spmdsplit import algo
from spmdsplit.batch import Batch
from spmdsplit.roles.common import forward_response, run_ppo_updates


class Critic:
    def __init__(self, engine, cfg, device, rollout_n: int = 1):
        self.engine, self.cfg, self.device = engine, cfg, device
        self.rollout_n = rollout_n

    def _values(self, micro: Batch) -> torch.Tensor:
        values = forward_response(self.engine, micro)[..., 0].float()
        return values * micro["response_mask"]  # no value past the end of a response

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        return torch.cat([self._values(m) for m in batch.split(self.cfg.forward_micro_batch_size_per_gpu)])

    def update_critic(self, batch: Batch, seed: int) -> dict[str, float]:
        cfg = self.cfg
        self.engine.model.train()

        def micro_loss(micro: Batch, num_tokens, num_seqs):
            mask = micro["response_mask"]
            vpreds = self._values(micro)
            vf_loss, vf_clipfrac = algo.compute_value_loss(
                vpreds, micro["returns"], micro["values"], mask, cfg.cliprange_value,
                loss_agg_mode=cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
            )
            self.engine.backward(vf_loss)
            n = mask.sum().item()
            pieces = {
                "critic/vf_clipfrac": (vf_clipfrac.item(), n),
                "critic/vpred_mean": (algo.masked_mean(vpreds.detach(), mask).item(), n),
            }
            return {"critic/vf_loss": vf_loss.item()}, pieces

        metrics = run_ppo_updates(self.engine, batch, cfg, self.rollout_n, seed, self.device, micro_loss)
        metrics["critic/grad_norm"] = metrics.pop("grad_norm")
        metrics["critic/lr"] = metrics.pop("lr")
        return metrics
