"""`python -m tools.device.continuous_check [--device cuda|cpu] [--batches 4] [--out DIR] [key=value ...]`

Continuous generation (rollout.continuous, spmdsplit/generation/continuous.py) on one device, in one process:
the HF engine kept full by `ContinuousGeneration` exactly as a rollout rank drives it
(generation.sources.ContinuousSource: batch k handed over as soon as its groups are complete, then
generating on until the weights of update k are in), with the actor pool played by this process:
the weights of update k are version k-1's plus noise, taken on the fixed schedule
(rollout.version_every_engine_steps) once batch k has been handed over. Why not a job: a
continuous job needs a rollout pool of its own, so two ranks, and NCCL refuses two ranks on one GPU
("Duplicate GPU detected"); on a machine with one GPU this is how the path runs on CUDA.

Checked, as tests/test_continuous.py checks a job: every trained token within rollout.staleness
of its batch's policy, weights landing mid-answer (rows whose tokens span two versions), and each
token's engine log-prob equal to the one the version it records gives it (teacher-forced by a
second copy of the model holding that version; scored instead under each row's first version the
mixed rows must differ: the loads took effect). Prints one summary line (tokens/s, occupancy,
mixed rows, the largest log-prob difference), writes `continuous_check.json` into --out; exit
code 1 when a check fails. The config: configs/grpo_rollout_actor.yaml with continuous generation
on the embedded model (one token per engine step), overrides after it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(REPO, "configs", "grpo_rollout_actor.yaml")
# tests/test_continuous.py's job: one token per engine step and answers of up to 24 tokens, so versions
# land while answers are half done; a fixed schedule, so where they land does not depend on timing.
DEFAULTS = ["rollout.continuous=true", "rollout.hf_step_tokens=1", "data.max_response_length=24",
            "data.train_batch_size=16", "rollout.version_every_engine_steps=6", "rollout.temperature=0.9"]
TOLERANCE = {"cpu": 1e-4, "cuda": 1e-3}  # |log p engine - log p(version)| in fp32 (a GPU's kernels differ more)
NOISE = 0.1  # each update: every parameter + NOISE x its std x N(0, 1)


def teacher_forced(model, rows, temperature: float) -> torch.Tensor:
    """[B, R] log_softmax(logits / T) of each response token after its prompt and the tokens before it."""
    responses = rows["responses"]
    width = responses.shape[1]
    with torch.no_grad():
        logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                       position_ids=rows["position_ids"]).logits
    logits = logits[:, -width - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.device.continuous_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batches", type=int, default=4, help="batches handed over (trainer.total_steps)")
    p.add_argument("--out", default="outputs/continuous_check")
    p.add_argument("overrides", nargs="*", help="key=value overrides after the preset's and the defaults")
    args = p.parse_args(argv)

    from spmdsplit.config import load_config
    from spmdsplit.generation.continuous import ContinuousGeneration
    from spmdsplit.data.prompts import PromptDataset
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.generation.shares import step_prompts
    from spmdsplit.models import eos_token_ids, load_causal_lm, load_tokenizer
    from spmdsplit.preflight import check_config
    from spmdsplit.inference import build_generator
    from spmdsplit.staleness import weights_needed

    cfg = load_config(PRESET, [*DEFAULTS, f"trainer.device={args.device}", f"trainer.total_steps={args.batches}",
                               *args.overrides])
    check_config(cfg)
    if cfg.rollout.name != "hf" or cfg.rollout.multi_turn.enable or cfg.model.lora_rank:
        print("continuous_check: runs the HF engine without agents or LoRA", file=sys.stderr)
        return 2
    device, dtype = torch.device(args.device), torch.float32
    torch.manual_seed(cfg.trainer.seed)
    path = cfg.model.path or ensure_embedded_model()
    tokenizer = load_tokenizer(path)
    eos = eos_token_ids(path, tokenizer)
    engine = build_generator(cfg, path, tokenizer, eos, device, dtype, cfg.trainer.seed, sleeps=False)
    oracle = load_causal_lm(path, dtype, device, cfg.trainer.seed).eval()
    oracle_params = dict(oracle.named_parameters())  # a tied head: its first name only
    noise = torch.Generator(device="cpu").manual_seed(cfg.trainer.seed)
    versions = [{n: t.detach().clone() for n, t in oracle_params.items()}]

    def weights(version: int) -> dict[str, torch.Tensor]:
        """The policy after update `version` (0: the checkpoint's)."""
        while len(versions) <= version:
            versions.append({n: t + NOISE * (t.float().std() if t.numel() > 1 else 1.0)
                             * torch.randn(t.shape, generator=noise).to(t) for n, t in versions[-1].items()})
        return versions[version]

    rows_data, _ = build_rows(cfg.data, tokenizer, "train")
    dataset = PromptDataset(rows_data, cfg.data.gen_batch_size or cfg.data.train_batch_size, cfg.data.shuffle,
                            cfg.data.seed)

    def take_weights(step: int) -> int:  # the next version, as generation.sources.ContinuousSource.take_weights
        version = stream.version + 1
        engine.update_weights(weights(version).items())
        return version

    stream = ContinuousGeneration(cfg, engine, lambda t: step_prompts(cfg, dataset, tokenizer, t, [0], 0),
                                  take_weights, lambda: False, 0, 1, tokenizer.pad_token_id, eos, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    stream.version = take_weights(1)
    batches, metrics = [], []
    for step in range(1, args.batches + 1):  # the rollout program's step with a ContinuousSource, the actor's side played here
        batches.append(stream.next_batch(step))
        while stream.version < step and weights_needed(cfg, step):
            stream.engine_step()
        metrics.append(stream.pop_metrics())
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    temperature = cfg.rollout.temperature
    worst, separation, mixed, stale, problems = 0.0, 0.0, 0, 0, []
    for step, rows in enumerate(batches, 1):
        mask = rows["response_mask"].bool()
        token_versions = rows["token_weights_version"]
        if len(rows) != cfg.data.train_batch_size * cfg.rollout.n:
            problems.append(f"batch {step}: {len(rows)} rows, expected {cfg.data.train_batch_size * cfg.rollout.n}")
        oldest = int(token_versions[mask].min())
        stale = max(stale, step - 1 - oldest)
        if oldest < step - 1 - cfg.rollout.staleness or int(token_versions[mask].max()) > step - 1:
            problems.append(f"batch {step}: token versions {oldest}..{int(token_versions[mask].max())}, "
                            f"allowed {step - 1 - cfg.rollout.staleness}..{step - 1}")
        scored = {}
        for v in sorted(set(token_versions[mask].tolist())):
            for n, t in weights(v).items():
                oracle_params[n].data.copy_(t)
            scored[v] = teacher_forced(oracle, rows, temperature)
        expected = torch.zeros_like(rows["rollout_log_probs"])
        for v, log_probs in scored.items():
            expected = torch.where(token_versions == v, log_probs, expected)
        worst = max(worst, (rows["rollout_log_probs"] - expected).abs()[mask].max().item())
        spans = [(token_versions[r][mask[r]].min() != token_versions[r][mask[r]].max()).item() for r in range(len(rows))]
        mixed += sum(spans)
        for r, spanning in enumerate(spans):  # the row's tokens as if no version had landed mid-answer
            if spanning:
                first = scored[int(token_versions[r][mask[r]].min())][r]
                separation = max(separation, (rows["rollout_log_probs"][r] - first).abs()[mask[r]].max().item())
    tolerance = TOLERANCE[device.type]
    if worst >= tolerance:
        problems.append(f"engine log-probs differ from their versions' by {worst:.2e} (tolerance {tolerance:g})")
    if not mixed:
        problems.append("no answer spans two versions: the weights never landed mid-answer")
    elif separation <= 10 * tolerance:
        problems.append(f"the mixed rows score the same under their first version ({separation:.2e}): the loads did nothing")
    tokens = sum(m["rollout/tokens_generated"] for m in metrics)
    steps = sum(m["rollout/engine_steps"] for m in metrics)
    result = {
        "schema": "spmdsplit.continuous_check/1", "device": args.device,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "overrides": [*DEFAULTS, *args.overrides],
        "batches": args.batches, "rows": sum(len(b) for b in batches), "seconds": seconds, "tokens": tokens,
        "tokens_per_s": tokens / seconds, "engine_steps": steps,
        "occupancy": sum(m["rollout/occupancy"] * m["rollout/engine_steps"] for m in metrics) / max(steps, 1),
        "restarted": sum(m["rollout/requests_restarted"] for m in metrics), "mixed_rows": mixed,
        "staleness_max": stale, "logprob_diff_max": worst, "tolerance": tolerance,
        "logprob_diff_under_first_version_max": separation,
        "problems": problems}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "continuous_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"continuous_check: {args.device}, {args.batches} batches, {result['rows']} rows, {tokens} tokens in "
          f"{seconds:.1f} s ({result['tokens_per_s']:.0f} tokens/s), {steps} engine steps, occupancy "
          f"{result['occupancy']:.1f}, {mixed} rows spanning two versions, staleness max {stale}, "
          f"max |log p engine - log p(version)| {worst:.2e} (tolerance {tolerance:g})", flush=True)
    for problem in problems:
        print(f"continuous_check: FAILED: {problem}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
