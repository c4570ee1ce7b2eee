"""`python -m tools.plan.memory_plan [--config PRESET] [--model NAME|config.json] [--world-size N] [--json] [key=value ...]`

A memory plan from our own step: each pool of a preset's layout builds its models (actor and
reference where the actor group sits, the critic where the critic group sits) from a Hugging
Face config with no weights (FakeTensorMode: tensors with a shape, a dtype and a device but no
storage), shards them with our FSDP2 engine (`engines/fsdp.py parallelize` + `FSDPEngine`, as
`load_into_shards` does, without the weights it would read) over a fake process group of the
pool's size (torch's `fake` backend: every collective returns at once, with nothing moved), and
runs our own roles' code (`roles/actor.py`, `roles/critic.py`, `roles/forward.py`, `roles/ppo_updates.py`) on one
micro-batch per phase: the actor's and the reference's log-prob pass, the critic's values, and
one optimizer step of the actor and of the critic (forward, backward, clip, AdamW), gradient
checkpointing and mixed precision as the config sets them. torch's `FSDPMemTracker` counts what
one rank holds through each phase, by category; a rank's peak is its largest phase, plus what its
other models keep meanwhile (their shards and optimizer state), plus the rollout engine, which is
not simulated: vLLM's `gpu_memory_utilization` x the device while it is awake, or the HF copy and
its KV cache (tools/plan/memory.py's arithmetic). Printed next to tools/plan/memory.py's prediction of the
same shape and workload.

Every micro-batch holds rows of the full prompt + response length (the widest a rollout gets,
what tools/plan/memory.py sizes for): with a token budget (use_dynamic_bsz) budget // row tokens of
them, packed; else the configured rows, padded. One micro-batch per mini-batch, so gradients are
reduce-scattered in the one backward (no_sync_accumulation's whole gradient is not planned).

What it does not see: NCCL's buffers, the CUDA context, the caching allocator's rounding beyond
512 B and its fragmentation, vLLM's own use (taken as its share, not simulated), DeepSpeed (FSDP2
only). The fake tensors live on the CPU device here (no CUDA on this machine): the tracker counts
bytes per device the same way, except that CUDA rounds each block up to 512 B, which it adds on
CUDA only. `model.attn_implementation=flash_attention_2`, `varlen` or `auto` (the GPU presets) is planned with
torch's varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`, whose fake kernel keeps
what FlashAttention-2 keeps: the output and its log-sum-exp, no [T, T] matrix), since flash-attn
does not install here.

`--real` runs the same step on real CPU tensors instead (small shapes only): what the test
compares the plan against. `--doc docs/memory.md` rewrites the plan's table in that page.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace

import torch

from tools.models import ModelShape
from tools.plan import memory
from tools.plan.memory import GB, QWEN25, Workload

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "temporaries")
# FSDPMemTracker's categories (torch/distributed/_tools/fsdp2_mem_tracker.py _FSDPRefType) in ours.
TRACKER_CATEGORIES = {
    "Sharded Param": "parameters", "Unsharded Param": "parameters", "Buffer": "parameters",
    "All Gather": "parameters", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients", "OptState": "optimizer state", "Activation": "activations",
    "Inputs": "activations", "Temp": "temporaries",
}


# ---------------------------------------------------------------------------------------------
# The model's config


def write_config(shape: ModelShape, folder: str) -> str:
    """A Qwen2 config.json of `shape` in `folder` (what ModelSource.skeleton reads)."""
    shape.qwen2_config().save_pretrained(folder)
    return folder


def model_folder(model: str, scratch: str) -> tuple[str, ModelShape]:
    """(folder holding config.json, its shape) for a name of memory.QWEN25, a config.json or a folder."""
    if model in QWEN25:
        return write_config(QWEN25[model], os.path.join(scratch, model)), QWEN25[model]
    folder = os.path.dirname(model) if model.endswith(".json") else model
    return folder, ModelShape.from_folder(folder)


# ---------------------------------------------------------------------------------------------
# Running our code on fake tensors


class _FakeHost:
    """What makes our host code run over fake tensors, and keeps the plan's own process small.

    A fake tensor has no value; where our code reads one on the host (a metric's `.tolist()`, the
    grad norm's `.item()`, `if torch.isfinite(norm)`), it gets 1 (True), so the code takes its
    ordinary path (the step is taken). Real tensors are read as they are: the rollout rows are
    real (the micro-batch plan reads their lengths).

    A factory call with no tensor to follow (`torch.empty(size)`) makes a real tensor even while
    the model's are fake: FSDP2 makes its all-gather outputs, unsharded parameters and
    reduce-scatter inputs that way, gigabytes each at 7B and more. Under `fake_mode`, those of 64
    KiB or more are made fake (the tracker counts them the same); smaller ones stay real, as the
    0-d sums and index tensors the host reads."""

    SMALL = 1 << 16

    def __init__(self, fake_mode=None):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch._subclasses.fake_tensor import FakeTensor

                kwargs = kwargs or {}
                if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
                    return True if args[0].dtype == torch.bool else (1.0 if args[0].is_floating_point() else 1)
                from torch._guards import active_fake_mode

                # (not inside DTensor's own fake mode, which works out shardings on its own tensors)
                if fake_mode is not None and active_fake_mode() is None and _large_factory(args, kwargs, _FakeHost.SMALL):
                    with fake_mode:
                        return func(*args, **kwargs)
                return func(*args, **kwargs)

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _large_factory(args, kwargs, small: int) -> bool:
    """A call that takes no tensor and makes one of `small` bytes or more from a size (empty,
    zeros, full, empty_strided...)."""
    # A size first (cheap: most ops take a tensor there), then no tensor anywhere else.
    if not args or not isinstance(args[0], (list, tuple, torch.Size)) or not all(isinstance(n, int) for n in args[0]):
        return False
    from torch.utils._pytree import tree_flatten

    if any(torch.is_tensor(x) for x in tree_flatten((args[1:], kwargs))[0]):
        return False
    numel = 1
    for n in args[0]:
        numel *= n
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return numel * dtype.itemsize >= small


def _varlen_flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """FlashAttention-2's packed path as transformers calls it (integrations/flash_attention.py,
    modeling_flash_attention_utils._prepare_from_posids: q, k, v made contiguous [T, H, D], the
    rows' boundaries from `cu_seq_lens_q`), on torch's varlen flash kernel, which keeps what
    flash-attn keeps for backward (q, k, v, the output and its log-sum-exp)."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x.transpose(1, 2).contiguous().view(-1, x.size(1), x.size(-1)) for x in (query, key, value))
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=True)
    return out[None], None


def gpu_attention(cfg) -> str:
    """The attention a GPU job of this config runs (models.attention_implementation on cuda), as
    planned here: spmdsplit's varlen (auto without flash-attn) runs torch's varlen kernel on cuda,
    the kernel the flash_attention_2 stand-in runs, so both are planned with it."""
    from spmdsplit.models import attention_implementation

    attention = attention_implementation(cfg.model.attn_implementation, "cuda")
    return "flash_attention_2" if attention == "varlen" else attention


@contextlib.contextmanager
def flash_attention_standin():
    """transformers' "flash_attention_2" served by `_varlen_flash_attention` while inside."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    before = local.get("flash_attention_2")
    local["flash_attention_2"] = _varlen_flash_attention
    try:
        yield
    finally:
        if before is None:
            local.pop("flash_attention_2", None)
        else:
            local["flash_attention_2"] = before


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of these tensors (a DTensor's local shard), as the tracker counts."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        key = (id(storage), storage.data_ptr()) if not _is_fake(local) else id(storage)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@dataclass
class Model:
    """One model of a rank: its engine and role object, and what it keeps between phases."""
    name: str
    engine: object
    role: object

    def resident(self) -> dict[str, int]:
        keep = {"parameters": _storage_bytes([*self.engine.model.parameters(), *self.engine.model.buffers()])}
        if self.engine.optimizer is not None:
            keep["optimizer state"] = _storage_bytes(v for s in self.engine.optimizer.state.values() for v in s.values()
                                                     if torch.is_tensor(v))
        return keep


def _engine(kind: str, folder: str, cfg, mesh, dtype, mixed, optim, checkpointing: bool, fake):
    """Our FSDP2 engine of one model, built as `FSDPEngine.from_source` builds it (skeleton on
    the meta device, `parallelize`, storage for the shards) but without reading weights: fake
    shards under `fake`, else real ones of small random values (the real run of the test)."""
    from spmdsplit.engines.fsdp import FSDPEngine, parallelize
    from spmdsplit.models import ModelSource

    attention = gpu_attention(cfg)
    # The skeleton is built under sdpa (flash-attn does not install here); the plan's stand-in
    # takes flash_attention_2 over once it is set back on the config.
    source = ModelSource(kind, folder, dtype, cfg.trainer.seed, cfg.model.trust_remote_code,
                         "sdpa" if attention == "flash_attention_2" else attention)
    model = parallelize(source.skeleton(), mesh, mixed, checkpointing)
    if attention == "flash_attention_2":
        model.config._attn_implementation = "flash_attention_2"
    with fake if fake is not None else contextlib.nullcontext():
        model.to_empty(device="cpu")
    if fake is None:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.normal_(0, 0.02) if t.dim() else t.fill_(1.0)
            for m in model.modules():  # the rotary table: finite values, so a real step is taken
                if hasattr(m, "inv_freq"):
                    m.inv_freq.copy_(torch.linspace(1.0, 1e-4, m.inv_freq.numel()))
    return FSDPEngine(model, mesh, optim, mixed)


def rows_per_micro(dynamic: bool, budget: int, rows: int, row_tokens: int) -> int:
    """Rows of `row_tokens` tokens one micro-batch holds: budget // row_tokens with a token budget, else `rows`."""
    return max(1, budget // row_tokens) if dynamic else rows


def rollout_rows(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """A rank's rollout of `rows` full rows (every prompt and response token real), with the
    columns the update reads."""
    from spmdsplit.batch import Batch
    from spmdsplit.inference.base import position_ids_from_mask

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(3, vocab, (rows, response_len), generator=g)
    mask = torch.ones(rows, prompt_len + response_len, dtype=torch.long)
    response_mask = torch.ones(rows, response_len, dtype=torch.long)
    return Batch({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                  "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
                  "position_ids": position_ids_from_mask(mask),
                  "old_log_probs": -2.0 - torch.rand(rows, response_len, generator=g),
                  "ref_log_prob": -2.0 - torch.rand(rows, response_len, generator=g),
                  "advantages": torch.randn(rows, response_len, generator=g),
                  "values": torch.randn(rows, response_len, generator=g) * 0.1,
                  "returns": torch.randn(rows, response_len, generator=g)})


def _categories(snapshot: dict) -> dict[str, int]:
    """The tracker's peak snapshot (device -> {its category: bytes}), summed over devices, in ours."""
    out = dict.fromkeys(CATEGORIES, 0)
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            name = getattr(kind, "value", kind)
            if name in TRACKER_CATEGORIES:
                out[TRACKER_CATEGORIES[name]] += nbytes
    return out


def _tracked(model: Model, run, fake_mode=None, allocator: bool = False) -> dict:
    """The peak of one phase by category: `run()` under FSDPMemTracker rooted at this model
    (which counts its shards, gradients, optimizer state and everything allocated inside).
    `allocator` (real tensors only): also the peak by the CPU allocator's own count (below)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model.engine.model, model.engine.optimizer)
    with contextlib.ExitStack() as stack:
        profiler = stack.enter_context(_allocator_events()) if allocator else None
        stack.enter_context(_FakeHost(fake_mode))
        stack.enter_context(tracker)
        run()
    out = {"bytes": _categories(tracker.get_tracker_snapshot("peak"))}
    if profiler is not None:
        out["allocator"] = sum(model.resident().values()) + _peak_of(profiler)
    return out


def _allocator_events():
    """torch.profiler with memory on: the CPU allocator reports every allocation and free
    (c10's profiledCPUMemoryReporter) to the op running it, or as a "[memory]" event of its own."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def _peak_of(profiler) -> int:
    """The most bytes live at once during the profile, over what was live at its start: the
    running sum of the allocator's +/- events in time order. Independent of the tracker: it sees
    every allocation the allocator serves, whatever made it."""
    # An allocation or free inside an op counts in that op's own (self) memory use, one outside
    # any op is a "[memory]" event of its own.
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in profiler.events())
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def _warm_optimizer(engine) -> None:
    """AdamW's moments exist from the first step on: one step on zero gradients creates them
    (untracked), so the tracked step is a steady-state one."""
    for p in engine.model.parameters():
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)


def pool_phases(cfg, folder: str, vocab: int, size: int, groups: set[str], fake: bool = True) -> dict:
    """Each phase's tracked peak (by category, this model's) on one rank of a pool of `size`
    ranks holding these role groups, and each model's resident bytes. The fake process group
    must be up, of at least `size` ranks."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh

    from spmdsplit.roles.actor import Actor
    from spmdsplit.models import compute_dtypes
    from spmdsplit.roles.build import ref_config, trains_critic
    from spmdsplit.roles.critic import Critic

    group = dist.group.WORLD if size == dist.get_world_size() else dist.new_group(list(range(size)))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("fsdp",))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    device = torch.device("cpu")
    dtype, mixed = compute_dtypes(cfg, torch.device("cuda"))  # the dtypes a GPU job computes in
    P, R = cfg.data.max_prompt_length, cfg.data.max_response_length
    row = P + R
    packed, checkpointing = cfg.model.use_remove_padding, cfg.model.gradient_checkpointing
    models: dict[str, Model] = {}
    runs = {}
    if "actor" in groups:
        a = cfg.actor
        update_rows = rows_per_micro(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, a.ppo_micro_batch_size_per_gpu, row)
        log_prob_rows = rows_per_micro(a.use_dynamic_bsz, a.log_prob_max_token_len_per_gpu,
                                       a.log_prob_micro_batch_size_per_gpu, row)
        ref_cfg = ref_config(cfg)
        ref_rows = rows_per_micro(ref_cfg.use_dynamic_bsz, ref_cfg.log_prob_max_token_len_per_gpu,
                                  ref_cfg.log_prob_micro_batch_size_per_gpu, row)
        # One micro-batch is the whole mini-batch: ppo_mini_batch_size counts prompts over the pool.
        actor_cfg = a.copy()
        actor_cfg.ppo_mini_batch_size, actor_cfg.ppo_epochs = update_rows * size, 1
        actor = Actor(_engine("causal_lm", folder, cfg, mesh, torch.float32, mixed, a.optim, checkpointing, fake_mode),
                      actor_cfg, cfg.rollout.temperature, device, rollout_n=1, remove_padding=packed, loss_horizon=R)
        ref = Actor(_engine("causal_lm", folder, cfg, mesh, dtype, None, None, False, fake_mode), ref_cfg,
                    cfg.rollout.temperature, device, remove_padding=packed)
        models["actor"], models["ref"] = Model("actor", actor.engine, actor), Model("ref", ref.engine, ref)
        # The rows are made here, real, before any fake factory could take them.
        rows = {n: rollout_rows(n, P, R, vocab) for n in {log_prob_rows, ref_rows, update_rows}}
        runs["actor log-probs"] = ("actor", lambda: actor.compute_log_prob(rows[log_prob_rows]))
        runs["ref log-probs"] = ("ref", lambda: ref.compute_log_prob(rows[ref_rows]))
        runs["update actor"] = ("actor", lambda: actor.update_policy(rows[update_rows], seed=1))
    if "critic" in groups and trains_critic(cfg):
        c = cfg.critic
        update_rows = rows_per_micro(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu, c.ppo_micro_batch_size_per_gpu, row)
        value_rows = rows_per_micro(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu,
                                    c.forward_micro_batch_size_per_gpu, row)
        critic_cfg = c.copy()
        critic_cfg.ppo_mini_batch_size, critic_cfg.ppo_epochs = update_rows * size, 1
        critic = Critic(_engine("value", cfg.critic.model_path or folder, cfg, mesh, torch.float32, mixed, c.optim,
                                checkpointing, fake_mode), critic_cfg, device, rollout_n=1, remove_padding=packed,
                        loss_horizon=R)
        models["critic"] = Model("critic", critic.engine, critic)
        critic_rows = {n: rollout_rows(n, P, R, vocab) for n in {value_rows, update_rows}}
        runs["values"] = ("critic", lambda: critic.compute_values(critic_rows[value_rows]))
        runs["update critic"] = ("critic", lambda: critic.update_critic(critic_rows[update_rows], seed=1))
    for m in models.values():
        if m.engine.optimizer is not None:
            with _FakeHost(fake_mode):
                _warm_optimizer(m.engine)
    phases = {}
    with flash_attention_standin() if gpu_attention(cfg) == "flash_attention_2" else contextlib.nullcontext():
        for phase, (name, run) in runs.items():
            phases[phase] = {"model": name, **_tracked(models[name], run, fake_mode, allocator=not fake)}
    return {"phases": phases, "resident": {name: m.resident() for name, m in models.items()}}


# ---------------------------------------------------------------------------------------------
# A rank's peak, and the memory model's prediction


def workload_of(cfg, device_gb: float) -> Workload:
    """tools.plan.memory's Workload of a config: the same shapes, budgets and rollout; NCCL's buffers
    left out (the plan does not see them; the fit table adds them)."""
    a, c = cfg.actor, cfg.critic
    return Workload(dtype_bytes=2 if cfg.model.dtype in ("bfloat16", "auto") else 4, engine="fsdp",
                    gradient_checkpointing=cfg.model.gradient_checkpointing,
                    prompts_per_step=cfg.data.train_batch_size * cfg.rollout.n,
                    prompt_len=cfg.data.max_prompt_length, response_len=cfg.data.max_response_length,
                    mini=a.ppo_mini_batch_size * cfg.rollout.n, micro=a.ppo_micro_batch_size_per_gpu,
                    log_prob_micro=a.log_prob_micro_batch_size_per_gpu,
                    ppo_max_token_len=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else 0,
                    log_prob_max_token_len=a.log_prob_max_token_len_per_gpu if a.use_dynamic_bsz else 0,
                    forward_max_token_len=c.forward_max_token_len_per_gpu if c.use_dynamic_bsz else 0,
                    critic_ppo_max_token_len=c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else 0,
                    rollout=cfg.rollout.name, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                    device_gb=device_gb, nccl_mb=0.0, logits_chunk=a.logits_chunk_size)


def rank_peak(plan: dict, cfg, shape: ModelShape, size: int, groups: set[str], w: Workload) -> dict:
    """One rank's phases, each the tracked peak plus what the rank's other models keep meanwhile,
    and the rollout engine's (not simulated: memory.py's arithmetic); the largest is the rank's peak."""
    resident = plan["resident"]
    phases = {}
    for phase, tracked in plan["phases"].items():
        total = dict(tracked["bytes"])
        for name, keep in resident.items():
            if name != tracked["model"]:
                for k, v in keep.items():
                    total[k] += v
        phases[phase] = total
    if "rollout" in groups:
        everything = dict.fromkeys(CATEGORIES, 0)
        for keep in resident.values():
            for k, v in keep.items():
                everything[k] += v
        if w.rollout == "vllm":
            phases["vLLM awake"] = {**everything, "vLLM": int(w.gpu_memory_utilization * w.device_gb * GB)}
        else:  # the HF copy is kept all the time; its KV cache while it generates
            copy = w.dtype_bytes * shape.params
            for total in phases.values():
                total["HF rollout copy"] = copy
            phases["generate"] = {**everything, "HF rollout copy": copy,
                                  "KV cache": int(memory.kv_cache(shape, w.prompts_per_step // size, w))}
    totals = {phase: sum(v.values()) for phase, v in phases.items()}
    worst = max(totals, key=totals.get)
    return {"phases": phases, "totals": totals, "peak_phase": worst, "peak": totals[worst],
            "by_category": phases[worst]}


def predicted(shape: ModelShape, size: int, groups: set[str], w: Workload) -> dict:
    """tools/plan/memory.py's rank of the same kind: {phase: bytes incl. what is kept} and its peak."""
    ranks = []
    if "actor" in groups:
        ranks.append(("actor ", memory.actor_rank(shape, size, w, engine="rollout" in groups)))
    if "critic" in groups:
        ranks.append(("critic ", memory.critic_rank(shape, size, w)))
    keep = sum(v for _, r in ranks for v in r["keep"].values())
    phases = {prefix + phase: keep + v for prefix, r in ranks for phase, v in r["phases"].items() if v}
    return {"phases": phases, "peak": max(phases.values()) if phases else keep}


# ---------------------------------------------------------------------------------------------
# The command


def plan(cfg, model: str, world_size: int, gpus_per_node: int, device_gb: float, fake: bool = True) -> list[dict]:
    """One object per pool of the layout: its size, role groups, the tracked rank's phases and peak
    by category (bytes), and memory.py's prediction."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from spmdsplit.placement import plan_from_config

    placement = plan_from_config(cfg, world_size, min(world_size, gpus_per_node),
                                 max(1, world_size // gpus_per_node))
    pools = {name: len(ranks) for name, ranks in placement.pools.items()}
    need = max(pools.values())
    if dist.is_initialized() and dist.get_world_size() < need:  # an earlier plan's world is too small
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=need, store=FakeStore())
    w = workload_of(cfg, device_gb)
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        folder, shape = model_folder(model, scratch)
        for name, size in pools.items():
            groups = set(placement.groups_on(name))
            tracked = pool_phases(cfg, folder, shape.vocab, size, groups, fake)
            rank = rank_peak(tracked, cfg, shape, size, groups, w)
            out.append({"pool": name, "ranks": size, "groups": sorted(groups), "model": shape.name,
                        "params": shape.params, "tracked": tracked["phases"], **rank, "predicted": predicted(shape, size, groups, w)})
    return out


def render(pools: list[dict]) -> str:
    gib = lambda b: f"{b / GB:.2f}"  # noqa: E731
    lines = []
    for p in pools:
        lines.append(f"pool {p['pool']}: {p['ranks']} ranks, {', '.join(p['groups'])}; {p['model']} "
                     f"({p['params'] / 1e9:.2f}B); per rank, GB:")
        cats = list(CATEGORIES) + sorted({k for v in p["phases"].values() for k in v} - set(CATEGORIES))
        lines.append("| phase | " + " | ".join(cats) + " | total | tools/plan/memory.py |")
        lines.append("|---" * (len(cats) + 3) + "|")
        model = p["predicted"]["phases"]
        for phase, v in p["phases"].items():
            guess = {"actor log-probs": "actor log-probs", "ref log-probs": "actor log-probs",
                     "update actor": "actor update", "values": "critic values", "update critic": "critic update",
                     "vLLM awake": "actor vLLM awake", "generate": "actor generate (KV cache)"}.get(phase)
            lines.append(f"| {phase} | " + " | ".join(gib(v.get(k, 0)) for k in cats)
                         + f" | {gib(p['totals'][phase])} | {gib(model[guess]) if guess in model else ''} |")
        lines.append(f"peak: {gib(p['peak'])} GB ({p['peak_phase']}); tools/plan/memory.py: "
                     f"{gib(p['predicted']['peak'])} GB ({p['predicted']['peak'] / p['peak'] - 1:+.0%})\n")
    return "\n".join(lines)


# docs/memory.md's table: (model, preset, GPUs, overrides). 32B and 72B take the 7B preset's
# workload; the rows with overrides are the changes that make a case that does not fit fit, and
# 0.5B's logits whole (actor.logits_chunk_size=0) is what the LM head in chunks saves.
SEVEN, HALF = "configs/gpu_qwen2.5_7b.yaml", "configs/gpu_qwen2.5_0.5b.yaml"
CASES = [("Qwen2.5-0.5B", HALF, 8, ()), ("Qwen2.5-0.5B", HALF, 8, ("actor.logits_chunk_size=0",)),
         ("Qwen2.5-7B", HALF, 8, ()), ("Qwen2.5-7B", SEVEN, 8, ()),
         ("Qwen2.5-32B", SEVEN, 16, ()), ("Qwen2.5-32B", SEVEN, 32, ()),
         ("Qwen2.5-72B", SEVEN, 16, ()), ("Qwen2.5-72B", SEVEN, 32, ()),
         # twice the GPUs, the update budgets halved, and vLLM's share what is left beside the
         # resident state (its 145 GB of bf16 weights then need tensor parallelism over 8 GPUs)
         ("Qwen2.5-72B", SEVEN, 64, ("rollout.gpu_memory_utilization=0.45", "rollout.tensor_model_parallel_size=8",
                                     "actor.ppo_max_token_len_per_gpu=8192", "critic.ppo_max_token_len_per_gpu=8192"))]
RESERVE_GB = 4.0  # left per GPU for the CUDA context and fragmentation, as tools.plan --memory leaves
MARK = "<!-- tools.plan.memory_plan table -->"


def fit_rows(pools: list[dict], w: Workload, gpu_gb: float) -> list[dict]:
    """Each pool's planned peak with NCCL's buffers added (memory.py's estimate: the pool's group
    and a two-rank communicator per rank of the other pool it trades rows with) and the margin to
    the GPU less the reserve (negative: over)."""
    rows = []
    for p in pools:
        others = [q["ranks"] for q in pools if q is not p]
        communicators = (p["ranks"] > 1) + sum(memory.links(p["ranks"], o) for o in others)
        nccl = memory.nccl(communicators, replace(w, nccl_mb=Workload.nccl_mb))
        total = p["peak"] + nccl
        rows.append({**p, "nccl": nccl, "with_nccl": total, "margin": (gpu_gb - RESERVE_GB) * GB - total})
    return rows


def table(cases=CASES, gpu_gb: float = 80.0, gpus_per_node: int = 8) -> str:
    """docs/memory.md's table: each case's pools, planned peak (GB), memory.py's, and the fit."""
    from spmdsplit.config import load_config

    lines = ["| model | preset | GPUs | changes | pool (ranks) | planned peak (phase) | + NCCL | tools/plan/memory.py, "
             "no NCCL | fits 80 GB (4 GB reserve) |", "|---|---|---|---|---|---|---|---|---|"]
    for model, preset, gpus, overrides in cases:
        cfg = load_config(preset, [f"model.path={model}", *overrides])
        for r in fit_rows(plan(cfg, model, gpus, gpus_per_node, gpu_gb), workload_of(cfg, gpu_gb), gpu_gb):
            fits = "yes" if r["margin"] >= 0 else "no"
            changes = ", ".join(f"`{o}`" for o in overrides)
            lines.append(f"| {model} | {os.path.basename(preset)} | {gpus} | {changes} | {r['pool']} ({r['ranks']}) | "
                         f"{r['peak'] / GB:.1f} ({r['peak_phase']}) | {r['with_nccl'] / GB:.1f} | "
                         f"{r['predicted']['peak'] / GB:.1f} | {fits}, {r['margin'] / GB:+.1f} GB |")
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def write_doc(path: str, text: str) -> None:
    """`text` between the page's two MARK lines."""
    with open(path) as f:
        before, _, rest = f.read().partition(MARK + "\n")
        _, _, after = rest.partition(MARK + "\n")
    with open(path, "w") as f:
        f.write(before + MARK + "\n" + text + "\n" + MARK + "\n" + after)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.plan.memory_plan", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpu_qwen2.5_7b.yaml", help="a preset (its layout and workload)")
    p.add_argument("--model", default="Qwen2.5-7B",
                   help=f"one of {', '.join(QWEN25)}, a config.json or a folder holding one")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-gb", type=float, default=80.0)
    p.add_argument("--real", action="store_true", help="real CPU tensors instead of fake ones (small shapes only), "
                   "each phase's peak also by the CPU allocator's count (torch.profiler's memory events)")
    p.add_argument("--compare-real", action="store_true",
                   help="the plan on fake tensors, then on real ones: {fake: pools, real: pools} as JSON (small shapes only)")
    p.add_argument("--json", action="store_true", help="one JSON object per pool (bytes)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--doc", help="write docs/memory.md's table of CASES into this page (between its markers)")
    args = p.parse_args(argv)
    from spmdsplit.config import load_config

    if args.doc:
        write_doc(args.doc, table(gpu_gb=args.gpu_gb, gpus_per_node=args.gpus_per_node))
        return 0
    cfg = load_config(args.config, [f"model.path={args.model}", *args.overrides])
    if args.compare_real:
        print(json.dumps({kind: plan(cfg, args.model, args.world_size, args.gpus_per_node, args.gpu_gb, fake=kind == "fake")
                          for kind in ("fake", "real")}))
        return 0
    pools = plan(cfg, args.model, args.world_size, args.gpus_per_node, args.gpu_gb, fake=not args.real)
    print(json.dumps(pools) if args.json else render(pools))
    return 0


if __name__ == "__main__":
    sys.exit(main())
