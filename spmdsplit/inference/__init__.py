"""Inference engines behind one contract (base.Engine): `rollout.name=hf` (transformers `generate`,
hf.py) or `rollout.name=vllm` (vllm_engine.py; vLLM is imported only then); with
rollout.multi_turn.enable either one runs multi-turn tool episodes (spmdsplit/agent/loop.py):
`build_generator` gives what generates, `build_engine` the engine alone."""

from __future__ import annotations

import torch

from spmdsplit import lora
from spmdsplit.inference.base import Engine  # noqa: F401 - the package's public names


def build_generator(cfg, model_path: str, tokenizer, eos_ids: list[int], device: torch.device, dtype: torch.dtype,
                    seed: int, sleeps: bool = True) -> Engine:
    """What generates a batch: the engine (build_engine), driven turn by turn by the agent loop
    with rollout.multi_turn.enable (spmdsplit/agent/loop.py), or served to the agent harness
    rollout.agent.harness names (spmdsplit/agent/harness.py)."""
    engine = build_engine(cfg, model_path, tokenizer, eos_ids, device, dtype, seed, sleeps)
    from spmdsplit.agent import build_agent

    return build_agent(cfg, engine, tokenizer, eos_ids) or engine


def build_engine(cfg, model_path: str, tokenizer, eos_ids: list[int], device: torch.device, dtype: torch.dtype,
                 seed: int, sleeps: bool = True) -> Engine:
    """The engine `cfg.rollout.name` names, holding the checkpoint at `model_path` (its weights are
    replaced by `wake_up(weights)` before each step's generation, or `update_weights` while it stays
    awake; with a LoRA policy it keeps them and takes the adapter, lora.engines_take_adapter). `sleeps`:
    it shares its device with training. vLLM: call only on ranks that generate,
    after every rank ran `vllm_engine.init_vllm_distributed`."""
    if cfg.rollout.name == "vllm":
        from spmdsplit.inference.vllm_engine import VLLMEngine

        engine = VLLMEngine(cfg, model_path, tokenizer, eos_ids, device, dtype, sleeps)
    else:
        from spmdsplit.models import load_causal_lm
        from spmdsplit.inference.hf import HFEngine

        model = load_causal_lm(model_path, dtype, device, seed, cfg.model.trust_remote_code)
        engine = HFEngine(model, tokenizer, cfg.rollout, cfg.data.max_response_length, eos_ids,
                          val_cfg=cfg.rollout.val_kwargs, adapter=lora.engines_take_adapter(cfg))
    return engine
