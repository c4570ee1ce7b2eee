"""FSDP2 (`fully_shard`) over one pool's device mesh: the training engine the roles use.

Every collective FSDP runs (all-gather of parameters, reduce-scatter of gradients, the
grad-norm reduction, the full-state-dict gather) goes over the mesh it was given, which is
the pool's own group, never the world. So the other pool can be doing anything meanwhile.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from spmdsplit.engines.common import HFExport, adamw_with_warmup


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shards each transformer block as its own unit (so only one block is gathered at a time),
    then the rest (embeddings, head) at the root. Blocks are found by the classes HF lists in
    `_no_split_modules`, which works for any architecture HF ships."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


class FSDPEngine(HFExport):
    """A model sharded over a pool, with AdamW, linear warmup and grad clipping when it trains.

    Losses handed to `backward` must already be this rank's share of the pool-wide loss (see
    algo.agg_loss with global token counts): FSDP averages gradients over the pool, and
    `backward` multiplies by the pool size to turn that average back into the sum of shares.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, optim=None, param_dtype=None):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.dp_size = mesh.size()
        self.model = apply_fsdp(model, mesh, param_dtype)
        self.optim_cfg = optim
        self.optimizer = None
        self.scheduler = None
        if optim is None:
            self.model.requires_grad_(False)  # a frozen model (reference policy, reward model)
            self.model.eval()
            return
        self.optimizer, self.scheduler = adamw_with_warmup(self.model.parameters(), optim)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.dp_size).backward()

    def step(self) -> dict[str, float]:
        """Clips and steps; returns grad_norm (before clipping) and lr. The LR schedule advances once
        per trainer step, not here (see roles/common.run_ppo_updates)."""
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        # A non-finite norm means a bad batch: skipping the step keeps the weights usable.
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm.item(), "lr": lr}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on every rank of the pool (a pool-scoped all-gather)."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


    def save_checkpoint(self, path: str) -> None:
        """Weights, optimizer and LR schedule under `path`, each rank writing its own shards
        (torch.distributed.checkpoint over the pool's group only); every pool rank calls it."""
        dcp.save(self._training_state(), checkpoint_id=path, process_group=self.group)

    def load_checkpoint(self, path: str) -> None:
        """The inverse of save_checkpoint. DCP reshards, so the pool may have another size."""
        state = self._training_state()
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])

    def _training_state(self) -> dict:
        if self.optimizer is None:
            raise RuntimeError("a frozen model has no training state to checkpoint; it is reloaded from its path")
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict()}
