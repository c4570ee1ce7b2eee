"""Helpers only tests use, kept out of the runtime package (`spmdsplit/` holds what a job runs):
whole models read on one rank, to compare an engine's sharded model with; hand-made rows for an
update and a way to watch one; threads standing in for ranks; weights that force one token."""

from __future__ import annotations

import threading

import torch

from spmdsplit.batch import Batch
from spmdsplit.models import ModelSource


def load_value_model(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code=False):
    """A whole critic on `device`: the policy's backbone with a one-output token-classification head."""
    return ModelSource("value", path, dtype, seed, trust_remote_code).read(device)


def load_reward_model(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code: bool = False):
    """The reward model, one output (`num_labels=1`). A checkpoint that has no such head (a plain
    causal LM) gets a fresh one, equal wherever it is read thanks to the seed."""
    return ModelSource("reward", path, dtype, seed, trust_remote_code).read(device)


def full_weights(engine) -> dict[str, torch.Tensor]:
    """Every weight of an engine, whole, as a copy: what a test compares updates by (the runtime
    streams them, `iter_full_weights`, and never holds them all)."""
    return {name: tensor.clone() for name, tensor in engine.iter_full_weights()}


class PlainEngine:
    """The engine's interface without FSDP, for single-process tests."""

    def __init__(self, model):
        self.model, self.group = model.eval(), None

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def ppo_rows(prompts, responses, prompt_mask, response_mask, generator: torch.Generator) -> Batch:
    """A rollout ready for an update: left-padded prompts and right-padded responses [B, P] and
    [B, R] with their masks, joined as the rollout joins them, and random old log-probs,
    advantages, values and returns (drawn from `generator`, in that order)."""
    from spmdsplit.inference.base import position_ids_from_mask

    rows, R = responses.shape
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "old_log_probs": -2.0 - torch.rand(rows, R, generator=generator),
        "advantages": torch.randn(rows, R, generator=generator) * response_mask,
        "values": torch.randn(rows, R, generator=generator) * 0.1 * response_mask,
        "returns": torch.randn(rows, R, generator=generator) * response_mask,
    })


ROWS, PROMPT, RESPONSE = 8, 4, 5
# How far one entry of the weights may move apart between layouts after the update's one Adam step
# (lr 1e-2): Adam divides each gradient entry by its own magnitude, so float noise in an entry near
# zero (other sums of the same numbers: other ranks, micro-batches, CPU kernels) becomes a step of
# its own. Single entries reached 2.2e-5 on one CPU and 6.1e-5 on another (an Intel Xeon, 1 entry
# of 8192, seq-mean-token-mean); a wrong loss normalisation moves entries by ~lr, and a wrong scale,
# which Adam's first step hides, shows in the gradient norm, compared tightly.
ADAM_NOISE = 1e-4


def make_batch(vocab: int):
    """ROWS hand-made rows of a vocabulary of `vocab` (tests/test_update_invariance.py and the
    update tests that compare one layout with another)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (ROWS, PROMPT), generator=g)
    responses = torch.randint(3, vocab, (ROWS, RESPONSE), generator=g)
    lengths = torch.tensor([5, 1, 3, 5, 2, 4, 5, 1])  # ragged: token-mean must weigh tokens, not rows
    response_mask = (torch.arange(RESPONSE)[None] < lengths[:, None]).long()
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    prompt_mask[::3, 0] = 0  # some left padding
    return ppo_rows(prompts, responses, prompt_mask, response_mask, g)


def after_each_backward(engine, look) -> list:
    """A list that gets `look(engine.model)` after each `engine.backward` from now on."""
    seen = []
    backward = engine.backward

    def watched_backward(loss):
        backward(loss)
        seen.append(look(engine.model))

    engine.backward = watched_backward
    return seen


def as_ranks(fn, shards):
    """Run fn(shard, reduce_sum) on one thread per shard; reduce_sum behaves like an all-reduce SUM
    over the shards (every "rank" deposits its tensor, waits for the others, gets the total)."""
    n = len(shards)
    barrier, slots, results, errors = threading.Barrier(n), [None] * n, [None] * n, []

    def work(rank):
        def reduce_sum(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())
            barrier.wait()  # nobody deposits the next round before everyone has read this one
            return total

        try:
            results[rank] = fn(shards[rank], reduce_sum)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    if errors:
        raise errors[0]
    return results


def forcing_state_dict(model, token_id):
    """Weights whose every next token is `token_id`: attention and MLP outputs zeroed, so the
    residual stream is the (constant) embedding, which the head maps to `token_id` only."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            state[k].zero_()
    state["model.embed_tokens.weight"].fill_(1.0)
    state["model.norm.weight"].fill_(1.0)
    head = torch.zeros_like(state["lm_head.weight"])
    head[token_id] = 1.0
    state["lm_head.weight"] = head
    return state
