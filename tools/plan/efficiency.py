"""How far each phase of a job runs from the chip: model FLOPs utilisation, tokens per second,
the device's idle share and the top kernels per phase (issue 37 item 4; `tools.device.gpu_check` runs it).

Inputs: the model's shapes (its Hugging Face config), the job's resolved config, its TensorBoard
scalars (`timing_s/<phase>`, `prompt_length/mean`, `response_length/mean` per step) and the
torch.profiler trace of one step (`trainer.profile_steps`, spmdsplit/timing.py StepProfiler),
whose `phase:<name>` ranges tell the phases apart.

FLOPs, counted from shapes and tokens (one rank's share: rows = data.train_batch_size x rollout.n
over the ranks; T = the rows' prompt and response tokens, R = their response tokens, from the
step's mean lengths; padding is never counted, so it shows as lost utilisation):
- W = the decoder layers' matmul weights, per layer h(q + 2kv)d + qd h + 3 h m (h hidden, q and
  kv heads of width d, m the MLP width); embeddings are a lookup (no FLOPs), norms and biases are
  elementwise (left out);
- attention, causal, per layer and row of L tokens: QK^T and AV over L(L+1)/2 pairs, 4qd FLOPs a
  pair, so 2qd L(L+1); from the mean row length L = T / rows (exact when rows are equal: at
  Qwen2.5-0.5B's shape and 200-token rows it is under 1 % of the total);
- forward = 2 W T + attention + the head: the actor's LM head (h x vocab) only where it predicts a
  response token (logits_to_keep, roles/forward.py), 2 h V R; the critic's value head (h x 1) at
  every token, 2 h T;
- gen = a forward of T - rows tokens (the last token of a response is never fed back), head R;
  old_log_prob and ref = the actor's forward; values = the critic's forward;
- update = per epoch, forward x 3 (backward: twice the forward, for the inputs' and the weights'
  gradients) plus, with gradient checkpointing, the decoder layers' forward once more less each
  layer's last matmul (MLP down, 2 h m T: torch.utils.checkpoint's non-reentrant recompute stops
  once backward has every tensor it saved, `set_checkpoint_early_stop`) and attention's forward.
  The actor's LM head is recomputed in the backward too where it runs in chunks
  (actor.logits_chunk_size > 0, the default; roles/lm_head.py): its head then counts 4 forwards. Recomputation counted makes this what PaLM calls hardware FLOPs
  utilisation; without checkpointing both are the same.
MFU = FLOPs / (phase time x the dense matmul rate measured in the same call: bf16 on a GPU, fp32
on CPU at the job's threads per rank). Phase times are the medians over the steps not profiled.

Idle share (from the profiled step): 1 - busy / wall over each phase's ranges, busy = the union of
the intervals in which the device ran something: on a GPU, CUDA kernels, memcpys and memsets on
any stream (CUPTI's records, on the host's clock; a collective that waits for a peer counts as
busy); on CPU, the union of aten ops on any thread (time in Python between ops, or in a wait, is
idle). Top kernels: per phase, on a GPU the kernels' time inside the phase, on CPU each op's self
time (its time less its child ops'), by name.
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
import time
from dataclasses import dataclass

from spmdsplit.timing import PHASE_RANGE
from tools.models import ModelShape

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies a GPU, in a kineto trace's "cat"
FLOP_PHASES = ("gen", "old_log_prob", "ref", "values", "update_actor", "update_critic")
TOP_KERNELS = 5


@dataclass(frozen=True)
class Tokens:
    """One step's work on one rank: rows, their prompt and response tokens."""
    rows: float
    prompt: float
    response: float

    @property
    def total(self) -> float:
        return self.prompt + self.response


def attention_flops(shape: ModelShape, tokens: float, rows: float) -> float:
    """Causal attention's forward over `rows` rows of tokens / rows tokens each."""
    if rows <= 0:
        return 0.0
    return 2 * shape.layers * shape.heads * shape.head_dim * tokens * (tokens / rows + 1)


def forward_flops(shape: ModelShape, tokens: float, rows: float, head_width: int, head_tokens: float) -> dict:
    """A forward's FLOPs by part: the decoder layers' matmuls, attention, the head."""
    return {"matmul": 2 * shape.body_weights() * tokens, "attention": attention_flops(shape, tokens, rows),
            "head": 2 * shape.hidden * head_width * head_tokens}


def update_flops(shape: ModelShape, forward: dict, tokens: float, checkpointing: bool, epochs: int,
                 head_recomputed: bool = False) -> dict:
    """Forward, backward (twice the forward) and, with gradient checkpointing, the layers'
    recompute less each layer's MLP down projection (see the module's docstring); with
    `head_recomputed` (the LM head in chunks) the head's forward once more; per epoch."""
    recompute = forward["matmul"] - 2 * shape.layers * shape.hidden * shape.mlp * tokens if checkpointing else 0.0
    return {"matmul": epochs * (3 * forward["matmul"] + recompute),
            "attention": epochs * (3 + checkpointing) * forward["attention"],
            "head": epochs * (3 + head_recomputed) * forward["head"]}


def phase_flops(phase: str, shape: ModelShape, t: Tokens, checkpointing: bool, actor_epochs: int = 1,
                critic_epochs: int = 1, head_in_chunks: bool = False) -> dict | None:
    """FLOPs of one step of `phase` by part, or None for a phase without a model pass;
    `head_in_chunks`: actor.logits_chunk_size > 0 (the update recomputes the LM head)."""
    actor = forward_flops(shape, t.total, t.rows, shape.vocab, t.response)
    critic = forward_flops(shape, t.total, t.rows, 1, t.total)
    if phase == "gen":
        body = t.total - t.rows  # a response's last token is sampled, never fed back
        return {"matmul": 2 * shape.body_weights() * body, "attention": attention_flops(shape, t.total, t.rows),
                "head": 2 * shape.hidden * shape.vocab * t.response}
    if phase in ("old_log_prob", "ref"):
        return actor
    if phase == "values":
        return critic
    if phase == "update_actor":
        return update_flops(shape, actor, t.total, checkpointing, actor_epochs, head_in_chunks)
    if phase == "update_critic":
        return update_flops(shape, critic, t.total, checkpointing, critic_epochs)
    return None


def phase_tokens(phase: str, t: Tokens, actor_epochs: int = 1, critic_epochs: int = 1) -> float | None:
    """The tokens/s numerator: generated tokens for gen, the tokens a pass runs over for the others."""
    return {"gen": t.response, "old_log_prob": t.total, "ref": t.total, "values": t.total,
            "update_actor": t.total * actor_epochs, "update_critic": t.total * critic_epochs}.get(phase)


# ------------------------------------------------------------------ the chip's rate

def matmul_rate(device: str, threads: int = 1, repeats: int = 5) -> dict:
    """The dense matmul rate this process reaches now, the best of `repeats` timings: on a GPU,
    bf16 8192^3 (10 in a row between CUDA events, after a warm-up); on CPU, fp32 1024^3 on
    `threads` threads (the job's threads per rank), timed by the wall clock."""
    import torch

    if device == "cuda":
        n, dtype, inner = 8192, torch.bfloat16, 10
    else:
        n, dtype, inner = 1024, torch.float32, 1
    old_threads = torch.get_num_threads()
    if device == "cpu" and threads > 0:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b  # warm-up: kernels chosen, pages touched
        best = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    a @ b
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                a @ b
                seconds = time.perf_counter() - t0
            best = min(best, seconds / inner)
        del a, b
        if device == "cuda":
            torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(old_threads)
    return {"flops_per_s": 2 * n**3 / best, "dtype": str(dtype).removeprefix("torch."), "n": n,
            "threads": threads if device == "cpu" else None}


# ------------------------------------------------------------------ the profiled step

def read_trace(path: str) -> list[dict]:
    """A Chrome trace as torch.profiler writes it (.json or .json.gz): its events."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals sorted by start."""
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _self_times(ops: list[dict]) -> list[float]:
    """Each CPU op's self time (µs): its duration less its direct children's, nesting read per
    thread from the intervals (ops sorted by start, a parent before a child that starts with it)."""
    self_us = [float(e["dur"]) for e in ops]
    stacks: dict[tuple, list[int]] = {}
    for i, e in enumerate(ops):
        stack = stacks.setdefault((e["pid"], e["tid"]), [])
        while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            self_us[stack[-1]] -= e["dur"]
        stack.append(i)
    return self_us


def phase_activity(events: list[dict], gpu: bool) -> dict[str, dict]:
    """Per phase of the trace: its ranges' wall time, the device's busy time inside them (s),
    and its kernels {name: [seconds, calls]}, each counted in the range it starts in (GPU: the
    kernel's time inside the range; CPU: the op's self time). Empty for a GPU trace without
    kernels (no CUPTI: nothing to say about the GPU's idle time)."""
    ranges = [(e["name"][len(PHASE_RANGE):], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
              if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith(PHASE_RANGE)]
    work = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in (GPU_WORK if gpu else ("cpu_op",))),
                  key=lambda e: (float(e["ts"]), -float(e["dur"])))
    if gpu and not work:
        return {}
    starts = [float(e["ts"]) for e in work]
    ends = [s + float(e["dur"]) for s, e in zip(starts, work)]
    self_us = [float(e["dur"]) for e in work] if gpu else _self_times(work)
    longest = max((float(e["dur"]) for e in work), default=0.0)
    out: dict[str, dict] = {}
    for name, start, end in ranges:
        row = out.setdefault(name, {"wall_s": 0.0, "busy_s": 0.0, "ranges": 0, "kernels": {}})
        row["wall_s"] += (end - start) / 1e6
        row["ranges"] += 1
        lo, hi = bisect.bisect_left(starts, start - longest), bisect.bisect_left(starts, end)
        inside = [(max(starts[i], start), min(ends[i], end)) for i in range(lo, hi) if ends[i] > start]
        row["busy_s"] += _union(inside) / 1e6
        for i in range(bisect.bisect_left(starts, start), hi):
            # GPU: the kernel's time inside the range; CPU: the op's self time (it starts inside).
            spent = (min(ends[i], end) - starts[i]) if gpu else self_us[i]
            kernel = row["kernels"].setdefault(work[i]["name"], [0.0, 0])
            kernel[0] += spent / 1e6
            kernel[1] += 1
    return out


# ------------------------------------------------------------------ the report

def step_tokens(scalars: dict, step: int, rows: float) -> Tokens:
    """A step's tokens on one rank from TensorBoard's mean prompt and response lengths."""
    return Tokens(rows, rows * scalars["prompt_length/mean"][step], rows * scalars["response_length/mean"][step])


def efficiency(shape: ModelShape, cfg, scalars: dict, activity: dict, rate: dict, timed_steps: list[int],
               profiled_steps: list[int], ranks: int = 1) -> dict:
    """The report's rows, one per phase: seconds per step (medians over `timed_steps`), tokens
    and FLOPs per step, tokens/s, MFU, and from the profile the idle share and the top kernels."""
    rows = cfg.data.train_batch_size * cfg.rollout.n / ranks
    epochs = {"actor_epochs": cfg.actor.ppo_epochs, "critic_epochs": cfg.critic.ppo_epochs}
    checkpointing = bool(cfg.model.gradient_checkpointing)
    timed = {k.removeprefix("timing_s/") for k in scalars if k.startswith("timing_s/")} - {"step"}
    names = [p for p in FLOP_PHASES if p in timed or p in activity]
    names += sorted((timed | set(activity)) - set(names))
    phases = {}
    for name in names:
        times = scalars.get(f"timing_s/{name}", {})
        steps = [s for s in timed_steps if s in times and times[s] > 0]
        row: dict = {"seconds": statistics.median(times[s] for s in steps) if steps else None}
        per_step = []
        for s in steps:
            t = step_tokens(scalars, s, rows)
            flops = phase_flops(name, shape, t, checkpointing, **epochs, head_in_chunks=cfg.actor.logits_chunk_size > 0)
            if flops is not None:
                total = sum(flops.values())
                per_step.append({"tokens": phase_tokens(name, t, **epochs), "flops": total, "parts": flops,
                                 "mfu": total / times[s] / rate["flops_per_s"],
                                 "tokens_per_s": phase_tokens(name, t, **epochs) / times[s]})
        if per_step:
            mid = sorted(per_step, key=lambda r: r["mfu"])[len(per_step) // 2]  # the median step's numbers
            row.update(tokens=mid["tokens"], flops=mid["flops"], flops_by_part=mid["parts"], mfu=mid["mfu"],
                       tokens_per_s=statistics.median(r["tokens_per_s"] for r in per_step))
        seen = activity.get(name)
        if seen:
            n = max(1, len(profiled_steps))
            kernels = sorted(seen["kernels"].items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
            row.update(profiled_seconds=seen["wall_s"] / n,
                       idle=1 - seen["busy_s"] / seen["wall_s"] if seen["wall_s"] > 0 else None,
                       top_kernels=[{"name": k, "seconds": v[0] / n, "calls": v[1] / n,
                                     "share": v[0] / seen["wall_s"] if seen["wall_s"] > 0 else None}
                                    for k, v in kernels])
        phases[name] = row
    flop_fields = ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab")  # what the FLOPs read
    return {"shape": {k: getattr(shape, k) for k in flop_fields}, "rows_per_step": rows, "gradient_checkpointing": checkpointing, **epochs,
            "matmul_rate": rate, "timed_steps": timed_steps, "profiled_steps": profiled_steps, "phases": phases}


def _num(x, spec: str) -> str:
    return "n/a" if x is None else spec.format(x)


def render_efficiency(report: dict, device: str, title: str) -> str:
    """Two Markdown tables: per phase, then each phase's top kernels."""
    rate = report["matmul_rate"]
    kind = "kernels" if device == "cuda" else "CPU ops (self time)"
    threads = "" if rate["threads"] is None else f", {rate['threads']} thread(s)"
    lines = [f"### Efficiency per phase: {title}", "",
             f"Dense matmul rate measured in this call: {rate['flops_per_s'] / 1e12:.3f} TFLOP/s "
             f"({rate['dtype']}, {rate['n']}^3{threads}). "
             f"Rows per step {report['rows_per_step']:g}; gradient checkpointing "
             f"{'on' if report['gradient_checkpointing'] else 'off'}; times: median of steps {report['timed_steps']}, "
             f"idle and {kind}: step(s) {report['profiled_steps']} under torch.profiler. FLOPs: tools/plan/efficiency.py.",
             "", "| phase | s/step | tokens/step | tokens/s | TFLOP/step | MFU | idle (profiled) | s/step profiled |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in report["phases"].items():
        lines.append(f"| {name} | {_num(r['seconds'], '{:.3f}')} | {_num(r.get('tokens'), '{:.0f}')} | "
                     f"{_num(r.get('tokens_per_s'), '{:.0f}')} | {_num(r.get('flops') and r['flops'] / 1e12, '{:.4g}')} | "
                     f"{_num(r.get('mfu'), '{:.2%}')} | {_num(r.get('idle'), '{:.0%}')} | "
                     f"{_num(r.get('profiled_seconds'), '{:.3f}')} |")
    lines += ["", f"Top {kind} per phase (profiled step; share of the phase's wall time):", "",
              "| phase | name | calls/step | s/step | share |", "|---|---|---|---|---|"]
    for name, r in report["phases"].items():
        for k in r.get("top_kernels", []):
            short = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            lines.append(f"| {name} | `{short.replace('|', '/')}` | {k['calls']:g} | {k['seconds']:.4f} | "
                         f"{_num(k['share'], '{:.1%}')} |")
    return "\n".join(lines) + "\n"
