"""DeepSpeed ZeRO 1/2/3 over one pool's group: the second training engine, beside FSDP2.

Same small interface as `FSDPEngine` (`model`, `group`, `dp_size`, `__call__`, `backward`, `step`, `iter_full_weights`,
`save_hf`, `save_checkpoint`, `load_checkpoint`), so the roles do not know
which engine they hold.

Confinement to the pool. DeepSpeed is handed an `mpu` whose data-parallel group is the pool's
group and whose model-parallel group is this rank alone, so its gradient reductions, ZeRO
partitions and parameter gathers all run over the pool. A few calls in DeepSpeed 0.19 still go
to the *world* whatever the mpu says; with the other pool busy elsewhere they hang (a barrier
the other pool never joins) or fail. `engines/deepspeed_compat.py` scopes each to the pool (and
works around DeepSpeed's other rough edges), each with the DeepSpeed version it targets and the
test that shows it is needed; this engine runs every DeepSpeed call inside `_pool_scope`.

Gradient scale. `managed_gradient_accumulation=false` (DeepSpeed 0.19) makes `step` the boundary
that finalizes and updates, which is this interface exactly. What `backward` does with the
gradient then depends on the stage (DeepSpeed 0.19.8, runtime/engine.py `step`, runtime/zero/
stage_1_and_2.py `reduce_ready_partitions_and_remove_grads`): ZeRO-2 and ZeRO-3 reduce-scatter
every backward's gradients into this rank's partition and drop the whole ones, as FSDPEngine
does by default, so several micro-batches never hold more than a partition; ZeRO-1 keeps whole
gradients (its design: only optimizer state is partitioned) and all-reduces them once, in `step`.
DeepSpeed averages gradients over its data-parallel group (the pool), as FSDP does, so
`backward` multiplies this rank's loss share by the pool size, as FSDPEngine does;
`gradient_accumulation_steps` is 1, so DeepSpeed divides by nothing else.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from spmdsplit.engines.common import HFExport, adamw_with_warmup, apply_ac
from spmdsplit.engines.deepspeed_compat import (active_group, checkpoint_config, comm_device,
                                                import_before_zero_init, init_deepspeed_comm,
                                                install_pool_scoping, zero_init)
from spmdsplit.models import ModelSource, hf_tensors
from spmdsplit.weight_sync import WeightShard

CHECKPOINT_TAG = "engine"  # fixed: the caller owns the directory and publishes it; no "latest" file


class _PoolMPU:
    """The `mpu` DeepSpeed asks for its groups: data parallel = the pool, nothing else."""

    def __init__(self, group: dist.ProcessGroup, single: dist.ProcessGroup):
        self.group, self.single = group, single

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_model_parallel_group(self):
        return self.single

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0

    # DeepSpeed >= 0.14 asks for these names too (tensor parallel = model parallel here).
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


_SINGLE_GROUPS: dict[int, dist.ProcessGroup] = {}


def _single_rank_group() -> dist.ProcessGroup:
    """A group of this rank alone (DeepSpeed's model-parallel group). `use_local_synchronization`
    lets each rank create its own without the rest of the world calling new_group with it."""
    rank = dist.get_rank()
    if rank not in _SINGLE_GROUPS:
        _SINGLE_GROUPS[rank] = dist.new_group(ranks=[rank], use_local_synchronization=True)
    return _SINGLE_GROUPS[rank]


def ds_config(zero_stage: int, optim, param_dtype, dp_size: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # only for DeepSpeed's sample counters: we feed batches ourselves
        "gradient_accumulation_steps": 1,
        "train_batch_size": dp_size,
        "managed_gradient_accumulation": False,  # backward accumulates, step() is the boundary
        "zero_optimization": {"stage": zero_stage},
        # check_grad_overflow: skip a step whose grad norm is not finite in bf16 too (DeepSpeed's
        # default, spelled out: FSDPEngine does the same, and fp32 ZeRO always does).
        "bf16": {"enabled": param_dtype == torch.bfloat16, "check_grad_overflow": True},
        "zero_allow_untested_optimizer": True,  # a torch AdamW we build: no config-named op to JIT-compile
        "checkpoint": checkpoint_config(),  # deepspeed_compat 4: no world all-reduce of the tag
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if optim is not None:
        config["gradient_clipping"] = float(optim.grad_clip)
    if zero_stage == 3:
        # Every parameter is partitioned and gathered when used, however small: the model's layout
        # is then the same on every pool size, and iter_full_weights gathers everything the same way.
        config["zero_optimization"].update(stage3_param_persistence_threshold=0)
    return config


class DeepSpeedEngine(HFExport):
    """A model under DeepSpeed ZeRO over a pool, with AdamW, linear warmup and grad clipping when it
    trains; `zero_stage` 0 (no sharding) or 3 for a frozen model (reference, reward model)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, zero_stage: int, optim=None, param_dtype=None,
                 activation_checkpointing: bool = False):
        import deepspeed

        if optim is None and zero_stage not in (0, 3):
            raise ValueError(f"ZeRO stage {zero_stage} partitions optimizer state (and gradients): a model that only "
                             "infers has neither; use stage 3 (sharded weights) or 0")
        if optim is not None and zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage}: a trained model takes ZeRO stage 1, 2 or 3")
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.zero_stage = zero_stage
        self.optim_cfg = optim
        self.device = next(model.parameters()).device
        if optim is None and param_dtype is None and next(model.parameters()).dtype == torch.bfloat16:
            param_dtype = torch.bfloat16  # a frozen model held in bf16 (GPU): DeepSpeed must keep it so
        self.compute_dtype = param_dtype or next(model.parameters()).dtype
        init_deepspeed_comm()
        install_pool_scoping()
        if activation_checkpointing:
            apply_ac(model)
        optimizer = scheduler = None
        if optim is None:
            model.requires_grad_(False)
            model.eval()
        else:
            # The schedule is stepped by us, not by DeepSpeed (which skips it on a skipped step): as in FSDPEngine.
            optimizer, scheduler = adamw_with_warmup(model.parameters(), optim)
        config = ds_config(zero_stage, optim, param_dtype, self.dp_size)
        mpu = _PoolMPU(group, _single_rank_group())
        with self._pool_scope():
            self.ds, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=config, mpu=mpu, dist_init_required=False)
        self.scheduler = scheduler
        self.model = self.ds.module  # the HF model: .config, .train(), .eval(), save_hf
        if optim is None:
            self.model.eval()

    @classmethod
    def from_source(cls, source: ModelSource, group: dist.ProcessGroup, zero_stage: int, device: torch.device,
                    optim=None, param_dtype=None, activation_checkpointing: bool = False) -> "DeepSpeedEngine":
        """The engine of `source`. ZeRO-3 on a pool of more than one rank loads it straight into its
        partitions (`load_into_partitions`); otherwise every rank holds it whole anyway and reads it."""
        if zero_stage == 3 and dist.get_world_size(group) > 1:
            if optim is None and param_dtype is None and source.dtype == torch.bfloat16:
                param_dtype = torch.bfloat16  # a frozen bf16 model stays bf16, as in __init__
            config = ds_config(zero_stage, optim, param_dtype, dist.get_world_size(group))
            model = load_into_partitions(source, group, device, config)
        else:
            model = source.read(device)
        return cls(model, group, zero_stage, optim, param_dtype, activation_checkpointing)

    def _pool_scope(self):
        return active_group(self.group)

    def __call__(self, *args, **kwargs):
        with self._pool_scope():
            return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        with self._pool_scope():
            self.ds.backward(loss * self.dp_size)

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool):
        """Nothing to switch: ZeRO-2/3 partition gradients in every backward, ZeRO-1 all-reduces its
        whole gradients once, in `step` (the module docstring); DeepSpeed's `no_sync` refuses
        ZeRO-2/3, so `no_sync_accumulation` is refused with this engine (preflight.check_engines)."""
        yield

    def step(self) -> dict[str, float]:
        """Reduces, clips, steps (DeepSpeed skips a step whose grad norm is not finite); returns
        grad_norm (before clipping) and lr. The LR schedule advances once per trainer step, not here."""
        lr = self.scheduler.get_last_lr()[0]
        with self._pool_scope():
            self.ds.step()
        grad_norm = self.ds.get_global_grad_norm()
        grad_norm = float(grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm)
        return {"grad_norm": grad_norm, "lr": lr}

    @torch.no_grad()
    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor in `dtype`) for each weight. ZeRO-3 gathers one module's own
        parameters at a time over the pool and hands out cast copies after releasing them; ZeRO
        0/1/2 hold them whole already. A pool collective under ZeRO-3: every rank of the pool must
        consume the whole stream, in order."""
        cast = (lambda t: t.detach().to(dtype, copy=True)) if dtype is not None else (lambda t: t.detach().clone())
        if self.zero_stage != 3:
            for name, tensor in hf_tensors(self.model):
                yield name, cast(tensor)
            return
        import deepspeed

        names = {id(t): n for n, t in hf_tensors(self.model)}
        for module in self.model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in names]
            buffers = [b for b in module.buffers(recurse=False) if id(b) in names]
            if not own and not buffers:
                continue
            with self._pool_scope(), deepspeed.zero.GatheredParameters(own, modifier_rank=None):
                gathered = [(names.pop(id(t)), cast(t)) for t in own + buffers]
            yield from gathered
            del gathered

    def iter_weight_shards(self, dtype: torch.dtype | None = None) -> Iterator[WeightShard]:
        """Every weight whole on every rank (`iter_full_weights`): ZeRO-3's flat partitions are not
        chunks of the tensors, so a sync to a rollout pool moves the whole model to every rank here,
        as before; FSDP2 hands out its shards (engines/fsdp.py)."""
        for name, tensor in self.iter_full_weights(dtype):
            yield WeightShard(name, tensor, tuple(tensor.shape), sharded=False)

    def save_checkpoint(self, path: str, wait_group: dist.ProcessGroup | None = None) -> None:
        """Weights, optimizer and LR schedule under `path` (which the caller publishes); every rank
        of the pool calls it, only the pool communicates.

        `wait_group`: the pool's gloo meeting group (trainer.pool_wait_timeout_s). DeepSpeed 0.19.8's
        save (runtime/engine.py `save_checkpoint`) waits for the pool in two group-less
        `deepspeed.comm.barrier()`s, before and after every rank writes its files (the tag's
        validation, an all-reduce, is off: deepspeed_compat.checkpoint_config); the scoping of
        deepspeed_compat sends them to the active group, here the meeting group, so the wait for
        the slowest rank's write runs under the long timeout instead of the pool's
        trainer.dist_timeout_s. Nothing else in the save communicates."""
        os.makedirs(path, exist_ok=True)  # DeepSpeed makes it on *global* rank 0 only
        client_state = {"spmdsplit_scheduler": self.scheduler.state_dict() if self.scheduler else None,
                        "spmdsplit_pool_size": self.dp_size, "spmdsplit_zero_stage": self.zero_stage}
        with active_group(wait_group or self.group):
            self.ds.save_checkpoint(path, tag=CHECKPOINT_TAG, client_state=client_state, save_latest=False)

    def load_checkpoint(self, path: str, wait_group: dist.ProcessGroup | None = None) -> None:
        """The inverse of save_checkpoint, on a pool of the same size and the same ZeRO stage:
        DeepSpeed's ZeRO files are one per data-parallel rank and do not reshard (FSDP's do).
        DeepSpeed 0.19.8's load has no group-less barrier (`wait_group` routes any to the meeting
        group, as on save); after each rank reads its files, ZeRO's optimizer restores its
        partitions with tensor collectives over the pool's own group (stage_1_and_2.py,
        stage3.py `load_state_dict`), which stay there: on GPUs they are NCCL's, on device
        tensors. A rank whose read outlasts another's by more than trainer.dist_timeout_s
        still trips that timeout there (the files are one per rank, of about equal size)."""
        saved = self._saved_layout(path)
        if saved != (self.dp_size, self.zero_stage):
            raise ValueError(
                f"{path}: saved by DeepSpeed ZeRO-{saved[1]} on a pool of {saved[0]} rank(s); this engine is "
                f"ZeRO-{self.zero_stage} on {self.dp_size}: DeepSpeed checkpoints load only on the same layout")
        with active_group(wait_group or self.group):
            _, client_state = self.ds.load_checkpoint(
                path, tag=CHECKPOINT_TAG, load_optimizer_states=self.optimizer is not None,
                load_lr_scheduler_states=False)
        if client_state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}/{CHECKPOINT_TAG}")
        if self.scheduler is not None and client_state.get("spmdsplit_scheduler") is not None:
            self.scheduler.load_state_dict(client_state["spmdsplit_scheduler"])

    @staticmethod
    def _saved_layout(path: str) -> tuple[int, int]:
        """(pool size, ZeRO stage) a checkpoint was saved with, from the client state DeepSpeed
        keeps in its model-states file (read here before DeepSpeed fails on a mismatch)."""
        folder = os.path.join(path, CHECKPOINT_TAG)
        names = sorted(n for n in os.listdir(folder) if n.endswith("model_states.pt")) if os.path.isdir(folder) else []
        if not names:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {folder}")
        state = torch.load(os.path.join(folder, names[0]), map_location="cpu", weights_only=False)
        return state.get("spmdsplit_pool_size"), state.get("spmdsplit_zero_stage")


@torch.no_grad()
def load_into_partitions(source: ModelSource, group: dist.ProcessGroup, device: torch.device,
                         config: dict[str, Any]) -> nn.Module:
    """`source` partitioned over the pool `group` by ZeRO-3, without any rank but the pool's first
    ever holding it whole. Every rank builds the model under `deepspeed.zero.Init` (each module is
    partitioned as soon as it is made, so a rank holds one whole module at most, and only while it
    is built); the pool's first rank reads the checkpoint on the CPU; then module by module the
    pool gathers the module's parameters, the first rank copies the checkpoint's values in, and
    `GatheredParameters` broadcasts them and partitions again on the way out. Buffers (rotary
    tables) are not partitioned: they are broadcast whole."""
    import deepspeed

    init_deepspeed_comm()
    install_pool_scoping()
    first = dist.get_global_rank(group, 0)
    is_reader = dist.get_rank() == first
    mpu = _PoolMPU(group, _single_rank_group())
    import_before_zero_init(source)
    with active_group(group):
        with zero_init(group, mpu, config, source.dtype):
            model = source.skeleton(device)
        reader = source.read("cpu") if is_reader else None
        # remove_duplicate=False: a head tied to the embeddings is found under its own name too.
        values = dict(reader.named_parameters(remove_duplicate=False)) if is_reader else {}
        done: set[int] = set()
        for module_name, module in model.named_modules():
            own = [(f"{module_name}.{n}" if module_name else n, p) for n, p in module.named_parameters(recurse=False)
                   if id(p) not in done]
            if not own:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0):
                if is_reader:
                    for name, param in own:
                        param.data.copy_(values[name])
            done.update(id(p) for _, p in own)
        buffer_values = dict(reader.named_buffers()) if is_reader else {}
        for name, buffer in model.named_buffers():
            if is_reader:
                buffer.copy_(buffer_values[name])
            on_wire = buffer.to(comm_device(group))
            dist.broadcast(on_wire, src=first, group=group)
            buffer.copy_(on_wire)
    del reader, values, buffer_values
    return model
