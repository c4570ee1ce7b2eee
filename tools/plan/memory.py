"""`python -m tools.plan --memory [--gpu-gb 80 --world-size 8] [--rollout hf|vllm] [--no-sync-accumulation]
[--max-token-len N] [--check outputs/bench_memory/bench_memory.json]`

A memory model: predicted peak device memory of one rank of each pool, from the model's shape,
the compute dtype, the engine (FSDP2 = ZeRO-3, or DeepSpeed stage 1/2/3), the pool sizes,
gradient checkpointing, micro-batch and sequence lengths. A micro-batch is rows padded to prompt +
response tokens, or with a token budget (`--max-token-len`, verl's `*_max_token_len_per_gpu`
with use_dynamic_bsz and use_remove_padding) one packed row of the budget's tokens. What a rank holds all the time:

  * a trained model (actor, critic): fp32 masters and AdamW's two fp32 moments, 12 B/param,
    divided by the pool size where the engine shards them (FSDP2: all of it; ZeRO-1/2: optimizer
    state; ZeRO-3: + weights, which DeepSpeed keeps in the compute dtype next to fp32 master
    shards); ZeRO-3 also keeps its flat fp32 gradient partition (4 B/param / pool) all the time;
  * the reference: frozen, compute dtype, sharded over the actor pool;
  * the HF rollout: a whole copy of the policy in the compute dtype (`rollout.name=hf`). vLLM
    sleeps at level 2 between rollouts (weights and KV cache discarded) and so keeps nothing;

and, on top, the largest of what one phase adds for a while:
  * generate: HF, the KV cache of the rank's rows; vLLM, `gpu_memory_utilization` x the whole
    device, which vLLM reserves on top of what is resident (weights, KV cache, activations);
  * update: the gradients (fp32: FSDP2 and ZeRO-2 4 B/param / pool, ZeRO-1 4 B/param whole; freed
    by zero_grad(set_to_none=True) after each step), or with `no_sync_accumulation` and several
    micro-batches per mini-batch a whole unsharded fp32 gradient (4 B/param, any pool size);
  * every forward: gathered FSDP units (the root, i.e. embeddings + head, and two blocks: the one
    running and the one prefetched), activations (per token and block: all the block's saved
    tensors, or with checkpointing only its input plus one block's recomputed tensors), and the
    logits of the response positions: one chunk of `actor.logits_chunk_size` tokens and its
    log-softmax's temporaries (roles/lm_head.py), or with 0 all of them (compute dtype, their
    gradient, and one fp32 chunk of the log-softmax, see algo.logprobs_and_entropy).
On CPU the RSS also counts the process itself (interpreter, torch, transformers: `--base-mb`)
and, on a pool's first rank, the whole model it reads to hand out shards.

and, on GPUs, NCCL's buffers: each communicator a rank has used holds device memory of its own
(`--nccl-mb`, an estimate, below): the pool's group, one two-rank communicator per rank of
another pool it trades rows with, and the weight groups (spmdsplit/groups.py creates them all and
warms them at start-up, before any engine exists). A rollout pool apart (`--rollout-pool N`)
adds its own kind of rank: its engine awake for the whole job (it shares its device with no
training, so it never sleeps), one weight group per actor rank, and the buckets of the weight
stream in flight; the actor ranks there hold no engine and, while they stream, their buckets.

Not modelled: allocator fragmentation and caching, the CUDA context (reserved as
`--reserve-gb` when checking what fits), attention score matrices (sdpa/flash keep none), a
reward model, vLLM's own share beyond `gpu_memory_utilization` (it keeps within it), and the
[T, T] block-causal mask of a packed micro-batch under sdpa/eager (compute dtype x T^2: 0.5 GB
at a bf16 budget of 16384 tokens; none under flash_attention_2, the packed path for GPUs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace

from tools.models import ModelShape

GB = 1e9
MB = 2**20


# Published config.json values of the Qwen2.5 base models.
QWEN25 = {
    "Qwen2.5-0.5B": ModelShape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, tied=True),
    "Qwen2.5-7B": ModelShape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064),
    "Qwen2.5-14B": ModelShape("Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064),
    "Qwen2.5-32B": ModelShape("Qwen2.5-32B", 5120, 64, 40, 8, 27648, 152064),
    "Qwen2.5-72B": ModelShape("Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064),
}
# tools.bench.memory's default model (vocabulary: the embedded tokenizer's).
BENCH_76M = ModelShape("bench 76M", 768, 12, 12, 4, 2048, 15)


@dataclass(frozen=True)
class Workload:
    dtype_bytes: int = 2  # compute dtype: 2 (bf16 on GPUs) or 4 (fp32, CPU)
    engine: str = "fsdp"  # fsdp | deepspeed
    zero_stage: int = 3
    gradient_checkpointing: bool = True
    prompts_per_step: int = 256  # data.train_batch_size * rollout.n (rows)
    prompt_len: int = 512
    response_len: int = 512
    mini: int = 64  # rows per optimizer step over the pool: ppo_mini_batch_size * rollout.n
    micro: int = 8  # ppo_micro_batch_size_per_gpu (actor and critic)
    log_prob_micro: int = 32  # log_prob / forward micro-batch
    # Token budgets per micro-batch (0 = fixed micro-batches of rows, each padded to prompt_len +
    # response_len): verl's use_dynamic_bsz with use_remove_padding, where a micro-batch is one
    # packed row of at most this many tokens and no padding. See micro_rows.
    ppo_max_token_len: int = 0  # actor.ppo_max_token_len_per_gpu and critic.ppo_max_token_len_per_gpu
    log_prob_max_token_len: int = 0  # actor.log_prob_max_token_len_per_gpu, ref.log_prob_max_token_len_per_gpu
    forward_max_token_len: int = 0  # critic.forward_max_token_len_per_gpu (values)
    critic_ppo_max_token_len: int = -1  # critic.ppo_max_token_len_per_gpu where it differs (-1: ppo_max_token_len)
    no_sync_accumulation: bool = False  # FSDP2: reduce gradients once per mini-batch (actor and critic)
    rollout: str = "hf"  # hf (a whole copy, always held) | vllm (sleeps at level 2 between rollouts)
    gpu_memory_utilization: float = 0.5  # vllm: its share of the whole device, on top of what is resident
    device_gb: float = 80.0  # the device vLLM's share is a fraction of
    cpu: bool = False  # RSS: adds the process and the reader's whole copy at load time
    base_mb: float = 350.0  # RSS of a process that imported torch, transformers and spmdsplit (measured)
    # Device memory of one NCCL communicator (GPUs only): an estimate from NCCL's defaults, not
    # measured here: per channel and peer, a 4 MiB buffer for the Simple protocol (NCCL_BUFFSIZE)
    # and about as much for LL128, with up to 32 channels on NVLink; NVLS buffers on top where
    # NVSwitch allows them. Lower it with NCCL_BUFFSIZE / NCCL_MAX_NCHANNELS, raise it if measured.
    nccl_mb: float = 500.0
    weight_bucket_mb: float = 256.0  # rollout.weight_bucket_mb: the weight stream's buckets
    logits_chunk: int = 512  # actor.logits_chunk_size: the LM head's tokens at a time (0: the logits whole)


def trained_state(params: int, pool: int, w: Workload) -> float:
    """Bytes a trained model's weights and AdamW state (and ZeRO-3's gradient partition) keep on
    one rank between updates."""
    if w.engine == "fsdp":
        return 12 * params / pool  # fp32 shards of weights and two moments
    weights = (w.dtype_bytes * params) * (1 / pool if w.zero_stage == 3 else 1)
    masters = 4 * params / pool if w.dtype_bytes != 4 else 0.0  # fp32 masters next to compute-dtype weights
    flat_grads = 4 * params / pool if w.zero_stage == 3 else 0.0  # DeepSpeed allocates it once, at init
    return weights + masters + flat_grads + 8 * params / pool


def micro_rows(rows: int, budget: int, w: Workload) -> float:
    """The rows one micro-batch holds, in rows of prompt_len + response_len tokens: `rows` for
    fixed micro-batches (padded to that length); with a token budget (use_dynamic_bsz and
    use_remove_padding), budget / (prompt_len + response_len), so that the micro-batch's tokens
    are the budget's, and its response positions those of rows shaped like the workload's (the
    lengths then read as typical rows', not only as the limits). A budget of rows x (prompt_len +
    response_len) gives what `rows` padded rows give."""
    return budget / (w.prompt_len + w.response_len) if budget else rows


def micro_batches(pool: int, w: Workload) -> int:
    """Micro-batches per mini-batch on one rank."""
    return max(1, math.ceil((w.mini // pool) / micro_rows(w.micro, w.ppo_max_token_len, w)))


def update_gradients(params: int, pool: int, w: Workload) -> float:
    """The fp32 gradients one rank holds while a mini-batch accumulates (none before its first
    backward: zero_grad sets them to None). Whole where nothing reduces them before the step:
    ZeRO-1 always, FSDP2 with no_sync_accumulation over several micro-batches (its unsharded
    gradient, in the reduce dtype, fp32)."""
    if w.engine == "deepspeed":
        return {1: 4 * params, 2: 4 * params / pool, 3: 0.0}[w.zero_stage]  # ZeRO-3's is resident
    if w.no_sync_accumulation and micro_batches(pool, w) > 1:
        return 4 * params
    return 4 * params / pool


def gathered_units(s: ModelShape, params: int, pool: int, w: Workload) -> float:
    """Transient FSDP/ZeRO-3 all-gathers: the root unit (embeddings, head) and two blocks in the
    compute dtype, and one block's unsharded fp32 gradient in backward."""
    if pool == 1 or (w.engine == "deepspeed" and w.zero_stage < 3):
        return 0.0
    root = params - s.layers * s.block_params
    return w.dtype_bytes * (root + 2 * s.block_params) + 4 * s.block_params


def block_saved(s: ModelShape, w: Workload) -> float:
    """Bytes a token's pass through one block saves for backward, as autograd saves them: norm
    inputs/outputs (the RMSNorm upcasts to fp32), q, k, v, attention output, o_proj input, gate,
    up, SiLU(gate), their product. q, the attention output and o_proj's input are heads x head_dim
    wide (hidden wide unless the config sets its own head_dim), k and v kv_heads x head_dim."""
    h = s.hidden
    return w.dtype_bytes * (3 * h + 3 * s.q_dim + 2 * s.kv_dim + 4 * s.mlp) + 4 * 2 * h


def activations(s: ModelShape, rows: int, w: Workload, training: bool) -> float:
    """Saved activations of one micro-batch's forward (training) or one block's (inference);
    `rows` of prompt_len + response_len tokens (see micro_rows)."""
    tokens = rows * (w.prompt_len + w.response_len)
    h, i = s.hidden, s.mlp
    per_block = block_saved(s, w)
    if not training:
        # Nothing is kept past a tensor's last use: the peak is the MLP's gate, up and SiLU(gate)
        # with a few hidden-sized tensors (residual, norm, output). tools.plan.memory_plan's tracked
        # step measured 3i + 4h values a token at 0.5B and 7B (values pass: 1.20 and 2.34 GB).
        return tokens * w.dtype_bytes * (3 * i + 4 * h)
    if w.gradient_checkpointing:
        return tokens * (s.layers * w.dtype_bytes * h + per_block)
    return tokens * s.layers * per_block


def logits(s: ModelShape, rows: float, w: Workload, training: bool) -> float:
    """What the LM head and the log-softmax hold in one micro-batch's pass (inference) or at the
    head's backward (training), on top of the blocks' saved activations.

    `w.logits_chunk` tokens at a time (actor.logits_chunk_size, roles/lm_head.py): one chunk's
    logits exist at a time, recomputed in the backward. tools.plan.memory_plan tracked, at 0.5B with
    chunks of 256 to 2048 tokens, the head's backward growing 20 B per logit of a chunk, in bf16
    and in fp32 alike (the chunk's logits, their gradient, the fp32 log-softmax's input and its
    backward's temporaries), and holding the head's whole weight gradient from the first chunk's
    backward on; and the log-prob pass, with no grad, 6 B in bf16 (the logits and their fp32
    copy). Both add the final norm's input and output (in training its input saved in fp32).

    0: the logits of every response position (R + 1 per row) at once, in the compute dtype, and
    the fp32 chunk (logits, softmax, gradient) of algo.logprobs_and_entropy's own chunks.
    Training adds three more logits-sized tensors in the head's backward: each chunk's gradient
    comes back through its slice as a zero tensor of all the logits' size, added to the sum of
    the chunks before (tools.plan.memory_plan tracked 3 x the bf16 logits as temporaries)."""
    tokens = rows * (w.prompt_len + w.response_len)
    positions = rows * (w.response_len + 1)
    if not w.logits_chunk:
        n = positions * s.vocab
        chunk = 4 * min(n, 1 << 26) * (3 if training else 2)
        return w.dtype_bytes * n * (4 if training else 1) + chunk
    n = min(w.logits_chunk, positions) * s.vocab
    upcast = 4 if w.dtype_bytes < 4 else 0  # logits.float() is the logits themselves in fp32
    if not training:
        return n * (w.dtype_bytes + upcast) + tokens * s.hidden * 2 * w.dtype_bytes
    return n * 20 + w.dtype_bytes * s.vocab * s.hidden + tokens * s.hidden * (w.dtype_bytes + 4)


def update_phase(s: ModelShape, params: int, head_params: int, rows: float, pool: int, w: Workload,
                 head_logits: float) -> float:
    """What one update micro-batch adds on top of what is kept: the gathered units, and the larger
    of the backward's two peaks (as tools.plan.memory_plan's tracked step shows them):
      * the head's backward: every block's saved activations (with checkpointing only their
        inputs) and the logits with their backward's temporaries (`head_logits`);
      * a block's backward: the larger of the saved activations (all there at the top block) and
        the blocks' gradient shards (all there at the bottom one), the block's recomputed saved
        tensors (with checkpointing), its backward's temporaries (the gradients of the MLP's
        three intermediate tensors and of a hidden state, compute dtype) and the head's weight
        gradient, whole in the compute dtype until the root unit's reduce-scatter at the end.
    The root's own gradient shards come last, when the activations are gone."""
    tokens = rows * (w.prompt_len + w.response_len)
    h, i = s.hidden, s.mlp
    recomputed = tokens * block_saved(s, w) if w.gradient_checkpointing else 0.0
    kept = activations(s, rows, w, True) - recomputed  # the block inputs (checkpointing) or every block's saved tensors
    block_grads = update_gradients(params, pool, w) * s.layers * s.block_params / params
    block = max(kept, block_grads) + recomputed + tokens * w.dtype_bytes * (3 * i + h) + w.dtype_bytes * head_params
    return gathered_units(s, params, pool, w) + max(kept + head_logits, block, update_gradients(params, pool, w))


def kv_cache(s: ModelShape, rows: int, w: Workload) -> float:
    return 2 * s.layers * s.kv_dim * w.dtype_bytes * rows * (w.prompt_len + w.response_len)


def generate(s: ModelShape, rows: int, w: Workload) -> tuple[str, float]:
    """(name, bytes) of the rollout phase on top of the resident state: the HF copy's KV cache,
    or all vLLM reserves when it wakes (its weights, KV cache and activations)."""
    if w.rollout == "vllm":
        return "vLLM awake", w.gpu_memory_utilization * w.device_gb * GB
    return "generate (KV cache)", kv_cache(s, rows, w)


def nccl(communicators: int, w: Workload) -> float:
    """NCCL's device buffers for this many communicators (none on CPU: gloo's are host memory)."""
    return 0.0 if w.cpu else communicators * w.nccl_mb * MB


def links(pool: int, other: int) -> int:
    """The ranks of another pool of `other` ranks that one rank of a pool of `pool` trades rows with
    (each pool holds equal, contiguous shares of a step's rows): one two-rank communicator each."""
    return math.ceil(other / pool) if other else 0


def in_flight(sources: int) -> int:
    """The weight stream's buckets a source keeps pending (spmdsplit/weight_sync.py)."""
    return min(4, max(2, sources))


def actor_rank(s: ModelShape, pool: int, w: Workload, peers: int = 0, engine: bool = True,
               streams_to: int = 0) -> dict[str, float]:
    """Bytes on one actor-pool rank: what it keeps, and the largest transient of any phase. `peers`:
    ranks of other pools it trades rows with; `engine`: the rollout engine is on this rank;
    `streams_to`: a rollout pool apart of that many ranks takes the weights from this pool (every
    actor rank a source: its weight group, and its buckets in flight while it streams)."""
    rows = w.prompts_per_step // pool
    log_prob_rows = micro_rows(w.log_prob_micro, w.log_prob_max_token_len, w)
    update_rows = micro_rows(w.micro, w.ppo_max_token_len, w)
    keep = {"policy (weights+AdamW)": trained_state(s.params, pool, w),
            "reference": w.dtype_bytes * s.params / pool,
            "rollout weights": w.dtype_bytes * s.params if w.rollout == "hf" and engine else 0.0,
            "NCCL communicators": nccl((pool > 1) + peers + (streams_to > 0), w),
            "process": w.base_mb * MB if w.cpu else 0.0}
    # On CPU the pool's first rank reads each model whole (fp32 here) to hand out its shards.
    phases = {"load": 4 * s.params if w.cpu and pool > 1 else 0.0,
              # the head runs after the last block: its logits never meet a block's activations
              "log-probs": gathered_units(s, s.params, pool, w)
              + max(activations(s, log_prob_rows, w, False), logits(s, log_prob_rows, w, False)),
              "update": update_phase(s, s.params, s.embed_params, update_rows, pool, w, logits(s, update_rows, w, True))}
    if engine:
        generate_name, generate_bytes = generate(s, rows, w)
        phases[generate_name] = generate_bytes
    if streams_to:  # its own buckets pending, the one it gathers among them, at worst the embeddings' (weight_sync.push)
        largest = w.dtype_bytes * s.embed_params
        phases["weight sync"] = max(largest, w.weight_bucket_mb * MB) + (in_flight(pool) - 1) * w.weight_bucket_mb * MB
    return _total(keep, phases)


def critic_rank(s: ModelShape, pool: int, w: Workload, peers: int = 0) -> dict[str, float]:
    p = s.critic_params
    forward_rows = micro_rows(w.log_prob_micro, w.forward_max_token_len, w)
    budget = w.ppo_max_token_len if w.critic_ppo_max_token_len < 0 else w.critic_ppo_max_token_len
    update_rows = micro_rows(w.micro, budget, w)
    keep = {"critic (weights+AdamW)": trained_state(p, pool, w),
            "NCCL communicators": nccl((pool > 1) + peers, w),
            "process": w.base_mb * MB if w.cpu else 0.0}
    phases = {"load": 4 * p if w.cpu and pool > 1 else 0.0,
              "values": gathered_units(s, p, pool, w) + activations(s, forward_rows, w, False),
              "update": update_phase(s, p, s.hidden + 1, update_rows, pool, w, 0.0)}
    return _total(keep, phases)


def colocated_rank(s: ModelShape, world: int, w: Workload, peers: int = 0, engine: bool = True,
                   streams_to: int = 0) -> dict[str, float]:
    """Every trained role on every rank, each sharded over the whole pool; the phases run one by
    one (and the engine too, unless a rollout pool apart holds it)."""
    a, c = actor_rank(s, world, w, peers, engine, streams_to), critic_rank(s, world, w)
    keep = {**a["keep"], **{k: v for k, v in c["keep"].items() if k not in ("process", "NCCL communicators")}}
    phases = {**{f"actor {k}": v for k, v in a["phases"].items()}, **{f"critic {k}": v for k, v in c["phases"].items()}}
    return _total(keep, phases)


def rollout_rank(s: ModelShape, pool: int, sources: int, train: int, w: Workload) -> dict[str, float]:
    """A rank of a rollout pool apart, fed by `sources` actor ranks and sending rows to a train pool
    of `train` ranks: its engine keeps its share of the device for the whole job (vLLM: all of
    `gpu_memory_utilization` x the device; HF: its copy and KV cache), and while it takes new
    weights, the buckets it has posted and one tensor put together from its pieces."""
    engine = ({"vLLM (never sleeps)": w.gpu_memory_utilization * w.device_gb * GB} if w.rollout == "vllm" else
              {"rollout weights": w.dtype_bytes * s.params,
               "generate (KV cache)": kv_cache(s, w.prompts_per_step // pool, w)})
    keep = {**engine, "NCCL communicators": nccl((pool > 1) + sources + links(pool, train), w),
            "process": w.base_mb * MB if w.cpu else 0.0}
    largest = w.dtype_bytes * s.embed_params  # the embeddings' (or the head's) bucket: one tensor
    bucket = w.weight_bucket_mb * MB
    # Posted: the largest bucket and `in_flight` more; and the tensor its pieces are put together into.
    phases = {"weight sync": max(largest, bucket) + in_flight(sources) * bucket + largest}
    return _total(keep, phases)


def _total(keep: dict[str, float], phases: dict[str, float]) -> dict:
    worst = max(phases, key=phases.get)
    return {"keep": keep, "phases": phases, "peak_phase": worst, "total": sum(keep.values()) + phases[worst]}


def layouts(world: int, rollout_pool: int = 0) -> dict[str, tuple[int, ...] | None]:
    """The layouts of one node that docs/memory.md's fit table compares (None = colocate; (a, c):
    actor | critic; (r, t): a rollout pool of r ranks | actor+critic on t, with `rollout_pool`)."""
    half = world // 2
    out = {f"{half}+{half}": (half, half), f"{world - 2}+2": (world - 2, 2), "colocate": None}
    if rollout_pool:
        out[f"rollout {rollout_pool}, actor+critic {world - rollout_pool}"] = ("rollout", rollout_pool, world - rollout_pool)
    return out


def layout_ranks(s: ModelShape, world: int, pools: tuple | None, w: Workload) -> dict[str, dict]:
    """Each kind of rank of a layout (None = colocate) and its prediction."""
    if pools is None:
        return {"all": colocated_rank(s, world, w)}
    if pools[0] == "rollout":
        _, gen, train = pools
        return {"all": colocated_rank(s, train, w, peers=links(train, gen), engine=False, streams_to=gen),
                "rollout": rollout_rank(s, gen, train, train, w)}
    a, c = pools
    return {"actor": actor_rank(s, a, w, peers=links(a, c)), "critic": critic_rank(s, c, w, peers=links(c, a))}


def fit_table(shapes, world: int, gpu_gb: float, reserve_gb: float, w: Workload, rollout_pool: int = 0) -> list[dict]:
    """Per model and layout: each rank's peak (GB) and its phase, whether the worst fits, and the
    worst rank's peak with no_sync_accumulation (what that option costs)."""
    rows = []
    budget = (gpu_gb - reserve_gb) * GB
    for s in shapes:
        for name, pools in layouts(world, rollout_pool).items():
            ranks = layout_ranks(s, world, pools, w)
            no_sync = layout_ranks(s, world, pools, replace(w, no_sync_accumulation=True))
            worst, worst_no_sync = (max(r["total"] for r in rs.values()) for rs in (ranks, no_sync))
            rows.append({"model": s.name, "params": s.params, "layout": name,
                         **{f"{k}_gb": r["total"] / GB for k, r in ranks.items()},
                         **{f"{k}_phase": r["peak_phase"] for k, r in ranks.items()},
                         "fits": worst <= budget, "no_sync_gb": worst_no_sync / GB, "no_sync_fits": worst_no_sync <= budget})
    return rows


def describe_micro(w: Workload) -> str:
    """Which micro-batching the prediction assumes."""
    if not (w.ppo_max_token_len or w.log_prob_max_token_len or w.forward_max_token_len):
        return (f"fixed micro-batches of {w.micro} rows (log-prob and values {w.log_prob_micro}), each row padded to "
                "prompt + response")
    budget = lambda tokens, rows: f"{tokens} tokens" if tokens else f"{rows} padded rows"  # noqa: E731
    return (f"token budgets (use_dynamic_bsz + use_remove_padding, no padding): update "
            f"{budget(w.ppo_max_token_len, w.micro)}, log-prob {budget(w.log_prob_max_token_len, w.log_prob_micro)}, "
            f"values {budget(w.forward_max_token_len, w.log_prob_micro)} per micro-batch, of rows shaped like the "
            "workload's")


def describe_rollout(w: Workload) -> str:
    if w.rollout == "vllm":
        return (f"vLLM rollout at gpu_memory_utilization {w.gpu_memory_utilization} (asleep at level 2 while the "
                f"trainer trains; awake it holds {w.gpu_memory_utilization * w.device_gb:.0f} GB on top of the "
                "trainer's resident state)")
    return "HF rollout (a whole bf16 copy + KV cache of the rank's rows)"


def render_fit(rows: list[dict], world: int, gpu_gb: float, reserve_gb: float, w: Workload) -> str:
    lines = [f"Predicted peak per GPU, one node of {world} x {gpu_gb:.0f} GB (fits: <= {gpu_gb - reserve_gb:.0f} GB, "
             f"{reserve_gb:.0f} GB left for the CUDA context and fragmentation; NCCL's buffers counted at "
             f"{w.nccl_mb:.0f} MB a communicator). Workload: bf16 compute, "
             f"{w.engine}{'' if w.engine == 'fsdp' else f' ZeRO-{w.zero_stage}'}, gradient checkpointing "
             f"{'on' if w.gradient_checkpointing else 'off'}, {w.prompts_per_step} rollouts per step, prompt "
             f"{w.prompt_len} + response {w.response_len} tokens, mini-batch {w.mini} rows, {describe_micro(w)}, "
             f"gradients reduced every micro-batch, {describe_rollout(w)}. Last "
             "columns: the worst rank with no_sync_accumulation (a whole fp32 gradient per rank while a mini-batch "
             "of several micro-batches accumulates).", "",
             "| model | params | layout | actor rank (GB) | critic rank (GB) | colocated rank (GB) | rollout rank (GB) "
             "| fits | no_sync_accumulation: worst rank (GB) | fits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[f'{k}_gb']:.1f} ({r[f'{k}_phase']})" if f"{k}_gb" in r else ""
                 for k in ("actor", "critic", "all", "rollout")]
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['layout']} | " + " | ".join(cells)
                     + f" | {'yes' if r['fits'] else 'no'} | {r['no_sync_gb']:.1f} | {'yes' if r['no_sync_fits'] else 'no'} |")
    return "\n".join(lines)


def bench_workload(meta: dict, layout: str = "") -> Workload:
    """tools.bench.memory's CPU jobs as a Workload (fp32, no checkpointing, FSDP), with the
    overrides the report recorded for `layout` (its micro-batching). The bench's actor and critic
    take the same mini- and micro-batch sizes."""
    overrides = meta.get("layout_overrides", {}).get(layout, [])
    opts = dict(o.split("=", 1) for o in [*meta["workload"], *overrides] if "=" in o)
    return Workload(dtype_bytes=4, engine="fsdp", gradient_checkpointing=False, cpu=True,
                    prompts_per_step=int(opts["data.train_batch_size"]),
                    prompt_len=int(opts["data.max_prompt_length"]), response_len=int(opts["data.max_response_length"]),
                    mini=int(opts["actor.ppo_mini_batch_size"]), micro=int(opts["actor.ppo_micro_batch_size_per_gpu"]),
                    log_prob_micro=int(opts["actor.log_prob_micro_batch_size_per_gpu"]),
                    no_sync_accumulation=opts.get("actor.no_sync_accumulation") == "true")


def check_against_bench(report: dict) -> list[dict]:
    """Predicted vs measured peak RSS of each pool's largest rank, per layout of a bench_memory report."""
    meta = report["meta"]
    s = ModelShape("bench", meta["hidden"], meta["layers"], meta["heads"], meta["kv_heads"], meta["mlp"], meta["vocab"])
    rows = []
    for layout, measured in report["summary"]["max_mb"].items():
        w = bench_workload(meta, layout)
        a, c = (int(x) for x in layout.split("/")[0].split("+"))
        predicted = {"actor": actor_rank(s, a, w)["total"] / MB, "critic": critic_rank(s, c, w)["total"] / MB}
        for pool, mb in measured.items():
            rows.append({"layout": layout, "pool": pool, "measured_mb": mb, "predicted_mb": predicted[pool],
                         "error": predicted[pool] / mb - 1})
    return rows


def render_check(rows: list[dict], params: int) -> str:
    lines = ["| layout | pool | measured peak RSS (MB) | predicted (MB) | predicted / measured - 1 |", "|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['pool']} | {r['measured_mb']:.0f} ({r['measured_mb'] * MB / params:.1f} B/param) | "
              f"{r['predicted_mb']:.0f} ({r['predicted_mb'] * MB / params:.1f} B/param) | {r['error']:+.0%} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.plan --memory", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8, help="GPUs of the node (default 8)")
    p.add_argument("--gpu-gb", type=float, default=80.0)
    p.add_argument("--reserve-gb", type=float, default=4.0, help="left free per GPU for what the model leaves out")
    p.add_argument("--nccl-mb", type=float, default=Workload.nccl_mb, help="device memory of one NCCL communicator")
    p.add_argument("--rollout-pool", type=int, default=0,
                   help="adds a layout with a rollout pool of this many ranks apart (actor+critic on the rest)")
    p.add_argument("--weight-bucket-mb", type=float, default=Workload.weight_bucket_mb)
    p.add_argument("--engine", choices=("fsdp", "deepspeed"), default="fsdp")
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--rollouts", type=int, default=256, help="rollouts per step (train_batch_size * rollout.n)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--mini", type=int, default=64, help="rows per optimizer step over a pool (ppo_mini_batch_size * n)")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--log-prob-micro", type=int, default=32)
    p.add_argument("--max-token-len", type=int, default=0,
                   help="token budget of every micro-batch (use_dynamic_bsz + use_remove_padding); each of the three "
                        "below overrides it for its phases")
    p.add_argument("--ppo-max-token-len-per-gpu", type=int, help="update micro-batches (actor and critic)")
    p.add_argument("--log-prob-max-token-len-per-gpu", type=int, help="actor and reference log-probs")
    p.add_argument("--forward-max-token-len-per-gpu", type=int, help="the critic's values")
    p.add_argument("--no-sync-accumulation", action="store_true",
                   help="actor and critic reduce gradients once per mini-batch (a whole fp32 gradient per rank)")
    p.add_argument("--logits-chunk-size", type=int, default=Workload.logits_chunk,
                   help="actor.logits_chunk_size: the LM head's tokens at a time (0: the logits whole)")
    p.add_argument("--rollout", choices=("hf", "vllm"), default="hf")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vllm: its share of the whole GPU")
    p.add_argument("--check", help="a bench_memory.json to compare the model with (CPU RSS)")
    args = p.parse_args(argv)
    budgets = {name: args.max_token_len if getattr(args, name) is None else getattr(args, name)
               for name in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "forward_max_token_len_per_gpu")}
    for name, tokens in budgets.items():
        # as verl: a packed micro-batch must take the longest row whole
        if tokens and tokens < args.prompt_len + args.response_len:
            p.error(f"{name}={tokens} is below one row of prompt {args.prompt_len} + response {args.response_len} tokens")
    w = Workload(engine=args.engine, zero_stage=args.zero_stage, gradient_checkpointing=not args.no_gradient_checkpointing,
                 prompts_per_step=args.rollouts, prompt_len=args.prompt_len, response_len=args.response_len,
                 mini=args.mini, micro=args.micro, log_prob_micro=args.log_prob_micro,
                 ppo_max_token_len=budgets["ppo_max_token_len_per_gpu"],
                 log_prob_max_token_len=budgets["log_prob_max_token_len_per_gpu"],
                 forward_max_token_len=budgets["forward_max_token_len_per_gpu"],
                 no_sync_accumulation=args.no_sync_accumulation, rollout=args.rollout,
                 gpu_memory_utilization=args.gpu_memory_utilization, device_gb=args.gpu_gb, nccl_mb=args.nccl_mb,
                 weight_bucket_mb=args.weight_bucket_mb, logits_chunk=args.logits_chunk_size)
    rows = fit_table([QWEN25[k] for k in ("Qwen2.5-0.5B", "Qwen2.5-7B", "Qwen2.5-14B")], args.world_size, args.gpu_gb, args.reserve_gb, w, args.rollout_pool)
    print(render_fit(rows, args.world_size, args.gpu_gb, args.reserve_gb, w))
    if args.check:
        with open(args.check) as f:
            report = json.load(f)
        print(f"\nMemory model vs {args.check} (CPU, fp32, RSS incl. {Workload.base_mb:.0f} MB of process):\n")
        print(render_check(check_against_bench(report), report["meta"]["params"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
