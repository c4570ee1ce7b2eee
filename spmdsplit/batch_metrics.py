"""The step's metrics from its rows, verl's names, each a local pass over this rank's rows and the
pool's reduction of them: the data metrics (scores, rewards, advantages, returns, values,
lengths, multi-turn counts), the engine's log-probs against the actor's (rollout_probs_diff,
rollout_corr/*) and the staleness of continuous generation's tokens. The math of each is local
(spmdsplit/algo.py, spmdsplit/inference/base.py); the all-reduces over the pool are here."""

from __future__ import annotations

import torch

from spmdsplit import algo
from spmdsplit.batch import Batch
from spmdsplit.distributed import pool_max_min, pool_reduce_metrics, pool_sum


@torch.no_grad()
def compute_data_metrics(batch: Batch, group, device, max_response_length: int) -> dict[str, float]:
    """verl's data metrics (critic/score, rewards, advantages, returns, values, response and
    prompt lengths) over the pool's whole global batch, from one SUM and one MAX all-reduce.
    `max_response_length`: data.max_response_length, what a clipped response ran to (the batch
    is only as wide as its longest response). An agent harness's episodes with several rows each
    are described by their first rows (the metrics of one row per episode), with the rows they
    trained beyond those (agent/harness/rows_extra)."""
    extra_rows = float((batch["episode_row"] > 0).sum().item()) if "episode_row" in batch else None
    batch = algo.episode_first_rows(batch)
    response_mask = batch["response_mask"].float()
    prompt_mask = batch["attention_mask"][:, : -response_mask.shape[1]].float()
    response_length = response_mask.sum(-1)
    prompt_length = prompt_mask.sum(-1)
    n_valid = response_mask.sum().item()
    per_token = {k: batch[k] for k in ("advantages", "returns", "values") if k in batch}  # no values without a critic
    per_seq = {
        "critic/score": batch["token_level_scores"].sum(-1),
        "critic/rewards": batch["token_level_rewards"].sum(-1),
        "response_length": response_length,
        "prompt_length": prompt_length,
    }
    sums, counts, maxes, mins = {}, {}, {}, {}
    for name, x in per_seq.items():
        sums[f"{name}/mean"], counts[f"{name}/mean"] = x.sum().item(), len(x)
        maxes[f"{name}/max"], mins[f"{name}/min"] = x.max().item(), x.min().item()
    for name, x in per_token.items():
        key = f"critic/{name}"
        sums[f"{key}/mean"], counts[f"{key}/mean"] = (x * response_mask).sum().item(), n_valid
        valid = x[response_mask.bool()]
        maxes[f"{key}/max"] = valid.max().item() if valid.numel() else float("-inf")
        mins[f"{key}/min"] = valid.min().item() if valid.numel() else float("inf")
    sums["response_length/clip_ratio"] = (response_length >= max_response_length).float().sum().item()
    counts["response_length/clip_ratio"] = len(response_length)
    if "num_turns" in batch:  # multi-turn: verl's num_turns/*, and the tool calls per step
        agent_metrics(batch, group, sums, counts, maxes, mins)
    if extra_rows is not None:  # a count of the step: the pool's sum, as a "mean" over weights summing to 1
        import torch.distributed as dist

        sums["agent/harness/rows_extra"] = extra_rows
        counts["agent/harness/rows_extra"] = 1.0 / (dist.get_world_size(group) if dist.is_initialized() else 1)
    metrics = pool_reduce_metrics(sums, counts, group, device)
    maxes, mins = pool_max_min(maxes, mins, group, device)
    metrics.update(maxes)
    metrics.update(mins)
    if "values" in batch:
        metrics["critic/vf_explained_var"] = algo.compute_explained_variance(
            batch["values"], batch["returns"], batch["response_mask"], reduce_sum=pool_sum(group)
        )
    return metrics


def agent_metrics(batch: Batch, group, sums: dict, counts: dict, maxes: dict, mins: dict) -> None:
    """verl's num_turns/{mean,max,min} (the prompt, assistant turns and tool rounds of an episode),
    and per step: tool/calls, tool/errors and each error kind (summed over the pool: a count of
    the step, sent as a "mean" over one), and response_length's share that the tools wrote.
    (response_length/* above counts the policy's tokens only: the response_mask.)"""
    import torch.distributed as dist

    from spmdsplit.agent.tools import ERROR_KINDS

    turns = batch["num_turns"].float()
    sums["num_turns/mean"], counts["num_turns/mean"] = turns.sum().item(), len(turns)
    maxes["num_turns/max"], mins["num_turns/min"] = turns.max().item(), turns.min().item()
    errors = batch["tool_errors"].sum(0).tolist()
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    for key, value in [("tool/calls", batch["tool_calls"].sum().item()), ("tool/errors", sum(errors)),
                       *((f"tool/errors/{kind}", n) for kind, n in zip(ERROR_KINDS, errors))]:
        sums[key], counts[key] = float(value), 1.0 / ranks  # weights summing to 1: the pool's total
    if "env_terminated" in batch:  # an environment's episodes: how many ended which way, and its info's numbers
        for key in ("env_terminated", "env_truncated"):
            sums[f"env/{key.removeprefix('env_')}"], counts[f"env/{key.removeprefix('env_')}"] = \
                float(batch[key].sum().item()), 1.0 / ranks
        env_info_metrics(batch, group, sums, counts)
    if "harness_rows_dropped" in batch:  # the rows a harness's episodes made beyond rollout.agent.rows_per_episode
        sums["agent/harness/rows_dropped"] = float(batch["harness_rows_dropped"].sum().item())
        counts["agent/harness/rows_dropped"] = 1.0 / ranks
    R = batch["response_mask"].shape[1]
    tool_tokens = (batch["attention_mask"][:, -R:] - batch["response_mask"]).sum(-1).float()
    sums["tool/response_tokens/mean"], counts["tool/response_tokens/mean"] = tool_tokens.sum().item(), len(tool_tokens)


def env_info_metrics(batch: Batch, group, sums: dict, counts: dict) -> None:
    """env/info/<key>/mean: the mean over the pool's episodes that reported it of each number of the
    environments' info (extra_info["environment_info"], agent/loop.py). The pool's ranks agree on the
    keys first: a rank none of whose episodes reported one still joins its reduction."""
    import torch.distributed as dist

    rows = batch["extra_info"] if "extra_info" in batch else []
    infos = [i["environment_info"] for i in rows if isinstance(i, dict) and i.get("environment_info")]
    keys = {k for info in infos for k in info}
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, sorted(keys), group=group)
        keys = set().union(*every)
    for k in sorted(keys):
        values = [info[k] for info in infos if k in info]
        sums[f"env/info/{k}/mean"], counts[f"env/info/{k}/mean"] = float(sum(values)), float(len(values))


def rollout_probs_diff_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, group, device) -> dict[str, float]:
    """verl's training/rollout_probs_diff_{max,mean} over the pool's valid tokens (the math:
    spmdsplit/inference/base.py rollout_probs_diff)."""
    from spmdsplit.inference.base import rollout_probs_diff

    total, count, largest = rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask)
    means = pool_reduce_metrics({"training/rollout_probs_diff_mean": total.item()},
                                {"training/rollout_probs_diff_mean": count.item()}, group, device)
    maxes, _ = pool_max_min({"training/rollout_probs_diff_max": largest.item()}, {}, group, device)
    return {**means, **maxes}


def rollout_corr_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                         response_mask: torch.Tensor, rollout_is: str | None, rollout_is_threshold: float,
                         group, device) -> dict[str, float]:
    """verl's rollout_corr/* over the pool's rows (the math: algo.rollout_correction_stats)."""
    means, maxes, mins = algo.rollout_correction_stats(old_log_probs, rollout_log_probs, response_mask,
                                                       rollout_is, rollout_is_threshold)
    reduced = pool_reduce_metrics({k: s for k, (s, _) in means.items()}, {k: w for k, (_, w) in means.items()},
                                  group, device)
    maxes, mins = pool_max_min(maxes, mins, group, device)
    return algo.finish_rollout_correction_metrics(reduced, maxes, mins)


def rollout_correction_metrics(rollout: Batch, corr, group, device) -> dict[str, float]:
    """The engine's own log-probs against the actor's old ones (every engine returns them):
    verl's training/rollout_probs_diff_* and rollout_corr/* metrics, the importance weights' at
    algorithm.rollout_correction.rollout_is (`corr`). The weights the loss takes are the actor's
    (roles/actor.py add_rollout_is_weights)."""
    if "rollout_log_probs" not in rollout:
        return {}
    engine, actor, mask = rollout["rollout_log_probs"], rollout["old_log_probs"], rollout["response_mask"]
    metrics = rollout_probs_diff_metrics(engine, actor, mask, group, device)
    metrics.update(rollout_corr_metrics(actor, engine, mask, corr.rollout_is, corr.rollout_is_threshold,
                                        group, device))
    return metrics


def token_staleness(rollout: Batch, step: int, group, device) -> dict[str, float]:
    """How stale the trained tokens were (continuous generation: each response token records the
    version it was sampled with, `token_weights_version`): update `step` trains with the policy of
    version step-1, so a token's staleness is step-1 minus its version. Over the pool's tokens."""
    if "token_weights_version" not in rollout:
        return {}
    mask = rollout["response_mask"].bool()
    per_token = rollout["token_weights_version"]
    versions = per_token[mask].double()
    staleness = (step - 1) - versions
    big = float(2**31)
    row_max = per_token.masked_fill(~mask, -2**31).max(1).values
    row_min = per_token.masked_fill(~mask, 2**31).min(1).values
    sums = {"rollout/token_staleness_mean": staleness.sum().item(),
            "rollout/mixed_version_rows": (row_max > row_min).sum().item()}
    counts = {"rollout/token_staleness_mean": staleness.numel(), "rollout/mixed_version_rows": len(per_token)}
    # The tokens sampled with the policy the actor now holds (version step-1): the engine's log-probs
    # of them must be the actor's (as rollout_probs_diff in on-policy runs), which holds only if
    # each token's recorded version is the one it was sampled with.
    current = mask & (per_token == step - 1)
    sums["rollout/current_version_tokens"], counts["rollout/current_version_tokens"] = current.sum().item(), mask.sum().item()
    extra_max = {}
    if "old_log_probs" in rollout:
        from spmdsplit.inference.base import rollout_probs_diff

        _, _, largest = rollout_probs_diff(rollout["rollout_log_probs"], rollout["old_log_probs"], current)
        extra_max["rollout/current_version_probs_diff_max"] = largest.item()
    means = pool_reduce_metrics(sums, counts, group, device)
    maxes, mins = pool_max_min({**extra_max,
                                "rollout/token_staleness_max": staleness.max().item() if staleness.numel() else 0.0,
                                "rollout/weights_version_max": versions.max().item() if versions.numel() else -big},
                               {"rollout/weights_version_min": versions.min().item() if versions.numel() else big},
                               group, device)
    return {**means, **maxes, **mins}
