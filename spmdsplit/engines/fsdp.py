"""FSDP2 (`fully_shard`) over one pool's device mesh: the training engine the roles use.

Every collective FSDP runs (all-gather of parameters, reduce-scatter of gradients, the
grad-norm reduction, the full-state-dict gather) goes over the mesh it was given, which is
the pool's own group, never the world. So the other pool can be doing anything meanwhile.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spmdsplit.engines.common import HFExport, adamw_with_warmup, apply_ac
from spmdsplit.models import ModelSource, hf_tensors
from spmdsplit.weight_sync import WeightShard


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


def parallelize(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
                activation_checkpointing: bool = False) -> nn.Module:
    """The one way every role's model is prepared for its pool (torchtitan's parallelize_*):
    activation checkpointing if asked (trained roles), then FSDP2."""
    if activation_checkpointing:
        apply_ac(model)
    return apply_fsdp(model, mesh, param_dtype)


@torch.no_grad()
def fill_from_reader(model: nn.Module, reader: nn.Module | None, group: dist.ProcessGroup) -> None:
    """Gives each parameter and buffer of the sharded `model` (fresh from `to_empty`) the value it
    has in `reader`, the whole model that the pool's first rank loaded (None on the other ranks).
    One tensor at a time: the first rank broadcasts it whole over the pool, each rank keeps its
    own shard, and the whole tensor is freed before the next. Written by hand, not with
    `set_model_state_dict(broadcast_from_rank0=True)`: torch 2.13 broadcasts that from *global*
    rank 0, which is not in the critic pool. Buffers are included: the rotary tables are not in
    the checkpoint, and `to_empty` leaves them uninitialised."""
    src = dist.get_global_rank(group, 0)
    if reader is not None:
        given = dict(reader.named_parameters(remove_duplicate=False))
        given.update(reader.named_buffers(remove_duplicate=False))
    for name, target in itertools.chain(model.named_parameters(), model.named_buffers()):
        local = target.to_local() if isinstance(target, DTensor) else target
        if reader is not None:
            full = given[name].detach().to(device=local.device, dtype=local.dtype, copy=True)
        else:
            full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
        dist.broadcast(full, src=src, group=group)
        if isinstance(target, DTensor):  # this rank's slice, cut the way FSDP cut it, no communication
            full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        local.copy_(full)
        del full


def load_into_shards(source: ModelSource, mesh: DeviceMesh, device: torch.device, param_dtype=None,
                     activation_checkpointing: bool = False) -> nn.Module:
    """`source` sharded over the pool `mesh`, without any rank but the pool's first ever holding
    it whole: every rank builds the model on the meta device and shards it, the shards get their
    storage, and the first rank reads the checkpoint (on the CPU) and hands it out tensor by
    tensor (`fill_from_reader`). A pool of one rank just reads it."""
    if mesh.size() == 1:
        return parallelize(source.read(device), mesh, param_dtype, activation_checkpointing)
    group = mesh.get_group()
    model = parallelize(source.skeleton(), mesh, param_dtype, activation_checkpointing)
    model.to_empty(device=device)
    reader = source.read("cpu") if dist.get_rank(group) == 0 else None
    fill_from_reader(model, reader, group)
    del reader
    return model


class FSDPEngine(HFExport):
    """A model sharded over a pool, with AdamW, linear warmup and grad clipping when it trains.

    Losses handed to `backward` must already be this rank's share of the pool-wide loss (see
    algo.agg_loss with global token counts): FSDP averages gradients over the pool, and
    `backward` multiplies by the pool size to turn that average back into the sum of shares.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, optim=None, param_dtype=None,
                 activation_checkpointing: bool = False):
        """`model`: whole on this rank (it is parallelized here), or already sharded (`load_into_shards`)."""
        self.mesh = mesh
        self.group = mesh.get_group()
        self.dp_size = mesh.size()
        if not isinstance(model, FSDPModule):
            model = parallelize(model, mesh, param_dtype, activation_checkpointing)
        self.model = model
        # What the model computes in: the mixed-precision dtype, else its parameters' own.
        self.compute_dtype = param_dtype or next(model.parameters()).dtype
        self.optim_cfg = optim
        self.optimizer = None
        self.scheduler = None
        if optim is None:
            self.model.requires_grad_(False)  # a frozen model (reference policy, reward model)
            self.model.eval()
            return
        # What trains: every parameter, or a LoRA model's adapter alone (its base frozen by PEFT).
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = adamw_with_warmup(self.trained, optim)
        # A checkpoint of a model with a frozen base holds what trains and its optimizer state only:
        # the base is reloaded from its path (DCP's own switch, torch 2.13 state_dict.py). Loading
        # one then sets what trains and leaves the rest (strict=False); that every key it holds was
        # in the checkpoint is dcp.load's check (a key missing from the files raises there).
        frozen_base = len(self.trained) < len(list(self.model.parameters()))
        self.state_options = StateDictOptions(ignore_frozen_params=frozen_base, strict=not frozen_base)

    @classmethod
    def from_source(cls, source: ModelSource, mesh: DeviceMesh, device: torch.device, optim=None,
                    param_dtype=None, activation_checkpointing: bool = False) -> "FSDPEngine":
        """The engine of a model loaded straight into its shards (`load_into_shards`)."""
        model = load_into_shards(source, mesh, device, param_dtype, activation_checkpointing)
        return cls(model, mesh, optim, param_dtype)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.dp_size).backward()

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool):
        """Backwards inside with `enabled=False` do not reduce-scatter: FSDP2 keeps each parameter's
        gradient *unsharded*, in the reduce dtype (fp32), and adds the next ones to it, until a
        backward with `enabled=True` reduces the sum once. A whole fp32 gradient per rank meanwhile
        (4 B/param, whatever the pool size) for one reduce-scatter saved per micro-batch: only
        `no_sync_accumulation` asks for it (roles/ppo_updates.run_ppo_updates)."""
        self.model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def step(self) -> dict[str, float]:
        """Clips and steps; returns grad_norm (before clipping) and lr. The LR schedule advances once
        per trainer step, not here (see roles/ppo_updates.run_ppo_updates)."""
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trained, self.optim_cfg.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        # A non-finite norm means a bad batch: skipping the step keeps the weights usable.
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm.item(), "lr": lr}

    @torch.no_grad()
    def iter_full_weights(self, dtype: torch.dtype | None = None,
                          only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor in `dtype`) for each weight, one at a time: cast, all-gathered over
        the pool, handed over, and freed when the consumer asks for the next. The shard is cast
        before the gather (a DTensor's `.to` is local), so a bf16 rollout's gather moves half the
        bytes of the fp32 masters, with the same values: the cast rounds each element alone. A pool
        collective: every rank of the pool must consume the whole stream, in order. `only`: the
        weights whose names it accepts (a LoRA adapter's), the others neither gathered nor given."""
        for name, tensor in hf_tensors(self.model):
            if only is not None and not only(name):
                continue
            cast = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
            full = cast.full_tensor() if isinstance(cast, DTensor) else cast
            del cast
            yield name, full
            del full

    @torch.no_grad()
    def iter_weight_shards(self, dtype: torch.dtype | None = None,
                           only: Callable[[str], bool] | None = None) -> Iterator[WeightShard]:
        """Each weight as this rank holds it, cast to `dtype`, with no communication: FSDP2 cuts
        every parameter along dim 0 into the pool's chunks (its Shard(0) placement: torch.chunk,
        ceil(rows / pool) rows a rank), and buffers are whole on every rank. What
        weight_sync.push brings bucket by bucket to one rank only. A parameter under another
        placement is gathered whole (on every rank, in order: a pool collective then). `only`: as
        iter_full_weights'."""
        for name, tensor in hf_tensors(self.model):
            if only is not None and not only(name):
                continue
            cast = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
            if not isinstance(cast, DTensor):
                yield WeightShard(name, cast, tuple(cast.shape), sharded=False)
            elif tuple(cast.placements) == (Shard(0),):
                yield WeightShard(name, cast.to_local(), tuple(cast.shape), sharded=True)
            else:
                yield WeightShard(name, cast.full_tensor(), tuple(cast.shape), sharded=False)

    def save_checkpoint(self, path: str, wait_group: dist.ProcessGroup | None = None) -> None:
        """Weights, optimizer and LR schedule under `path`, each rank writing its own shards
        (torch.distributed.checkpoint over the pool's ranks only); every pool rank calls it.

        `wait_group`: the pool's gloo meeting group (Pools.meet_group, trainer.pool_wait_timeout_s),
        over the same ranks in the same order, so DCP's file names and plans are the pool group's.
        DCP's own collectives (torch 2.13, checkpoint/utils.py `_DistWrapper`; state_dict_saver.py
        and state_dict_loader.py) are object collectives only, pickled plans and results on the
        host: gather + scatter of the plans, then a gather of every rank's write results and a
        broadcast of the metadata, which waits for the slowest rank's write (its read, on load).
        On the pool's NCCL group that wait runs under trainer.dist_timeout_s, and one rank's write
        of a large shard to a busy filesystem may outlast it; on gloo it waits as long as any
        wait for another pool. The tensors themselves never travel: each rank writes and reads its
        own shards, device to file (torch's async_save even requires a CPU backend for this)."""
        dcp.save(self._training_state(), checkpoint_id=path, process_group=wait_group or self.group)

    def load_checkpoint(self, path: str, wait_group: dist.ProcessGroup | None = None) -> None:
        """The inverse of save_checkpoint. DCP reshards, so the pool may have another size."""
        state = self._training_state()
        dcp.load(state, checkpoint_id=path, process_group=wait_group or self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self.state_options)
        self.scheduler.load_state_dict(state["scheduler"])

    def _training_state(self) -> dict:
        if self.optimizer is None:
            raise RuntimeError("a frozen model has no training state to checkpoint; it is reloaded from its path")
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self.state_options)
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict()}
