"""A continuous generation stream (spmdsplit/generation/continuous.py) around the agent loop (or a harness's
server) on the HF engine, built as a rollout pool's rank builds it, for the tests of what its
checkpoints keep of episodes."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf


def agent_stream_factory(cfg, tokenizer, eos_ids: list[int], rows: list[dict]):
    """A function making a fresh stream of `cfg`'s agent (its environment's episodes, or its
    harness's): 8 prompts a batch, 2 responses each, one token a step, up to 4 batches ahead, the
    same weights every time."""
    from spmdsplit.agent import build_agent
    from spmdsplit.generation.continuous import ContinuousGeneration
    from spmdsplit.data.prompts import PromptDataset
    from spmdsplit.generation.shares import step_prompts
    from spmdsplit.inference import build_generator

    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([
        "rollout.continuous=true", "rollout.hf_step_tokens=1", "rollout.n=2", "rollout.staleness=4",
        "data.train_batch_size=8", "rollout.per_row_seed=false"]))

    def make_stream():
        torch.manual_seed(5)
        base = build_generator(cfg, cfg.model.path, tokenizer, eos_ids, torch.device("cpu"), torch.float32, seed=3).engine
        dataset = PromptDataset(rows, 8, shuffle=False, seed=0)
        weights = {k: v.clone() for k, v in base.model.state_dict().items()}

        def take_weights(step):
            base.wake_up(weights.items())
            return 0
        stream = ContinuousGeneration(cfg, base, lambda t: step_prompts(cfg, dataset, tokenizer, t, [0], 0),
                                      take_weights, lambda: False, 0, 1, tokenizer.pad_token_id, eos_ids,
                                      torch.device("cpu"), agent=build_agent(cfg, base, tokenizer, eos_ids))
        stream.version = take_weights(1)
        return stream
    return make_stream
