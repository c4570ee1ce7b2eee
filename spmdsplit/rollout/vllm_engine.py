"""Rollout with vLLM, in-process, one engine per generating rank (or tensor-parallel group), under
torchrun (`rollout.name=vllm`). vLLM is imported only from here, and only when it is chosen.

Three things make an in-process vLLM engine safe inside an SPMD trainer (measured facts in the
project's VLLM_NOTES):

* vLLM adopts the trainer's torch world and creates its own process groups with `new_group` over
  *every* rank (tensor-, pipeline-, data-, expert-parallel, ..., each for the device and for gloo).
  `new_group` is collective over the world, so every rank must create them at the same point of
  the program, even ranks that build no engine: `init_vllm_distributed`, called by every rank right
  after the pools are built. Engine ranks then find the groups made and create none.
* At start-up an engine all-reduces its KV-cache size over the whole world (vLLM's torchrun
  executor takes the minimum over ranks that run one model together). Ranks without an engine never
  join, so `PoolExecutor` confines that all-reduce to the engine's tensor-parallel group.
* On CPU, vLLM repacks linear weights for oneDNN when it loads them, so writing new tensors into
  the engine's model (`model.load_weights`, the fast path on CUDA) fails or, for the LM head,
  silently leaves the old weights; `reload_weights` re-runs the loading and does update it.
"""

from __future__ import annotations

import gc
import itertools
import os
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.config import ConfigError, check_rollout_placement
from spmdsplit.rollout.base import GREEDY, rollout_batch

# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes() (0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_DEFAULT_KV_CACHE_GB = 1.0


def check_vllm(cfg, placement, model_path: str, device_type: str) -> None:
    """What would fail only inside vLLM, checked on every rank before the first collective: a
    tensor-parallel group across the pools, and a head size the CPU attention kernel rejects."""
    if cfg.rollout.name != "vllm":
        return
    check_rollout_placement(cfg, placement)
    if device_type == "cpu":
        head = head_size(model_path, cfg.model.trust_remote_code)
        if head not in CPU_HEAD_SIZES:
            raise ConfigError(
                f"rollout.name=vllm: model.path={model_path!r} has attention heads of size {head}, which vLLM's CPU "
                f"attention kernel does not support (sizes {list(CPU_HEAD_SIZES)}); use rollout.name=hf"
            )


def head_size(model_path: str, trust_remote_code: bool = False) -> int:
    from transformers import AutoConfig

    # A multimodal checkpoint nests its language model's config.
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def engine_kwargs(cfg, model_path: str, device: torch.device, dtype: torch.dtype) -> dict:
    """`LLM(...)` arguments, the same on every rank (the distributed set-up reads them too)."""
    r = cfg.rollout
    kv_gb = r.kv_cache_memory_gb or (CPU_DEFAULT_KV_CACHE_GB if device.type == "cpu" else 0)
    return dict(
        model=model_path,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
        trust_remote_code=cfg.model.trust_remote_code,
        seed=cfg.trainer.seed,
        tensor_parallel_size=r.tensor_model_parallel_size,
        distributed_executor_backend=PoolExecutor(),
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        gpu_memory_utilization=r.gpu_memory_utilization,
        # On CPU vLLM would size the KV cache from the NUMA node's memory minus this whole
        # process (trainer included): an explicit size is the only predictable one.
        kv_cache_memory_bytes=int(kv_gb * 2**30) if kv_gb else None,
        enforce_eager=r.enforce_eager,
        enable_prefix_caching=r.enable_prefix_caching,
        enable_sleep_mode=r.free_cache_engine and device.type == "cuda",  # CPU refuses sleep mode
        # Log-probs of the distribution tokens were sampled from (after temperature), which is what
        # the actor scores; the default ("raw") ignores the temperature.
        logprobs_mode="processed_logprobs",
        # Sampling comes from rollout.* only, never from the checkpoint's generation_config.json
        # (an instruct model's repetition_penalty, top_k, ...), as in HFRollout.
        generation_config="vllm",
    )


def PoolExecutor():
    """vLLM's torchrun executor with its start-up KV-size all-reduce confined to the engine's
    tensor-parallel group instead of the world (a function, so vLLM is imported only when called)."""
    from vllm.distributed.parallel_state import get_tp_group
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    class _PoolExecutor(ExecutorWithExternalLauncher):
        def _distributed_args(self) -> tuple[str, int, int]:
            # vLLM 0.32 takes LOCAL_RANK for the worker's device index (gpu_worker.py init_device:
            # cuda:<local_rank> among the visible GPUs); the rank's own GPU is the current device
            # (train.pick_device: cuda:0 where the cluster binds one GPU per task).
            method, rank, local_rank = super()._distributed_args()
            return method, rank, torch.cuda.current_device() if torch.cuda.is_available() else local_rank

        def determine_available_memory(self) -> list[int]:
            memory = torch.tensor(super(ExecutorWithExternalLauncher, self).determine_available_memory(),
                                  dtype=torch.int64)
            dist.all_reduce(memory, group=get_tp_group().cpu_group, op=dist.ReduceOp.MIN)
            return memory.tolist()

    return _PoolExecutor


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
    Not scoped away: every tensor-parallel group lies inside one pool (check_rollout_placement),
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
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    vllm_config = EngineArgs(**engine_kwargs(cfg, model_path, device, dtype)).create_engine_config()
    with set_current_vllm_config(vllm_config):
        # vLLM's "local rank" is the device index its groups bind (parallel_state.py
        # GroupCoordinator: cuda:<local_rank>): the rank's own GPU, which is not LOCAL_RANK where the
        # cluster binds one GPU per task (train.pick_device).
        local_rank = device.index if device.type == "cuda" else int(os.environ.get("LOCAL_RANK", 0))
        init_worker_distributed_environment(vllm_config, dist.get_rank(), "env://", local_rank,
                                            current_platform.dist_backend)


class VLLMRollout:
    """One in-process vLLM engine. Construct only on generating ranks, after every rank ran
    `init_vllm_distributed`; with tensor parallel > 1 the ranks of a group must be given the same
    prompts (and seeds) and return the same rollout."""

    def __init__(self, cfg, model_path: str, tokenizer, eos_token_ids: list[int], device: torch.device,
                 dtype: torch.dtype):
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
        # Rows without a seed of their own (rollout.per_row_seed=false) draw from the engine's
        # generator: one seed per engine, shared by its tensor-parallel peers, so that two engines
        # never draw the same random numbers.
        engine_index = dist.get_rank() // cfg.rollout.tensor_model_parallel_size if dist.is_initialized() else 0
        self.llm = LLM(**{**engine_kwargs(cfg, model_path, device, dtype), "seed": cfg.trainer.seed * 1009 + engine_index})
        # The engine freezes every object alive now (gc.freeze) so GC never scans them: the
        # trainer's too, whose cyclic garbage would then never be freed.
        gc.unfreeze()
        self.sampling = self._sampling_params(cfg.rollout)
        self.val_sampling = self._sampling_params(cfg.rollout.val_kwargs)
        self.greedy_sampling = self._sampling_params(GREEDY)  # ReMax's baseline
        # Asleep until the trainer's first wake_up, which brings the policy's weights: the ones
        # read from model_path are never used for a rollout.
        self.sleep_mode = cfg.rollout.free_cache_engine and not self.on_cpu
        if self.sleep_mode:
            self.llm.sleep(level=2)
        self.awake = False
        self.wake_ups = self.sleeps = 0  # counted on CPU too, where vLLM has no sleep: tests check the cycle

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

    def wake_up(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """The start of a step's generation, with the policy's new weights: free the trainer's
        cached blocks, map the weights, load them, free the load's temporaries, map the KV cache.
        Every `generate` of the step (all chunks, all validation batches) runs before `sleep`."""
        if self.awake:
            raise RuntimeError("VLLMRollout.wake_up: the engine is already awake (one wake_up per sleep)")
        self.wake_ups += 1
        if self.sleep_mode:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        self.load_weights(weights)
        if self.sleep_mode:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])  # fully awake: vLLM resumes its scheduler
        # Cached KV of earlier prompts was computed with the old weights (after a level-2 sleep
        # vLLM has dropped it already; on CPU, without sleep, this is what drops it).
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update (requests still running?)")
        self.awake = True

    def sleep(self) -> None:
        """The end of a step's generation: give the device back to the trainer (GPU), keeping nothing."""
        if not self.awake:
            raise RuntimeError("VLLMRollout.sleep: the engine is not awake")
        self.sleeps += 1
        if self.sleep_mode:
            self.llm.sleep(level=2)
        self.awake = False

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Writes the stream of (HF name, whole tensor) into the engine's model; the trainer calls
        it only through `wake_up`, which makes room for it first."""
        if isinstance(weights, Mapping):  # a whole state dict also works
            weights = weights.items()
        if self.on_cpu:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        else:  # in place, each tensor straight into the engine's (possibly sharded) parameters
            self.llm.apply_model(lambda model: model.load_weights(weights))

    @torch.no_grad()
    def generate(self, prompts: Batch, validate: bool = False, greedy: bool = False) -> Batch:
        """As HFRollout.generate, plus `rollout_log_probs` [B, R] float32 (the sampled tokens'
        log-probs after temperature, 0 past each response). An int64 `sample_seed` [B] column seeds
        each row's sampling on its own (row_seeds), so a row's tokens do not depend on its batch."""
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        requests = [{"prompt_token_ids": row[keep].tolist()} for row, keep in zip(ids.cpu(), mask.cpu())]
        params = self.greedy_sampling if greedy else self.val_sampling if validate else self.sampling
        if "sample_seed" in prompts:
            params = [params.clone() for _ in requests]
            for p, seed in zip(params, prompts["sample_seed"].tolist()):
                p.seed = seed
        if not self.awake:
            raise RuntimeError("VLLMRollout.generate: the engine is asleep; wake_up(weights) first")
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        responses, log_probs = sampled_tokens_and_log_probs([out.outputs[0] for out in outputs],
                                                            self.max_response_length, self.pad_token_id)
        return rollout_batch(prompts, responses.to(ids.device), self.pad_token_id, self.eos_token_ids,
                             extras={"rollout_log_probs": log_probs.to(ids.device)})

    @torch.no_grad()
    def continue_ids(self, contexts: list[list[int]], budgets: list[int], stop_ids: list[int],
                     seeds: list[int] | None = None, validate: bool = False) -> list[tuple[list[int], list[float]]]:
        """As HFRollout.continue_ids: one turn of multi-turn episodes, token ids in and out, each
        row with its own budget of new tokens (and its own seed, when given). With prefix caching
        on, a turn's context (the previous turns) is found in the KV cache and not computed again."""
        if not self.awake:
            raise RuntimeError("VLLMRollout.continue_ids: the engine is asleep; wake_up(weights) first")
        base = self.val_sampling if validate else self.sampling
        params = []
        for i, budget in enumerate(budgets):
            p = base.clone()
            p.max_tokens, p.stop_token_ids = budget, list(stop_ids)
            if seeds is not None:
                p.seed = seeds[i]
            params.append(p)
        outputs = self.llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
        samples = [out.outputs[0] for out in outputs]
        _, log_probs = sampled_tokens_and_log_probs(samples, max(budgets), self.pad_token_id)
        return [(list(s.token_ids), row[: len(s.token_ids)]) for s, row in zip(samples, log_probs.tolist())]


def sampled_tokens_and_log_probs(samples, width: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's completions (`CompletionOutput`, one per row, asked for with logprobs=0 and
    flat_logprobs=True) as [B, width] token ids (padded) and float32 log-probs of the sampled
    tokens (0 past each response). Each row's FlatLogprobs holds exactly one entry per generated
    token (the sampled one; logprobs=0 asks for no others), in plain lists: the whole batch is
    concatenated into one tensor per column and scattered under a length mask, with no dict or
    Python loop per token (the loop is per row; the lists are vLLM's, filled as it decodes)."""
    lengths = torch.tensor([len(sample.token_ids) for sample in samples], dtype=torch.long)
    flat = [sample.logprobs for sample in samples]
    if not all(hasattr(lp, "start_indices") and len(lp.logprobs) == n for lp, n in zip(flat, lengths.tolist())):
        raise RuntimeError("vLLM returned log-probs that are not flat with one entry per sampled token "
                           "(SamplingParams needs logprobs=0 and flat_logprobs=True)")
    tokens = torch.tensor(list(itertools.chain.from_iterable(sample.token_ids for sample in samples)), dtype=torch.long)
    # The flat lists' token ids are the sampled ones, in the same order: a check that costs one tensor.
    scored = torch.tensor(list(itertools.chain.from_iterable(lp.token_ids for lp in flat)), dtype=torch.long)
    if not torch.equal(scored, tokens):
        raise RuntimeError("vLLM's log-probs are not of the sampled tokens")
    filled = torch.arange(width)[None] < lengths[:, None]  # row-major: the concatenation's order
    responses = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    responses[filled] = tokens
    log_probs = torch.zeros((len(samples), width), dtype=torch.float32)
    log_probs[filled] = torch.tensor(list(itertools.chain.from_iterable(lp.logprobs for lp in flat)),
                                     dtype=torch.float32)
    return responses, log_probs


def shutdown_vllm_distributed() -> None:
    """vLLM's process groups, destroyed on every rank before the trainer destroys its world.
    vLLM's own clean-up (run when an engine is collected, or at exit) would destroy the trainer's
    default group too, and then fail on groups the trainer already destroyed."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:  # noqa: SLF001 - vLLM has no call that spares torch's world
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
