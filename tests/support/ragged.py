"""Ragged rows for the packed and token-budget passes (tests/test_packing.py, tests/test_logprobs.py):
left-padded prompts and right-padded responses of different lengths, and an actor pool of two
that scores and updates them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmdsplit.batch import Batch
from tests.support.helpers import full_weights, ppo_rows


P, R = 7, 6
# Left-padded prompts and right-padded responses of different lengths, some of length 1; no row
# fills the prompt or the response width, so the padded path's trimming has columns to drop.
PROMPT_LENGTHS = [5, 1, 3, 2, 5, 4, 1, 3]
RESPONSE_LENGTHS = [4, 1, 3, 1, 2, 4, 3, 1]


def ragged_batch(vocab: int, prompt_lengths=PROMPT_LENGTHS, response_lengths=RESPONSE_LENGTHS) -> Batch:
    g = torch.Generator().manual_seed(0)
    rows = len(prompt_lengths)
    prompt_mask = (torch.arange(P)[None] >= P - torch.tensor(prompt_lengths)[:, None]).long()
    response_mask = (torch.arange(R)[None] < torch.tensor(response_lengths)[:, None]).long()
    prompts = torch.randint(3, vocab, (rows, P), generator=g) * prompt_mask
    responses = torch.randint(3, vocab, (rows, R), generator=g) * response_mask
    return ppo_rows(prompts, responses, prompt_mask, response_mask, g)


def actor_on_pool(rank, world_size, model_dir, engine_name, packed, dynamic, logits_chunk_size=512):
    """An actor pool of two: old log-probs of unequal shares (rank 0: 6 rows, rank 1: 2, so with a
    small token budget rank 1 runs dummy micro-batches), then one update of equal shares; the
    per-row log-probs in the batch's order, and the updated weights."""
    from spmdsplit.config import ActorConfig, OptimConfig
    from spmdsplit.engines.deepspeed import DeepSpeedEngine
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import load_causal_lm
    from spmdsplit.roles.actor import Actor

    device = torch.device("cpu")
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2, grad_clip=1e9), ppo_mini_batch_size=8,
                      ppo_micro_batch_size_per_gpu=2, log_prob_micro_batch_size_per_gpu=2, entropy_coeff=0.01,
                      shuffle=False, use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=11,
                      log_prob_max_token_len_per_gpu=9, logits_chunk_size=logits_chunk_size)
    model = load_causal_lm(model_dir, torch.float32, device, seed=3)
    if engine_name == "fsdp":
        engine = FSDPEngine(model, DeviceMesh.from_group(dist.group.WORLD, "cpu"), cfg.optim)
    else:
        engine = DeepSpeedEngine(model, dist.group.WORLD, 3, cfg.optim)
    actor = Actor(engine, cfg, temperature=0.7, device=device, remove_padding=packed)
    batch = ragged_batch(model.config.vocab_size)
    shares = [(0, 6), (6, 8)][rank]
    log_probs = actor.compute_log_prob(batch.slice(*shares))
    metrics = actor.update_policy(batch.slice(4 * rank, 4 * rank + 4), seed=1)
    return log_probs, metrics, full_weights(engine)
