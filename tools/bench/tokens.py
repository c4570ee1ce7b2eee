"""`python -m tools.bench --long-tail [--layouts 1+1 2+2] [--workloads long-tail default]
[--token-modes fixed budgets tokens] [--max-token-len N] [--steps S]`

Training on tokens, not padding (issue 20): the same workload run with `fixed` micro-batches
(rows per micro-batch, each micro-batch padded to its widest row, no row balancing) and in
`tokens` mode (verl's `use_dynamic_bsz` token budgets, `use_remove_padding` and
`trainer.balance_batch`), on request also `budgets` (token budgets and balancing, no packing), at
each layout, one real `torchrun -m spmdsplit.train` job each, with per-phase times, step time,
tokens/s, the padding share and the final metrics side by side.

Two workloads:
  * `long-tail`: a random Qwen2 (tools.models, no download) that draws its EOS at ~2 % per
    token, so response lengths spread geometrically up to data.max_response_length=256 (mean
    ~50, a tail to 256), from prompts of 4-64 tokens (a parquet the bench writes). A custom reward
    function (the built-in positional match) also appends each row's prompt and response lengths
    to a file of the job's, so the length histogram and the padding are read from what the job
    generated, not re-sampled. Token budgets: each fixed micro-batch's tokens (LONG_TAIL_MAX_TOKEN_LEN).
  * `default`: the embedded default job (lengths barely spread): tokens mode must cost nothing
    there. Token budgets: each fixed micro-batch's rows x (max prompt + max response).

Padding share = 1 - valid tokens / tokens the forward passes processed, per pass from the length
dump and the runtime's own micro-batch plan (spmdsplit/roles/micro_batches.py): a padded
micro-batch processes its rows x its widest row, a packed one its valid tokens.
"""

from __future__ import annotations

import datetime
import os
import random
import statistics
import sys
import time

from tools.bench import analysis
from tools.jobs import pick_device, run_job
from tools.models import build_random_qwen2
from tools.report import fmt

# ~3.0M parameters, heads of 64: enough compute per token that the passes' cost follows their
# tokens (at 0.4M, hidden 128 and 2 layers, fixed costs per micro-batch hid most of it: tokens mode
# gained 1.0-1.6x at 1+1 where this model gains 1.5-1.9x), small enough for 2 CPU cores.
LONG_TAIL_MODEL = dict(hidden=256, layers=4, heads=4, kv_heads=1, mlp=768, max_positions=512)
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
# mode -> (use_dynamic_bsz, use_remove_padding, balance_batch). `budgets` (on request) tells
# which of the two changes pays on this machine: token budgets alone, each micro-batch still
# padded to (trimmed at) its widest row, no packing.
MODES = {"fixed": (False, False, False), "budgets": (True, False, True), "tokens": (True, True, True)}
# The long tail's budgets (--max-token-len sets one for every pass instead): by default each
# pass's fixed micro-batch's tokens (1280 for updates, 5120 for log-probs and values), as on the
# default workload, so a packed micro-batch never holds more tokens than a fixed one. Packed
# attention no longer grows with the budget squared (model.attn_implementation=auto: each row on its
# own, spmdsplit/attention.py), so larger budgets pay. 2+2 sweeps of tokens mode on this workload (6
# steps, one run each, shared 2-core machine, 2026-11-27), the five phases: with the dense
# block-causal mask (sdpa) 512 -> 5.41 s (a 1+1 sweep then: 256 -> 4.91 s, 512 -> 5.30 s,
# 1024 -> 6.27 s, 2048 -> 7.41 s); varlen 512 -> 4.66 s, 1024 -> 4.39 s, 2048 -> 3.66 s.
LONG_TAIL_MAX_TOKEN_LEN = None
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

REWARD_FN = '''"""Written by tools.bench.tokens: the built-in positional-match score, and each row's
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

def token_budgets(shapes: dict, max_token_len: int | None = None) -> dict[str, int]:
    """Each verl token budget: `max_token_len` for all, or by default its fixed micro-batch's rows x
    the padded row length, so that a tokens-mode micro-batch never holds more tokens than a fixed one
    (same peak activations)."""
    row = int(shapes["data.max_prompt_length"]) + int(shapes["data.max_response_length"])
    return {budget: max_token_len or int(shapes[rows]) * row for budget, rows in BUDGETS.items()}


def mode_overrides(mode: str, budgets: dict[str, int]) -> list[str]:
    """fixed: today's micro-batches of rows, padded, unbalanced; tokens: token budgets, padding
    removed, rows balanced; budgets: token budgets and balancing, padding kept. Every switch spelled
    out (balance_batch defaults to true), the budgets where they are used."""
    dynamic, packed, balance = ("true" if on else "false" for on in MODES[mode])
    switches = [f"actor.use_dynamic_bsz={dynamic}", f"critic.use_dynamic_bsz={dynamic}",
                f"model.use_remove_padding={packed}", f"trainer.balance_batch={balance}"]
    chosen = [f"{k}={v}" for k, v in budgets.items()] if dynamic == "true" else []
    return ["placement.mode=split", "placement.overlap=true", *switches, *chosen]


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


def step_tokens(scalars: dict[str, dict[int, float]], rows: int, packed: bool) -> dict[int, dict[str, float]]:
    """step -> {valid, processed} tokens of one pass over the step's rows. valid = rows x (mean
    prompt + mean response length), from the job's TensorBoard. processed: `packed`
    (remove-padding), the valid tokens alone; padded, rows x (the step's longest prompt + longest
    response), an upper bound: each micro-batch is trimmed to its own widest row, which the
    logged maxima cannot show (`dump_pass_tokens` counts it exactly from the length dump)."""
    prompts, responses = scalars.get("prompt_length/mean", {}), scalars.get("response_length/mean", {})
    prompt_max, response_max = scalars.get("prompt_length/max", {}), scalars.get("response_length/max", {})
    out = {}
    for step in sorted(set(prompts) & set(responses)):
        valid = rows * (prompts[step] + responses[step])
        if packed:
            processed = valid
        elif step in prompt_max and step in response_max:
            processed = rows * (prompt_max[step] + max(response_max[step], 1))
        else:
            processed = None
        out[step] = {"valid": valid, "processed": processed}
    return out


def pass_tokens(ranks: list[list[tuple[int, int]]], micro_rows: int, mini_rows: int | None, budget: int | None,
                packed: bool) -> tuple[int, int]:
    """(valid, processed) tokens of one training pass over a step's rows on a pool: `ranks` holds
    each rank's rows as (prompt, response) lengths in the rank's order. Micro-batches as the runtime
    plans them (spmdsplit/roles/micro_batches.py, its own functions): mini-batches of `mini_rows`
    consecutive rows per rank (None: one, the log-prob passes); in each, `micro_rows` consecutive
    rows per micro-batch, or with a token `budget` first-fit-decreasing bins; the pool's ranks agree
    on the largest count, splitting bins or adding dummies (2 tokens). A micro-batch processes its
    valid tokens when `packed` (use_remove_padding), else its rows x its widest row, the longest
    prompt + the longest response (the padded pass trims the columns no row uses)."""
    from spmdsplit.roles.micro_batches import fixed_bins, split_to_count, token_budget_bins

    valid = processed = 0
    longest = max((len(r) for r in ranks), default=0)
    size = mini_rows or longest or 1
    for first in range(0, longest, size):
        minis = [r[first:first + size] for r in ranks]
        lengths = [[p + q for p, q in mini] for mini in minis]
        bins = [token_budget_bins(n, budget) if budget else fixed_bins(len(n), micro_rows) for n in lengths]
        count = max(len(b) for b in bins)
        for mini, n, rank_bins in zip(minis, lengths, bins):
            for rows in split_to_count(rank_bins, n, count):
                if not rows:  # a dummy: the prompt's last token and the response's first
                    processed += 2
                    continue
                micro = [mini[i] for i in rows]
                valid += sum(p + q for p, q in micro)
                processed += sum(p + q for p, q in micro) if packed else \
                    len(micro) * (max(p for p, _ in micro) + max(max(q for _, q in micro), 1))
    return valid, processed


def dump_pass_tokens(per_rank: list[list[tuple[int, int]]], rows_per_rank: int, passes: dict[str, tuple],
                     packed: bool, warmup: int) -> dict[str, dict[str, int]]:
    """pass -> {valid, processed} tokens over the steps after the warm-up, from the length dump: one
    list per critic rank of (prompt, response) lengths, rows_per_rank rows of step 1, then of step
    2, ... With pools of one size each critic rank holds, in the same order, exactly the rows one
    actor rank trains on (balanced or not: both pools take contiguous slices of one order), so the
    critic ranks' lists are the actor ranks' too. `passes`: name -> (micro_rows, mini_rows per rank
    or None, token budget or None)."""
    out = {name: {"valid": 0, "processed": 0} for name in passes}
    steps = min((len(rows) for rows in per_rank), default=0) // rows_per_rank
    for step in range(warmup, steps):
        ranks = [rows[step * rows_per_rank:(step + 1) * rows_per_rank] for rows in per_rank]
        for name, (micro, mini, budget) in passes.items():
            valid, processed = pass_tokens(ranks, micro, mini, budget, packed)
            out[name]["valid"] += valid
            out[name]["processed"] += processed
    return out


def share(valid: float, processed: float) -> float | None:
    return 1 - valid / processed if processed else None


def pass_shapes(shapes: dict, pool: int, budgets: dict[str, int] | None) -> dict[str, tuple[int, int | None, int | None]]:
    """Each training pass's (micro-batch rows, mini-batch rows per rank or None, token budget or
    None) on pools of `pool` ranks each; `budgets`: token_budgets' (None: fixed micro-batches)."""
    get = lambda key: int(shapes[key])  # noqa: E731
    budget = (budgets or {}).get
    return {"old_log_prob": (get("actor.log_prob_micro_batch_size_per_gpu"), None,
                             budget("actor.log_prob_max_token_len_per_gpu")),
            "ref": (get("ref.log_prob_micro_batch_size_per_gpu"), None, budget("ref.log_prob_max_token_len_per_gpu")),
            "values": (get("critic.forward_micro_batch_size_per_gpu"), None, budget("critic.forward_max_token_len_per_gpu")),
            "update_actor": (get("actor.ppo_micro_batch_size_per_gpu"), get("actor.ppo_mini_batch_size") // pool,
                             budget("actor.ppo_max_token_len_per_gpu")),
            "update_critic": (get("critic.ppo_micro_batch_size_per_gpu"), get("critic.ppo_mini_batch_size") // pool,
                              budget("critic.ppo_max_token_len_per_gpu"))}


def padding_shares(tokens: dict, per_rank: list, passes: dict, packed: bool, rows: int, warmup: int) -> dict:
    """The padding share of one job, over the five passes together and per pass, and how it was
    got: "exact", counted from the length dump with the runtime's micro-batch plan; without a dump
    (the default workload) "upper bound" for padded passes (rows x the step's longest prompt +
    longest response) and "rule" for packed ones (the valid tokens)."""
    if not per_rank:
        return {"padding_share": padding_share(tokens, warmup), "padding_by_pass": {},
                "padding_how": "rule" if packed else "upper bound"}
    counted = dump_pass_tokens(per_rank, rows // len(per_rank), passes, packed, warmup)
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
    return analysis.median(tokens[s]["valid"] / t for s, t in step_times.items() if s > warmup and s in tokens and t)


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
            value = analysis.median_after_warmup({s: high[s] / low[s] for s in high if low.get(s)}, warmup)
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
    """fixed / another mode (`tokens`) per training phase, for their sum and for the step; tokens/s
    both ways; the final metrics side by side."""
    phases = {p: analysis.ratio(fixed["train_phases"].get(p), tokens["train_phases"].get(p))
              for p in (*TRAIN_PHASES, "sum")}
    metrics = {k: {"fixed": fixed["final"].get(k), "mode": tokens["final"].get(k),
                   "agree": agree(tokens["final"].get(k), fixed["final"].get(k))}
               for k in FINAL_METRICS if k in fixed["final"] or k in tokens["final"]}
    return {"phase_ratio": phases, "step_ratio": analysis.ratio(fixed["step_time_s"], tokens["step_time_s"]),
            "tokens_per_s_ratio": analysis.ratio(tokens["tokens_per_s"], fixed["tokens_per_s"]), "final": metrics}


def targets(comparisons: dict, runs: list[dict]) -> list[dict]:
    """Issue 20's targets against what was measured: the five phases >= 1.8x faster in tokens mode
    on the long tail at 2+2, no slower than 1.05x on the default, and with balancing on no rank
    above 1.1x another's tokens (balance_metrics' "after")."""
    out = []
    for key, c in comparisons.items():
        workload, layout, mode = key.split(" ")
        if mode != "tokens":
            continue
        if workload == "long-tail" and layout == "2+2":
            out.append({"target": "long tail, 2+2: five phases fixed / tokens >= 1.8", "value": c["phase_ratio"]["sum"],
                        "met": None if c["phase_ratio"]["sum"] is None else c["phase_ratio"]["sum"] >= 1.8})
        if workload == "default":
            slower = analysis.ratio(1.0, c["phase_ratio"]["sum"])
            out.append({"target": f"default, {layout}: five phases tokens / fixed <= 1.05", "value": slower,
                        "met": None if slower is None else slower <= 1.05})
    for r in runs:
        for tag, v in r["balance"].items():
            if r["mode"] == "tokens" and tag.endswith("after") and r["layout"] != "1+1":  # 1+1: nothing to balance
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

def run_one(workload: str, mode: str, layout: str, base: list[str], shapes: dict, budgets: dict, args,
            device: str) -> dict:
    name = f"{workload}-{mode}-{layout}"
    job_dir = os.path.join(args.out, name)
    extra = mode_overrides(mode, budgets)
    dump_overrides, dump = length_dump(job_dir) if workload == "long-tail" else ([], None)
    print(f"tools.bench: {name}: {' '.join(extra)}", file=sys.stderr, flush=True)
    start = time.time()
    trace, scalars = run_job(LAYOUTS[layout], base + dump_overrides + extra, job_dir)
    m = analysis.analyze(trace, scalars, args.warmup)
    rows, max_response = int(shapes["data.train_batch_size"]), int(shapes["data.max_response_length"])
    per_rank = read_lengths(dump, max_response) if dump else []
    lengths = [r for rank in per_rank for _, r in rank]
    dynamic, packed, _ = MODES[mode]
    tokens = step_tokens(scalars, rows, packed)
    passes = pass_shapes(shapes, LAYOUTS[layout] // 2, budgets if dynamic else None)
    padding = padding_shares(tokens, per_rank, passes, packed, rows, args.warmup)
    return {"workload": workload, "mode": mode, "layout": layout, "overrides": extra, "wall_s": time.time() - start,
            "step_time_s": m["step_time_s"], "steps_used": m["steps_used"], "train_phases": train_phase_seconds(m["phases"]),
            "phases": m["phases"], **padding,
            "tokens_per_s": tokens_per_second(tokens, scalars.get("timing_s/step", {}), args.warmup),
            "valid_tokens_per_step": analysis.median(t["valid"] for s, t in tokens.items() if s > args.warmup),
            "response_length_tb": {k: analysis.median(scalars.get(f"response_length/{k}", {}).values())
                                   for k in ("mean", "max", "min")},
            "response_lengths": length_stats(lengths),
            "histogram": histogram(lengths, max_response) if lengths else [],
            "balance": balance_metrics(scalars, args.warmup), "final": final_metrics(scalars),
            "peak_memory": m["peak_memory"]}


def run(args) -> dict:
    import torch

    device = pick_device(args.overrides, max(LAYOUTS[lay] for lay in args.layouts))
    os.makedirs(args.out, exist_ok=True)
    common = [*args.overrides, f"trainer.device={device}"]
    runs = []
    budgets_by_workload = {}
    for workload in args.workloads:
        if workload == "long-tail":
            shapes = {**LONG_TAIL, **dict(o.split("=", 1) for o in args.overrides if "=" in o)}
            base = [f"{k}={v}" for k, v in LONG_TAIL.items()] + long_tail_inputs(args.out, 4096) + common
            base.append(f"trainer.total_steps={args.steps}")
            budgets = token_budgets(shapes, args.max_token_len or LONG_TAIL_MAX_TOKEN_LEN)
        else:  # budgets of its fixed micro-batches' tokens: the no-regression check
            shapes = {**DEFAULT, **dict(o.split("=", 1) for o in args.overrides if "=" in o)}
            # its steps take 0.2-0.7 s: more of them, for medians that a busy machine moves less
            base = common + [f"trainer.total_steps={args.default_steps}"]
            budgets = token_budgets(shapes)
        budgets_by_workload[workload] = budgets
        for layout in args.layouts:
            for mode in args.token_modes:
                runs.append(run_one(workload, mode, layout, base, shapes, budgets, args, device))
    pairs = {}
    for r in runs:
        pairs.setdefault(f"{r['workload']} {r['layout']}", {})[r["mode"]] = r
    comparisons = {f"{k} {mode}": compare(v["fixed"], v[mode]) for k, v in pairs.items() for mode in MODES
                   if mode != "fixed" and {"fixed", mode} <= set(v)}
    meta = {"device": device, "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "steps": args.steps, "default_steps": args.default_steps, "warmup": args.warmup,
            "overrides": args.overrides, "layouts": args.layouts,
            "long_tail_model": LONG_TAIL_MODEL, "eos_rate": LONG_TAIL_EOS_RATE, "prompt_tokens": LONG_TAIL_PROMPTS,
            "wall_s": sum(r["wall_s"] for r in runs), "budgets": budgets_by_workload}
    return {"schema": "spmdsplit.bench_tokens/1", "meta": meta, "runs": runs, "comparisons": comparisons,
            "targets": targets(comparisons, runs)}


# ------------------------------------------------------------------ report

def render_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Tokens, not padding: {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             f"{meta['steps']} steps per long-tail job, {meta.get('default_steps')} per default job, medians over "
             f"steps > {meta['warmup']}; all jobs "
             f"{meta['wall_s']:.0f} s of wall time. Extra overrides: `{' '.join(meta['overrides']) or '(none)'}`.", "",
             "| workload | layout | mode | " + " | ".join(TRAIN_PHASES) + " | sum of five (s) | step (s) | "
             "valid tokens/s | padding share | wall (s) |", "|---" * (len(TRAIN_PHASES) + 8) + "|"]
    for r in report["runs"]:
        ph = r["train_phases"]
        lines.append(f"| {r['workload']} | {r['layout']} | {r['mode']} | " + " | ".join(fmt(ph.get(p)) for p in TRAIN_PHASES)
                     + f" | {fmt(ph.get('sum'))} | {fmt(r['step_time_s'])} | {fmt(r['tokens_per_s'], '{:.0f}')} | "
                     f"{'<= ' if r['padding_how'] == 'upper bound' else ''}{fmt(r['padding_share'], '{:.1%}')} | "
                     f"{r['wall_s']:.0f} |")
    by_pass = [r for r in report["runs"] if r["padding_by_pass"] and not MODES[r["mode"]][1]]
    if by_pass:
        lines += ["", "Padding share of each pass where micro-batches are padded (counted from the length dump; "
                  "tokens mode packs: 0):", "",
                  "| workload | layout | mode | " + " | ".join(TRAIN_PHASES) + " |", "|---" * (len(TRAIN_PHASES) + 3) + "|"]
        lines += [f"| {r['workload']} | {r['layout']} | {r['mode']} | "
                  + " | ".join(fmt(r["padding_by_pass"].get(p), "{:.1%}") for p in TRAIN_PHASES) + " |" for r in by_pass]
    lines += ["", "fixed / the mode (above 1: the mode is faster; targets for tokens: the five phases >= 1.8x on the "
              "long tail at 2+2, >= 1/1.05 on the default):", "",
              "| workload | layout | mode | " + " | ".join(TRAIN_PHASES) + " | sum of five | step | tokens/s (mode / fixed) |",
              "|---" * (len(TRAIN_PHASES) + 6) + "|"]
    for key, c in report["comparisons"].items():
        workload, layout, mode = key.split(" ")
        lines.append(f"| {workload} | {layout} | {mode} | " + " | ".join(fmt(c["phase_ratio"][p], "{:.2f}x") for p in TRAIN_PHASES)
                     + f" | {fmt(c['phase_ratio']['sum'], '{:.2f}x')} | {fmt(c['step_ratio'], '{:.2f}x')} | "
                     f"{fmt(c['tokens_per_s_ratio'], '{:.2f}x')} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {fmt(t['value'], '{:.2f}')} | {'n/a' if t['met'] is None else 'yes' if t['met'] else 'NO'} |"
              for t in report["targets"]]
    lines += ["", "Final metrics (last step), fixed vs the mode; `agree`: |mode - fixed| <= 0.01 + 5% |fixed|:", "",
              "| workload | layout | mode | metric | fixed | mode | agree |", "|---|---|---|---|---|---|---|"]
    for key, c in report["comparisons"].items():
        workload, layout, mode = key.split(" ")
        for metric, v in c["final"].items():
            lines.append(f"| {workload} | {layout} | {mode} | {metric} | {fmt(v['fixed'], '{:.4f}')} | {fmt(v['mode'], '{:.4f}')} "
                         f"| {'n/a' if v['agree'] is None else 'yes' if v['agree'] else 'NO'} |")
    balance = [(r, k, v) for r in report["runs"] for k, v in r["balance"].items()]
    if balance:
        lines += ["", "Balance metrics (median after warm-up):", "", "| workload | layout | mode | metric | value |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['layout']} | {r['mode']} | {k} | {v:.3f} |" for r, k, v in balance]
    shown: dict[tuple, list[str]] = {}  # one histogram per distinct set of rollouts: modes share a layout's
    for r in report["runs"]:
        if r["histogram"]:
            shown.setdefault((r["workload"], r["layout"], str(r["histogram"])), []).append(r["mode"])
    for r in report["runs"]:
        modes = shown.pop((r["workload"], r["layout"], str(r["histogram"])), None) if r["histogram"] else None
        if modes:
            s, tb = r["response_lengths"], r["response_length_tb"]
            lines += ["", f"Response lengths, {r['workload']} {r['layout']}, {' = '.join(modes)} (every response of every step, "
                      f"from the job's length dump): {s['count']} responses, mean {s['mean']:.1f}, median {s['median']:.1f}, "
                      f"max {s['max']}, min {s['min']} (TensorBoard, median over steps: mean {fmt(tb['mean'], '{:.1f}')}, "
                      f"max {fmt(tb['max'], '{:.0f}')})", "", "```"] + text_histogram(r["histogram"]) + ["```"]
    lines += ["", "Definitions: a phase's time is its pool's slowest rank's, median over steps. valid tokens = rows x "
              "(mean prompt + mean response length) per step (TensorBoard); padding share = 1 - valid / processed, "
              "processed = in fixed mode each micro-batch's rows x its widest row (longest prompt + longest response, "
              "as the padded passes trim them), counted per pass from the length dump on the long tail (whose updates "
              "do not shuffle, so micro-batches are consecutive rows), bounded by rows x (the step's longest prompt + "
              "longest response) on the default (`<=`); in tokens mode the valid tokens (remove-padding packs them). "
              "Token budgets (tokens and budgets modes): "
              + "; ".join(f"{w}: " + ", ".join(f"{k.split('.')[0]}.{k.split('.')[1].replace('_per_gpu', '')} {v}"
                                               for k, v in b.items()) for w, b in meta.get("budgets", {}).items()) + ".", ""]
    return "\n".join(lines)
