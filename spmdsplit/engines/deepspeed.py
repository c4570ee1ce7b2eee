"""DeepSpeed ZeRO 1/2/3 over one pool's group: the second training engine, beside FSDP2.

Same small interface as `FSDPEngine` (`model`, `group`, `dp_size`, `__call__`, `backward`, `step`,
`full_state_dict`, `save_hf`, `save_checkpoint`, `load_checkpoint`), so the roles do not know
which engine they hold.

Confinement to the pool. DeepSpeed is handed an `mpu` whose data-parallel group is the pool's
group and whose model-parallel group is this rank alone, so its gradient reductions, ZeRO
partitions and parameter gathers all run over the pool. A few calls in DeepSpeed 0.19 still go
to the *world* whatever the mpu says; with the other pool busy elsewhere they hang (a barrier
the other pool never joins) or fail. Each is scoped to the pool below, in the narrowest way
found, and `tests/test_deepspeed.py::test_each_unscoped_call_hangs_beside_another_pool` shows
that without each scoping the same job hangs:

  1. `deepspeed.comm.torch.TorchBackend.__init__` JIT-builds the CPU shared-memory all-reduce
     op (`build_shm_op`: 53 s of C++ compile on a fresh machine here) although only tensor-parallel
     inference (`inference_all_reduce`) ever uses it. Not a collective, but it makes the first
     start slow: `build_shm_op` is replaced by `lambda: None` while we create the backend.
  2. `PartitionedParameterCoordinator.reset_step` (ZeRO-3) checks that every rank recorded the
     same module trace with `deepspeed.runtime.zero.utils.assert_ints_same_as_other_ranks`,
     which broadcasts from *global* rank 0 over the world: replaced (in the modules that
     imported it) by the same check over the pool, from the pool's first rank.
  3. `deepspeed.comm.barrier()` with no group: in `DeepSpeedZeroOptimizer_Stage3.__init__`
     (`_create_fp16_partitions_with_defragmentation`, `_setup_for_real_optimizer`) and in
     `DeepSpeedEngine.save_checkpoint` (before and after writing): while this engine runs a
     DeepSpeed call, a barrier with no group is a barrier over the pool.
  4. `DeepSpeedEngine._checkpoint_tag_validation` all-reduces a hash of the tag over the world:
     turned off by DeepSpeed's own config, `checkpoint.tag_validation="Ignore"` (the tag is a
     constant here, so there is nothing to validate).
The scope (2, 3) is active only inside this engine's methods (`_pool_scope`), so DeepSpeed calls
made by anyone else are untouched.

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
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from spmdsplit.engines.common import HFExport, adamw_with_warmup, apply_ac
from spmdsplit.models import ModelSource, hf_tensors

# DeepSpeed 0.19 calls torch's all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13
# deprecates with a FutureWarning on every call: theirs to change, and noise in every step's log.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

CHECKPOINT_TAG = "engine"  # fixed: the caller owns the directory and publishes it; no "latest" file

# The process group of the engine whose method is running (innermost last); DeepSpeed calls
# that would go to the world go to this group instead while it is set.
_ACTIVE_GROUPS: list[dist.ProcessGroup] = []
_PATCHED = False


@contextlib.contextmanager
def _active_group(group: dist.ProcessGroup):
    """DeepSpeed's world-wide calls (2, 3 above) go to `group` while inside."""
    _ACTIVE_GROUPS.append(group)
    try:
        yield
    finally:
        _ACTIVE_GROUPS.pop()


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


def _pool_assert_ints_same(original):
    """`assert_ints_same_as_other_ranks` over the active pool: the pool's first rank's list is
    broadcast over the pool and every rank compares its own to it (same check, same message)."""

    def check(ints: list[int]) -> None:
        if not _ACTIVE_GROUPS:
            return original(ints)
        group = _ACTIVE_GROUPS[-1]
        device = _comm_device(group)
        src = dist.get_global_rank(group, 0)
        length = torch.tensor([len(ints)], dtype=torch.long, device=device)
        dist.broadcast(length, src=src, group=group)
        if int(length.item()) != len(ints):
            raise RuntimeError(f"ZeRO-3 trace: {len(ints)} entries on rank {dist.get_rank()}, "
                               f"{int(length.item())} on the pool's first rank {src}")
        first = torch.tensor(ints, dtype=torch.long, device=device)
        dist.broadcast(first, src=src, group=group)
        if first.tolist() != list(ints):
            raise RuntimeError(f"ZeRO-3 trace differs between rank {dist.get_rank()} and the pool's first rank {src}: "
                               f"{list(ints)} vs {first.tolist()}")

    return check


def _pool_barrier(original):
    """`deepspeed.comm.barrier`: with no group while a pool engine runs, a barrier over the pool."""

    def barrier(group=None, *args, **kwargs):
        if group is None and _ACTIVE_GROUPS:
            group = _ACTIVE_GROUPS[-1]
        return original(group, *args, **kwargs)

    return barrier


def _comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _install_pool_scoping() -> None:
    """Installs the wrappers (2, 3 of the module docstring) once per process. Outside an engine's
    `_pool_scope` they call straight through to DeepSpeed's own functions."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    # For the tests that show each scoping is needed: "trace" and/or "barrier" leave that one out.
    unscoped = set(os.environ.get("SPMDSPLIT_DS_UNSCOPED", "").split(","))
    import deepspeed.comm
    import deepspeed.runtime.zero.partition_parameters as partition_parameters
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.utils as zero_utils

    # DeepSpeed 0.19.8, deepspeed/runtime/zero/partitioned_param_coordinator.py,
    # PartitionedParameterCoordinator.reset_step: trace check over the world from global rank 0.
    # partition_parameters (safe_mode) and stage3 (enable_sanity_checks) import the same function
    # for checks that are off by default; they are scoped too so that turning them on stays safe.
    check = _pool_assert_ints_same(zero_utils.assert_ints_same_as_other_ranks)
    for module in (coordinator, partition_parameters, stage3):
        if "trace" not in unscoped:
            module.assert_ints_same_as_other_ranks = check
    # DeepSpeed 0.19.8, deepspeed/runtime/zero/stage3.py (DeepSpeedZeroOptimizer_Stage3.
    # _create_fp16_partitions_with_defragmentation, ._setup_for_real_optimizer) and
    # deepspeed/runtime/engine.py (DeepSpeedEngine.save_checkpoint): `dist.barrier()` with no
    # group, where `dist` is the package `deepspeed.comm`, looked up at call time.
    if "barrier" not in unscoped:
        deepspeed.comm.barrier = _pool_barrier(deepspeed.comm.barrier)


def init_deepspeed_comm() -> None:
    """DeepSpeed's communication backend on top of the torch.distributed world already there,
    without the JIT build of its CPU shared-memory op (1 in the module docstring)."""
    import importlib

    import deepspeed.comm

    # importlib, not `import deepspeed.comm.torch as`: the package's `torch` attribute is torch itself.
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    if ds_comm.cdb is not None:
        return
    # DeepSpeed 0.19.8, deepspeed/comm/torch.py, TorchBackend.__init__ calls build_shm_op(),
    # which compiles deepspeed_shm_comm (C++, 53 s here) on first use; None is its own "not
    # available" answer, after which all collectives go through torch.distributed as usual.
    original = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
    finally:
        ds_torch.build_shm_op = original


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
        "checkpoint": {"tag_validation": "Ignore"},  # 4: no world all-reduce of the tag
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if optim is not None:
        config["gradient_clipping"] = float(optim.grad_clip)
    if zero_stage == 3:
        # Every parameter is partitioned and gathered when used, however small: the model's layout
        # is then the same on every pool size, and full_state_dict gathers everything the same way.
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
        _install_pool_scoping()
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
        return _active_group(self.group)

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
        ZeRO-2/3, so `no_sync_accumulation` is refused with this engine (config.check_engines)."""
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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on every rank of the pool. ZeRO-3 gathers them over the pool (every
        parameter's `ds_process_group` is the pool's group); ZeRO 0/1/2 hold them whole already.
        Tied weights stay one tensor under both names."""
        with self._pool_scope():
            if self.zero_stage != 3:
                return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            import deepspeed

            params = list(self.model.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                clones: dict[int, torch.Tensor] = {}
                state = {}
                for name, tensor in self.model.state_dict(keep_vars=True).items():
                    key = id(tensor)
                    if key not in clones:
                        clones[key] = tensor.detach().clone()
                    state[name] = clones[key]
            return state

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

    def save_checkpoint(self, path: str) -> None:
        """Weights, optimizer and LR schedule under `path` (which the caller publishes); every rank
        of the pool calls it, only the pool communicates."""
        os.makedirs(path, exist_ok=True)  # DeepSpeed makes it on *global* rank 0 only
        client_state = {"spmdsplit_scheduler": self.scheduler.state_dict() if self.scheduler else None,
                        "spmdsplit_pool_size": self.dp_size, "spmdsplit_zero_stage": self.zero_stage}
        with self._pool_scope():
            self.ds.save_checkpoint(path, tag=CHECKPOINT_TAG, client_state=client_state, save_latest=False)

    def load_checkpoint(self, path: str) -> None:
        """The inverse of save_checkpoint, on a pool of the same size and the same ZeRO stage:
        DeepSpeed's ZeRO files are one per data-parallel rank and do not reshard (FSDP's do)."""
        saved = self._saved_layout(path)
        if saved != (self.dp_size, self.zero_stage):
            raise ValueError(
                f"{path}: saved by DeepSpeed ZeRO-{saved[1]} on a pool of {saved[0]} rank(s); this engine is "
                f"ZeRO-{self.zero_stage} on {self.dp_size}: DeepSpeed checkpoints load only on the same layout")
        with self._pool_scope():
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
    _install_pool_scoping()
    first = dist.get_global_rank(group, 0)
    is_reader = dist.get_rank() == first
    mpu = _PoolMPU(group, _single_rank_group())
    # A first build on the meta device (no storage) imports everything the model's construction
    # imports: under zero.Init, which patches tensor construction, a first import of torch._dynamo
    # (transformers imports it lazily) fails.
    source.skeleton("meta")
    with _active_group(group):
        # No `dtype=`: the config's bf16 switch decides, as deepspeed.initialize would. (DeepSpeed
        # 0.19.8's _set_dtype, given a dtype, parses `dtype or fp16 if fp16_ok else bf16 ...` so
        # that on a CPU it yields bf16 whatever dtype was asked for.)
        with deepspeed.zero.Init(data_parallel_group=group, mpu=mpu, config_dict_or_path=config):
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
            on_wire = buffer.to(_comm_device(group))
            dist.broadcast(on_wire, src=first, group=group)
            buffer.copy_(on_wire)
    del reader, values, buffer_values
    return model
