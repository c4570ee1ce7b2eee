"""The memory model's arithmetic (tools/memory.py): parameter counts from shapes, what sharding
divides by the pool size and what it does not."""

import pytest

from tools import memory
from tools.memory import QWEN25, Shape, Workload


def test_shape_counts_parameters_like_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for tied in (False, True):
        s = Shape("t", 64, 3, 4, 2, 96, 50, tied=tied)
        config = Qwen2Config(vocab_size=50, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tied)
        assert s.params == sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())


def test_qwen25_shapes_give_the_published_sizes():
    assert QWEN25["Qwen2.5-0.5B"].params == 494_032_768
    assert QWEN25["Qwen2.5-7B"].params == 7_615_616_512
    assert QWEN25["Qwen2.5-14B"].params == 14_770_033_664


def test_sharding_divides_by_the_pool():
    p = 10**9
    fsdp = Workload(engine="fsdp")
    assert memory.trained_state(p, 1, fsdp) == 16 * p
    assert memory.trained_state(p, 4, fsdp) == pytest.approx(16 * p / 4)
    zero1 = Workload(engine="deepspeed", zero_stage=1, dtype_bytes=2)
    # ZeRO-1 shards only the optimizer state (and the fp32 masters): weights and gradients stay whole.
    assert memory.trained_state(p, 4, zero1) == pytest.approx(2 * p + 4 * p / 4 + 4 * p + 8 * p / 4)
    s = QWEN25["Qwen2.5-7B"]
    one, four = memory.actor_rank(s, 1, fsdp)["keep"], memory.actor_rank(s, 4, fsdp)["keep"]
    assert four["reference"] == pytest.approx(one["reference"] / 4)
    assert four["rollout weights"] == one["rollout weights"]  # the rollout copy is whole on every rank


def test_checkpointing_keeps_one_block_plus_block_inputs():
    s = QWEN25["Qwen2.5-0.5B"]
    on, off = Workload(gradient_checkpointing=True), Workload(gradient_checkpointing=False)
    full = memory.activations(s, 4, off, training=True)
    assert memory.activations(s, 4, on, training=True) < full / 5
    assert memory.activations(s, 4, off, training=False) == pytest.approx(full / s.layers)


def test_model_matches_the_checked_in_cpu_benchmark():
    """tests/data/bench_memory_76m.json: `python -m tools.bench_memory` on the 76M model (CPU,
    fp32, 1+1 and 2+2, freed memory returned to the system). The model predicts each pool's
    largest rank within 20%: it leaves out allocator slack and transient copies inside torch ops.
    Re-measure and replace the file when a change moves memory on purpose."""
    import json
    import os

    with open(os.path.join(os.path.dirname(__file__), "data", "bench_memory_76m.json")) as f:
        report = json.load(f)
    rows = memory.check_against_bench(report)
    assert len(rows) == 4
    for row in rows:
        assert abs(row["error"]) <= 0.20, row
