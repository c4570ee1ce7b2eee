"""`python -m tools.plan --memory [--gpu-gb 80 --world-size 8] [--check outputs/bench_memory/bench_memory.json]`

A memory model: predicted peak device memory of one rank of each pool, from the model's shape,
the compute dtype, the engine (FSDP2 = ZeRO-3, or DeepSpeed stage 1/2/3), the pool sizes,
gradient checkpointing, micro-batch and sequence lengths. What a rank holds all the time:

  * a trained model (actor, critic): fp32 masters, fp32 gradients and AdamW's two fp32 moments,
    16 B/param, divided by the pool size where the engine shards them (FSDP2: all of it;
    ZeRO-1: optimizer state; ZeRO-2: + gradients; ZeRO-3: + weights, which DeepSpeed keeps in
    the compute dtype next to fp32 master shards);
  * the reference: frozen, compute dtype, sharded over the actor pool;
  * the rollout: a whole copy of the policy in the compute dtype (HF rollout, or vLLM's weights
    at tensor parallel 1) plus the KV cache of the rows it generates at once;

and, on top, the largest of what one phase adds for a while: gathered FSDP units (the root, i.e.
embeddings + head, and two blocks: the one running and the one prefetched), activations
(per token and block: all the block's saved tensors, or with checkpointing only its input plus
one block's recomputed tensors), and the logits of the response positions (compute dtype, their
gradient, and one fp32 chunk of the log-softmax, see algo.logprobs_and_entropy). On CPU the
RSS also counts the process itself (interpreter, torch, transformers: `--base-mb`) and, on a
pool's first rank, the whole model it reads to hand out shards.

Not modelled: allocator fragmentation and caching, NCCL buffers, the CUDA context (reserved as
`--reserve-gb` when checking what fits), attention score matrices (sdpa/flash keep none), a
reward model, vLLM's `gpu_memory_utilization` pre-allocation.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

GB = 1e9
MB = 2**20


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def block_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k, v (bias), o
        return attention + 3 * h * self.intermediate + 2 * h  # SwiGLU MLP, two RMSNorms

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """The causal LM's parameter count (Qwen2 architecture)."""
        head = 0 if self.tied else self.embed_params
        return self.layers * self.block_params + self.embed_params + head + self.hidden

    @property
    def critic_params(self) -> int:
        """The value model: the backbone and a one-output head instead of the LM head."""
        return self.layers * self.block_params + self.embed_params + self.hidden + self.hidden + 1


# Published config.json values of the Qwen2.5 base models.
QWEN25 = {
    "Qwen2.5-0.5B": Shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, tied=True),
    "Qwen2.5-7B": Shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064),
    "Qwen2.5-14B": Shape("Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064),
}
# tools.bench_memory's default model (vocabulary: the embedded tokenizer's).
BENCH_76M = Shape("bench 76M", 768, 12, 12, 4, 2048, 15)


@dataclass(frozen=True)
class Workload:
    dtype_bytes: int = 2  # compute dtype: 2 (bf16 on GPUs) or 4 (fp32, CPU)
    engine: str = "fsdp"  # fsdp | deepspeed
    zero_stage: int = 3
    gradient_checkpointing: bool = True
    prompts_per_step: int = 256  # data.train_batch_size * rollout.n (rows)
    prompt_len: int = 512
    response_len: int = 512
    micro: int = 4  # ppo_micro_batch_size_per_gpu (actor and critic)
    log_prob_micro: int = 8  # log_prob / forward micro-batch
    cpu: bool = False  # RSS: adds the process and the reader's whole copy at load time
    base_mb: float = 350.0  # RSS of a process that imported torch, transformers and spmdsplit (measured)


def trained_state(params: int, pool: int, w: Workload) -> float:
    """Bytes a trained model's weights, gradients and AdamW state keep on one rank."""
    if w.engine == "fsdp":
        return 16 * params / pool  # fp32 shards of weights, gradients, two moments
    weights = (w.dtype_bytes * params) * (1 / pool if w.zero_stage == 3 else 1)
    masters = 4 * params / pool if w.dtype_bytes != 4 else 0.0  # fp32 masters next to compute-dtype weights
    grads = 4 * params * (1 / pool if w.zero_stage >= 2 else 1)
    return weights + masters + grads + 8 * params / pool


def gathered_units(s: Shape, params: int, pool: int, w: Workload) -> float:
    """Transient FSDP/ZeRO-3 all-gathers: the root unit (embeddings, head) and two blocks in the
    compute dtype, and one block's unsharded fp32 gradient in backward."""
    if pool == 1 or (w.engine == "deepspeed" and w.zero_stage < 3):
        return 0.0
    root = params - s.layers * s.block_params
    return w.dtype_bytes * (root + 2 * s.block_params) + 4 * s.block_params


def activations(s: Shape, rows: int, w: Workload, training: bool) -> float:
    """Saved activations of one micro-batch's forward (training) or one block's (inference)."""
    tokens = rows * (w.prompt_len + w.response_len)
    h, i = s.hidden, s.intermediate
    # Per token and block, as autograd saves them: norm inputs/outputs (the RMSNorm upcasts to
    # fp32), q, k, v, attention output, o_proj input, gate, up, SiLU(gate), their product.
    per_block = w.dtype_bytes * (6 * h + 2 * s.kv_dim + 4 * i) + 4 * 2 * h
    if not training:
        return tokens * per_block  # nothing is kept past a block
    if w.gradient_checkpointing:
        return tokens * (s.layers * w.dtype_bytes * h + per_block)
    return tokens * s.layers * per_block


def logits(s: Shape, rows: int, w: Workload, training: bool) -> float:
    """Response-position logits (R + 1 per row) in the compute dtype, their gradient when
    training, and the fp32 chunk (logits, softmax, gradient) of the chunked log-softmax."""
    n = rows * (w.response_len + 1) * s.vocab
    chunk = 4 * min(n, 1 << 26) * (3 if training else 2)
    return w.dtype_bytes * n * (2 if training else 1) + chunk


def kv_cache(s: Shape, rows: int, w: Workload) -> float:
    return 2 * s.layers * s.kv_dim * w.dtype_bytes * rows * (w.prompt_len + w.response_len)


def actor_rank(s: Shape, pool: int, w: Workload) -> dict[str, float]:
    """Bytes on one actor-pool rank: what it keeps, and the largest transient of any phase."""
    rows = w.prompts_per_step // pool
    keep = {"policy (weights+grads+AdamW)": trained_state(s.params, pool, w),
            "reference": w.dtype_bytes * s.params / pool,
            "rollout weights": w.dtype_bytes * s.params,
            "process": w.base_mb * MB if w.cpu else 0.0}
    # On CPU the pool's first rank reads each model whole (fp32 here) to hand out its shards.
    phases = {"load": 4 * s.params if w.cpu and pool > 1 else 0.0,
              "generate (KV cache)": kv_cache(s, rows, w),
              "log-probs": gathered_units(s, s.params, pool, w) + activations(s, w.log_prob_micro, w, False)
              + logits(s, w.log_prob_micro, w, False),
              "update": gathered_units(s, s.params, pool, w) + activations(s, w.micro, w, True)
              + logits(s, w.micro, w, True)}
    return _total(keep, phases)


def critic_rank(s: Shape, pool: int, w: Workload) -> dict[str, float]:
    p = s.critic_params
    keep = {"critic (weights+grads+AdamW)": trained_state(p, pool, w),
            "process": w.base_mb * MB if w.cpu else 0.0}
    phases = {"load": 4 * p if w.cpu and pool > 1 else 0.0,
              "values": gathered_units(s, p, pool, w) + activations(s, w.log_prob_micro, w, False),
              "update": gathered_units(s, p, pool, w) + activations(s, w.micro, w, True)}
    return _total(keep, phases)


def colocated_rank(s: Shape, world: int, w: Workload) -> dict[str, float]:
    """Every role on every rank, each sharded over the whole world; the phases run one by one."""
    a, c = actor_rank(s, world, w), critic_rank(s, world, w)
    keep = {**a["keep"], **{k: v for k, v in c["keep"].items() if k != "process"}}
    phases = {**{f"actor {k}": v for k, v in a["phases"].items()}, **{f"critic {k}": v for k, v in c["phases"].items()}}
    return _total(keep, phases)


def _total(keep: dict[str, float], phases: dict[str, float]) -> dict:
    worst = max(phases, key=phases.get)
    return {"keep": keep, "phases": phases, "peak_phase": worst, "total": sum(keep.values()) + phases[worst]}


def layouts(world: int) -> dict[str, tuple[int, int] | None]:
    """The layouts of one node that the README's table compares (None = colocate)."""
    half = world // 2
    return {f"{half}+{half}": (half, half), f"{world - 2}+2": (world - 2, 2), "colocate": None}


def fit_table(shapes, world: int, gpu_gb: float, reserve_gb: float, w: Workload) -> list[dict]:
    rows = []
    for s in shapes:
        for name, pools in layouts(world).items():
            if pools is None:
                ranks = {"all": colocated_rank(s, world, w)["total"]}
            else:
                ranks = {"actor": actor_rank(s, pools[0], w)["total"], "critic": critic_rank(s, pools[1], w)["total"]}
            worst = max(ranks.values())
            rows.append({"model": s.name, "params": s.params, "layout": name,
                         **{f"{k}_gb": v / GB for k, v in ranks.items()},
                         "fits": worst <= (gpu_gb - reserve_gb) * GB})
    return rows


def render_fit(rows: list[dict], world: int, gpu_gb: float, reserve_gb: float, w: Workload) -> str:
    lines = [f"Predicted peak per GPU, one node of {world} x {gpu_gb:.0f} GB (fits: <= {gpu_gb - reserve_gb:.0f} GB, "
             f"{reserve_gb:.0f} GB left for the CUDA context, NCCL and fragmentation). Workload: bf16 compute, "
             f"{w.engine}{'' if w.engine == 'fsdp' else f' ZeRO-{w.zero_stage}'}, gradient checkpointing "
             f"{'on' if w.gradient_checkpointing else 'off'}, {w.prompts_per_step} rollouts per step, prompt "
             f"{w.prompt_len} + response {w.response_len} tokens, micro-batch {w.micro} (log-prob {w.log_prob_micro}), "
             "HF rollout (a whole bf16 copy + KV cache of the rank's rows).", "",
             "| model | params | layout | actor rank (GB) | critic rank (GB) | colocated rank (GB) | fits |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.1f}" if k in r else "" for k in ("actor_gb", "critic_gb", "all_gb")]
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['layout']} | " + " | ".join(cells)
                     + f" | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def bench_workload(meta: dict) -> Workload:
    """tools.bench_memory's CPU jobs as a Workload (fp32, no checkpointing, FSDP)."""
    opts = dict(o.split("=", 1) for o in meta["workload"] if "=" in o)
    return Workload(dtype_bytes=4, engine="fsdp", gradient_checkpointing=False, cpu=True,
                    prompts_per_step=int(opts["data.train_batch_size"]),
                    prompt_len=int(opts["data.max_prompt_length"]), response_len=int(opts["data.max_response_length"]),
                    micro=int(opts["actor.ppo_micro_batch_size_per_gpu"]),
                    log_prob_micro=int(opts["actor.log_prob_micro_batch_size_per_gpu"]))


def check_against_bench(report: dict) -> list[dict]:
    """Predicted vs measured peak RSS of each pool's largest rank, per layout of a bench_memory report."""
    meta = report["meta"]
    s = Shape("bench", meta["hidden"], meta["layers"], meta["heads"], meta["kv_heads"], meta["mlp"], meta["vocab"])
    w = bench_workload(meta)
    rows = []
    for layout, measured in report["summary"]["max_mb"].items():
        a, c = (int(x) for x in layout.split("+"))
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
    p.add_argument("--engine", choices=("fsdp", "deepspeed"), default="fsdp")
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--rollouts", type=int, default=256, help="rollouts per step (train_batch_size * rollout.n)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--log-prob-micro", type=int, default=8)
    p.add_argument("--check", help="a bench_memory.json to compare the model with (CPU RSS)")
    args = p.parse_args(argv)
    w = Workload(engine=args.engine, zero_stage=args.zero_stage, gradient_checkpointing=not args.no_gradient_checkpointing,
                 prompts_per_step=args.rollouts, prompt_len=args.prompt_len, response_len=args.response_len,
                 micro=args.micro, log_prob_micro=args.log_prob_micro)
    rows = fit_table(QWEN25.values(), args.world_size, args.gpu_gb, args.reserve_gb, w)
    print(render_fit(rows, args.world_size, args.gpu_gb, args.reserve_gb, w))
    if args.check:
        with open(args.check) as f:
            report = json.load(f)
        print(f"\nMemory model vs {args.check} (CPU, fp32, RSS incl. {Workload.base_mb:.0f} MB of process):\n")
        print(render_check(check_against_bench(report), report["meta"]["params"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
