"""tools/plan/efficiency.py: the FLOPs it counts per phase, against a hand count and against what
torch's own FLOP counter sees the real passes run on a tiny Qwen2; what it reads from a trace.
The profile it reads, from every rank of a split job (trainer.profile_steps); the whole report
from a real job's profile: tests/test_bench.py (the gpu_check test)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdsplit.batch import Batch
from spmdsplit.engines.common import apply_ac
from spmdsplit.roles.forward import forward_response
from tests.support.launch import job
from tools.models import ModelShape
from tools.plan.efficiency import Tokens, phase_activity, phase_flops, phase_tokens, read_trace

# hidden 8, one layer, 2 query heads and 1 key/value head of width 4, MLP 16, vocabulary 10
SHAPE = ModelShape("tiny", hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, mlp=16, vocab=10)


def test_flops_of_a_tiny_model_by_hand():
    # One layer's matmul weights: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate, up, down 3 x 8x16 = 576.
    assert SHAPE.body_weights() == 64 + 32 + 32 + 64 + 384 == 576
    one_row = Tokens(rows=1, prompt=3, response=2)  # a 5-token row, 2 of them the response
    # Attention: 5 * 6 / 2 = 15 causal pairs x 2 heads x (QK^T 2*4 + AV 2*4) = 480.
    forward = {"matmul": 2 * 576 * 5, "attention": 15 * 2 * 16, "head": 2 * 8 * 10 * 2}  # head on the 2 responses
    assert phase_flops("old_log_prob", SHAPE, one_row, checkpointing=True) == forward
    assert phase_flops("ref", SHAPE, one_row, checkpointing=False) == forward
    # The critic: a value head (8 x 1) at all 5 tokens.
    assert phase_flops("values", SHAPE, one_row, True) == {**forward, "head": 2 * 8 * 1 * 5}
    # gen: 4 tokens through the body (the last response token is not fed back), the head twice.
    assert phase_flops("gen", SHAPE, one_row, True) == {**forward, "matmul": 2 * 576 * 4}
    # update, checkpointed: 3 forwards (forward + backward) + the layer again less MLP down (2*16*8*5 = 1280).
    assert phase_flops("update_actor", SHAPE, one_row, True) == {
        "matmul": 3 * 5760 + 5760 - 1280, "attention": 4 * 480, "head": 3 * 320}
    assert phase_flops("update_actor", SHAPE, one_row, False, actor_epochs=2) == {
        "matmul": 2 * 3 * 5760, "attention": 2 * 3 * 480, "head": 2 * 3 * 320}
    assert phase_flops("adv", SHAPE, one_row, True) is None
    assert phase_tokens("gen", one_row) == 2 and phase_tokens("update_critic", one_row, critic_epochs=3) == 15


@pytest.fixture(scope="module")
def tiny_qwen2():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=16, max_position_embeddings=32,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    assert ModelShape.from_config(config) == SHAPE
    return Qwen2ForCausalLM(config)


def rollout_rows() -> Batch:
    """Two rows, prompts of 2 and 3 tokens (left-padded to 3), responses of 2 and 3 (right-padded)."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    ids = torch.randint(3, 10, mask.shape) * mask
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                  "responses": ids[:, 3:], "response_mask": mask[:, 3:]})


def counted(fn) -> tuple[int, set]:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops(), {str(op) for op in counter.get_flop_counts()["Global"]}


def without_attention(flops: dict) -> int:
    return flops["matmul"] + flops["head"]


def test_flops_match_torch_flop_counter_on_the_real_passes(tiny_qwen2):
    """torch.utils.flop_counter counts every matmul the passes dispatch; on CPU it has no formula
    for sdpa's kernel (checked: only mm and addmm seen), so attention is compared by hand above
    and the rest here, exactly."""
    model, batch = tiny_qwen2, rollout_rows()
    t = Tokens(rows=2, prompt=5, response=5)
    # The actor's log-prob pass as roles/actor.py runs it: packed, the LM head on response tokens only.
    flops, ops = counted(lambda: forward_response(model, batch, lambda logits, tokens: logits.sum(-1),
                                                  remove_padding=True, response_only=True))
    assert ops == {"aten.mm", "aten.addmm"}
    assert flops == without_attention(phase_flops("old_log_prob", SHAPE, t, checkpointing=True)) == 2 * 576 * 10 + 2 * 80 * 5
    # The update: forward and backward, blocks checkpointed as the engines do (engines/common.py).
    apply_ac(model)
    model.train()
    flops, _ = counted(lambda: forward_response(model, batch, lambda logits, tokens: logits.sum(-1),
                                                remove_padding=True, response_only=True).sum().backward())
    assert flops == without_attention(phase_flops("update_actor", SHAPE, t, checkpointing=True))
    # The LM head in chunks (actor.logits_chunk_size, roles/lm_head.py): recomputed in the backward
    # where the head needs the logits back (a log-softmax does; a sum would not, and checkpoint's
    # early stop would skip the recompute).
    def log_probs(logits, tokens):
        return logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)

    flops, _ = counted(lambda: forward_response(model, batch, log_probs, remove_padding=True, response_only=True,
                                                chunk=2).sum().backward())
    assert flops == without_attention(phase_flops("update_actor", SHAPE, t, checkpointing=True, head_in_chunks=True))
    model.gradient_checkpointing_disable()
    flops, _ = counted(lambda: forward_response(model, batch, lambda logits, tokens: logits.sum(-1),
                                                remove_padding=True, response_only=True).sum().backward())
    assert flops == without_attention(phase_flops("update_actor", SHAPE, t, checkpointing=False))
    model.eval()
    # gen: transformers' generate with its KV cache, two rows of 3 prompt tokens, 4 tokens each.
    prompts = torch.randint(3, 10, (2, 3))
    flops, _ = counted(lambda: model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                              max_new_tokens=4, min_new_tokens=4, pad_token_id=0, eos_token_id=None))
    assert flops == without_attention(phase_flops("gen", SHAPE, Tokens(rows=2, prompt=6, response=8), True))


def op(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_phase_activity_reads_busy_time_and_kernels_from_a_trace():
    phase = {"ph": "X", "cat": "user_annotation", "name": "phase:ref", "pid": 1, "tid": 1, "ts": 100.0, "dur": 100.0}
    cpu = [phase, op("aten::linear", 110, 40), op("aten::addmm", 115, 30), op("aten::mul", 170, 10),
           op("aten::mul", 175, 10, tid=2), op("aten::add", 300, 5)]  # a second thread overlaps; one op after
    seen = phase_activity(cpu, gpu=False)["ref"]
    assert seen["wall_s"] == pytest.approx(100e-6) and seen["busy_s"] == pytest.approx((40 + 15) * 1e-6)
    assert seen["kernels"] == {"aten::linear": [pytest.approx(10e-6), 1], "aten::addmm": [pytest.approx(30e-6), 1],
                               "aten::mul": [pytest.approx(20e-6), 2]}  # self times: linear less its addmm
    gpu = [phase, op("cudaLaunchKernel", 105, 5, cat="cuda_runtime"), op("gemm", 90, 30, cat="kernel", tid=7),
           op("gemm", 150, 20, cat="kernel", tid=7), op("nccl", 160, 60, cat="kernel", tid=9)]
    seen = phase_activity(gpu, gpu=True)["ref"]
    # Kernels clipped to the range and unioned over streams: 100-120 and 150-200.
    assert seen["busy_s"] == pytest.approx(70e-6)
    assert seen["kernels"] == {"gemm": [pytest.approx(20e-6), 1], "nccl": [pytest.approx(40e-6), 1]}
    assert phase_activity([phase, op("aten::mm", 110, 5)], gpu=True) == {}  # no CUPTI records: nothing to say


def test_every_rank_profiles_its_own_phases_over_the_chosen_steps(tmp_path):
    """trainer.profile_steps=[2,3] on split 1+1: each rank writes its trace when step 3 ends, its
    own pool's phases in it as ranges, once per profiled step, and no step outside them."""
    result = job(2, "placement.mode=split", "trainer.total_steps=4", "trainer.profile_steps=[2,3]",
                 f"trainer.profile_dir={tmp_path}", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
                 "critic.ppo_mini_batch_size=8", f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    own = {0: {"gen", "old_log_prob", "ref", "update_actor"}, 1: {"values", "reward", "adv", "update_critic"}}
    for rank in (0, 1):
        events = read_trace(str(tmp_path / f"rank{rank}.json.gz"))
        ranges = [e["name"].removeprefix("phase:") for e in events
                  if e.get("cat") == "user_annotation" and e["name"].startswith("phase:")]
        assert own[rank] <= set(ranges) and not own[1 - rank] & set(ranges), (rank, sorted(set(ranges)))
        assert all(ranges.count(name) == 2 for name in own[rank]), (rank, ranges)  # steps 2 and 3, not 1 or 4
        seen = phase_activity(events, gpu=False)
        assert all(seen[name]["busy_s"] > 0 and seen[name]["kernels"] for name in own[rank])
