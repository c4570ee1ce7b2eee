"""An inference engine: vLLM, in-process, one engine per generating rank (or tensor-parallel group), under
torchrun (`rollout.name=vllm`). vLLM is imported only from here, and only when it is chosen.

Four things make an in-process vLLM engine safe inside an SPMD trainer (measured facts in the
project's VLLM_NOTES; every vLLM path that can reach other ranks is listed, with what we do about
it, in docs/rollout.md "What vLLM runs over the world"):

* vLLM adopts the trainer's torch world and creates its own process groups with `new_group` over
  *every* rank (tensor-, pipeline-, data-, expert-parallel, ..., each for the device and for gloo).
  `new_group` is collective over the world, so every rank must create them at the same point of
  the program, even ranks that build no engine: `init_vllm_distributed`, called by every rank right
  after the pools are built. Engine ranks then find the groups made and create none.
* vLLM's *world group* is that whole torch world, and several of its paths after start-up run
  collectives on it (the KV-cache size all-reduce of its torchrun executor; on Hopper/Blackwell the
  FlashInfer autotune of its kernel warm-up, an `all_gather_object` and a `barrier`). Ranks
  without an engine never join them. So every rank also builds an *engine world*: one group per
  engine over that engine's ranks (its tensor-parallel group), and an engine's executor makes it
  vLLM's world group as soon as the worker's start-up has checked the real one
  (`PoolExecutor`): every later world-group collective of that engine, known or not, stays
  among the ranks that run it.
* On CPU, vLLM repacks linear weights for oneDNN when it loads them, so writing new tensors into
  the engine's model (`model.load_weights`, the fast path on CUDA) fails or, for the LM head,
  silently leaves the old weights; `reload_weights` re-runs the loading and does update it.
* An engine that shares its device with training sleeps between its generations (GPU sleep mode);
  one on a device of its own (a rollout pool apart) stays awake and takes new weights in place.

With a LoRA policy (spmdsplit/lora.py) the engine keeps the base it loads from model.path and each
sync brings the adapter alone: vLLM 0.32 loads an adapter only from a folder, so this rank writes it
to a folder of its own (`AdapterFolder`: /dev/shm where it fits) and loads it in place under one id.
"""

from __future__ import annotations

import functools
import gc
import os
import shutil
import sys
import tempfile
import weakref
from typing import Iterable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from spmdsplit import lora
from spmdsplit.batch import Batch
from spmdsplit.distributed import world_rank
from spmdsplit.inference.base import GREEDY, Delta, engine_index, engine_peers, rollout_batch
from spmdsplit.seeds import SeedSequence, engine_own_seed

# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes() (0.32);
# spmdsplit/preflight.py check_vllm refuses other sizes before the job starts.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_DEFAULT_KV_CACHE_GB = 1.0
# vllm/config/lora.py MaxLoRARanks (0.32): the adapter ranks an engine can be started for.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(cfg) -> int:
    """The largest adapter rank the engine is started for: rollout.max_lora_rank, or the policy's
    rank rounded up to one vLLM takes (preflight.check_lora checks both)."""
    return cfg.rollout.max_lora_rank or next(r for r in MAX_LORA_RANKS if r >= cfg.model.lora_rank)


def head_size(model_path: str, trust_remote_code: bool = False) -> int:
    from transformers import AutoConfig

    # A multimodal checkpoint nests its language model's config; older configs have no head_dim
    # (getattr), whose heads then split the hidden size.
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def engine_kwargs(cfg, model_path: str, device: torch.device, dtype: torch.dtype, sleeps: bool = True) -> dict:
    """`LLM(...)` arguments, the same on every rank (the distributed set-up reads them too).
    `sleeps`: the engine shares its device with training, so it sleeps between generations."""
    r = cfg.rollout
    kv_gb = r.kv_cache_memory_gb or (CPU_DEFAULT_KV_CACHE_GB if device.type == "cpu" else 0)
    # LoRA: one adapter slot (the policy's, replaced in place at each sync); its dtype the engine's.
    # On CPU vLLM then runs without compilation (it forces CompilationMode.NONE with LoRA).
    adapter = dict(enable_lora=True, max_lora_rank=max_lora_rank(cfg), max_loras=1) if lora.engines_take_adapter(cfg) else {}
    return dict(
        **adapter,
        model=model_path,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
        trust_remote_code=cfg.model.trust_remote_code,
        seed=cfg.trainer.seed,
        tensor_parallel_size=r.tensor_model_parallel_size,
        distributed_executor_backend=PoolExecutor(device),
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        gpu_memory_utilization=r.gpu_memory_utilization,
        # On CPU vLLM would size the KV cache from the NUMA node's memory minus this whole
        # process (trainer included): an explicit size is the only predictable one.
        kv_cache_memory_bytes=int(kv_gb * 2**30) if kv_gb else None,
        enforce_eager=r.enforce_eager,
        enable_prefix_caching=r.enable_prefix_caching,
        # CPU refuses sleep mode; an engine on a device of its own never sleeps, and without sleep
        # mode vLLM allocates through torch's allocator, not its own mapped one (device_allocator/).
        enable_sleep_mode=r.free_cache_engine and device.type == "cuda" and sleeps,
        # Log-probs of the distribution tokens were sampled from (after temperature), which is what
        # the actor scores; the default ("raw") ignores the temperature.
        logprobs_mode="processed_logprobs",
        # Sampling comes from rollout.* only, never from the checkpoint's generation_config.json
        # (an instruct model's repetition_penalty, top_k, ...), as in HFEngine.
        generation_config="vllm",
        # One scheduling mode on every device, the one the suite runs: vLLM 0.32 turns async
        # scheduling on by itself on CUDA for this executor (config/vllm.py; the external launcher
        # supports it) and off on CPU (platforms/cpu.py). Under it `step()` returns one engine
        # step late, with the next batch already launched: continuous generation's loads between
        # steps would land under a batch in flight (its tokens tagged with the new version), the
        # fixed schedule's clock would differ from CPU's, and a sleep would find that batch in
        # `batch_queue` (release_kv_cache_memory refuses). Off, each step completes before it returns.
        async_scheduling=False,
    )


@functools.lru_cache(maxsize=1)
def _user_autotune_root() -> str:
    """VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR as the user set it, read before an engine replaces it."""
    return os.environ.get("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "")


def flashinfer_autotune_dir(engine_index: int) -> str:
    """The folder of this engine's FlashInfer autotune results (Hopper and later GPUs), one per engine.
    vLLM 0.32 names the file after the rank in its world group (model_executor/warmup/
    kernel_warmup.py flashinfer_autotune: `autotune_configs_dp0_rank{world rank}.json`, in a
    folder named by the engine's config hash); the engine world makes that 0 in every engine, so
    the engines of one node (or of a shared home) would write and read one file at the same time,
    and FlashInfer's save is not atomic. Under the folder vLLM would use (or the one the user set in
    VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR), a subfolder per engine index: the same engine of the same
    job reuses its results on a restart."""
    root = _user_autotune_root()
    if not root:
        import vllm.envs as envs

        root = os.path.join(envs.VLLM_CACHE_ROOT, "flashinfer_autotune_cache")
        try:  # vLLM's default also keys the folder by FlashInfer's build (its JIT workspace)
            from flashinfer.jit import env as flashinfer_env

            workspace = flashinfer_env.FLASHINFER_WORKSPACE_DIR
            root = os.path.join(root, workspace.parent.name, workspace.name)
        except Exception:  # no FlashInfer (CPU, ROCm): no autotune runs, the folder stays unused
            pass
    return os.path.join(os.path.expanduser(root), f"engine{engine_index}")


def PoolExecutor(device: torch.device):
    """vLLM's torchrun executor (`external_launcher`: one worker in this process) confined to the
    engine's ranks (a function, so vLLM is imported only when called):

    * vLLM's world group becomes the engine world (`init_vllm_distributed`) once the worker's
      `init_device` has run: it re-enters vLLM's distributed set-up, which asserts that the world
      group spans torch's whole world. What follows it reads the engine world: the KV-cache size
      taken as the minimum over the world's ranks (so over the engine's), the profiling run, the
      kernel warm-ups (FlashInfer's autotune gathers and barriers over the world) and CUDA-graph
      capture (docs/rollout.md lists each path).
    * The worker's device is this rank's trainer device, not `LOCAL_RANK` (the external launcher's
      default): where a cluster binds one GPU per task, the rank's device is cuda:0 whatever its
      local rank."""
    from vllm.distributed import parallel_state
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    local_rank = vllm_local_rank(device)

    class _PoolExecutor(ExecutorWithExternalLauncher):
        def _distributed_args(self) -> tuple[str, int, int]:
            return "env://", dist.get_rank(), local_rank

        def _init_executor(self) -> None:
            super()._init_executor()  # the worker: init_device (world check), load_model
            parallel_state._WORLD = _WORLDS["engine"]  # noqa: SLF001 - vLLM reads its world from here

    return _PoolExecutor


def vllm_local_rank(device: torch.device) -> int:
    """The device index vLLM's worker takes as its local rank: the trainer's own device on CUDA."""
    return device.index if device.type == "cuda" else int(os.environ.get("LOCAL_RANK", 0))


# vLLM's world group as its set-up makes it (every rank of the torch world) and the engine world
# (each rank's engine's ranks): set by init_vllm_distributed on every rank, destroyed by shutdown.
_WORLDS: dict = {}


def init_vllm_distributed(cfg, model_path: str, device: torch.device, dtype: torch.dtype) -> None:
    """vLLM's process groups, created by every rank at the same point (right after the pools are
    built), engine or not; torch.distributed must be initialised. Also fixes what vLLM reads from
    the environment once: in-process engines (no engine-core subprocess).

    What a rank without an engine pays (vLLM 0.32, parallel_state.py; docs/rollout.md "vLLM's
    groups"): vLLM cuts the whole world into tensor-parallel groups of consecutive ranks (and
    pipeline/context/data-parallel groups of one rank here; expert-parallel only for MoE models),
    each as a device and a gloo group, every rank making every `new_group` call. The device
    groups' NCCL communicators are lazy and never built where no collective runs. But for its
    *own* group of size > 1 each rank's GroupCoordinator eagerly builds a device communicator:
    on CUDA a PyNccl communicator (ncclCommInitRank and a warm-up all-reduce: NCCL's buffers),
    vLLM's custom all-reduce (~32 MiB of device memory per rank: 8 MiB meta + 16 MiB IPC buffer
    + 8 MiB rank data, when the group is 2/4/6/8/16 GPUs of one node with P2P), symmetric-memory /
    FlashInfer all-reduce workspaces where enabled, and a ~24 MiB shared-memory broadcast queue
    (host). With tensor_model_parallel_size=1 every group has one rank and none of this exists.
    Not scoped away: every tensor-parallel group lies inside one pool (preflight.check_rollout_placement),
    so its ranks are all engine ranks or none, and skipping the communicators for the latter
    would keep the `new_group` order; but vLLM 0.32 has no per-group switch (only process-wide
    ones, VLLM_DISABLE_PYNCCL read once, disable_custom_all_reduce), and the CUDA path it would
    change cannot be run here, so it is documented rather than changed untested."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the engine runs in this rank
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines x every rank bury the step lines
    # On a CPU whose vLLM build has the shared-memory all-reduce (x86 with AVX-512, ...), a
    # tensor-parallel group names its /dev/shm segment after VLLM_DIST_IDENT, which only vLLM's CPU
    # worker sets, after these groups exist here: without it `new_group` for TP fails with
    # KeyError. vLLM takes the port of its init method; ours is torchrun's rendezvous port, the same
    # on every rank of a job and different between jobs on one host.
    os.environ["VLLM_DIST_IDENT"] = f"spmdsplit-{os.environ.get('MASTER_PORT', '0')}"
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    vllm_config = EngineArgs(**engine_kwargs(cfg, model_path, device, dtype)).create_engine_config()
    tp, world = cfg.rollout.tensor_model_parallel_size, dist.get_world_size()
    with set_current_vllm_config(vllm_config):
        init_worker_distributed_environment(vllm_config, dist.get_rank(), "env://", vllm_local_rank(device),
                                            current_platform.dist_backend)
        _WORLDS["vllm"] = parallel_state.get_world_group()
        # One group per engine (consecutive ranks, as vLLM's tensor-parallel groups: engine_peers),
        # made by every rank in the same order; no device communicator: vLLM's world group never
        # has one either.
        _WORLDS["engine"] = parallel_state.init_model_parallel_group(
            [engine_peers(tp, first) for first in range(0, world, tp)], vllm_local_rank(device),
            current_platform.dist_backend, group_name="engine_world", use_device_communicator=False)


class VLLMEngine:
    """One in-process vLLM engine. Construct only on generating ranks, after every rank ran
    `init_vllm_distributed`; with tensor parallel > 1 the ranks of a group must be given the same
    prompts (and seeds) and return the same rollout."""

    def __init__(self, cfg, model_path: str, tokenizer, eos_token_ids: list[int], device: torch.device,
                 dtype: torch.dtype, sleeps: bool = True):
        """`sleeps`: the engine shares its device with training (the actor's or the critic's pool), so
        it sleeps between generations; one on a pool of its own stays awake (`update_weights`)."""
        from vllm import LLM

        self.max_response_length = cfg.data.max_response_length
        self.dtype = dtype  # what the actor streams its weights in
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.on_cpu = device.type == "cpu"
        # A CPU engine changes its whole process: torch.set_num_threads becomes a no-op (the
        # trainer sets its thread count before; train.py does, before the world forms), and all
        # later allocations are bound to the NUMA node of the rank's first CPU (MEMBIND): pin each
        # rank to one node's cores (numactl / srun --cpu-bind) on multi-socket hosts.
        index = engine_index(cfg.rollout.tensor_model_parallel_size, world_rank())
        os.environ["VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR"] = flashinfer_autotune_dir(index)
        self.llm = LLM(**{**engine_kwargs(cfg, model_path, device, dtype, sleeps),
                          "seed": engine_own_seed(cfg.trainer.seed, index)})
        # Every request carries a seed (generation.shares.sample_seeds gives each row one); one that comes
        # without takes the engine's own next seed, never a global generator's: on CUDA vLLM 0.32
        # (its V2 model runner) would draw it from numpy's global generator when the request is
        # admitted (v1/worker/gpu/sample/states.py), on CPU (V1) every token from torch's
        # (v1/sample/ops/topk_topp_sampler.py forward_cpu); the tools and environments of a
        # tensor-parallel engine run on its first rank only, and one that touches either generator
        # would make the ranks sample different tokens. With seeds, V2 reads them inside its one
        # batched sampling kernel (a hash of seed and position, gumbel.py; it takes no FlashInfer
        # path anyway with processed log-probs, which the engine always asks for), and CPU draws
        # one number per seeded row per token from the row's generator.
        self.own_seeds = SeedSequence(engine_own_seed(cfg.trainer.seed, index))
        # The engine freezes every object alive now (gc.freeze) so GC never scans them: the
        # trainer's too, whose cyclic garbage would then never be freed.
        gc.unfreeze()
        self.keep_kv = cfg.rollout.kv_after_load == "keep"  # continuous generation's loads (reset_prefix_cache)
        self.sampling = self._sampling_params(cfg.rollout)
        self.val_sampling = self._sampling_params(cfg.rollout.val_kwargs)
        self.greedy_sampling = self._sampling_params(GREEDY)  # ReMax's baseline
        # LoRA: the base read from model_path is kept, and each sync brings the adapter (AdapterFolder).
        adapter = lora.engines_take_adapter(cfg)
        self.adapter = AdapterFolder(adapter, model_path, cfg.rollout.lora_adapter_dir) if adapter else None
        # Asleep until the trainer's first wake_up, which brings the policy's weights: the ones
        # read from model_path are never used for a rollout (with LoRA: only its adapter comes).
        self.sleep_mode = cfg.rollout.free_cache_engine and not self.on_cpu and sleeps
        if self.sleep_mode:
            self._release()
        self.awake = False
        # Counted on CPU too, where vLLM has no sleep: tests check the cycle.
        self.wake_ups = self.sleeps = self.weight_updates = self.offloads = 0

    @property
    def max_model_len(self) -> int:
        """The longest context (prompt and response) the engine takes (data.max_prompt_length +
        data.max_response_length, engine_kwargs)."""
        return self.llm.llm_engine.model_config.max_model_len

    def _sampling_params(self, cfg):
        from vllm import SamplingParams

        sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=max(cfg.top_k, 0))
        return SamplingParams(
            **(sampling if cfg.do_sample else dict(temperature=0.0)),  # temperature 0 = greedy
            max_tokens=self.max_response_length,  # vLLM's default is 16
            stop_token_ids=self.eos_token_ids,  # the checkpoint's EOS ids; the stopping EOS is kept
            logprobs=0,  # the sampled token's log-prob only
            # Log-probs as flat lists per request (vllm/logprobs.py FlatLogprobs) rather than a
            # {token: Logprob} dict per generated token: no objects per token for vLLM to build
            # and GC to scan, and `sampled_tokens_and_log_probs` reads them without a loop per token.
            flat_logprobs=True,
            detokenize=False,
        )

    # ---- the engine's life in a step (GPU; on CPU vLLM has no sleep mode and only the state is kept)
    #
    # vLLM 0.32 (v1/worker/gpu_worker.py, device_allocator/): with enable_sleep_mode its weights and
    # KV cache live in memory mapped by its own allocator. `sleep(level=2)` unmaps both and keeps
    # nothing but the model's buffers (rotary tables, copied to host and back on wake); level 1
    # would also copy every weight to host memory and back, which is wasted here: the weights
    # are replaced at every wake. `wake_up(tags)` maps memory again, so it needs *free* device
    # memory: blocks cached by torch's allocator for the trainer (the update's peak) are not free
    # until `torch.cuda.empty_cache()` returns them. `sleep` also synchronises the whole device,
    # which on NCCL waits for pending point-to-point sends: the callers sleep the engine before the
    # step's last rows go out (spmdsplit/programs/actor.py).
    #
    # With LoRA the base must outlive every sleep, and the adapter's slots (the stacked lora_a/b
    # tensors, allocated with the model under the "weights" tag: gpu_worker.py load_model,
    # lora/layers/base_linear.py create_lora_weights) live beside it. Level 2 would drop both while
    # vLLM's LoRA manager still lists the adapter as loaded (a request would then run on garbage
    # slots), and the base would have to be streamed again; level 1 would copy the base to pinned
    # host memory and back at every sleep. So only the KV cache goes: `sleep(level=0)` pauses the
    # scheduler and `release_kv_cache_memory()` unmaps the "kv_cache" tag alone, with no backup
    # (v1/engine/core.py release_kv_cache_memory, executor `discard`); the adapter is loaded in
    # place while the base stays mapped, and `wake_up(tags=["kv_cache"])` maps the cache and
    # resumes. What that costs: the engine's copy of the base stays on the device while the trainer
    # trains (with LoRA the trainer's own share is small: the frozen base, the adapter and its state).
    #
    # `release_kv_cache_memory()` refuses ("requires a completed pause first") while the scheduler
    # `has_requests()`, which counts the ids of requests that finished (or that the pause aborted)
    # until the next `schedule()` hands them to the model runner to drop (v1/core/sched/scheduler.py
    # `finished_req_ids`, cleared after each schedule): `LLM.generate` returns before that schedule,
    # so after any generation the ids are still there. One engine step under the pause flushes them:
    # the paused scheduler schedules nothing new (PAUSED_NEW), its output carries only the finished
    # ids, and the runner drops those requests from its batch without running the model (no tokens
    # scheduled). With async scheduling a launched batch would also wait in `batch_queue`: the
    # engines run without it (engine_kwargs).

    def _release(self) -> None:
        """The engine's device memory back to the trainer (sleep mode): everything (level 2), or
        with LoRA the KV cache alone."""
        if self.adapter:
            self.llm.sleep(level=0)  # pauses the scheduler, aborting whatever it still holds
            self.llm.llm_engine.step()  # flushes the finished ids (above)
            self.llm.release_kv_cache_memory()
        else:
            self.llm.sleep(level=2)

    def wake_up(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """The start of a step's generation, with the policy's new weights: free the trainer's
        cached blocks, map the weights (with LoRA: still mapped), load them, free the load's
        temporaries, map the KV cache. Every `generate` of the step (all chunks, all validation
        batches) runs before `sleep`."""
        if self.awake:
            raise RuntimeError("VLLMEngine.wake_up: the engine is already awake (one wake_up per sleep)")
        self.wake_ups += 1
        if self.sleep_mode and not self.adapter:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        self.load_weights(weights)
        if self.sleep_mode:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])  # fully awake: vLLM resumes its scheduler
        self.reset_prefix_cache()
        self.awake = True

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """New weights into the awake engine, which keeps its memory (the weights are written in
        place, the KV cache stays allocated): an engine on a device of its own (a rollout pool
        apart) takes each new version of the policy so, instead of a sleep and a wake that
        would unmap and map again its whole share of the device for nothing."""
        if not self.awake:
            raise RuntimeError("VLLMEngine.update_weights: the engine is asleep; wake_up(weights) first")
        self.weight_updates += 1
        self.load_weights(weights)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Cached KV of earlier prompts was computed with the old weights (after a level-2 sleep
        vLLM has dropped it already; otherwise this is what drops it).

        With requests held (continuous generation, weights loaded between two engine steps) vLLM
        0.32 resets only with `reset_running_requests` (v1/core/sched/scheduler.py
        reset_prefix_cache): every running request is preempted for recompute, its tokens kept
        (and its seeded generator: the model runner keeps the request's state across a
        preemption), and its KV is computed again with the new weights at its next step. So every
        token sampled after a load is drawn from the new policy given its whole context, and the
        engine's log-prob of it is the probability it was sampled with: the importance correction
        divides by exactly that. The cost: one prefill of the held requests per load.
        rollout.kv_after_load=keep skips it, as PipelineRL does: the held requests keep the KV older
        weights computed (their later tokens come from a mix of versions; the log-probs returned are
        still those they were drawn with), which is sound only without prefix caching (preflight)."""
        held = self.llm.llm_engine.has_unfinished_requests()
        if held and self.keep_kv:  # rollout.kv_after_load=keep: nothing cached is reused (no prefix caching)
            return
        if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=held):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")

    def sleep(self) -> None:
        """The end of a step's generation: give the device back to the trainer (GPU), keeping nothing."""
        if not self.awake:
            raise RuntimeError("VLLMEngine.sleep: the engine is not awake")
        self.sleeps += 1
        if self.sleep_mode:
            self._release()
        self.awake = False

    def offload(self) -> None:
        """For an engine whose weights come from no trainer (an LLM judge beside a critic): its
        weights to host memory and its KV cache freed while training takes the device (vLLM's
        level-1 sleep: the worker's allocator copies the "weights" pool to the host and drops the
        rest); `restore` maps both back, the weights copied in. Nothing may be held (the caller's
        driver is paused). Counted on CPU too, where vLLM has no sleep mode."""
        self.offloads += 1
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def restore(self) -> None:
        if self.sleep_mode:
            torch.cuda.empty_cache()  # what training cached goes back to the device first
            self.llm.wake_up()  # every pool: weights, KV cache, scheduling

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Writes the stream of (HF name, whole tensor) into the engine's model; the trainer calls
        it only through `wake_up`, which makes room for it first."""
        if isinstance(weights, Mapping):  # a whole state dict also works
            weights = weights.items()
        if self.adapter:  # the adapter, into its folder, then into the engine's slot in place
            self.adapter.write(weights)
            self.llm.llm_engine.add_lora(self.adapter.request(load_inplace=True))
        elif self.on_cpu:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        else:  # in place, each tensor straight into the engine's (possibly sharded) parameters
            self.llm.apply_model(lambda model: model.load_weights(weights))

    @torch.no_grad()
    def generate(self, prompts: Batch, validate: bool = False, greedy: bool = False) -> Batch:
        """As HFEngine.generate, plus `rollout_log_probs` [B, R] float32 (the sampled tokens'
        log-probs after temperature, 0 past each response). An int64 `sample_seed` [B] column seeds
        each row's sampling on its own (row_seeds), so a row's tokens do not depend on its batch;
        without it each row takes the engine's next own seed."""
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        requests = [{"prompt_token_ids": row[keep].tolist()} for row, keep in zip(ids.cpu(), mask.cpu())]
        base = self.greedy_sampling if greedy else self.val_sampling if validate else self.sampling
        seeds = prompts["sample_seed"].tolist() if "sample_seed" in prompts else [None] * len(requests)
        params = [self.seeded(base.clone(), seed) for seed in seeds]
        if not self.awake:
            raise RuntimeError("VLLMEngine.generate: the engine is asleep; wake_up(weights) first")
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        responses, log_probs = sampled_tokens_and_log_probs([out.outputs[0] for out in outputs],
                                                            self.max_response_length, self.pad_token_id)
        return rollout_batch(prompts, responses.to(ids.device), self.pad_token_id, self.eos_token_ids,
                             extras={"rollout_log_probs": log_probs.to(ids.device)})

    @torch.no_grad()
    def continue_ids(self, contexts: list[list[int]], budgets: list[int], stop_ids: list[int],
                     seeds: list[int] | None = None, validate: bool = False) -> list[tuple[list[int], list[float]]]:
        """As HFEngine.continue_ids: one turn of multi-turn episodes, token ids in and out, each
        row with its own budget of new tokens (and its own seed, when given). With prefix caching
        on, a turn's context (the previous turns) is found in the KV cache and not computed again."""
        if not self.awake:
            raise RuntimeError("VLLMEngine.continue_ids: the engine is asleep; wake_up(weights) first")
        base = self.val_sampling if validate else self.sampling
        params = []
        for i, budget in enumerate(budgets):
            p = self.seeded(base.clone(), None if seeds is None else seeds[i])
            p.max_tokens, p.stop_token_ids = budget, list(stop_ids)
            params.append(p)
        outputs = self.llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        samples = [out.outputs[0] for out in outputs]
        _, log_probs = sampled_tokens_and_log_probs(samples, max(budgets), self.pad_token_id)
        return [(list(s.token_ids), row[: len(s.token_ids)]) for s, row in zip(samples, log_probs.tolist())]

    # ---- continuous generation (spmdsplit/generation/continuous.py; inference/base.py StepwiseEngine): the
    # engine's own loop, one scheduler step per call (LLMEngine.add_request / step / abort_request,
    # in-process: each step runs the model in this thread), outputs as deltas.

    def submit(self, request_id: str, context: list[int], budget: int, seed: int | None = None,
               validate: bool = False, stop_ids: list[int] | None = None) -> None:
        from vllm.sampling_params import RequestOutputKind

        if not self.awake:
            raise RuntimeError("VLLMEngine.submit: the engine is asleep; wake_up(weights) first")
        params = (self.val_sampling if validate else self.sampling).clone()
        params.max_tokens, params.output_kind = budget, RequestOutputKind.DELTA
        if stop_ids is not None:  # an agent's turn: its parser's stop token too (kept, as the EOS)
            params.stop_token_ids = list(stop_ids)
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(context)}, self.seeded(params, seed),
                                        lora_request=self.lora_request)

    def seeded(self, params, seed: int | None):
        """`params` (this request's own copy) with `seed`, or the engine's next own seed."""
        params.seed = self.own_seeds.next() if seed is None else seed
        return params

    def step(self) -> list[Delta]:
        deltas = []
        for out in self.llm.llm_engine.step():
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            log_probs = list(sample.logprobs.logprobs) if tokens else []
            if len(log_probs) != len(tokens):
                raise RuntimeError("vLLM returned a step's log-probs that are not one per sampled token")
            deltas.append(Delta(out.request_id, tokens, log_probs, out.finished))
        return deltas

    def abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(list(request_ids))

    @property
    def lora_request(self):
        """What every generate request carries with LoRA (None without): the adapter's id, without
        load_inplace. vLLM adds each request's adapter at every scheduler step, a no-op while the id
        is loaded; a request without one would silently sample from the base."""
        return self.adapter.request() if self.adapter else None

    def tensor_parallel_group(self):
        """vLLM's group of this engine's ranks (its `cpu_group`, `is_first_rank`, `first_rank`:
        vLLM 0.32 parallel_state.py GroupCoordinator); None at tensor parallel 1."""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return None if group.world_size == 1 else group

    def run_on_first_rank(self, fn):
        """fn() run once for the engine: on its first tensor-parallel rank, its result handed to
        the other ranks, which wait for it. The agent loop runs each turn's tool calls so: were each
        rank to run them, a timeout or a tool that answers differently would give the ranks
        different contexts (vLLM's lockstep silently mixes them), and a side effect would happen
        tp times. The result goes pickled over vLLM's gloo group of the engine's ranks (its
        `cpu_group`, gloo on GPU too; vLLM 0.32 parallel_state.py), where the peers block in a
        receive: not over the NCCL device group, and not by the group's `broadcast_object`, whose
        shared-memory queue busy-waits its readers for a second and warns of a hang after 60 s."""
        group = self.tensor_parallel_group()
        if group is None:
            return fn()
        box = [fn() if group.is_first_rank else None]
        dist.broadcast_object_list(box, src=group.first_rank, group=group.cpu_group)
        return box[0]


class AdapterFolder:
    """The policy's adapter as vLLM reads it: a PEFT folder (lora.write_adapter) of this rank's own.
    Each sync writes the new adapter into a fresh folder and swaps the symlink `adapter` over to it
    (an atomic rename), so the path the engine's requests name always holds one whole adapter, then
    drops the old folder. The folders go when the engine does (or the process ends).

    Where: rollout.lora_adapter_dir, by default /dev/shm (memory, not disk) where it exists. A
    container's /dev/shm is often small (Docker's default: 64 MB, against ~40 MB for one version of
    a 7B model's rank-8 adapter, and the old version is still there while the new one is written),
    so each write first checks the folder's free space, and an adapter that does not fit goes to
    the node's temp folder instead (TMPDIR), said in one warning line."""

    ID = 1  # the adapter's one id in the engine (vLLM's must be > 0)
    HEADROOM = 64 << 10  # adapter_config.json and the safetensors header (a few KB), with room to spare

    def __init__(self, spec: lora.LoraSpec, base_model: str, folder: str = ""):
        self.config = spec.peft_config("causal_lm")
        self.base_model = base_model
        self.root = self._make_root(folder or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
        self.version = 0
        self.bytes = 0  # the adapter's tensors, as last written

    def _make_root(self, parent: str) -> str:
        rank = world_rank()
        root = tempfile.mkdtemp(prefix=f"spmdsplit-lora-rank{rank}-", dir=parent)
        weakref.finalize(self, shutil.rmtree, root, True)
        return root

    @property
    def path(self) -> str:
        return os.path.join(self.root, "adapter")

    def request(self, load_inplace: bool = False):
        """The LoRARequest naming the current folder under the adapter's one id. `load_inplace`: vLLM
        reads the folder again although the id is loaded (a sync); without it, a generate request's,
        which vLLM adds at every scheduler step, a no-op while the id is loaded."""
        from vllm.lora.request import LoRARequest

        return LoRARequest("policy", self.ID, self.path, load_inplace=load_inplace)

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        """The stream of (saved name, tensor) into the next folder, made the current one; returns the
        path the engine loads it from (in place of the adapter it holds: `load_inplace`)."""
        tensors = [(name, t.detach().to("cpu")) for name, t in weights]  # an adapter: small
        size = sum(t.nbytes for _, t in tensors) + self.HEADROOM
        if shutil.disk_usage(self.root).free < size:
            self._move_to(tempfile.gettempdir(), size)
        self.version += 1
        folder = os.path.join(self.root, f"v{self.version}")
        self.bytes = lora.write_adapter(folder, tensors, self.config, self.base_model)
        link = os.path.join(self.root, ".adapter")
        os.symlink(folder, link)
        os.replace(link, self.path)
        shutil.rmtree(os.path.join(self.root, f"v{self.version - 1}"), ignore_errors=True)
        return self.path

    def _move_to(self, parent: str, size: int) -> None:
        old = self.root
        if os.path.realpath(parent) == os.path.realpath(os.path.dirname(old)):
            raise OSError(f"the LoRA adapter ({size / 2**20:.1f} MiB) does not fit in {parent}; "
                          "set rollout.lora_adapter_dir to a folder with room")
        self.root = self._make_root(parent)
        print(f"spmdsplit: warning: the LoRA adapter ({size / 2**20:.1f} MiB) does not fit in "
              f"{os.path.dirname(old)} ({shutil.disk_usage(old).free / 2**20:.1f} MiB free): the engine reads it "
              f"from {self.root} (rollout.lora_adapter_dir chooses the folder)", file=sys.stderr, flush=True)
        shutil.rmtree(old, ignore_errors=True)  # the engine holds the adapter it read from there


def sampled_tokens_and_log_probs(samples, width: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's completions (`CompletionOutput`, one per row, asked for with logprobs=0 and
    flat_logprobs=True) as [B, width] token ids (padded) and float32 log-probs of the sampled
    tokens (0 past each response). Each row's FlatLogprobs holds exactly one entry per generated
    token (the sampled one; logprobs=0 asks for no others), in plain Python lists (vLLM 0.32 keeps
    no array of them: `FlatLogprobs.append_fast` appends a token at a time as it decodes). Each
    list goes into its row of a numpy array in one assignment, which numpy converts in C: no
    Python step and no dict per token, and no concatenation of the batch (one row at a time, 512
    rows x 1024 tokens: ~35 ms here, against ~180 ms through one flat Python list per column)."""
    responses = np.full((len(samples), width), pad_token_id, dtype=np.int64)
    log_probs = np.zeros((len(samples), width), dtype=np.float32)
    for row, sample in enumerate(samples):
        tokens, flat = list(sample.token_ids), sample.logprobs
        if not (hasattr(flat, "start_indices") and len(flat.logprobs) == len(tokens)):
            raise RuntimeError("vLLM returned log-probs that are not flat with one entry per sampled token "
                               "(SamplingParams needs logprobs=0 and flat_logprobs=True)")
        # The flat lists' token ids are the sampled ones, in the same order (a list compare, in C).
        if flat.token_ids != tokens:
            raise RuntimeError("vLLM's log-probs are not of the sampled tokens")
        responses[row, : len(tokens)] = tokens
        log_probs[row, : len(tokens)] = flat.logprobs
    return torch.from_numpy(responses), torch.from_numpy(log_probs)


def shutdown_vllm_distributed() -> None:
    """vLLM's process groups, destroyed on every rank before the trainer destroys its world.
    vLLM's own clean-up (run when an engine is collected, or at exit) would destroy the trainer's
    default group too, and then fail on groups the trainer already destroyed."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    # An engine collected before (a test's) ran vLLM's clean-up, which destroys torch's world and
    # every group with it: then nothing is left to destroy.
    if dist.is_initialized():
        for coordinator in _WORLDS.values():  # vLLM's world group is one of them (the engine's, on an engine rank)
            coordinator.destroy()
    _WORLDS.clear()
    parallel_state._WORLD = None  # noqa: SLF001 - vLLM has no call that spares torch's world
