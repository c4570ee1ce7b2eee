"""spmdsplit.algo against values worked out by hand (in the comments), plus the distributed contracts:
global statistics through ``reduce_sum`` and loss aggregation that does not depend on how the batch
is cut into ranks / micro-batches."""

import math
import statistics

import pytest
import torch
import torch.distributed as dist

from spmdsplit import algo
from tests.support.helpers import as_ranks
from tests.support.launch import run_ranks

T = torch.tensor
NAN = float("nan")


def close(actual, expected, tol=1e-6):
    as64 = lambda x: x.detach().double() if isinstance(x, torch.Tensor) else T(x, dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(as64(actual), as64(expected), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- masked statistics

def test_masked_sum_mean_var_by_hand():
    v = T([[1.0, 2.0, NAN], [4.0, float("inf"), 6.0]])
    m = T([[1, 1, 0], [1, 0, 1]])
    close(algo.masked_sum(v, m), 13.0)  # 1+2+4+6, padding NaN/inf ignored
    close(algo.masked_sum(v, m, axis=-1), [3.0, 10.0])
    close(algo.masked_mean(v, m), 13.0 / 4)
    close(algo.masked_mean(v, m, axis=-1), [1.5, 5.0])
    close(algo.masked_mean(v, T([[0, 0, 0], [1, 0, 0]]), axis=-1), [0.0, 4.0])  # empty row -> 0
    # values 1,2,4,6: mean 3.25, squared deviations 5.0625+1.5625+0.5625+7.5625 = 14.75
    close(algo.masked_var(v, m, unbiased=False), 14.75 / 4)
    close(algo.masked_var(v, m), 14.75 / 3)
    with pytest.raises(ValueError):
        algo.masked_var(v, T([[1, 0, 0], [0, 0, 0]]))


def test_masked_whiten_by_hand():
    v = T([[1.0, 2.0, 3.0, 100.0]])
    m = T([[1, 1, 1, 0]])
    # mean 2, unbiased var (1+0+1)/2 = 1 -> (v-2)/sqrt(1+1e-8); padding value 100 must not count
    s = 1 / math.sqrt(1 + 1e-8)
    close(algo.masked_whiten(v, m)[0, :3], [-s, 0.0, s])
    close(algo.masked_whiten(v, m, shift_mean=False)[0, :3], [2 - s, 2.0, 2 + s])


def _ragged_batch(seed=0, rows=6, cols=5):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3 + 1
    lengths = T([5, 2, 3, 1, 4, 5])[:rows]
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).long()
    return values, mask


def test_masked_whiten_global_equals_full_batch():
    values, mask = _ragged_batch()
    full = algo.masked_whiten(values, mask)
    halves = [(values[:3], mask[:3]), (values[3:], mask[3:])]
    parts = as_ranks(lambda sh, rs: algo.masked_whiten(sh[0], sh[1], reduce_sum=rs), halves)
    got = torch.cat(parts)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], full[valid])
    # the test means something: whitening each half on its own gives a different answer
    local = torch.cat([algo.masked_whiten(v, m) for v, m in halves])
    assert not torch.allclose(local[valid], full[valid], atol=1e-3)


def _whiten_on_rank(rank, world_size, values, mask):
    def reduce_sum(t):
        dist.all_reduce(t)
        return t

    part = slice(rank * 3, rank * 3 + 3)
    return algo.masked_whiten(values[part], mask[part], reduce_sum=reduce_sum)


def test_masked_whiten_with_real_all_reduce():
    values, mask = _ragged_batch()
    parts = run_ranks(_whiten_on_rank, 2, values, mask)
    full = algo.masked_whiten(values, mask)
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(parts)[valid], full[valid])


# ----------------------------------------------------------------------------- advantages

def test_gae_by_hand_with_masked_tail():
    gamma, lam = 0.9, 0.5
    rewards = T([[0.0, 0.0, 1.0, 5.0]])  # 5.0 sits in the padding: must be ignored
    values = T([[0.5, 1.0, 2.0, 10.0]])  # 10.0 sits in the padding: must not be bootstrapped from
    mask = T([[1, 1, 1, 0]])
    # t=2 (last valid): delta = 1 + 0.9*0 - 2 = -1.0                    A2 = -1.0
    # t=1: delta = 0 + 0.9*2 - 1 = 0.8;  A1 = 0.8 + 0.9*0.5*(-1.0)      = 0.35
    # t=0: delta = 0 + 0.9*1 - 0.5 = 0.4; A0 = 0.4 + 0.45*0.35          = 0.5575
    raw = [0.5575, 0.35, -1.0]
    adv, ret = algo.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    close(ret, [[0.5575 + 0.5, 0.35 + 1.0, -1.0 + 2.0, 0.0]])
    mean, var = statistics.mean(raw), statistics.variance(raw)  # unbiased, as masked_whiten
    close(adv, [[(a - mean) / math.sqrt(var + 1e-8) for a in raw] + [0.0]], tol=1e-5)


def test_gae_global_whitening_matches_full_batch():
    values, mask = _ragged_batch(seed=1)
    rewards = torch.zeros_like(values)
    rewards[torch.arange(6), mask.sum(-1) - 1] = torch.arange(6, dtype=values.dtype)
    full_adv, full_ret = algo.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    halves = [(rewards[:3], values[:3], mask[:3]), (rewards[3:], values[3:], mask[3:])]
    parts = as_ranks(lambda s, rs: algo.compute_gae_advantage_return(*s, 0.99, 0.95, reduce_sum=rs), halves)
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), full_adv)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), full_ret)


SCORES_INDEX = ["a", "a", "a", "b", "c", "c"]


def _outcome_rewards(scores, lengths, cols=4):
    """Score on the last valid token of each row, as a reward model produces it."""
    rewards = torch.zeros(len(scores), cols)
    mask = (torch.arange(cols)[None, :] < T(lengths)[:, None]).long()
    rewards[torch.arange(len(scores)), T(lengths) - 1] = T(scores, dtype=torch.float32)
    return rewards, mask


def _expand(per_row, mask):
    return [[x if m else 0.0 for m in row] for x, row in zip(per_row, mask.tolist())]


def test_grpo_by_hand():
    # group a: scores 1,0,5 -> mean 2, deviations -1,-2,3, unbiased var (1+4+9)/2 = 7
    # group b: single sample -> mean 0, std 1 (score passes through)
    # group c: 1,1 -> deviation 0 (std 0 must not give NaN)
    rewards, mask = _outcome_rewards([1, 0, 5, 3, 1, 1], [4, 2, 3, 1, 4, 2])
    eps = 1e-6
    s7 = math.sqrt(7)
    adv, ret = algo.compute_grpo_outcome_advantage(rewards, mask, SCORES_INDEX, epsilon=eps)
    expect = [-1 / (s7 + eps), -2 / (s7 + eps), 3 / (s7 + eps), 3 / (1 + eps), 0.0, 0.0]
    close(adv, _expand(expect, mask), tol=1e-5)
    close(ret, _expand(expect, mask), tol=1e-5)
    adv, _ = algo.compute_grpo_outcome_advantage(rewards, mask, SCORES_INDEX, norm_adv_by_std_in_grpo=False)
    close(adv, _expand([-1, -2, 3, 3, 0, 0], mask))


def test_rloo_by_hand():
    # group a: n=3, a_i = s_i - mean(others): 1-(0+5)/2 = -1.5, 0-(1+5)/2 = -3, 5-(1+0)/2 = 4.5
    # group b: single sample keeps its score 3; group c: 1 - 1 = 0
    rewards, mask = _outcome_rewards([1, 0, 5, 3, 1, 1], [4, 2, 3, 1, 4, 2])
    adv, ret = algo.compute_rloo_outcome_advantage(rewards, mask, SCORES_INDEX)
    close(adv, _expand([-1.5, -3.0, 4.5, 3.0, 0.0, 0.0], mask))
    close(ret, adv)


def test_reinforce_plus_plus_by_hand():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])  # 7.0 is in row 1's padding
    mask = T([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5: row0 returns 0.25, 0.5, 1; row1 returns 1, 2, (0)
    # valid: 0.25 .5 1 1 2 -> mean 0.95, unbiased var (0.49+0.2025+0.0025+0.0025+1.1025)/4 = 0.45
    adv, ret = algo.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    d = math.sqrt(0.45 + 1e-8)
    close(adv, [[(0.25 - 0.95) / d, (0.5 - 0.95) / d, 0.05 / d], [0.05 / d, 1.05 / d, 0.0]], tol=1e-5)
    parts = as_ranks(lambda s, rs: algo.compute_reinforce_plus_plus_outcome_advantage(*s, 0.5, reduce_sum=rs),
                     [(rewards[:1], mask[:1]), (rewards[1:], mask[1:])])
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), adv)


def test_reinforce_plus_plus_baseline_by_hand():
    rewards, mask = _outcome_rewards([1, 3, 5], [2, 1, 3], cols=3)
    # group a (rows 0,1): mean 2 -> -1, +1; group b single -> mean 0 -> 5
    adv, ret = algo.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "b"])
    close(ret, [[-1, -1, 0], [1, 0, 0], [5, 5, 5]])
    tokens = [-1, -1, 1, 5, 5, 5]  # whitened over valid tokens
    mean, sd = statistics.mean(tokens), math.sqrt(statistics.variance(tokens) + 1e-8)
    w = lambda x: (x - mean) / sd  # noqa: E731
    close(adv, [[w(-1), w(-1), 0], [w(1), 0, 0], [w(5), w(5), w(5)]], tol=1e-5)


def test_remax_by_hand():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = algo.compute_remax_outcome_advantage(rewards, T([0.5, 1.0]), mask)
    close(ret, [[1, 1, 1], [2, 2, 0]])  # reward-to-go
    close(adv, [[0.5, 0.5, 0.5], [1, 1, 0]])  # minus the greedy baseline on valid tokens


# ----------------------------------------------------------------------------- KL

def test_kl_estimators_by_hand():
    logp, ref = T([-1.0, -2.0]), T([-1.5, -1.0])  # log r = logp - ref = 0.5, -1.0
    close(algo.kl_penalty(logp, ref, "kl"), [0.5, -1.0])
    close(algo.kl_penalty(logp, ref, "abs"), [0.5, 1.0])
    close(algo.kl_penalty(logp, ref, "mse"), [0.125, 0.5])
    # k3 with x = ref - logp = -0.5, 1.0: e^x - x - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.e - 2]
    close(algo.kl_penalty(logp, ref, "low_var_kl"), k3)
    close(algo.kl_penalty(logp, ref, "k3"), k3)
    # extreme log-ratios: e^20 - 21 and e^-20 + 19 are both clamped to 10
    close(algo.kl_penalty(T([0.0, -30.0]), T([-30.0, 0.0]), "low_var_kl"), [10.0, 10.0])
    with pytest.raises(ValueError, match="low_var_kl"):
        algo.kl_penalty(logp, ref, "k4")


def test_kl_controllers_by_hand():
    fixed = algo.get_kl_controller("fixed", 0.3)
    fixed.update(current_kl=5.0, n_steps=100)
    assert fixed.value == 0.3
    ctl = algo.get_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=1000)
    ctl.update(current_kl=0.055, n_steps=100)  # error 0.1 -> x(1 + 0.1*100/1000) = x1.01
    assert ctl.value == pytest.approx(0.101)
    ctl.update(current_kl=1.0, n_steps=100)  # error 19 clipped to 0.2 -> x1.02
    assert ctl.value == pytest.approx(0.10302)
    ctl.update(current_kl=0.0, n_steps=100)  # error -1 clipped to -0.2 -> x0.98
    assert ctl.value == pytest.approx(0.10302 * 0.98)
    restored = algo.get_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=1000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError):
        algo.get_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="fixed"):
        algo.get_kl_controller("pid", 0.1)


def test_apply_kl_penalty_by_hand():
    scores = T([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    old = T([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = T([[-1.5, -0.5, -9.0], [-1.0, -2.0, -2.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # k1 = old - ref = [[0.5, -0.5, (8 masked)], [-1, (0), (0)]], beta 0.1
    ctl = algo.FixedKLController(0.1)
    rewards, metrics = algo.apply_kl_penalty(scores, old, ref, mask, ctl, "kl")
    close(rewards, [[-0.05, 1.05, 0.0], [2.1, 0.0, 0.0]])
    # per-sequence mean KL: 0 and -1 -> -0.5
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(-0.5), "actor/reward_kl_penalty_coeff": 0.1}


def test_apply_kl_penalty_adaptive_uses_global_batch():
    old = torch.zeros(4, 2)
    ref = T([[-0.5, 0.5], [1.0, 1.0], [-1.0, 0.0], [-2.0, -2.0]])
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1]])
    scores = torch.zeros(4, 2)
    # per-seq mean KL (old - ref): 0, -1, 0.5, 2 -> global mean 0.375 over n=4 sequences
    # target 0.25: error 0.5 clipped to 0.2, horizon 10 -> beta 1.0 * (1 + 0.2*4/10) = 1.08
    def step(shard, rs):
        ctl = algo.get_kl_controller("adaptive", 1.0, target_kl=0.25, horizon=10)
        _, metrics = algo.apply_kl_penalty(*shard, ctl, "kl", reduce_sum=rs)
        return metrics, ctl.value

    shards = [(scores[:2], old[:2], ref[:2], mask[:2]), (scores[2:], old[2:], ref[2:], mask[2:])]
    for metrics, value in as_ranks(step, shards):
        assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.375)
        assert metrics["actor/reward_kl_penalty_coeff"] == 1.0  # the beta used, before the update
        assert value == pytest.approx(1.08)


# ----------------------------------------------------------------------------- loss aggregation

LOSS = T([[1.0, 2.0, NAN], [4.0, NAN, NAN], [NAN, NAN, NAN]])
LOSS_MASK = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row has no valid token


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 3),  # (1+2+4) / 3 tokens
    ("token-sum", 7.0),  # 1+2+4, unnormalised
    ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty seqs
    ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
    ("seq-mean-token-sum-norm", 7 / 6),  # 7 / (2 seqs * horizon 3)
])
def test_agg_loss_by_hand(mode, expected):
    close(algo.agg_loss(LOSS, LOSS_MASK, mode), expected)


def test_agg_loss_explicit_counts():
    close(algo.agg_loss(LOSS, LOSS_MASK, "token-mean", num_tokens=14), 0.5)
    close(algo.agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum", num_seqs=7), 1.0)
    close(algo.agg_loss(LOSS, LOSS_MASK, "seq-mean-token-mean", num_seqs=11), 0.5)
    close(algo.agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", num_seqs=2, horizon=7), 0.5)
    close(algo.agg_loss(LOSS[2:], LOSS_MASK[2:], "seq-mean-token-mean"), 0.0)  # all empty: 0, not NaN
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        algo.agg_loss(LOSS, LOSS_MASK, "sum")


@pytest.mark.parametrize("mode", algo.LOSS_AGG_MODES)
@pytest.mark.parametrize("cuts", [[[0, 1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]], [[0], [1, 2], [3], [4, 5]],
                                  [[5, 1], [0, 3, 2], [4]]])
def test_agg_loss_is_invariant_to_ranks_and_micro_batches(mode, cuts):
    """Rows with different valid lengths (one empty) cut into ranks x micro-batches in several ways:
    summing the pieces, normalised by the global counts, is the full-batch loss and gradient."""
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.arange(5)[None, :] < T([5, 2, 0, 1, 4, 3])[:, None]).long()
    loss_mat = leaf * leaf + leaf  # something non-linear between the leaf and the loss

    full = algo.agg_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, leaf, retain_graph=True)

    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    pieces = [algo.agg_loss(loss_mat[rows], mask[rows], mode, num_tokens=num_tokens, num_seqs=num_seqs)
              for rows in cuts]
    total = sum(pieces)
    (grad,) = torch.autograd.grad(total, leaf)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(grad, full_grad)
    if len(cuts) > 1 and mode != "token-sum":  # a sum needs no global counts: local ones are right too
        naive = sum(algo.agg_loss(loss_mat[rows], mask[rows], mode) for rows in cuts)  # local counts
        assert not torch.allclose(naive, full)


def test_agg_loss_sum_norm_with_trimmed_micro_batches_needs_one_horizon():
    leaf = torch.arange(12, dtype=torch.float64).reshape(3, 4).requires_grad_()
    mask = T([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    full = algo.agg_loss(leaf, mask, "seq-mean-token-sum-norm")  # (0+1+2+3 + 4+5 + 8) / (3*4)
    close(full, 23 / 12)
    # the second micro-batch is trimmed to its longest valid length (2 columns)
    total = (algo.agg_loss(leaf[:1], mask[:1], "seq-mean-token-sum-norm", num_seqs=3, horizon=4)
             + algo.agg_loss(leaf[1:, :2], mask[1:, :2], "seq-mean-token-sum-norm", num_seqs=3, horizon=4))
    close(total, 23 / 12)


# ----------------------------------------------------------------------------- PPO losses

def test_policy_loss_clip_and_dual_clip_by_hand():
    # cliprange 0.2, c = 3. Token by token (ratio r, advantage A):
    #  1) A=+1, r=1.5: -1.5 vs -1.2 -> clipped branch, loss -1.2, gradient 0
    #  2) A=-1, r=0.5: 0.5 vs 0.8   -> clipped branch, loss 0.8 (< dual cap 3), gradient 0
    #  3) A=-1, r=4.0: 4.0 vs 1.2   -> unclipped 4.0, dual cap -A*c = 3 wins: loss 3, gradient 0
    #  4) A=+2, r=1.1: -2.2 vs -2.2 -> inside the trust region, loss -2.2, d/dlogp = -A*r/4 = -0.55
    #  5) masked (huge numbers that must not count)
    ratios = [1.5, 0.5, 4.0, 1.1, math.exp(10)]
    adv = T([[1.0, -1.0, -1.0, 2.0, -100.0]])
    old = torch.zeros(1, 5)
    logp = T([[math.log(r) for r in ratios]]).requires_grad_()
    mask = T([[1, 1, 1, 1, 0]])
    loss, clipfrac, ppo_kl, clipfrac_lower = algo.compute_policy_loss(old, logp, adv, mask, cliprange=0.2)
    close(loss, (-1.2 + 0.8 + 3.0 - 2.2) / 4)
    close(clipfrac, 2 / 4)  # tokens 1 and 2
    close(clipfrac_lower, 1 / 4)  # token 3
    close(ppo_kl, -math.log(1.5 * 0.5 * 4.0 * 1.1) / 4)  # mean of old - new
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 0.0, -0.55, 0.0]])
    # same inputs, global token count of a bigger batch: halves the loss
    loss2, *_ = algo.compute_policy_loss(old, logp.detach(), adv, mask, cliprange=0.2, num_tokens=8)
    close(loss2, (-1.2 + 0.8 + 3.0 - 2.2) / 8)


def test_policy_loss_asymmetric_clip_by_hand():
    # low 0.1, high 0.3: A=+2, r=1.25 stays (< 1.3) -> -2.5; A=-1, r=0.88 clipped up to 0.9 -> 0.9
    # (symmetric 0.2 would give -2.4 and 0.88)
    adv = T([[2.0, -1.0]])
    logp = T([[math.log(1.25), math.log(0.88)]])
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, clipfrac, _, _ = algo.compute_policy_loss(old, logp, adv, mask, cliprange=0.2, cliprange_low=0.1,
                                                    cliprange_high=0.3)
    close(loss, (-2.5 + 0.9) / 2)
    close(clipfrac, 0.5)
    loss_sym, *_ = algo.compute_policy_loss(old, logp, adv, mask, cliprange=0.2)
    close(loss_sym, (-2.4 + 0.88) / 2)
    with pytest.raises(ValueError):
        algo.compute_policy_loss(old, logp, adv, mask, clip_ratio_c=1.0)


def test_value_loss_clip_by_hand():
    # old values 1, cliprange 0.5 -> predictions clipped to [0.5, 1.5]
    #  vpred 2.0, R 3: (2-3)^2 = 1 vs (1.5-3)^2 = 2.25 -> 2.25 (clipped branch larger)
    #  vpred 1.2, R 1: 0.04 vs 0.04                   -> 0.04
    #  vpred 0.0, R 0: 0 vs (0.5-0)^2 = 0.25           -> 0.25 (clipped branch larger)
    #  masked token
    vpreds = T([[2.0, 1.2, 0.0, 50.0]])
    returns = T([[3.0, 1.0, 0.0, -50.0]])
    values = torch.ones(1, 4)
    mask = T([[1, 1, 1, 0]])
    vf_loss, vf_clipfrac = algo.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    close(vf_loss, 0.5 * (2.25 + 0.04 + 0.25) / 3)
    close(vf_clipfrac, 2 / 3)
    vf_sum, _ = algo.compute_value_loss(vpreds, returns, values, mask, 0.5, loss_agg_mode="seq-mean-token-sum")
    close(vf_sum, 0.5 * (2.25 + 0.04 + 0.25))


# ----------------------------------------------------------------------------- logits helpers, metrics

def test_logprobs_and_entropy_by_hand():
    logits = T([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    labels = T([[2, 0]])
    # log softmax: 3 - log(e + e^2 + e^3) and -log 3
    expect = [[3 - math.log(math.e + math.e ** 2 + math.e ** 3), -math.log(3)]]
    close(algo.logprobs_from_logits(logits, labels), expect)
    close(algo.logprobs_from_logits(logits.bfloat16(), labels), expect, tol=2e-2)
    # entropies: p = (1/4, 3/4) from logits (0, log 3); uniform over 4 -> log 4
    close(algo.entropy_from_logits(T([[0.0, math.log(3)], [0.0, 0.0]])),
          [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2)])
    close(algo.entropy_from_logits(torch.zeros(4)), math.log(4))


def test_explained_variance_by_hand_and_global():
    returns = T([[1.0, 2.0], [3.0, 4.0], [9.0, 0.0]])
    values = T([[1.0, 2.0], [3.0, 3.0], [-9.0, 0.0]])
    mask = T([[1, 1], [1, 1], [0, 0]])
    # R - V = 0,0,0,1: var 0.25; Var[R] = 5/3 -> 1 - 0.25 / (5/3) = 0.85
    assert algo.compute_explained_variance(values, returns, mask) == pytest.approx(0.85)
    parts = as_ranks(lambda s, rs: algo.compute_explained_variance(*s, reduce_sum=rs),
                     [(values[:1], returns[:1], mask[:1]), (values[1:], returns[1:], mask[1:])])
    assert parts == [pytest.approx(0.85)] * 2
