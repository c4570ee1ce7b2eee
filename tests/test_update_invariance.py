"""The PPO update is the same whatever the layout: one rank, two ranks (FSDP2 over a pool), or
more micro-batches. This is what token-mean with pool-wide token counts and FSDP's gradient
averaging undone by the pool size must give."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tests.support.helpers import ADAM_NOISE, ROWS, after_each_backward, full_weights, make_batch
from tests.support.launch import run_ranks


def _update(rank, world_size, model_dir, role, micro, loss_agg_mode="token-mean", checkpointing=False,
            max_tokens=None):
    """One update of the pool's rows; `max_tokens`: token-budget micro-batches of at most that many
    tokens (use_dynamic_bsz) instead of `micro` rows each."""
    from spmdsplit.config import ActorConfig, CriticConfig, OptimConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.exchange import row_ranges
    from spmdsplit.models import load_causal_lm
    from tests.support.helpers import load_value_model
    from spmdsplit.roles.actor import Actor
    from spmdsplit.roles.critic import Critic

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    device = torch.device("cpu")
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=0, grad_clip=1e9)
    if role == "actor":
        cfg = ActorConfig(optim=optim, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=micro,
                          entropy_coeff=0.01, shuffle=False, loss_agg_mode=loss_agg_mode,
                          use_dynamic_bsz=max_tokens is not None, ppo_max_token_len_per_gpu=max_tokens or 1)
        model = load_causal_lm(model_dir, torch.float32, device, seed=3)
        worker = Actor(FSDPEngine(model, mesh, cfg.optim), cfg, temperature=1.0, device=device)
    else:
        cfg = CriticConfig(optim=optim, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=micro,
                           cliprange_value=0.05, shuffle=False, loss_agg_mode=loss_agg_mode,
                           use_dynamic_bsz=max_tokens is not None, ppo_max_token_len_per_gpu=max_tokens or 1)
        model = load_value_model(model_dir, torch.float32, device, seed=3)
        worker = Critic(FSDPEngine(model, mesh, cfg.optim, activation_checkpointing=checkpointing), cfg, device)
        assert model.is_gradient_checkpointing == checkpointing
    batch = make_batch(model.config.vocab_size)
    start, end = row_ranges(ROWS, world_size)[rank]
    mine = batch.slice(start, end)
    metrics = worker.update_policy(mine, seed=1) if role == "actor" else worker.update_critic(mine, seed=1)
    state = full_weights(worker.engine)
    return state, metrics


@pytest.mark.parametrize(
    "role, mode",
    [("actor", "token-mean"), ("actor", "token-sum"), ("actor", "seq-mean-token-sum"), ("actor", "seq-mean-token-mean"),
     ("actor", "seq-mean-token-sum-norm"), ("critic", "token-mean")],
)
def test_update_matches_across_ranks_and_micro_batches(embedded_model_dir, role, mode):
    (one_rank, metrics_1), = run_ranks(_update, 1, embedded_model_dir, role, 4, mode)
    two_ranks = run_ranks(_update, 2, embedded_model_dir, role, 2, mode)
    (more_micro, _), = run_ranks(_update, 1, embedded_model_dir, role, 1, mode)
    initial = _initial_state(embedded_model_dir, role)

    moved = max((one_rank[k] - initial[k]).abs().max().item() for k in one_rank)
    assert moved > 1e-3, "the update did not change the weights: nothing to compare"
    # Adam's first step is ~lr * sign(grad), which magnifies float noise in near-zero gradient
    # entries and hides a uniform gradient scale: so the weights are compared to ADAM_NOISE, 1% of
    # how far they moved, and the gradient itself through its norm (before clipping), tightly.
    for name, expected in one_rank.items():
        for got in (two_ranks[0][0][name], two_ranks[1][0][name], more_micro[name]):
            torch.testing.assert_close(got, expected, rtol=0, atol=ADAM_NOISE)
    grad = "actor/grad_norm" if role == "actor" else "critic/grad_norm"
    loss = "actor/pg_loss" if role == "actor" else "critic/vf_loss"
    for key in (grad, loss):
        assert two_ranks[0][1][key] == pytest.approx(metrics_1[key], rel=1e-5, abs=1e-8), key


@pytest.mark.parametrize("role, mode", [("actor", "token-mean"), ("actor", "seq-mean-token-mean"), ("critic", "token-mean")])
def test_token_budget_micro_batches_leave_the_update_unchanged(embedded_model_dir, role, mode):
    """FSDP2 on 2 ranks: micro-batches of at most 11 tokens bin the two ranks' rows differently
    (4 bins and 3, so rank 1 splits one to match) and give the weights and metrics of 2 rows each."""
    from spmdsplit.roles.micro_batches import token_budget_bins

    tokens = make_batch(32)["attention_mask"].sum(-1).tolist()
    assert len(token_budget_bins(tokens[:4], 11)) != len(token_budget_bins(tokens[4:], 11))
    fixed = run_ranks(_update, 2, embedded_model_dir, role, 2, mode)
    by_tokens = run_ranks(_update, 2, embedded_model_dir, role, 2, mode, False, 11)
    for (expected, m_fixed), (got, m_tokens) in zip(fixed, by_tokens):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=ADAM_NOISE, msg=name)
        for key in m_fixed:
            assert m_tokens[key] == pytest.approx(m_fixed[key], rel=1e-5, abs=1e-8), key


def _initial_state(model_dir, role):
    from spmdsplit.models import load_causal_lm
    from tests.support.helpers import load_value_model

    load = load_causal_lm if role == "actor" else load_value_model
    return {k: v.clone() for k, v in load(model_dir, torch.float32, torch.device("cpu"), seed=3).state_dict().items()}


def _critic_update_counting_blocks(rank, world_size, model_dir, checkpointing):
    """A critic update on the pool, and how often its transformer blocks ran forward meanwhile
    (checkpointing runs each again in the backward)."""
    import transformers

    calls = []
    layer = transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer
    original = layer.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    layer.forward = counted
    state, metrics = _update(rank, world_size, model_dir, "critic", 2, checkpointing=checkpointing)
    return state, metrics, len(calls)


def test_activation_checkpointing_leaves_the_critic_update_unchanged(embedded_model_dir):
    """On a pool of two: the same weights and metrics with and without checkpointing, which did
    run (blocks ran forward more often)."""
    plain = run_ranks(_critic_update_counting_blocks, 2, embedded_model_dir, False)
    checkpointed = run_ranks(_critic_update_counting_blocks, 2, embedded_model_dir, True)
    for (expected, m_plain, calls_plain), (got, m_ckpt, calls_ckpt) in zip(plain, checkpointed):
        assert calls_ckpt > calls_plain, "checkpointing did not recompute any block"
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
        assert m_ckpt["critic/vf_loss"] == pytest.approx(m_plain["critic/vf_loss"], rel=1e-6)
        assert m_ckpt["critic/grad_norm"] == pytest.approx(m_plain["critic/grad_norm"], rel=1e-5)


def _whole_gradients(model) -> list[str]:
    """Names of the sharded parameters of which this rank holds a whole-size gradient: as `.grad`,
    or where FSDP2 keeps it unsharded between backwards without a reduce-scatter (torch 2.13,
    _fsdp_param.py: `_unsharded_param.grad` in the gradient's own dtype, `unsharded_accumulated_grad`
    once upcast to the reduce dtype)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    whole = [name for name, p in model.named_parameters()
             if p.grad is not None and (not isinstance(p.grad, DTensor) or p.grad.to_local().numel() >= p.numel())]
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if fsdp_param.unsharded_accumulated_grad is not None or (unsharded is not None and unsharded.grad is not None):
                    whole.append(fsdp_param._param_fqn)
    return whole


def _update_watching_gradients(rank, world_size, model_dir, no_sync_accumulation):
    """An actor update on a pool of two, 4 micro-batches of one row per rank in its one mini-batch,
    with the names of whole gradients this rank holds after each micro-batch's backward."""
    from spmdsplit.config import ActorConfig, OptimConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.exchange import row_ranges
    from spmdsplit.models import load_causal_lm
    from spmdsplit.roles.actor import Actor

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    device = torch.device("cpu")
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, grad_clip=1e9), ppo_mini_batch_size=ROWS,
                      ppo_micro_batch_size_per_gpu=1, shuffle=False, no_sync_accumulation=no_sync_accumulation)
    model = load_causal_lm(model_dir, torch.float32, device, seed=3)
    engine = FSDPEngine(model, mesh, cfg.optim)
    assert all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in engine.model.parameters())
    whole_after_micro = after_each_backward(engine, _whole_gradients)
    start, end = row_ranges(ROWS, world_size)[rank]
    metrics = Actor(engine, cfg, temperature=1.0, device=device).update_policy(make_batch(model.config.vocab_size).slice(start, end), seed=1)
    state = full_weights(engine)
    return whole_after_micro, metrics, state


def test_micro_batches_reduce_into_shards_unless_no_sync_accumulation(embedded_model_dir):
    """FSDP2 on 2 ranks, a mini-batch of 4 micro-batches per rank: by default no rank ever holds a
    whole gradient of a sharded parameter; with no_sync_accumulation every micro-batch but the
    last leaves one per parameter (the cost that option names), and the update is the same."""
    default = run_ranks(_update_watching_gradients, 2, embedded_model_dir, False)
    no_sync = run_ranks(_update_watching_gradients, 2, embedded_model_dir, True)
    for (whole_after_micro, _, _), (whole_no_sync, _, _) in zip(default, no_sync):
        assert len(whole_after_micro) == ROWS // 2
        assert whole_after_micro == [[]] * (ROWS // 2), whole_after_micro
        assert all(whole_no_sync[:-1]) and whole_no_sync[-1] == [], [len(w) for w in whole_no_sync]
    (_, metrics, state), (_, metrics_no_sync, state_no_sync) = default[0], no_sync[0]
    for name, expected in state_no_sync.items():
        torch.testing.assert_close(state[name], expected, rtol=0, atol=5e-5, msg=name)
    assert metrics["actor/grad_norm"] == pytest.approx(metrics_no_sync["actor/grad_norm"], rel=1e-5)
