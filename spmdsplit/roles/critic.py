"""The value model: values of rollout states and the clipped value-loss update."""

from __future__ import annotations

import torch

from spmdsplit import algo
from spmdsplit.batch import Batch
from spmdsplit.roles.forward import forward_response
from spmdsplit.roles.ppo_updates import run_ppo_updates
from spmdsplit.roles.micro_batches import Extent, in_row_order, micro_batches, plan_micro_batches


def value_head(outputs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The token classifier's one output is the value (of the state before each token)."""
    return outputs[..., 0].float()


class Critic:
    """remove_padding and loss_horizon: as the Actor's."""

    def __init__(self, engine, cfg, device, rollout_n: int = 1, remove_padding: bool = False,
                 loss_horizon: int | None = None):
        self.engine, self.cfg, self.device = engine, cfg, device
        self.rollout_n = rollout_n
        self.remove_padding = remove_padding
        self.loss_horizon = loss_horizon

    def _values(self, micro: Batch, extent: Extent | None = None) -> torch.Tensor:
        # 0 past the end of a response: forward_response leaves no value there.
        return forward_response(self.engine, micro, value_head, self.remove_padding, extent=extent)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        cfg = self.cfg
        bins = plan_micro_batches(batch, cfg.use_dynamic_bsz, cfg.forward_micro_batch_size_per_gpu,
                                  cfg.forward_max_token_len_per_gpu, self.engine.group, self.device)
        values = [self._values(micro, extent) for micro, _, extent in micro_batches(batch, bins)]
        return in_row_order(values, bins, len(batch))

    def update_critic(self, batch: Batch, seed: int) -> dict[str, float]:
        cfg = self.cfg
        self.engine.model.train()

        def micro_loss(micro: Batch, num_tokens, num_seqs, extent: Extent):
            mask = micro["response_mask"]
            vpreds = self._values(micro, extent)
            vf_loss, vf_clipfrac = algo.compute_value_loss(
                vpreds, micro["returns"], micro["values"], mask, cfg.cliprange_value,
                loss_agg_mode=cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=self.loss_horizon,
            )
            # Tensors, summed on the device by run_ppo_updates and read once a step.
            n = mask.sum()
            pieces = {
                "critic/vf_clipfrac": (vf_clipfrac, n),
                "critic/vpred_mean": (algo.masked_mean(vpreds.detach(), mask), n),
            }
            return vf_loss, {"critic/vf_loss": vf_loss}, pieces

        metrics = run_ppo_updates(self.engine, batch, cfg, self.rollout_n, seed, self.device, micro_loss)
        metrics["critic/grad_norm"] = metrics.pop("grad_norm")
        metrics["critic/lr"] = metrics.pop("lr")
        return metrics
