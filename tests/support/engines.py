"""Inference engines on tiny models, for the engine tests (tests/test_vllm_rollout.py,
tests/test_continuous_engines.py, tests/test_continuous_stream.py): a random Qwen2 with heads of size 32
(vLLM's CPU attention kernel rejects 16), the task's prompts, and a vLLM engine started as a job
starts one (the config checked as on its ranks, vLLM's groups made on every rank)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from spmdsplit.config import load_config
from spmdsplit.preflight import check_config


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


P_SHORT, P_LONG, R = 8, 48, 5  # the task's prompt length; prompts longer than a KV block (32)


def build_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdsplit.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval(), tokenizer


def job_config(model_dir: str, *overrides: str):
    """A vLLM job's config, loaded and checked as on its ranks before the world forms."""
    cfg = load_config(None, [
        "rollout.name=vllm", f"model.path={model_dir}", f"data.max_prompt_length={P_LONG}",
        f"data.max_response_length={R}", "rollout.kv_cache_memory_gb=0.0625", "rollout.temperature=0.7",
        *overrides,
    ])
    check_config(cfg)
    return cfg


def task_prompts(tokenizer, n: int, seed: int, max_prompt_length: int = P_SHORT, digits=(2, 5)):
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.data.synthetic import make_dataset

    rows = make_dataset("repeat", n, seed, min_digits=digits[0], max_digits=digits[1])
    return collate_prompts(rows, tokenizer, max_prompt_length, step=1, first_row=0)


def start_engine(model_dir: str, *overrides: str):
    """Every rank: vLLM's groups; returns (cfg, engine factory)."""
    from spmdsplit.models import eos_token_ids, load_tokenizer
    from spmdsplit.inference import build_generator
    from spmdsplit.inference.vllm_engine import init_vllm_distributed

    cfg = job_config(model_dir, *overrides)
    init_vllm_distributed(cfg, model_dir, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir, tokenizer)
    return cfg, tokenizer, lambda: build_generator(cfg, model_dir, tokenizer, eos, torch.device("cpu"), torch.float32, 0)
