"""PPO / RLHF math: advantage estimators, KL penalty and controllers, losses and their aggregation.

Names and arguments follow verl's ``core_algos`` so a verl user can map them one to one. Tensors are
``[batch, response_len]`` unless said otherwise; ``response_mask`` is 1 on valid response tokens.

Nothing here talks to ``torch.distributed``. Where a statistic has to be over the *global* batch
(whitening, the KL controller input, explained variance), the function takes ``reduce_sum``: a
callable the caller supplies that turns a small 1-D tensor of local sums into global sums, e.g.

    def reduce_sum(t):
        dist.all_reduce(t, group=pool_group)   # SUM
        return t

``None`` means this process holds the whole batch. Loss normalisation is global through the
``num_tokens`` / ``num_seqs`` arguments of :func:`agg_loss` instead.

Estimators and policy losses are registered by name, as in verl (``register_adv_est`` /
``get_adv_estimator_fn``, ``register_policy_loss`` / ``get_policy_loss_fn``); the config's choices
for ``algorithm.adv_estimator`` and ``actor.policy_loss.loss_mode`` are the registries' names.
tests/test_algo_registry.py checks every one of them against verl 0.9.1's own functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import math

import torch
import torch.utils.checkpoint
from torch import Tensor

from spmdsplit.config import KL_ESTIMATORS

ReduceSum = Callable[[Tensor], Tensor]

# The choices of actor/critic.loss_agg_mode (agg_loss) and of algorithm.rollout_correction.rollout_is
# (compute_rollout_is_weights); spmdsplit/config.py reads them from here.
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ROLLOUT_IS_LEVELS = ("token", "sequence")  # one weight per token, or the row's on each of its tokens

__all__ = [
    "masked_sum", "masked_mean", "masked_var", "masked_whiten",
    "AdvEstimator", "ADV_ESTIMATOR_REGISTRY", "register_adv_est", "get_adv_estimator", "get_adv_estimator_fn",
    "generates_greedy_baselines",
    "POLICY_LOSS_REGISTRY", "register_policy_loss", "get_policy_loss_fn",
    "compute_gae_advantage_return", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_remax_outcome_advantage",
    "compute_grpo_passk_outcome_advantage", "compute_opo_outcome_advantage", "compute_gpg_outcome_advantage",
    "kl_penalty", "FixedKLController", "AdaptiveKLController", "get_kl_controller", "apply_kl_penalty",
    "LOSS_AGG_MODES", "agg_loss", "compute_policy_loss", "compute_value_loss",
    "compute_policy_loss_vanilla", "compute_policy_loss_gspo", "compute_policy_loss_sapo",
    "compute_policy_loss_gpg", "compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov",
    "compute_policy_loss_geo_mean", "compute_policy_loss_cispo",
    "ROLLOUT_IS_LEVELS", "compute_rollout_is_weights", "rollout_correction_stats", "finish_rollout_correction_metrics",
    "logprobs_from_logits", "logprobs_and_entropy", "entropy_from_logits", "compute_explained_variance",
]


# ----------------------------------------------------------------------------- masked statistics

def masked_sum(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    # torch.where, not values * mask: padding may hold inf/NaN (e.g. -inf logprobs) and 0 * inf = NaN.
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if axis is None else kept.sum(dim=axis)


def masked_mean(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Mean over mask; an empty row/batch gives 0 rather than NaN."""
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(f"unbiased masked_var needs at least 2 valid elements, got {int(count)}")
        var = var * count / (count - 1)
    return var


def _global_sums(local: Sequence[Tensor], reduce_sum: ReduceSum | None) -> Tensor:
    """Stack local scalar sums into one float64 vector: one collective for all of them, and float64
    keeps the one-pass variance (sum_sq - sum * mean) accurate."""
    device = local[0].device
    sums = torch.stack([x.detach().to(device=device, dtype=torch.float64).reshape(()) for x in local])
    return sums if reduce_sum is None else reduce_sum(sums)


def _moment_sums(values: Tensor, mask: Tensor) -> list[Tensor]:
    v = values.detach().to(torch.float64)
    return [masked_sum(v, mask), masked_sum(v * v, mask), mask.bool().sum()]


def _mean_var(s: Tensor, sq: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased (Bessel, with the *global* count) variance from sum, sum of squares, count."""
    mean = s / n
    return mean, ((sq - s * mean) / (n - 1)).clamp_min(0.0)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True,
                  reduce_sum: ReduceSum | None = None) -> Tensor:
    """(v - mean) / sqrt(var + 1e-8) with mean/var over the valid entries of the global batch.

    Statistics are constants (no gradient flows through them). With ``shift_mean=False`` the mean is
    added back, i.e. only the scale is normalised.
    """
    s, sq, n = _global_sums(_moment_sums(values, mask), reduce_sum)
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 valid elements in the batch, got {int(n)}")
    mean, var = _mean_var(s, sq, n)
    mean, scale = mean.to(values.dtype), torch.rsqrt(var + 1e-8).to(values.dtype)
    whitened = (values - mean) * scale
    return whitened if shift_mean else whitened + mean


# ----------------------------------------------------------------------------- registries
#
# verl's core_algos registries. An estimator is called with keyword arguments only, from this
# vocabulary: token_level_rewards, response_mask, index (the row's prompt id, batch["uid"]), gamma,
# lam, norm_adv_by_std_in_grpo, reduce_sum, and the batch columns its registration names in
# `inputs`; it takes the ones it uses and ignores the rest (**_), as verl's do. It returns
# (advantages, returns), both [batch, len].
#
# A policy loss is called as fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
# config, rollout_is_weights, **counts), with `config` the actor's section (clip_ratio*, tau_*,
# policy_loss.*) and `counts` agg_loss's num_tokens / num_seqs / horizon (global normalisation:
# see agg_loss). It returns (pg_loss, {metric name: float}), the metrics local to its micro-batch.

@dataclass(frozen=True)
class AdvEstimator:
    fn: Callable
    groups: bool  # compares the responses to one prompt (by `index`): needs rollout.n >= 2
    inputs: tuple[str, ...]  # batch columns it reads besides token_level_rewards and response_mask

    @property
    def needs_critic(self) -> bool:
        return "values" in self.inputs

    @property
    def one_per_response(self) -> bool:
        """Whether it gives a response one advantage, on every token of it (an outcome estimator):
        those that compare a prompt's responses do."""
        return self.groups


ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimator] = {}
POLICY_LOSS_REGISTRY: dict[str, Callable] = {}


def register_adv_est(name: str, groups: bool = False, inputs: Sequence[str] = ()):
    def decorator(fn):
        if name in ADV_ESTIMATOR_REGISTRY and ADV_ESTIMATOR_REGISTRY[name].fn is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATOR_REGISTRY[name] = AdvEstimator(fn, groups, tuple(inputs))
        return fn
    return decorator


def get_adv_estimator(name: str) -> AdvEstimator:
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {', '.join(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def get_adv_estimator_fn(name: str) -> Callable:
    return get_adv_estimator(name).fn


def generates_greedy_baselines(cfg) -> bool:
    """Whether the job generates each prompt's greedy response as its reward baseline: its
    estimator reads `reward_baselines` (ReMax). generation/shares.py generates them; preflight refuses
    what cannot have them (multi-turn episodes, continuous generation)."""
    return "reward_baselines" in get_adv_estimator(cfg.algorithm.adv_estimator).inputs


def register_policy_loss(name: str):
    def decorator(fn):
        if name in POLICY_LOSS_REGISTRY and POLICY_LOSS_REGISTRY[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn
    return decorator


def get_policy_loss_fn(name: str) -> Callable:
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


# ----------------------------------------------------------------------------- advantage estimators

@register_adv_est("gae", inputs=("values",))
@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards: Tensor, values: Tensor, response_mask: Tensor,
                                 gamma: float, lam: float, reduce_sum: ReduceSum | None = None, **_):
    """Generalized Advantage Estimation (Schulman et al. 2016), delta_t = r_t + gamma V_{t+1} - V_t.

    Masked positions are skipped: they neither provide V_{t+1} nor reset the running estimate, so the
    last valid token bootstraps from 0 (the episode ends) and values in the padding never leak in.
    Returns are the unwhitened advantages + values (the critic's target); advantages are then
    whitened over the global batch. Both are 0 where the mask is 0.
    """
    valid = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        last_gae = torch.where(valid[:, t], gae, last_gae)
        advantages[:, t] = last_gae
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    returns = torch.where(valid, advantages + values, zero)
    advantages = torch.where(valid, masked_whiten(advantages, response_mask, reduce_sum=reduce_sum), zero)
    return advantages, returns


def _group_ids(index, device) -> tuple[Tensor, int]:
    """(group number of each row, number of groups) from one hashable prompt id per row."""
    if isinstance(index, Tensor):
        index = index.tolist()
    ids: dict[Hashable, int] = {}
    group = torch.tensor([ids.setdefault(k, len(ids)) for k in index], device=device)
    return group, len(ids)


def _group_stats(scores: Tensor, index) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (mean, unbiased std, size) of the row's group; ``index`` holds one hashable id per row.

    A group of one has no baseline to compare with: mean 0, std 1 (as verl), so its score passes through.
    """
    group, num_groups = _group_ids(index, scores.device)
    x = scores.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, group, torch.ones_like(x))
    mean = torch.zeros_like(count).index_add_(0, group, x) / count
    sq_dev = torch.zeros_like(count).index_add_(0, group, (x - mean[group]) ** 2)
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    single = count == 1
    mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
    return mean[group], std[group], count[group]


def _broadcast(per_row: Tensor, response_mask: Tensor, like: Tensor) -> Tensor:
    return per_row.to(like.dtype).unsqueeze(-1) * response_mask.to(like.dtype)


@register_adv_est("grpo", groups=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, **_):
    """GRPO (Shao et al. 2024): outcome score standardised within its prompt group.

    ``norm_adv_by_std_in_grpo=False`` only subtracts the group mean (Dr. GRPO, Liu et al. 2025).
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, std, _ = _group_stats(scores, index)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = _broadcast(adv, response_mask, token_level_rewards)
    return adv, adv


@register_adv_est("rloo", groups=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                   epsilon: float = 1e-6, **_):
    """REINFORCE leave-one-out (Ahmadian et al. 2024): baseline = mean score of the *other* samples.

    score - sum_others/(n-1) == score*n/(n-1) - mean*n/(n-1). Groups of one keep their raw score.
    ``epsilon`` is unused; it is accepted for signature parity with the other estimators.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, n = _group_stats(scores, index)
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), torch.ones_like(n))
    adv = _broadcast(scores * scale - mean * scale, response_mask, token_level_rewards)
    return adv, adv


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor,
                                                  gamma: float, reduce_sum: ReduceSum | None = None, **_):
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the global batch."""
    valid = response_mask.bool()
    running = torch.zeros_like(token_level_rewards[:, 0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        # masked positions neither add reward nor break the discounting chain
        running = torch.where(valid[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    adv = masked_whiten(returns, response_mask, reduce_sum=reduce_sum) * response_mask.to(returns.dtype)
    return adv, returns


@register_adv_est("reinforce_plus_plus_baseline", groups=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor,
                                                           index, epsilon: float = 1e-6,
                                                           reduce_sum: ReduceSum | None = None, **_):
    """REINFORCE++-baseline: subtract the group mean score, then whiten over the global batch.

    Returns (advantages, returns) with returns = the mean-subtracted score broadcast over valid tokens.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = _group_stats(scores, index)
    returns = _broadcast(scores - mean, response_mask, token_level_rewards)
    adv = masked_whiten(returns, response_mask, reduce_sum=reduce_sum) * response_mask.to(returns.dtype)
    return adv, returns


@register_adv_est("remax", inputs=("reward_baselines",))
@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards: Tensor, reward_baselines: Tensor, response_mask: Tensor,
                                    **_):
    """ReMax (Li et al. 2023): return-to-go minus the reward of the greedy response (``reward_baselines``, [batch])."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    adv = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return adv, returns


@register_adv_est("grpo_passk", groups=True)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                         epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, **_):
    """Pass@k training (arXiv 2503.19595, as verl cites it): a group passes if its best response does,
    so only the best response learns, with advantage r_max - r_second_max (divided by the group's
    std + epsilon unless ``norm_adv_by_std_in_grpo=False``); every other response gets 0. With a tie
    at the top the gap is 0, whichever of the tied rows holds it. Needs >= 2 responses per group.
    """
    scores = token_level_rewards.sum(dim=-1)
    group, num_groups = _group_ids(index, scores.device)
    adv = torch.zeros_like(scores)
    for g in range(num_groups):  # top-2 per group: a loop over prompts, not over rows
        rows = (group == g).nonzero().squeeze(-1)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt, got {len(rows)} (rollout.n)")
        top, where = scores[rows].topk(2)
        gap = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            gap = gap / (scores[rows].std() + epsilon)
        adv[rows[where[0]]] = gap
    adv = _broadcast(adv, response_mask, token_level_rewards)
    return adv, adv


@register_adv_est("opo", groups=True)
@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                  epsilon: float = 1e-6, **_):
    """OPO (Hao et al. 2025, arXiv 2505.23585): the baseline that minimises the gradient's variance
    when every token counts the same is the group's *length-weighted* mean score,
    b = sum_j |y_j| R_j / sum_j |y_j| (|y| = the row's valid tokens). A group of one keeps its raw
    score; ``epsilon`` is unused (signature parity)."""
    scores = token_level_rewards.sum(dim=-1)
    group, num_groups = _group_ids(index, scores.device)
    x, length = scores.to(torch.float64), response_mask.sum(dim=-1).to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=x.device)
    count = zeros.index_add(0, group, torch.ones_like(x))
    weighted, total_length = zeros.index_add(0, group, length * x), zeros.index_add(0, group, length)
    baseline = torch.where(count > 1, weighted / total_length.clamp_min(1), zeros)
    adv = _broadcast(x - baseline[group], response_mask, token_level_rewards)
    return adv, adv


@register_adv_est("gpg", groups=True)
@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                  epsilon: float = 1e-6, f_norm: float = 1.0, reduce_sum: ReduceSum | None = None,
                                  **_):
    """GPG (Chu et al. 2025, arXiv 2504.02546): score minus its group's mean, scaled by
    alpha / f_norm with alpha = B / M, B the responses of the global batch and M those whose score is
    non-zero: the paper's correction of the batch mean for the responses that bring no gradient,
    counted as verl counts them (with verl's f_norm = 1, and no division by the group's std). A
    group of one keeps its raw score.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = _group_stats(scores, index)
    nonzero, total = _global_sums([torch.count_nonzero(scores), scores.new_tensor(scores.shape[0])], reduce_sum)
    alpha = total / nonzero.clamp_min(1)
    adv = _broadcast(alpha * (scores.to(torch.float64) - mean) / f_norm, response_mask, token_level_rewards)
    return adv, adv


# ----------------------------------------------------------------------------- KL penalty

KL_PENALTY_NAMES = tuple(n for name, alias in KL_ESTIMATORS.items() for n in (name, alias) if n)  # kl, k1, abs, ...
_KL_NAME = {alias: name for name, alias in KL_ESTIMATORS.items() if alias}  # verl's other names: k1 -> kl, ...


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman, "Approximating KL").

    kl/k1: log r; abs: |log r|; mse/k2: (log r)^2 / 2; low_var_kl/k3: e^{-log r} + log r - 1, with
    log r = logprob - ref_logprob. k3 is unbiased and non-negative; its log-ratio is clamped to
    [-20, 20] and the result to [-10, 10] (as verl) so a single outlier token cannot explode.
    """
    diff = logprob - ref_logprob
    estimator = _KL_NAME.get(kl_penalty, kl_penalty)
    if estimator == "kl":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "mse":
        return 0.5 * diff.square()
    if estimator == "low_var_kl":
        log_ratio = (-diff).clamp(-20.0, 20.0)  # log(pi_ref / pi)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid: {', '.join(KL_PENALTY_NAMES)}")


_kl_penalty = kl_penalty  # apply_kl_penalty's argument shadows the function name (verl's naming)


class FixedKLController:
    """Constant KL coefficient beta."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019: move beta towards the KL target, proportionally, at most 20% per horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        super().__init__(init_kl_coef)
        self.target, self.horizon = float(target_kl), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def get_kl_controller(type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None):
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None or horizon <= 0:
            raise ValueError(f"adaptive KL controller needs target_kl and horizon > 0, got {target_kl=}, {horizon=}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r}; valid: fixed, adaptive")


@torch.no_grad()
def apply_kl_penalty(token_level_scores: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor,
                     response_mask: Tensor, kl_ctrl: FixedKLController, kl_penalty: str = "kl",
                     reduce_sum: ReduceSum | None = None):
    """In-reward KL penalty (Ziegler et al. 2019): r_t = score_t - beta * KL_t on valid tokens.

    The controller sees the global mean over sequences of each sequence's mean token KL, and
    n_steps = the global number of sequences, so every rank updates beta identically.
    """
    kl_all = _kl_penalty(old_log_probs, ref_log_probs, kl_penalty)
    kld = torch.where(response_mask.bool(), kl_all, torch.zeros_like(kl_all))
    beta = float(kl_ctrl.value)
    token_level_rewards = token_level_scores - beta * kld.to(token_level_scores.dtype)
    seq_kl = masked_mean(kld, response_mask, axis=-1)
    total, n_seqs = _global_sums([seq_kl.sum(), seq_kl.new_tensor(seq_kl.shape[0])], reduce_sum)
    current_kl = float(total / n_seqs)
    kl_ctrl.update(current_kl=current_kl, n_steps=int(n_seqs))
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def episode_first_rows(batch):
    """Where an agent harness's episodes train several rows each (an `episode_row` column: 0 an
    episode's first row, k its k-th more, -1 an empty one), the episodes' first rows; else the batch."""
    if "episode_row" not in batch:
        return batch
    return batch.index((batch["episode_row"] == 0).nonzero().squeeze(1).tolist())


def compute_advantage(batch, algorithm, kl_ctrl: FixedKLController | None,
                      reduce_sum: ReduceSum | None = None) -> dict[str, float]:
    """A step's advantages and returns into `batch` (its columns by name: token_level_scores,
    response_mask, uid, old_log_probs and ref_log_prob with the KL penalty in the reward, and what
    the estimator's registration names: values for gae, reward_baselines for remax). `algorithm`:
    the config's algorithm section. Returns the KL penalty's metrics (none without it).

    An agent harness's episodes with several rows each (`episode_row`): the estimator sees each
    episode once, as its first row, and each of the episode's rows takes that row's advantage, one
    number per episode (an outcome estimator's: preflight); an empty row's is 0. Its rows are
    consecutive, the first first (agent/harness.py)."""
    if "episode_row" in batch:
        first_rows = episode_first_rows(batch)
        episodes = first_rows.select([k for k in first_rows.keys() if k != "episode_row"])
        metrics = compute_advantage(episodes, algorithm, kl_ctrl, reduce_sum)
        per_episode = masked_mean(episodes["advantages"], episodes["response_mask"], axis=-1)
        first = batch["episode_row"] == 0
        episode_of_row = first.long().cumsum(0) - 1
        per_row = torch.where(batch["episode_row"] >= 0, per_episode[episode_of_row], 0.0)
        batch["token_level_rewards"] = batch["token_level_scores"]
        batch["advantages"] = per_row.unsqueeze(-1) * batch["response_mask"].to(per_row.dtype)
        batch["returns"] = batch["advantages"]
        return metrics
    metrics = {}
    if algorithm.use_kl_in_reward:
        batch["token_level_rewards"], metrics = apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"],
            kl_ctrl, algorithm.kl_penalty, reduce_sum=reduce_sum,
        )
    else:
        batch["token_level_rewards"] = batch["token_level_scores"]
    # Every estimator gets the same keywords and takes what it uses ("registries" above), plus the
    # batch columns its registration names.
    estimator = get_adv_estimator(algorithm.adv_estimator)
    missing = [column for column in estimator.inputs if column not in batch]
    if missing:
        raise ValueError(f"algorithm.adv_estimator={algorithm.adv_estimator} needs the batch column(s) {missing}, "
                         "which this step's rollout did not provide")
    batch["advantages"], batch["returns"] = estimator.fn(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"], index=batch["uid"],
        gamma=algorithm.gamma, lam=algorithm.lam, norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        reduce_sum=reduce_sum, **{column: batch[column] for column in estimator.inputs},
    )
    return metrics


# ----------------------------------------------------------------------------- losses


def _positive(x):
    return x.clamp_min(1) if isinstance(x, Tensor) else max(x, 1)


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, num_tokens=None, num_seqs=None,
             horizon=None) -> Tensor:
    """Reduce a [batch, len] loss to a scalar.

    token-mean:              sum(loss) / num_tokens
    token-sum:               sum(loss)   (no normalisation: the loss grows with the batch's tokens)
    seq-mean-token-sum:      sum_seqs(token sum) / num_seqs
    seq-mean-token-mean:     sum_seqs(token mean) / num_seqs
    seq-mean-token-sum-norm: sum(loss) / (num_seqs * horizon)   (Dr. GRPO; horizon defaults to len)

    ``num_tokens`` (valid tokens) and ``num_seqs`` (rows with >= 1 valid token) default to this call's
    local counts. For data parallel training with gradient accumulation pass the counts of the whole
    *mini-batch* (all ranks, all micro-batches): each term is then a sum over local rows divided by a
    global constant, so summing the returned values over micro-batches and ranks (what gradient
    accumulation plus a SUM all-reduce of gradients does) gives exactly the full-batch loss and
    gradient, independent of how many ranks / micro-batches the batch was cut into. Likewise pass one
    ``horizon`` if micro-batches are padded to different lengths. Rows with no valid token add 0.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    tokens_per_seq = loss_mask.bool().sum(dim=-1)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / _positive(tokens_per_seq.sum() if num_tokens is None else num_tokens)
    if loss_agg_mode == "token-sum":  # a sum of local sums is the global sum: no counts needed
        return masked_sum(loss_mat, loss_mask)
    num_seqs = _positive((tokens_per_seq > 0).sum() if num_seqs is None else num_seqs)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, loss_mask) / num_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        seq_means = masked_sum(loss_mat, loss_mask, axis=-1) / tokens_per_seq.clamp_min(1)
        return seq_means.sum() / num_seqs
    horizon = loss_mat.shape[-1] if horizon is None else horizon
    return masked_sum(loss_mat, loss_mask) / (num_seqs * horizon)


def compute_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                        cliprange: float = 0.2, cliprange_low: float | None = None,
                        cliprange_high: float | None = None, clip_ratio_c: float = 3.0,
                        loss_agg_mode: str = "token-mean", num_tokens=None, num_seqs=None, horizon=None,
                        rollout_is_weights: Tensor | None = None):
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip and dual clip (Ye et al. 2020).

    loss_t = max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0 it is further capped at -A * c, because
    for a very large ratio with a negative advantage the plain PPO loss is unbounded.
    ``rollout_is_weights`` (detached, see :func:`compute_rollout_is_weights`) multiply each token's
    loss after the clipping, as in verl, to correct for the engine having sampled from another
    policy than the one ``old_log_prob`` scores; the clip metrics do not see them.
    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower); the last three are local, detached metrics.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip bound clip_ratio_c must be > 1, got {clip_ratio_c}")
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)  # clamp keeps exp finite
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    ppo_losses = torch.maximum(loss_unclipped, loss_clipped)
    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(ppo_losses, dual_cap), ppo_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                       horizon=horizon)
    with torch.no_grad():
        pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
        pg_clipfrac_lower = masked_mean(((ppo_losses > dual_cap) & negative).float(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


# Registered policy losses (actor.policy_loss.loss_mode). Each reads its hyper-parameters from the
# actor's config under verl's keys, multiplies its per-token loss by rollout_is_weights before the
# aggregation unless its docstring says otherwise (as verl), and logs verl's metric names.

def _clip_range(config) -> tuple[float, float]:
    low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    return low, high


def _weighted(pg_losses: Tensor, rollout_is_weights: Tensor | None) -> Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _metrics(**values) -> dict[str, Tensor | float]:
    """verl's names for a policy loss's metrics; tensors stay tensors (detached), not read: the
    caller sums them over micro-batches on the device and reads them once a step."""
    return {f"actor/{name}": value.detach() if torch.is_tensor(value) else float(value)
            for name, value in values.items()}


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                loss_agg_mode: str = "token-mean", config=None,
                                rollout_is_weights: Tensor | None = None, **counts):
    """:func:`compute_policy_loss` under the actor's clip_ratio, clip_ratio_low/high and clip_ratio_c."""
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, cliprange=config.clip_ratio,
        cliprange_low=config.clip_ratio_low, cliprange_high=config.clip_ratio_high, clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights, **counts)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                             loss_agg_mode: str = "token-mean", config=None,
                             rollout_is_weights: Tensor | None = None, **counts):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence, the geometric
    mean of its token ratios s_i = exp(mean_t log r_it) over the row's valid tokens, clipped as PPO
    clips a token's ratio. In the paper's token form s_it = sg[s_i] pi(y_it) / sg[pi(y_it)]: its
    value is s_i on every token and its gradient s_i d log pi(y_it), so any loss_agg_mode applies
    (the paper's is seq-mean-token-mean). log s_i is capped at 10 before exp (as verl).
    """
    low, high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1).detach()
    s = (log_prob - log_prob.detach() + seq_log_ratio.unsqueeze(-1)).clamp(max=10.0).exp()
    loss_unclipped = -advantages * s
    loss_clipped = -advantages * s.clamp(1 - low, 1 + high)
    pg_losses = _weighted(torch.maximum(loss_unclipped, loss_clipped), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **counts)
    with torch.no_grad():
        return pg_loss, _metrics(pg_clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
                                 ppo_kl=masked_mean(-log_ratio, response_mask), pg_clipfrac_lower=0.0)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                             loss_agg_mode: str = "token-mean", config=None,
                             rollout_is_weights: Tensor | None = None, **counts):
    """SAPO (Qwen 2025, arXiv 2511.20347): a soft gate instead of the hard clip. A token's
    objective is f(r) A with f(r) = (4 / tau) sigmoid(tau (r - 1)), whose slope is 1 at r = 1 (the
    policy gradient, on-policy) and fades smoothly as r leaves 1, where PPO's drops to 0 at 1 +- eps.
    tau is actor.tau_pos where A > 0, actor.tau_neg elsewhere (a larger tau fades the negative
    updates, the less stable ones, faster). Aggregated seq-mean-token-mean whatever loss_agg_mode
    says, as the paper and verl do (num_seqs still normalises it globally). Log-ratios are clamped to
    +-20 before exp.
    """
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    tau_pos = torch.as_tensor(config.tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=advantages.dtype, device=advantages.device)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = _weighted(-gate * advantages, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **counts)
    with torch.no_grad():
        return pg_loss, _metrics(pg_clipfrac=0.0, ppo_kl=masked_mean(-log_ratio, response_mask), pg_clipfrac_lower=0.0)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                            loss_agg_mode: str = "token-mean", config=None,
                            rollout_is_weights: Tensor | None = None, **counts):
    """GPG (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient -A log pi, with no ratio and
    no clip, so it is only right on-policy (one update per batch; old_log_prob is unused). Pair it with
    algorithm.adv_estimator=gpg. No metrics, as verl.
    """
    pg_losses = _weighted(-log_prob * advantages, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **counts), {}


def _centred_covariance(advantages: Tensor, log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """(A_t - mean A)(log pi_t - mean log pi) per token, means over the valid tokens given."""
    logp = log_prob.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (logp - masked_mean(logp, response_mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                 loss_agg_mode: str = "token-mean", config=None,
                                 rollout_is_weights: Tensor | None = None, **counts):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): the policy's entropy collapses through the few
    tokens whose log-prob and advantage covary most, so some of them lose their gradient. PPO's
    clipped loss (no dual clip, no clamp of the log-ratio: as verl), except that
    max(1, int(clip_cov_ratio * valid tokens)) tokens, drawn at random among the valid ones PPO did
    not clip whose centred covariance lies in (clip_cov_lb, clip_cov_ub), count 0.

    The covariance's means and the token count are over the tensors given, i.e. per micro-batch, as
    verl: the selection is a heuristic on local statistics (the loss itself is still normalised by
    the global counts). The draw uses torch's global CPU generator (torch.randperm), as verl's.
    pg_clipfrac counts the cut tokens only (as verl), not PPO's clipped ones.
    """
    low, high = _clip_range(config)
    knobs = config.policy_loss
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    with torch.no_grad():
        cov = _centred_covariance(advantages, log_prob, response_mask)
        candidates = (response_mask.bool() & ~(loss_clipped > loss_unclipped)
                      & (cov > knobs.clip_cov_lb) & (cov < knobs.clip_cov_ub)).reshape(-1).nonzero().squeeze(-1)
        num_cut = max(int(knobs.clip_cov_ratio * response_mask.sum().item()), 1)
        cut = torch.zeros(response_mask.numel(), dtype=torch.bool, device=response_mask.device)
        if len(candidates):
            cut[candidates[torch.randperm(len(candidates))[:num_cut].to(candidates.device)]] = True
        cut = cut.view(response_mask.shape)
    ppo_losses = torch.maximum(loss_unclipped, loss_clipped)
    pg_losses = _weighted(torch.where(cut, torch.zeros_like(ppo_losses), ppo_losses), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **counts)
    with torch.no_grad():
        return pg_loss, _metrics(pg_clipfrac=masked_mean(cut.float(), response_mask),
                                 ppo_kl=masked_mean(-log_ratio, response_mask))


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                               loss_agg_mode: str = "token-mean", config=None,
                               rollout_is_weights: Tensor | None = None, **counts):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): no clip; instead the max(1, int(kl_cov_ratio *
    valid tokens)) valid tokens of largest centred covariance (see clip_cov) get a penalty
    ppo_kl_coef * |log r| added to -A r, which holds exactly those tokens near the old policy. No
    clamp of the log-ratio (as verl). Statistics per micro-batch, as clip_cov's. actor/ppo_kl is the
    mean |log r| for this loss, as verl logs it.
    """
    knobs = config.policy_loss
    log_ratio = log_prob - old_log_prob
    pg_losses = -advantages * log_ratio.exp()
    with torch.no_grad():
        valid = response_mask.bool().reshape(-1).nonzero().squeeze(-1)
        penalised = torch.zeros(response_mask.numel(), dtype=torch.bool, device=response_mask.device)
        if len(valid):
            adv, logp = advantages.detach().reshape(-1)[valid], log_prob.detach().reshape(-1)[valid]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            penalised[valid[cov.topk(max(1, int(len(valid) * knobs.kl_cov_ratio))).indices]] = True
        penalised = penalised.view(response_mask.shape)
    pg_losses = torch.where(penalised, pg_losses + knobs.ppo_kl_coef * log_ratio.abs(), pg_losses)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **counts)
    with torch.no_grad():
        return pg_loss, _metrics(ppo_kl=masked_mean(log_ratio.abs(), response_mask))


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                 loss_agg_mode: str = "token-mean", config=None,
                                 rollout_is_weights: Tensor | None = None, **counts):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): a row's objective is its advantage times the
    *geometric* mean of its token ratios, which one outlier token moves far less than the arithmetic
    mean PPO optimises. Each token's log-ratio is clipped to [-clip_ratio_low, clip_ratio_high] on
    the side its advantage pushes towards (PPO's pessimism, in log space:
    sign(A) min(sign(A) log r, sign(A) clip(log r))); the row's ratio is exp of their mean over its
    valid tokens and its advantage the mean of its token advantages (an outcome advantage: the
    row's). No clamp of the log-ratio (as verl).

    Sequence-level whatever loss_agg_mode says (as verl): the loss is sum_i loss_i / num_seqs, the
    global count of rows with a valid token (verl divides by its micro-batch's rows, empty ones
    included). Rollout IS weights enter as the row's geometric mean of its token weights (as verl).
    """
    low, high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    sign = advantages.sign()
    clipped_log_ratio = log_ratio.clamp(-low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_log_ratio)
    seq_losses = -masked_mean(advantages, response_mask, axis=-1) * masked_mean(pessimistic, response_mask, axis=-1).exp()
    if rollout_is_weights is not None:
        seq_losses = seq_losses * masked_mean((rollout_is_weights + 1e-10).log(), response_mask, axis=-1).exp()
    num_seqs = counts.get("num_seqs")
    num_seqs = response_mask.bool().any(dim=-1).sum() if num_seqs is None else num_seqs
    pg_loss = seq_losses.sum() / _positive(num_seqs)
    with torch.no_grad():
        clipped = log_ratio != clipped_log_ratio
        return pg_loss, _metrics(pg_clipfrac=masked_mean((clipped & (advantages > 0)).float(), response_mask),
                                 ppo_kl=masked_mean(-log_ratio, response_mask),
                                 pg_clipfrac_lower=masked_mean((clipped & (advantages < 0)).float(), response_mask))


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                              loss_agg_mode: str = "token-mean", config=None,
                              rollout_is_weights: Tensor | None = None, **counts):
    """CISPO (MiniMax 2025, arXiv 2506.13585): clip the importance weight, not the update. The loss
    -sg[clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)] A log pi keeps every token's gradient
    (PPO's clip drops those outside the trust region, often the rare, decisive tokens) and only caps
    its weight. Log-ratios are clamped to +-20 before exp. pg_clipfrac: tokens whose weight was clipped.
    """
    low, high = _clip_range(config)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - low, 1 + high).detach()
    pg_losses = _weighted(-weight * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **counts)
    with torch.no_grad():
        return pg_loss, _metrics(pg_clipfrac=masked_mean((ratio != weight).float(), response_mask),
                                 ppo_kl=masked_mean(-log_ratio, response_mask), pg_clipfrac_lower=0.0)


# ----------------------------------------------------------------------------- rollout correction
#
# verl's algorithm.rollout_correction (verl/trainer/ppo/rollout_corr_helper.py): the engine samples
# from pi_rollout (another dtype, kernels, or weights) while PPO's old_log_prob scores pi_old, the
# actor's recomputation. A truncated importance weight pi_old / pi_rollout per token (or per row)
# multiplies the policy loss. Log-ratios are clamped to +-20 before exp, as verl, so an outlier
# cannot overflow; the truncation at the threshold is what bounds the variance.

IS_SAFETY_BOUND = 20.0


def _rollout_log_ratio(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """log(pi_old / pi_rollout) per token, 0 past each response (padding may hold anything)."""
    log_ratio = old_log_prob.float() - rollout_log_prob.float()
    return torch.where(response_mask.bool(), log_ratio, torch.zeros_like(log_ratio))


def _is_log_weights(log_ratio: Tensor, rollout_is: str) -> Tensor:
    """Untruncated log-weights per token: the token's log-ratio, or its row's sum (the product of
    the row's ratios) on every token of the row."""
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; valid: {', '.join(ROLLOUT_IS_LEVELS)}")
    if rollout_is == "token":
        return log_ratio
    return log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)


@torch.no_grad()
def compute_rollout_is_weights(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor,
                               rollout_is: str = "token", rollout_is_threshold: float = 2.0) -> Tensor:
    """Truncated importance weights min(pi_old / pi_rollout, threshold), [batch, len] float32, 0 on
    padding, detached (they change the measure the loss averages over, not the objective).

    token:    w_t = pi_old(y_t) / pi_rollout(y_t)           (biased, low variance)
    sequence: w_t = prod_s pi_old(y_s) / pi_rollout(y_s)    (the row's, on each of its tokens)
    """
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {rollout_is_threshold}")
    log_ratio = _rollout_log_ratio(old_log_prob, rollout_log_prob, response_mask)
    weights = _is_log_weights(log_ratio, rollout_is).clamp(-IS_SAFETY_BOUND, IS_SAFETY_BOUND).exp()
    weights = torch.where(response_mask.bool(), weights, torch.zeros_like(weights))
    return weights.clamp(max=rollout_is_threshold)


@torch.no_grad()
def rollout_correction_stats(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor,
                             rollout_is: str | None = None, rollout_is_threshold: float = 2.0):
    """This rank's share of verl's rollout_corr/* metrics, for a pool-wide reduction: (means
    {name: (local sum, local weight)}, maxes {name: local max}, mins {name: local min}). Means
    are over valid tokens or over rows with a valid token; :func:`finish_rollout_correction_metrics`
    turns the reduced numbers into the metrics. The IS ones (rollout_is_*) only when ``rollout_is``
    is chosen; they describe the weights before truncation, as verl's do.
    """
    mask = response_mask.bool()
    rows = mask.any(dim=-1)
    tokens, num_rows = float(mask.sum()), float(rows.sum())
    log_ratio = _rollout_log_ratio(old_log_prob, rollout_log_prob, response_mask)
    old, rollout = old_log_prob.double(), rollout_log_prob.double()
    per_row = response_mask.sum(dim=-1).clamp_min(1).double()
    old_row_mean = masked_sum(old, mask, axis=-1) / per_row
    rollout_row_mean = masked_sum(rollout, mask, axis=-1) / per_row
    log_ppl_diff = (rollout_row_mean - old_row_mean)[rows]
    row_log_ratio = log_ratio.double().sum(dim=-1)[rows].clamp(-IS_SAFETY_BOUND, IS_SAFETY_BOUND)

    def token_sum(values):
        return float(masked_sum(values.double(), mask))

    def row_sum(values):
        return float(values.double().sum())

    bounded_ratio = log_ratio.double().clamp(-IS_SAFETY_BOUND, IS_SAFETY_BOUND)
    means = {
        "kl": (token_sum(rollout - old), tokens),
        "k3_kl": (token_sum(log_ratio.double().exp() - log_ratio.double() - 1), tokens),
        "training_ppl": (row_sum((-old_row_mean[rows]).exp()), num_rows),
        "training_log_ppl": (row_sum(-old_row_mean[rows]), num_rows),
        "rollout_ppl": (row_sum((-rollout_row_mean[rows]).exp()), num_rows),
        "rollout_log_ppl": (row_sum(-rollout_row_mean[rows]), num_rows),
        "log_ppl_diff": (row_sum(log_ppl_diff), num_rows),
        "log_ppl_abs_diff": (row_sum(log_ppl_diff.abs()), num_rows),
        "ppl_ratio": (row_sum(log_ppl_diff.exp()), num_rows),
        "chi2_token": (token_sum((2 * bounded_ratio).exp()), tokens),  # E[rho^2]; finish subtracts 1
        "chi2_seq": (row_sum((2 * row_log_ratio).exp()), num_rows),
    }
    empty = num_rows == 0
    maxes = {"log_ppl_diff_max": float("-inf") if empty else float(log_ppl_diff.max())}
    mins = {"log_ppl_diff_min": float("inf") if empty else float(log_ppl_diff.min())}
    if rollout_is is not None:
        upper, lower = rollout_is_threshold, 1.0 / rollout_is_threshold
        log_weights = _is_log_weights(log_ratio, rollout_is).double()
        weights = log_weights.clamp(-IS_SAFETY_BOUND, IS_SAFETY_BOUND).exp()
        clamped = weights.clamp(lower, upper)  # verl's std and effective sample size use these
        if rollout_is == "token":  # fractions of tokens, extremes of token weights
            high, low, count = token_sum((weights > upper).double()), token_sum((weights < lower).double()), tokens
            largest, smallest = weights[mask], weights[mask]
        else:  # fractions of rows, extremes of row weights (the log-space test, as verl)
            high = row_sum((log_weights[:, 0][rows] > math.log(upper)).double())
            low = row_sum((log_weights[:, 0][rows] < math.log(lower)).double())
            count = num_rows
            largest, smallest = weights[:, 0][rows], log_weights[:, 0][rows].exp()
        means.update({
            "rollout_is_mean": (token_sum(weights), tokens),
            "rollout_is_ratio_fraction_high": (high, count),
            "rollout_is_ratio_fraction_low": (low, count),
            "rollout_is_clamped_mean": (token_sum(clamped), tokens),
            "rollout_is_clamped_sq_mean": (token_sum(clamped.square()), tokens),
        })
        maxes["rollout_is_max"] = float(largest.max()) if largest.numel() else float("-inf")
        mins["rollout_is_min"] = float(smallest.min()) if smallest.numel() else float("inf")
    return means, maxes, mins


def finish_rollout_correction_metrics(means: dict[str, float], maxes: dict[str, float],
                                      mins: dict[str, float]) -> dict[str, float]:
    """verl's rollout_corr/* from the pool-reduced means, maxes and mins of
    :func:`rollout_correction_stats`."""
    out = {**means, **maxes, **mins}
    out["chi2_token"] -= 1.0
    out["chi2_seq"] -= 1.0
    if "rollout_is_clamped_mean" in out:
        mean, sq_mean = out.pop("rollout_is_clamped_mean"), out.pop("rollout_is_clamped_sq_mean")
        out["rollout_is_std"] = math.sqrt(max(sq_mean - mean * mean, 0.0))
        # 1 / E[(w / E[w])^2], with verl's 1e-8 guard on E[w]
        out["rollout_is_eff_sample_size"] = (mean + 1e-8) ** 2 / sq_mean
    return {f"rollout_corr/{name}": value for name, value in out.items()}


def compute_value_loss(vpreds: Tensor, returns: Tensor, values: Tensor, response_mask: Tensor,
                       cliprange_value: float, loss_agg_mode: str = "token-mean", num_tokens=None, num_seqs=None,
                       horizon=None):
    """Clipped value loss: 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2), as in PPO2 baselines."""
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_losses = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = agg_loss(vf_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                       horizon=horizon)
    with torch.no_grad():
        vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


# ----------------------------------------------------------------------------- logits helpers

def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[label] for logits [..., vocab] and labels [...], in fp32."""
    return logprobs_and_entropy(logits, labels, temperature)[0]


# Positions per chunk of the log-softmax: at most this many logits (256 MB in fp32) exist in fp32 at once.
CHUNK_ELEMENTS = 1 << 26


def logprobs_and_entropy(logits: Tensor, labels: Tensor, temperature: float = 1.0, entropy: str = "none",
                         chunk_elements: int | None = CHUNK_ELEMENTS) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `labels` (and, if asked, the entropy) under softmax(logits / temperature), in fp32.

    entropy: "none" | "grad" (part of the graph, for an entropy bonus) | "detached" (for logging
    only: verl builds no entropy graph when its coefficient is 0).

    Over a vocabulary of 152k, the fp32 copy of a micro-batch's logits (and the softmax the entropy
    needs) would dwarf the model's activations. So the positions go through in chunks of at most
    `chunk_elements` logits, each upcast and temperature-divided on its own; with grad, each chunk
    is checkpointed, so backward keeps only the logits in their own dtype and recomputes one fp32
    chunk at a time. chunk_elements=None: all positions in one pass, no checkpoint, for a caller
    that hands over one chunk at a time and checkpoints it together with its LM head (roles/lm_head.py).
    """
    if entropy not in ("none", "grad", "detached"):
        raise ValueError(f"entropy={entropy!r}: expected none | grad | detached")
    if chunk_elements is None:
        return _chunk_logprob_entropy(logits, labels, temperature, entropy)
    lead, vocab = labels.shape, logits.shape[-1]
    flat_logits, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1)
    rows = max(1, chunk_elements // vocab)
    log_probs, entropies = [], []
    for start in range(0, flat_labels.numel(), rows):
        chunk, chunk_labels = flat_logits[start:start + rows], flat_labels[start:start + rows]
        if torch.is_grad_enabled() and chunk.requires_grad:
            out = torch.utils.checkpoint.checkpoint(_chunk_logprob_entropy, chunk, chunk_labels, temperature,
                                                    entropy, use_reentrant=False)
        else:
            out = _chunk_logprob_entropy(chunk, chunk_labels, temperature, entropy)
        log_probs.append(out[0])
        entropies.append(out[1])
    log_prob = torch.cat(log_probs).reshape(lead)
    return log_prob, None if entropy == "none" else torch.cat(entropies).reshape(lead)


def _chunk_logprob_entropy(logits: Tensor, labels: Tensor, temperature: float, entropy: str):
    z = logits.float()  # a no-op on fp32 logits; on half precision, only this chunk is upcast
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    log_prob = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if entropy == "none":
        return log_prob, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return log_prob, ent


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy per position: H = logsumexp(z) - sum_i p_i z_i."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


@torch.no_grad()
def compute_explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor,
                               reduce_sum: ReduceSum | None = None) -> float:
    """1 - Var[R - V] / Var[R] over valid tokens of the global batch (1 = perfect critic, <= 0 = useless)."""
    local = _moment_sums(returns - values, response_mask)[:2] + _moment_sums(returns, response_mask)
    sd, sqd, sr, sqr, n = _global_sums(local, reduce_sum)
    if n < 2:
        return float("nan")
    _, var_diff = _mean_var(sd, sqd, n)
    _, var_ret = _mean_var(sr, sqr, n)
    return float(1.0 - var_diff / (var_ret + 1e-8))
