"""What DeepSpeed 0.19 does wrong (or slowly) when it runs in one pool beside another, and the
narrowest fix found for each. All target DeepSpeed 0.19.8 (pyproject caps it below 0.20;
spmdsplit.versions warns on another version): a new DeepSpeed may move or fix any of them, and
the test named with each says whether the fix is still needed: each can be left out by naming
it in SPMDSPLIT_DS_WITHOUT (comma-separated; tests only), and its test shows what then goes wrong.

Kept apart from `engines/deepspeed.py`, which is the engine itself: DeepSpeed is confined to the
pool there by the `mpu` it is handed; what the mpu does not reach is patched here.

  name             what                                                          without it
  1. shm_build      `init_deepspeed_comm`: no JIT build of the CPU shared-memory    a ~53 s C++ build
                    all-reduce on first start
  2. trace          `install_pool_scoping`: ZeRO-3's module-trace check             hang
                    broadcasts over the world
  3. barrier        `install_pool_scoping`: group-less `deepspeed.comm.barrier()`   hang
                    waits on the world
  4. tag_validation `checkpoint_config`: the checkpoint tag's validation            hang
                    all-reduces over the world
  5. dynamo_import  `import_before_zero_init`: a first import of torch._dynamo      error at build
                    under `zero.Init` fails
  6. zero_init_dtype `zero_init`: `zero.Init` given a `dtype` picks bf16 on a CPU   wrong dtype
                    whatever was asked
  7. (none)         the FutureWarning filter below: torch's deprecation of two      log noise only
                    collectives DeepSpeed calls
Tests: 1 in tests/test_deepspeed.py::test_deepspeed_comm_init_would_build_the_shm_op, 2-4 in
::test_each_unscoped_call_hangs_beside_another_pool, 5-6 in ::test_zero_init_workarounds_are_needed.
2 and 3 are active only inside `active_group(group)`, i.e. inside a pool engine's methods, so
DeepSpeed calls made by anyone else are untouched.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings

import torch
import torch.distributed as dist

# 7. DeepSpeed 0.19 calls torch's all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13
# deprecates with a FutureWarning on every call: theirs to change, and noise in every step's log.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def without(name: str) -> bool:
    """Whether the test running asks to leave workaround `name` out (SPMDSPLIT_DS_WITHOUT)."""
    return name in os.environ.get("SPMDSPLIT_DS_WITHOUT", "").split(",")


def checkpoint_config() -> dict:
    """4. DeepSpeed 0.19.8, deepspeed/runtime/engine.py, `DeepSpeedEngine._checkpoint_tag_validation`
    (called by save_checkpoint, after its first barrier) all-reduces a hash of the tag over the
    world. DeepSpeed's own config turns it off; the engine's tag is a constant, so there is nothing
    to validate. Without it: tests/test_deepspeed.py::
    test_each_unscoped_call_hangs_beside_another_pool[2-tag_validation-_checkpoint_tag_validation]."""
    return {} if without("tag_validation") else {"tag_validation": "Ignore"}


# The process group of the engine whose method is running (innermost last); DeepSpeed calls
# that would go to the world go to this group instead while it is set.
_ACTIVE_GROUPS: list[dist.ProcessGroup] = []
_PATCHED = False


@contextlib.contextmanager
def active_group(group: dist.ProcessGroup):
    """DeepSpeed's world-wide calls (2, 3) go to `group` while inside."""
    _ACTIVE_GROUPS.append(group)
    try:
        yield
    finally:
        _ACTIVE_GROUPS.pop()


def comm_device(group) -> torch.device:
    """Where a tensor for a collective over `group` must live: the current GPU under NCCL, else the CPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _pool_assert_ints_same(original):
    """2. DeepSpeed 0.19.8, deepspeed/runtime/zero/partitioned_param_coordinator.py,
    `PartitionedParameterCoordinator.reset_step` (ZeRO-3) checks that every rank recorded the same
    module trace with `deepspeed/runtime/zero/utils.py::assert_ints_same_as_other_ranks`, which
    broadcasts from *global* rank 0 over the world. Replaced by the same check over the active pool:
    the pool's first rank's list is broadcast over the pool and every rank compares its own to it
    (same check, same message). Without it: tests/test_deepspeed.py::
    test_each_unscoped_call_hangs_beside_another_pool[3-trace-reset_step]."""

    def check(ints: list[int]) -> None:
        if not _ACTIVE_GROUPS:
            return original(ints)
        group = _ACTIVE_GROUPS[-1]
        device = comm_device(group)
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
    """3. `deepspeed.comm.barrier()` with no group, in DeepSpeed 0.19.8's deepspeed/runtime/zero/
    stage3.py (`DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation`,
    `._setup_for_real_optimizer`) and deepspeed/runtime/engine.py (`DeepSpeedEngine.save_checkpoint`,
    before and after writing), waits on the world: while a pool engine runs, it is a barrier over
    the pool. Without it: tests/test_deepspeed.py::test_each_unscoped_call_hangs_beside_another_pool
    [3-barrier-_create_fp16_partitions_with_defragmentation] and [2-barrier-save_checkpoint]."""

    def barrier(group=None, *args, **kwargs):
        if group is None and _ACTIVE_GROUPS:
            group = _ACTIVE_GROUPS[-1]
        return original(group, *args, **kwargs)

    return barrier


def install_pool_scoping() -> None:
    """Installs the wrappers of 2 and 3 once per process. Outside `active_group` they call straight
    through to DeepSpeed's own functions."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    import deepspeed.comm
    import deepspeed.runtime.zero.partition_parameters as partition_parameters
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.utils as zero_utils

    # The coordinator's reset_step is the call that hangs. partition_parameters (safe_mode) and
    # stage3 (enable_sanity_checks) import the same function for checks that are off by default;
    # they are scoped too so that turning them on stays safe.
    check = _pool_assert_ints_same(zero_utils.assert_ints_same_as_other_ranks)
    for module in (coordinator, partition_parameters, stage3):
        if not without("trace"):
            module.assert_ints_same_as_other_ranks = check
    # `dist` in those DeepSpeed files is the package `deepspeed.comm`, looked up at call time.
    if not without("barrier"):
        deepspeed.comm.barrier = _pool_barrier(deepspeed.comm.barrier)


def init_deepspeed_comm() -> None:
    """1. DeepSpeed's communication backend on top of the torch.distributed world already there.
    DeepSpeed 0.19.8, deepspeed/comm/torch.py, `TorchBackend.__init__` calls `build_shm_op()`,
    which JIT-compiles the CPU shared-memory all-reduce `deepspeed_shm_comm` (C++, 53 s on a fresh
    machine here) although only tensor-parallel inference (`inference_all_reduce`) uses it. Not a
    collective, so no hang, only a slow first start: `build_shm_op` answers None (its own "not
    available", after which all collectives go through torch.distributed as usual) while the
    backend is made. Without it: tests/test_deepspeed.py::test_deepspeed_comm_init_would_build_the_shm_op
    (DeepSpeed calls the builder); ::test_ppo_job_with_engine_mix_on_2_plus_2 fails if anything
    lands in TORCH_EXTENSIONS_DIR."""
    import deepspeed.comm

    # importlib, not `import deepspeed.comm.torch as`: the package's `torch` attribute is torch itself.
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    if ds_comm.cdb is not None:
        return
    original = ds_torch.build_shm_op
    if not without("shm_build"):
        ds_torch.build_shm_op = lambda: None
    try:
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
    finally:
        ds_torch.build_shm_op = original


def import_before_zero_init(source) -> None:
    """5. `deepspeed.zero.Init` patches tensor construction, and under it a first import of
    torch._dynamo (which transformers imports lazily while building a model) fails (DeepSpeed
    0.19.8). A first build of `source`'s model on the meta device (no storage) imports everything
    the model's construction imports, before zero.Init. Without it: tests/test_deepspeed.py::
    test_zero_init_workarounds_are_needed[dynamo_import] (a fresh process)."""
    if not without("dynamo_import"):
        source.skeleton("meta")


def zero_init(group: dist.ProcessGroup, mpu, config: dict, dtype: torch.dtype):
    """6. `deepspeed.zero.Init` over `group`, with no `dtype=` (`dtype`, the one the model is
    built in, is not passed): the config's bf16 switch decides, as deepspeed.initialize would.
    DeepSpeed 0.19.8's `Init._set_dtype` (deepspeed/runtime/zero/partition_parameters.py), given a
    dtype, parses `dtype or fp16 if fp16_ok else bf16 ...` so that on a CPU it yields bf16 whatever
    dtype was asked for. Without it: tests/test_deepspeed.py::
    test_zero_init_workarounds_are_needed[zero_init_dtype] (fp32 asked, bf16 built)."""
    import deepspeed

    asked = {"dtype": dtype} if without("zero_init_dtype") else {}
    return deepspeed.zero.Init(data_parallel_group=group, mpu=mpu, config_dict_or_path=config, **asked)
