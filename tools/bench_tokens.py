"""`python -m tools.bench --long-tail [--layouts 1+1 2+2] [--workloads long-tail default] [--steps S]`

Training on tokens, not padding (issue 20): the same workload run with today's `fixed`
micro-batches (rows padded to data.max_prompt_length + data.max_response_length, no row
balancing) and in `tokens` mode (verl's `use_dynamic_bsz` token budgets, `use_remove_padding`
and `trainer.balance_batch`), at each layout, one real `torchrun -m spmdsplit.train` job each,
with per-phase times, step time, tokens/s, the padding share and the final metrics side by side.

Two workloads:
  * `long-tail`: a random Qwen2 (tools.models, no download) that draws its EOS at ~2 % per
    token, so response lengths spread geometrically up to data.max_response_length=256 (mean
    ~50, a tail to 256), from prompts of 4-64 tokens (a parquet the bench writes). A custom reward
    function (the built-in positional match) also appends each response's length to a file of
    the job's, so the length histogram is read from what the job generated, not re-sampled.
  * `default`: the embedded default job (lengths barely spread): tokens mode must cost nothing there.

Token budgets: each mode's micro-batch holds at most the tokens of a fixed micro-batch of the
same workload (`ppo_max_token_len_per_gpu` = ppo_micro_batch_size_per_gpu x (max prompt + max
response), and likewise for log-probs and values), so neither mode may hold more activations at once.

Padding share = 1 - valid tokens / tokens the forward passes processed, computed from what the
job logged (TensorBoard prompt_length/mean and response_length/mean, the length dump) and each
mode's rule: fixed processes each rank's rows at data.max_prompt_length + the rank's longest
response (the rollout engine cuts responses to their longest); tokens mode with remove-padding
processes the valid tokens alone.
"""

from __future__ import annotations

import datetime
import os
import random
import statistics
import sys
import time

from tools import bench
from tools.jobs import run_job
from tools.models import build_random_qwen2
from tools.report import fmt

# ~0.4M parameters, heads of 64: small enough for 2 CPU cores at 320-token rows.
LONG_TAIL_MODEL = dict(hidden=128, layers=2, heads=2, kv_heads=1, mlp=384, max_positions=512)
LONG_TAIL_EOS_RATE = 0.02
LONG_TAIL_PROMPTS = (4, 64)  # tokens per prompt, uniform: digits then "="
LONG_TAIL = {"data.max_prompt_length": 64, "data.max_response_length": 256, "data.train_batch_size": 32,
             "actor.ppo_mini_batch_size": 16, "critic.ppo_mini_batch_size": 16,
             "actor.ppo_micro_batch_size_per_gpu": 4, "critic.ppo_micro_batch_size_per_gpu": 4,
             "actor.log_prob_micro_batch_size_per_gpu": 16, "ref.log_prob_micro_batch_size_per_gpu": 16,
             "critic.forward_micro_batch_size_per_gpu": 16,
             # consecutive rows in every fixed micro-batch, so the bench can count its padding (dump_pass_tokens)
             "actor.shuffle": "false", "critic.shuffle": "false"}
# The embedded default's shapes (spmdsplit/config.py and embedded.py), for its token budgets.
DEFAULT = {"data.max_prompt_length": 8, "data.max_response_length": 6, "data.train_batch_size": 128,
           "actor.ppo_mini_batch_size": 16, "critic.ppo_mini_batch_size": 16,
           "actor.ppo_micro_batch_size_per_gpu": 16, "critic.ppo_micro_batch_size_per_gpu": 16,
           "actor.log_prob_micro_batch_size_per_gpu": 32, "ref.log_prob_micro_batch_size_per_gpu": 32,
           "critic.forward_micro_batch_size_per_gpu": 32}
TOKEN_MODES = ("fixed", "tokens")
WORKLOADS = ("long-tail", "default")
LAYOUTS = {"1+1": 2, "2+2": 4}
TRAIN_PHASES = ("old_log_prob", "ref", "values", "update_actor", "update_critic")
FINAL_METRICS = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/ppo_kl",
                 "response_length/mean")
# Which micro-batch rows become which token budget (verl's names).
BUDGETS = {"actor.ppo_max_token_len_per_gpu": "actor.ppo_micro_batch_size_per_gpu",
           "critic.ppo_max_token_len_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
           "actor.log_prob_max_token_len_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
           "ref.log_prob_max_token_len_per_gpu": "ref.log_prob_micro_batch_size_per_gpu",
           "critic.forward_max_token_len_per_gpu": "critic.forward_micro_batch_size_per_gpu"}

REWARD_FN = '''"""Written by tools.bench_tokens: the built-in positional-match score, and each row's
prompt length (extra_info.prompt_tokens, from the bench's parquet) and response length (characters
= tokens but the EOS: the bench's model never draws another special token) appended to a file of
this process, in the order the rows come, for the bench's histogram and padding count."""
import os

from spmdsplit.rewards.rule import positional_match_score

DUMP = {dump!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.path.join(DUMP, f"lengths.{{os.getpid()}}.txt"), "a") as f:
        f.write(f"{{extra_info['prompt_tokens']}} {{len(solution_str)}}\\n")
    return positional_match_score(solution_str, ground_truth)
'''


# ------------------------------------------------------------------ pure pieces

def token_budgets(shapes: dict) -> dict[str, int]:
    """Each verl token budget = its fixed micro-batch's rows x the padded row length: a tokens-mode
    micro-batch then never holds more tokens than a fixed one (same peak activations)."""
    row = int(shapes["data.max_prompt_length"]) + int(shapes["data.max_response_length"])
    return {budget: int(shapes[rows]) * row for budget, rows in BUDGETS.items()}


def mode_overrides(mode: str, shapes: dict) -> list[str]:
    """fixed: today's micro-batches of rows, padded, unbalanced (every switch spelled out, since
    balance_batch defaults to true); tokens: token budgets, padding removed, rows balanced."""
    on = "true" if mode == "tokens" else "false"
    switches = [f"actor.use_dynamic_bsz={on}", f"critic.use_dynamic_bsz={on}", f"model.use_remove_padding={on}",
                f"trainer.balance_batch={on}"]
    budgets = [f"{k}={v}" for k, v in token_budgets(shapes).items()] if mode == "tokens" else []
    return ["placement.mode=split", "placement.overlap=true", *switches, *budgets]


def response_tokens(chars: int, max_response: int) -> int:
    """A response's length in tokens from its decoded text: the EOS that ends it is not in the
    text (one more token), unless it ran to the limit without one."""
    return min(chars + 1, max_response)


def length_stats(lengths: list[int]) -> dict:
    if not lengths:
        return {"count": 0, "mean": None, "median": None, "max": None, "min": None}
    return {"count": len(lengths), "mean": statistics.fmean(lengths), "median": statistics.median(lengths),
            "max": max(lengths), "min": min(lengths)}


def histogram(lengths: list[int], top: int, bins: int = 8) -> list[tuple[int, int, int]]:
    """(low, high, count) for `bins` equal bins over 1..top, both ends inclusive."""
    width = -(-top // bins)
    counts = [0] * bins
    for n in lengths:
        counts[min((max(n, 1) - 1) // width, bins - 1)] += 1
    return [(i * width + 1, min((i + 1) * width, top), c) for i, c in enumerate(counts)]


def text_histogram(bins: list[tuple[int, int, int]], bar: int = 40) -> list[str]:
    most = max((c for _, _, c in bins), default=0) or 1
    total = sum(c for _, _, c in bins) or 1
    return [f"{lo:>4}-{hi:<4} {'#' * round(bar * c / most):<{bar}} {c} ({c / total:.0%})" for lo, hi, c in bins]


def step_tokens(scalars: dict[str, dict[int, float]], rows: int, mode: str) -> dict[int, dict[str, float]]:
    """step -> {valid, processed} tokens of one pass over the step's rows. valid = rows x (mean
    prompt + mean response length), from the job's TensorBoard. processed: tokens mode
    (remove-padding), the valid tokens alone; fixed, rows x (the step's longest prompt + longest
    response), an upper bound: each fixed micro-batch is trimmed to its own widest row, which the
    logged maxima cannot show (`dump_pass_tokens` counts it exactly from the length dump)."""
    prompts, responses = scalars.get("prompt_length/mean", {}), scalars.get("response_length/mean", {})
    prompt_max, response_max = scalars.get("prompt_length/max", {}), scalars.get("response_length/max", {})
    out = {}
    for step in sorted(set(prompts) & set(responses)):
        valid = rows * (prompts[step] + responses[step])
        if mode == "tokens":
            processed = valid
        elif step in prompt_max and step in response_max:
            processed = rows * (prompt_max[step] + max(response_max[step], 1))
        else:
            processed = None
        out[step] = {"valid": valid, "processed": processed}
    return out


def fixed_pass_tokens(rows: list[tuple[int, int]], micro_rows: int, mini_rows: int | None = None) -> tuple[int, int]:
    """(valid, processed) tokens of one fixed-micro-batch pass over a rank's rows, each a (prompt,
    response) length in the rank's order: mini-batches of `mini_rows` consecutive rows (None: one,
    the log-prob passes), each cut into micro-batches of `micro_rows` consecutive rows, each
    trimmed to its widest row, i.e. its longest prompt + its longest response (the padded passes
    of spmdsplit/roles/common.py; consecutive because the bench turns the update's shuffle off)."""
    valid = processed = 0
    step = mini_rows or len(rows) or 1
    for m in range(0, len(rows), step):
        mini = rows[m:m + step]
        for i in range(0, len(mini), micro_rows):
            micro = mini[i:i + micro_rows]
            valid += sum(p + r for p, r in micro)
            processed += len(micro) * (max(p for p, _ in micro) + max(max(r for _, r in micro), 1))
    return valid, processed


def dump_pass_tokens(per_rank: list[list[tuple[int, int]]], rows_per_rank: int, passes: dict[str, tuple],
                     warmup: int) -> dict[str, dict[str, int]]:
    """pass -> {valid, processed} tokens of fixed mode over the steps after the warm-up, summed over
    ranks, from the length dump: one list per critic rank of (prompt, response) lengths,
    rows_per_rank rows of step 1, then of step 2, ... With pools of one size and no balancing each
    critic rank holds, in the same order, exactly the rows one actor rank generated and trains on,
    so its list is that actor rank's too. `passes`: name -> (micro_rows, mini_rows per rank or None)."""
    out = {name: {"valid": 0, "processed": 0} for name in passes}
    for rows in per_rank:
        for first in range(warmup * rows_per_rank, len(rows) - rows_per_rank + 1, rows_per_rank):
            for name, (micro, mini) in passes.items():
                valid, processed = fixed_pass_tokens(rows[first:first + rows_per_rank], micro, mini)
                out[name]["valid"] += valid
                out[name]["processed"] += processed
    return out


def share(valid: float, processed: float) -> float | None:
    return 1 - valid / processed if processed else None


def pass_shapes(shapes: dict, pool: int) -> dict[str, tuple[int, int | None]]:
    """Each training pass's (micro-batch rows, mini-batch rows per rank or None) in fixed mode, on
    pools of `pool` ranks each."""
    get = lambda key: int(shapes[key])  # noqa: E731
    return {"old_log_prob": (get("actor.log_prob_micro_batch_size_per_gpu"), None),
            "ref": (get("ref.log_prob_micro_batch_size_per_gpu"), None),
            "values": (get("critic.forward_micro_batch_size_per_gpu"), None),
            "update_actor": (get("actor.ppo_micro_batch_size_per_gpu"), get("actor.ppo_mini_batch_size") // pool),
            "update_critic": (get("critic.ppo_micro_batch_size_per_gpu"), get("critic.ppo_mini_batch_size") // pool)}


def padding_shares(mode: str, tokens: dict, per_rank: list, passes: dict, rows: int, warmup: int) -> dict:
    """The padding share of one job: over the five passes together and per pass, and how it was
    got ("exact": counted from the length dump, or the mode's rule; "upper bound": fixed mode
    without a dump, from the logged maxima)."""
    if mode == "tokens":  # remove-padding: every pass processes the valid tokens alone
        return {"padding_share": padding_share(tokens, warmup), "padding_by_pass": {p: 0.0 for p in passes},
                "padding_how": "exact"}
    if not per_rank:
        return {"padding_share": padding_share(tokens, warmup), "padding_by_pass": {}, "padding_how": "upper bound"}
    counted = dump_pass_tokens(per_rank, rows // len(per_rank), passes, warmup)
    total_valid, total_processed = (sum(c[k] for c in counted.values()) for k in ("valid", "processed"))
    return {"padding_share": share(total_valid, total_processed),
            "padding_by_pass": {p: share(c["valid"], c["processed"]) for p, c in counted.items()}, "padding_how": "exact"}


def padding_share(tokens: dict[int, dict[str, float]], warmup: int) -> float | None:
    """1 - valid / processed, over all steps after the warm-up together."""
    kept = [t for s, t in tokens.items() if s > warmup and t["processed"]]
    processed = sum(t["processed"] for t in kept)
    return 1 - sum(t["valid"] for t in kept) / processed if processed else None


def tokens_per_second(tokens: dict[int, dict[str, float]], step_times: dict[int, float], warmup: int) -> float | None:
    """Valid tokens per second of step time, median over the steps after the warm-up."""
    return bench.median(tokens[s]["valid"] / t for s, t in step_times.items() if s > warmup and s in tokens and t)


def train_phase_seconds(phases: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """The five training phases from a split run's per-pool medians (actor pool: old_log_prob,
    ref, update_actor; critic pool: values, update_critic), and their sum."""
    merged = {name: sec for pool in phases.values() for name, sec in pool.items()}
    out = {p: merged.get(p) for p in TRAIN_PHASES}
    out["sum"] = sum(v for v in out.values() if v is not None) if any(v is not None for v in out.values()) else None
    return out


def balance_metrics(scalars: dict[str, dict[int, float]], warmup: int) -> dict[str, float]:
    """Max / min tokens per rank of each pool, before balancing (as generated) and after, median
    over the steps after the warm-up, from verl's balance metrics as trainer.balance_batch logs
    them: global_seqlen/{min,max,balanced_min,balanced_max} for the actor pool,
    global_seqlen/critic/... for the critic pool. Empty where balancing was off."""
    out = {}
    for pool, prefix in (("actor", "global_seqlen"), ("critic", "global_seqlen/critic")):
        for when, lo, hi in (("before", "min", "max"), ("after", "balanced_min", "balanced_max")):
            low, high = scalars.get(f"{prefix}/{lo}", {}), scalars.get(f"{prefix}/{hi}", {})
            value = bench.median_after_warmup({s: high[s] / low[s] for s in high if low.get(s)}, warmup)
            if value is not None:
                out[f"{pool} max/min tokens per rank, {when}"] = value
    return out


def final_metrics(scalars: dict[str, dict[int, float]]) -> dict[str, float]:
    """The last step's value of each FINAL_METRICS scalar the job logged."""
    return {k: scalars[k][max(scalars[k])] for k in FINAL_METRICS if scalars.get(k)}


def agree(a: float | None, b: float | None, rtol: float = 0.05, atol: float = 0.01) -> bool | None:
    """Equal within tolerance: |a - b| <= atol + rtol |b| (losses near 0 need the absolute part)."""
    if a is None or b is None:
        return None
    return abs(a - b) <= atol + rtol * abs(b)


def compare(fixed: dict, tokens: dict) -> dict:
    """fixed / tokens per training phase, for their sum and for the step; tokens/s both ways."""
    phases = {p: bench.ratio(fixed["train_phases"].get(p), tokens["train_phases"].get(p))
              for p in (*TRAIN_PHASES, "sum")}
    metrics = {k: {"fixed": fixed["final"].get(k), "tokens": tokens["final"].get(k),
                   "agree": agree(tokens["final"].get(k), fixed["final"].get(k))}
               for k in FINAL_METRICS if k in fixed["final"] or k in tokens["final"]}
    return {"phase_ratio": phases, "step_ratio": bench.ratio(fixed["step_time_s"], tokens["step_time_s"]),
            "tokens_per_s_ratio": bench.ratio(tokens["tokens_per_s"], fixed["tokens_per_s"]), "final": metrics}


def targets(comparisons: dict, runs: list[dict]) -> list[dict]:
    """Issue 20's targets against what was measured: the five phases >= 1.8x faster in tokens mode
    on the long tail at 2+2, no slower than 1.05x on the default, and with balancing on no rank
    above 1.1x another's tokens (balance_metrics' "after")."""
    out = []
    for key, c in comparisons.items():
        workload, layout = key.split(" ")
        if workload == "long-tail" and layout == "2+2":
            out.append({"target": "long tail, 2+2: five phases fixed / tokens >= 1.8", "value": c["phase_ratio"]["sum"],
                        "met": None if c["phase_ratio"]["sum"] is None else c["phase_ratio"]["sum"] >= 1.8})
        if workload == "default":
            slower = bench.ratio(1.0, c["phase_ratio"]["sum"])
            out.append({"target": f"default, {layout}: five phases tokens / fixed <= 1.05", "value": slower,
                        "met": None if slower is None else slower <= 1.05})
    for r in runs:
        for tag, v in r["balance"].items():
            if r["mode"] == "tokens" and tag.endswith("after"):
                out.append({"target": f"{r['workload']} {r['layout']}: {tag} <= 1.1", "value": v, "met": v <= 1.1})
    return out


# ------------------------------------------------------------------ the workload on disk

def write_prompts(path: str, rows: int, lengths: tuple[int, int], seed: int = 0) -> None:
    """A verl parquet of plain-string prompts: random digits then "=", `lengths` tokens inclusive,
    scored as the embedded `repeat` task (the last digit four times)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    prompts, truths = [], []
    for _ in range(rows):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(lengths[0] - 1, lengths[1] - 1)))
        prompts.append(digits + "=")
        truths.append(digits[-1] * 4)
    table = pa.table({"prompt": prompts, "data_source": ["bench/long_tail"] * rows,
                      "reward_model": [{"ground_truth": t, "style": "rule"} for t in truths],
                      "extra_info": [{"index": i, "prompt_tokens": len(p)} for i, p in enumerate(prompts)]})
    pq.write_table(table, path)


def long_tail_inputs(out: str, rows: int) -> list[str]:
    """The model and the prompts (built once, kept in `out`), as overrides."""
    folder = os.path.join(out, "long_tail")
    model, prompts = os.path.join(folder, "model"), os.path.join(folder, "prompts.parquet")
    if not os.path.isfile(os.path.join(model, "config.json")):
        build_random_qwen2(model, **LONG_TAIL_MODEL, eos_rate=LONG_TAIL_EOS_RATE)
    if not os.path.isfile(prompts):
        write_prompts(prompts, rows, LONG_TAIL_PROMPTS)
    return [f"model.path={os.path.abspath(model)}", f"data.train_files={os.path.abspath(prompts)}"]


def length_dump(job_dir: str) -> tuple[list[str], str]:
    """A reward function file for one job that records response lengths into `job_dir`/lengths:
    (overrides, the dump folder), the folder emptied first."""
    dump = os.path.abspath(os.path.join(job_dir, "lengths"))
    os.makedirs(dump, exist_ok=True)
    for name in os.listdir(dump):
        os.remove(os.path.join(dump, name))
    path = os.path.join(os.path.abspath(job_dir), "length_reward.py")
    with open(path, "w") as f:
        f.write(REWARD_FN.format(dump=dump))
    return [f"reward.custom_fn.path={path}"], dump


def read_lengths(dump: str, max_response: int) -> list[list[tuple[int, int]]]:
    """(prompt, response) lengths in tokens, one list per process that scored rows (a critic
    rank), in the order it scored them."""
    per_rank = []
    for name in sorted(os.listdir(dump)):
        with open(os.path.join(dump, name)) as f:
            pairs = [line.split() for line in f if line.strip()]
        per_rank.append([(int(p), response_tokens(int(r), max_response)) for p, r in pairs])
    return per_rank


# ------------------------------------------------------------------ running

def run_one(workload: str, mode: str, layout: str, base: list[str], shapes: dict, args, device: str) -> dict:
    name = f"{workload}-{mode}-{layout}"
    job_dir = os.path.join(args.out, name)
    extra = mode_overrides(mode, shapes)
    dump_overrides, dump = length_dump(job_dir) if workload == "long-tail" else ([], None)
    print(f"tools.bench: {name}: {' '.join(extra)}", file=sys.stderr, flush=True)
    start = time.time()
    trace, scalars = run_job(LAYOUTS[layout], base + dump_overrides + extra, job_dir)
    m = bench.analyze(trace, scalars, args.warmup)
    rows, max_response = int(shapes["data.train_batch_size"]), int(shapes["data.max_response_length"])
    per_rank = read_lengths(dump, max_response) if dump else []
    lengths = [r for rank in per_rank for _, r in rank]
    tokens = step_tokens(scalars, rows, mode)
    padding = padding_shares(mode, tokens, per_rank, pass_shapes(shapes, LAYOUTS[layout] // 2), rows, args.warmup)
    return {"workload": workload, "mode": mode, "layout": layout, "overrides": extra, "wall_s": time.time() - start,
            "step_time_s": m["step_time_s"], "steps_used": m["steps_used"], "train_phases": train_phase_seconds(m["phases"]),
            "phases": m["phases"], **padding,
            "tokens_per_s": tokens_per_second(tokens, scalars.get("timing_s/step", {}), args.warmup),
            "valid_tokens_per_step": bench.median(t["valid"] for s, t in tokens.items() if s > args.warmup),
            "response_length_tb": {k: bench.median(scalars.get(f"response_length/{k}", {}).values())
                                   for k in ("mean", "max", "min")},
            "response_lengths": length_stats(lengths),
            "histogram": histogram(lengths, max_response) if lengths else [],
            "balance": balance_metrics(scalars, args.warmup), "final": final_metrics(scalars),
            "peak_memory": m["peak_memory"]}


def run(args) -> dict:
    import torch

    device = bench.pick_device(args.overrides, max(LAYOUTS[lay] for lay in args.layouts))
    os.makedirs(args.out, exist_ok=True)
    common = [*args.overrides, f"trainer.total_steps={args.steps}", f"trainer.device={device}"]
    runs = []
    for workload in args.workloads:
        if workload == "long-tail":
            shapes = {**LONG_TAIL, **dict(o.split("=", 1) for o in args.overrides if "=" in o)}
            base = [f"{k}={v}" for k, v in LONG_TAIL.items()] + long_tail_inputs(args.out, 4096) + common
        else:
            shapes = {**DEFAULT, **dict(o.split("=", 1) for o in args.overrides if "=" in o)}
            base = list(common)
        for layout in args.layouts:
            for mode in args.token_modes:
                runs.append(run_one(workload, mode, layout, base, shapes, args, device))
    pairs = {}
    for r in runs:
        pairs.setdefault(f"{r['workload']} {r['layout']}", {})[r["mode"]] = r
    comparisons = {k: compare(v["fixed"], v["tokens"]) for k, v in pairs.items() if {"fixed", "tokens"} <= set(v)}
    meta = {"device": device, "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "steps": args.steps, "warmup": args.warmup, "overrides": args.overrides, "layouts": args.layouts,
            "long_tail_model": LONG_TAIL_MODEL, "eos_rate": LONG_TAIL_EOS_RATE, "prompt_tokens": LONG_TAIL_PROMPTS,
            "wall_s": sum(r["wall_s"] for r in runs)}
    return {"schema": "spmdsplit.bench_tokens/1", "meta": meta, "runs": runs, "comparisons": comparisons,
            "targets": targets(comparisons, runs)}


# ------------------------------------------------------------------ report

def render_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Tokens, not padding: {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             f"{meta['steps']} steps per job, medians over steps > {meta['warmup']}; all jobs "
             f"{meta['wall_s']:.0f} s of wall time. Extra overrides: `{' '.join(meta['overrides']) or '(none)'}`.", "",
             "| workload | layout | mode | " + " | ".join(TRAIN_PHASES) + " | sum of five (s) | step (s) | "
             "valid tokens/s | padding share | wall (s) |", "|---" * (len(TRAIN_PHASES) + 8) + "|"]
    for r in report["runs"]:
        ph = r["train_phases"]
        lines.append(f"| {r['workload']} | {r['layout']} | {r['mode']} | " + " | ".join(fmt(ph.get(p)) for p in TRAIN_PHASES)
                     + f" | {fmt(ph.get('sum'))} | {fmt(r['step_time_s'])} | {fmt(r['tokens_per_s'], '{:.0f}')} | "
                     f"{'<= ' if r['padding_how'] == 'upper bound' else ''}{fmt(r['padding_share'], '{:.1%}')} | "
                     f"{r['wall_s']:.0f} |")
    by_pass = [r for r in report["runs"] if r["mode"] == "fixed" and r["padding_by_pass"]]
    if by_pass:
        lines += ["", "Padding share of each pass in fixed mode (counted from the length dump; tokens mode: 0):", "",
                  "| workload | layout | " + " | ".join(TRAIN_PHASES) + " |", "|---" * (len(TRAIN_PHASES) + 2) + "|"]
        lines += [f"| {r['workload']} | {r['layout']} | " + " | ".join(fmt(r["padding_by_pass"].get(p), "{:.1%}")
                                                                    for p in TRAIN_PHASES) + " |" for r in by_pass]
    lines += ["", "fixed / tokens (above 1: tokens mode faster; targets: the five phases >= 1.8x on the long tail "
              "at 2+2, >= 1/1.05 on the default):", "",
              "| workload | layout | " + " | ".join(TRAIN_PHASES) + " | sum of five | step | tokens/s (tokens / fixed) |",
              "|---" * (len(TRAIN_PHASES) + 5) + "|"]
    for key, c in report["comparisons"].items():
        workload, layout = key.split(" ")
        lines.append(f"| {workload} | {layout} | " + " | ".join(fmt(c["phase_ratio"][p], "{:.2f}x") for p in TRAIN_PHASES)
                     + f" | {fmt(c['phase_ratio']['sum'], '{:.2f}x')} | {fmt(c['step_ratio'], '{:.2f}x')} | "
                     f"{fmt(c['tokens_per_s_ratio'], '{:.2f}x')} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {fmt(t['value'], '{:.2f}')} | {'n/a' if t['met'] is None else 'yes' if t['met'] else 'NO'} |"
              for t in report["targets"]]
    lines += ["", "Final metrics (last step), fixed vs tokens; `agree`: |tokens - fixed| <= 0.01 + 5% |fixed|:", "",
              "| workload | layout | metric | fixed | tokens | agree |", "|---|---|---|---|---|---|"]
    for key, c in report["comparisons"].items():
        workload, layout = key.split(" ")
        for metric, v in c["final"].items():
            lines.append(f"| {workload} | {layout} | {metric} | {fmt(v['fixed'], '{:.4f}')} | {fmt(v['tokens'], '{:.4f}')} "
                         f"| {'n/a' if v['agree'] is None else 'yes' if v['agree'] else 'NO'} |")
    balance = [(r, k, v) for r in report["runs"] for k, v in r["balance"].items()]
    if balance:
        lines += ["", "Balance metrics (median after warm-up):", "", "| workload | layout | mode | metric | value |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['layout']} | {r['mode']} | {k} | {v:.3f} |" for r, k, v in balance]
    for r in report["runs"]:
        if r["histogram"]:
            s, tb = r["response_lengths"], r["response_length_tb"]
            lines += ["", f"Response lengths, {r['workload']} {r['mode']} {r['layout']} (every response of every step, "
                      f"from the job's length dump): {s['count']} responses, mean {s['mean']:.1f}, median {s['median']:.1f}, "
                      f"max {s['max']}, min {s['min']} (TensorBoard, median over steps: mean {fmt(tb['mean'], '{:.1f}')}, "
                      f"max {fmt(tb['max'], '{:.0f}')})", "", "```"] + text_histogram(r["histogram"]) + ["```"]
    lines += ["", "Definitions: a phase's time is its pool's slowest rank's, median over steps. valid tokens = rows x "
              "(mean prompt + mean response length) per step (TensorBoard); padding share = 1 - valid / processed, "
              "processed = in fixed mode each micro-batch's rows x its widest row (longest prompt + longest response, "
              "as the padded passes trim them), counted per pass from the length dump on the long tail (whose updates "
              "do not shuffle, so micro-batches are consecutive rows), bounded by rows x (the step's longest prompt + "
              "longest response) on the default (`<=`); in tokens mode the valid tokens (remove-padding packs them). "
              "Token budgets: see `overrides` in bench_tokens.json.", ""]
    return "\n".join(lines)
