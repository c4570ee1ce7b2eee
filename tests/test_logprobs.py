"""The lean log-prob path (logits only for the response positions, chunked fp32 log-softmax with
checkpointed chunks, entropy without a graph when its coefficient is 0) gives the same log-probs,
entropy, PPO loss and gradients as the straightforward one: full-length logits, one fp32 copy
divided by the temperature, log_softmax, entropy with grad."""

import pytest
import torch

from spmdsplit import algo
from tests.test_update_invariance import RESPONSE, make_batch

TEMPERATURE = 0.7


def tiny_model(vocab=40):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).float()


def straightforward(model, batch, temperature):
    """What the actor computed before: logits for every position, sliced, upcast, divided."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits[:, -RESPONSE - 1:-1].float() / temperature
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].bool()  # the actor leaves 0 past each response
    return torch.where(mask, log_probs, 0), torch.where(mask, algo.entropy_from_logits(logits), 0)


def ppo_loss(batch, log_prob, entropy, entropy_coeff):
    mask = batch["response_mask"]
    pg_loss, *_ = algo.compute_policy_loss(batch["old_log_probs"], log_prob, batch["advantages"], mask,
                                           cliprange=0.2, loss_agg_mode="token-mean")
    return pg_loss - entropy_coeff * algo.agg_loss(entropy, mask, "token-mean")


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_actor_log_probs_match_straightforward(entropy_coeff):
    from spmdsplit.config import ActorConfig
    from spmdsplit.roles.actor import Actor

    model = tiny_model()
    batch = make_batch(40)
    ref_lp, ref_ent = straightforward(model, batch, TEMPERATURE)
    ppo_loss(batch, ref_lp, ref_ent, entropy_coeff).backward()
    ref_grads = grads(model)
    model.zero_grad()

    actor = Actor(model, ActorConfig(entropy_coeff=entropy_coeff), TEMPERATURE, torch.device("cpu"))
    with torch.no_grad():
        no_grad_lp, no_grad_ent = actor._log_probs(batch, "none")
    assert no_grad_ent is None
    torch.testing.assert_close(no_grad_lp, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    mode = "grad" if entropy_coeff else "detached"
    lp, ent = actor._log_probs(batch, mode)
    assert ent.requires_grad == bool(entropy_coeff)  # no entropy graph at coefficient 0
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    loss = ppo_loss(batch, lp, ent, entropy_coeff)
    torch.testing.assert_close(loss, ppo_loss(batch, ref_lp, ref_ent, entropy_coeff))
    loss.backward()
    lean_grads = grads(model)
    assert lean_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(lean_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_log_softmax_matches_full(dtype):
    """Chunks smaller than a row, of a row, and of several rows (with a ragged last chunk) give the
    full computation's values and gradients."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 11, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    full = logits.float().detach().requires_grad_(True)
    z = full / TEMPERATURE
    ref_lp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = algo.entropy_from_logits(z)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    for chunk_elements in (1, 11, 4 * 11, 1 << 20):
        x = logits.detach().requires_grad_(True)
        lp, ent = algo.logprobs_and_entropy(x, labels, TEMPERATURE, "grad", chunk_elements=chunk_elements)
        assert lp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
        (lp.sum() + 0.3 * ent.sum()).backward()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(x.grad.float(), full.grad, rtol=tol, atol=tol)
