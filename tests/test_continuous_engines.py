"""Engines driven step by step (inference/base.py StepwiseEngine: submit, step, abort, and
update_weights between two steps), HF and vLLM, on a random tiny Qwen2 (heads of 32 for vLLM's
CPU kernel). The oracle is outside the engine: each request's tokens are scored by transformers
under the weights of the version the driver recorded for each token, and must equal the engine's
own log-probs; the same tokens scored under the other version must not (the load took effect,
mid-request)."""

from __future__ import annotations

import pytest
import torch

from tests.support.launch import run_ranks
from tests.support.engines import build_model, needs_vllm, start_engine, task_prompts

R, TEMPERATURE = 16, 0.9


def drive(engine, contexts: list[list[int]], new_weights, load_after: int):
    """Every context as a request; `new_weights` loaded after `load_after` steps (between two steps,
    requests held). Returns per request (tokens, engine log-probs, version per token 0/1), the
    number of steps, and how many requests were held at the load."""
    held = {}
    for i, context in enumerate(contexts):
        engine.submit(f"r{i}", context, R, seed=100 + i)
        held[f"r{i}"] = ([], [], [])
    version, steps, held_at_load, live = 0, 0, 0, set(held)
    while live:
        if steps == load_after:
            held_at_load = len(live)
            engine.update_weights(new_weights)
            version = 1
        for delta in engine.step():
            tokens, log_probs, versions = held[delta.request_id]
            tokens += delta.token_ids
            log_probs += delta.log_probs
            versions += [version] * len(delta.token_ids)
            if delta.finished:
                live.discard(delta.request_id)
        steps += 1
        assert steps < 200, "the engine never finished its requests"
    return [held[f"r{i}"] for i in range(len(contexts))], steps, held_at_load


def teacher_forced(model, context: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax(logits / T) of `tokens` after `context`, as the actor scores them."""
    ids = torch.tensor([context + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1: -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def check_in_flight_load(engine, tokenizer, load_after: int) -> dict:

    old, _ = build_model(seed=0)
    new, _ = build_model(seed=1)
    engine.wake_up(old.state_dict().items())
    prompts = task_prompts(tokenizer, 6, seed=3)
    contexts = [row[keep].tolist() for row, keep in zip(prompts["input_ids"], prompts["attention_mask"].bool())]
    requests, steps, held_at_load = drive(engine, contexts, new.state_dict().items(), load_after)
    errors, other_version = [], []
    mixed = 0
    for context, (tokens, log_probs, versions) in zip(contexts, requests):
        v = torch.tensor(versions)
        mixed += int(0 < v.sum() < len(v))  # tokens of both versions in one response
        by_version = torch.where(v == 1, teacher_forced(new, context, tokens), teacher_forced(old, context, tokens))
        under_other = torch.where(v == 1, teacher_forced(old, context, tokens), teacher_forced(new, context, tokens))
        errors.append((torch.tensor(log_probs) - by_version).abs().max().item())
        other_version.append((torch.tensor(log_probs) - under_other).abs().max().item())
    return dict(errors=errors, other=other_version, mixed=mixed, held_at_load=held_at_load, steps=steps,
                lengths=[len(t) for t, _, _ in requests])


def hf_checks():
    from spmdsplit.config import RolloutConfig
    from spmdsplit.embedded import build_tokenizer
    from spmdsplit.inference.hf import HFEngine

    tokenizer = build_tokenizer()
    model, _ = build_model(seed=0)
    engine = HFEngine(model, tokenizer, RolloutConfig(temperature=TEMPERATURE, hf_step_tokens=3), R,
                      [tokenizer.eos_token_id])
    return check_in_flight_load(engine, tokenizer, load_after=2)


def vllm_checks(rank, world_size, model_dir):
    from spmdsplit.inference.vllm_engine import shutdown_vllm_distributed

    _, tokenizer, make_engine = start_engine(model_dir, f"data.max_response_length={R}",
                                             f"rollout.temperature={TEMPERATURE}")
    try:
        engine = make_engine()
        res = check_in_flight_load(engine, tokenizer, load_after=4)
        # An abort drops a request: no delta for it afterwards.
        engine.submit("a", [tokenizer.bos_token_id or 1, 5, 6], R)
        engine.submit("b", [tokenizer.bos_token_id or 1, 7, 8], R)
        engine.step()
        engine.abort(["a"])
        seen = set()
        while engine.llm.llm_engine.has_unfinished_requests():
            seen |= {d.request_id for d in engine.step()}
        res["after_abort"] = sorted(seen)
        return res
    finally:
        shutdown_vllm_distributed()


def assert_in_flight(res):
    assert res["held_at_load"] >= 4, res  # most requests were mid-answer when the weights changed
    assert res["mixed"] >= 3, res  # responses that hold tokens of both versions
    assert max(res["errors"]) < 1e-4, res  # each token's log-prob is its version's
    assert min(res["other"]) > 1e-3, res  # ... and not the other version's: the load took effect


def test_hf_takes_weights_between_steps_and_samples_the_rest_with_them():
    assert_in_flight(hf_checks())


@pytest.mark.e2e
@needs_vllm
def test_vllm_takes_weights_between_steps_and_samples_the_rest_with_them(head32_model_dir):
    res = run_ranks(vllm_checks, 1, head32_model_dir, timeout=400, kind="vllm")[0]
    assert_in_flight(res)
    assert res["after_abort"] == ["b"]
