"""vLLM's completions as the rollout's tensors (spmdsplit/inference/vllm_engine.py
`sampled_tokens_and_log_probs`), on vLLM's own output classes built by hand: rows of different
lengths, and the two ways vLLM's output could be other than asked. In a rank forked from the
server that has imported vLLM (tests/support/launch.py), as the engine tests run, never in pytest's own
process. Speed: issue 36 measured 512 rows x up to 1024 tokens at ~180 ms as it was (one flat
Python list per column, then torch.tensor) and ~26-35 ms now (numpy, a row at a time); no test
here times it (the machine is shared)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tests.support.launch import run_ranks

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def completion(tokens: list[int], log_probs: list[float], scored: list[int] | None = None):
    """vLLM's CompletionOutput of one row as a generate with logprobs=0, flat_logprobs=True gives it:
    one flat entry per sampled token (`scored`: other token ids in the flat lists, a broken output)."""
    from vllm.logprobs import FlatLogprobs
    from vllm.outputs import CompletionOutput

    n = len(tokens)
    flat = FlatLogprobs(start_indices=list(range(n)), end_indices=list(range(1, n + 1)),
                        token_ids=list(tokens if scored is None else scored), logprobs=list(log_probs),
                        ranks=[1] * n, decoded_tokens=[None] * n)
    return CompletionOutput(index=0, text="", token_ids=list(tokens), cumulative_logprob=None, logprobs=flat)


def _conversion_checks(rank, world_size):
    from spmdsplit.inference.vllm_engine import sampled_tokens_and_log_probs

    rng = random.Random(0)
    lengths = [7, 1, 12, 0, 12, 3]
    samples = [completion([rng.randrange(1000) for _ in range(n)], [-5 * rng.random() for _ in range(n)])
               for n in lengths]
    responses, log_probs = sampled_tokens_and_log_probs(samples, 12, pad_token_id=999)
    # What the engine read before issue 25: each token's {token: Logprob} dict, walked in Python.
    walked_tokens = torch.full((len(samples), 12), 999, dtype=torch.long)
    walked = torch.zeros((len(samples), 12), dtype=torch.float32)
    for i, sample in enumerate(samples):
        for t, (token, position) in enumerate(zip(sample.token_ids, sample.logprobs)):
            walked_tokens[i, t] = token
            walked[i, t] = position[token].logprob
    errors = []
    for broken in (completion([5, 6], [-1.0]),  # fewer log-probs than tokens
                   completion([5, 6], [-1.0, -2.0], scored=[5, 7])):  # log-probs of other tokens
        try:
            sampled_tokens_and_log_probs([samples[0], broken], 12, pad_token_id=999)
        except RuntimeError as e:
            errors.append(str(e))
    return responses, log_probs, walked_tokens, walked, errors


@pytest.mark.e2e
@needs_vllm
def test_completions_become_padded_tokens_and_their_log_probs():
    responses, log_probs, walked_tokens, walked, errors = run_ranks(_conversion_checks, 1, timeout=300, kind="vllm")[0]
    assert responses.dtype == torch.long and log_probs.dtype == torch.float32 and responses.shape == (6, 12)
    assert torch.equal(responses, walked_tokens)
    assert torch.equal(log_probs, walked)  # the same float32 rounding of vLLM's Python floats
    assert "not flat with one entry per sampled token" in errors[0]
    assert "not of the sampled tokens" in errors[1]
