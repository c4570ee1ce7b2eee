"""The memory model's arithmetic (tools/plan/memory.py): parameter counts from shapes, what sharding
divides by the pool size and what it does not."""

from dataclasses import replace

import pytest

from tools.models import ModelShape
from tools.plan import memory
from tools.plan.memory import QWEN25, Workload


def test_shape_counts_parameters_like_transformers(tmp_path):
    """Also with a head_dim of the config's own (32, not 64 // 4: heads x head_dim wider than the
    hidden size, as Qwen3 and Gemma set it), and the shape read back from the config.json written."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for tied in (False, True):
        for head_dim in (None, 32):
            s = ModelShape("t", 64, 3, 4, 2, 96, 50, tied=tied, head_dim=head_dim or 0)
            config = Qwen2Config(vocab_size=50, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tied,
                                 **({"head_dim": head_dim} if head_dim else {}))
            model = Qwen2ForCausalLM(config)
            assert s.params == sum(p.numel() for p in model.parameters())
            assert s.kv_dim == model.model.layers[0].self_attn.k_proj.out_features
            config.save_pretrained(tmp_path)
            assert ModelShape.from_folder(str(tmp_path)) == s


def test_qwen25_shapes_give_the_published_sizes():
    assert QWEN25["Qwen2.5-0.5B"].params == 494_032_768
    assert QWEN25["Qwen2.5-7B"].params == 7_615_616_512
    assert QWEN25["Qwen2.5-14B"].params == 14_770_033_664


def test_sharding_divides_by_the_pool():
    p = 10**9
    fsdp = Workload(engine="fsdp")
    assert memory.trained_state(p, 1, fsdp) == 12 * p  # gradients only while updating: zero_grad frees them
    assert memory.trained_state(p, 4, fsdp) == pytest.approx(12 * p / 4)
    assert memory.update_gradients(p, 4, fsdp) == pytest.approx(4 * p / 4)
    zero1 = Workload(engine="deepspeed", zero_stage=1, dtype_bytes=2)
    # ZeRO-1 shards only the optimizer state (and the fp32 masters): weights and gradients stay whole.
    assert memory.trained_state(p, 4, zero1) == pytest.approx(2 * p + 4 * p / 4 + 8 * p / 4)
    assert memory.update_gradients(p, 4, zero1) == 4 * p
    s = QWEN25["Qwen2.5-7B"]
    one, four = memory.actor_rank(s, 1, fsdp)["keep"], memory.actor_rank(s, 4, fsdp)["keep"]
    assert four["reference"] == pytest.approx(one["reference"] / 4)
    assert four["rollout weights"] == one["rollout weights"]  # the rollout copy is whole on every rank


def test_checkpointing_keeps_one_block_plus_block_inputs():
    s = QWEN25["Qwen2.5-0.5B"]
    on, off = Workload(gradient_checkpointing=True), Workload(gradient_checkpointing=False)
    full = memory.activations(s, 4, off, training=True)
    assert memory.activations(s, 4, on, training=True) < full / 5
    assert memory.activations(s, 4, off, training=False) < full / s.layers  # inference keeps no block whole


def test_the_update_peaks_at_the_head_or_at_a_block_never_both():
    """Measured by tools.plan.memory_plan with the logits whole (actor.logits_chunk_size=0; Qwen2.5-7B,
    the 7B preset's 16384-token budget, 4 ranks): the
    actor's update peaked at a block's backward (44.9 GB with the reference's shards), the 0.5B
    preset's at the head's (its 152k logits are large beside 0.5B's blocks) with three more
    logits-sized temporaries in the head's backward. The model's sum of every part (block inputs,
    one block's saved tensors, logits and their gradient, the whole gradient shard) was 14 % over
    at 7B; without the backward's temporaries it was 12 % under at 0.5B (and 31 % for a critic
    whose own budget, 32768 tokens, it read as the actor's)."""
    s, w = QWEN25["Qwen2.5-7B"], Workload(ppo_max_token_len=16384, log_prob_max_token_len=16384,
                                          forward_max_token_len=16384, logits_chunk=0)
    rank = memory.actor_rank(s, 4, w)
    update = sum(rank["keep"].values()) - rank["keep"]["rollout weights"] - rank["keep"]["NCCL communicators"] \
        + rank["phases"]["update"]
    assert update / memory.GB == pytest.approx(44.9, rel=0.10)
    rows = memory.micro_rows(0, 16384, w)
    assert memory.logits(s, rows, w, True) > 4 * 2 * rows * (w.response_len + 1) * s.vocab  # logits + 3 in backward
    both = memory.gathered_units(s, s.params, 4, w) + memory.activations(s, rows, w, True) + memory.logits(s, rows, w, True)
    assert rank["phases"]["update"] < both + memory.update_gradients(s.params, 4, w)
    wide = replace(w, critic_ppo_max_token_len=32768)
    assert memory.critic_rank(s, 4, wide)["phases"]["update"] > memory.critic_rank(s, 4, w)["phases"]["update"]


# tools.plan.memory_plan's tracked peaks (GB, what the rank's other models keep and the HF copy
# included), the 0.5B preset on Qwen2.5-0.5B (actor pool of 4), by actor.logits_chunk_size.
PLANNED_05B = {512: {"actor log-probs": 4.45, "ref log-probs": 4.25, "update actor": 5.87},
               0: {"actor log-probs": 6.84, "ref log-probs": 6.58, "update actor": 10.61}}


@pytest.mark.parametrize("chunk", sorted(PLANNED_05B))
def test_the_lm_head_in_chunks_holds_one_chunks_logits(chunk):
    """actor.logits_chunk_size (roles/lm_head.py) runs the head and the log-softmax a chunk of
    tokens at a time, recomputed in the backward: the update's head no longer holds the whole
    logits and three logits-sized temporaries (0.5B preset: 4.96 GB), nor the log-prob pass the
    whole logits. The model follows the option within 10 % of tools.plan.memory_plan's tracked step in
    every phase; the whole-logits term it had before was 95 % over on the update at 512."""
    from spmdsplit.config import load_config
    from tools.plan.memory_plan import predicted, workload_of

    cfg = load_config("configs/gpu_qwen2.5_0.5b.yaml", ["model.path=Qwen2.5-0.5B", f"actor.logits_chunk_size={chunk}"])
    w = workload_of(cfg, 80.0)
    assert w.logits_chunk == chunk
    model = predicted(QWEN25["Qwen2.5-0.5B"], 4, {"actor", "rollout"}, w)["phases"]
    planned = PLANNED_05B[chunk]
    for phase, ours in (("actor log-probs", "actor log-probs"), ("ref log-probs", "actor log-probs"),
                        ("update actor", "actor update")):
        assert model[ours] / memory.GB == pytest.approx(planned[phase], rel=0.10), phase
    # The head's backward grows 20 B per logit of a chunk (tracked at 256 to 2048 tokens, bf16 and fp32).
    s, rows = QWEN25["Qwen2.5-0.5B"], 100
    wider = memory.logits(s, rows, replace(w, logits_chunk=1024), True) - memory.logits(s, rows, replace(w, logits_chunk=512), True)
    assert wider == 20 * 512 * s.vocab


def test_inference_holds_the_mlp_peak_or_the_logits_never_both():
    """Measured by tools.plan.memory_plan (FSDPMemTracker over our own log-prob and values passes, bf16,
    token budgets of the GPU presets): a token's activations peak at the MLP's three
    intermediate-sized tensors and four hidden-sized ones (7B, 16384 tokens: 2.34 GB tracked), and
    the head's logits come after the last block, so the log-prob pass holds the larger of the two.
    The model's sum of both, and every saved tensor of a block at once, was 11% over at 7B and 31%
    over at 0.5B."""
    s = QWEN25["Qwen2.5-7B"]
    w = Workload(log_prob_max_token_len=16384, ppo_max_token_len=16384, forward_max_token_len=16384)
    rows = memory.micro_rows(0, 16384, w)
    assert memory.activations(s, rows, w, False) == pytest.approx(16384 * 2 * (3 * s.mlp + 4 * s.hidden))
    assert memory.activations(s, rows, w, False) / memory.GB == pytest.approx(2.33, abs=0.01)
    rank = memory.actor_rank(s, 4, w)
    head = memory.logits(s, rows, w, False)
    assert rank["phases"]["log-probs"] == pytest.approx(
        memory.gathered_units(s, s.params, 4, w) + max(head, memory.activations(s, rows, w, False)))


def test_model_matches_the_checked_in_cpu_benchmark():
    """tests/data/bench_memory_76m.json: `python -m tools.bench.memory --layouts 1+1 2+2 2+2/4
    2+2/4-nosync` on the 76M model (CPU, fp32, freed memory returned to the system). The model
    predicts each pool's largest rank within 20%, whatever the micro-batching: it leaves out
    allocator slack and transient copies inside torch ops. Re-measure and replace the file when
    a change moves memory on purpose."""
    import json
    import os

    with open(os.path.join(os.path.dirname(__file__), "data", "bench_memory_76m.json")) as f:
        report = json.load(f)
    rows = memory.check_against_bench(report)
    assert {row["layout"] for row in rows} == {"1+1", "2+2", "2+2/4", "2+2/4-nosync"}
    assert len(rows) == 8
    for row in rows:
        assert abs(row["error"]) <= 0.20, row


def test_no_sync_accumulation_costs_a_whole_fp32_gradient_when_a_mini_batch_has_several_micro_batches():
    s, p = QWEN25["Qwen2.5-7B"], QWEN25["Qwen2.5-7B"].params
    reduce_each = Workload(mini=64, micro=8)  # 16 rows per rank of a pool of 4: 2 micro-batches
    no_sync = Workload(mini=64, micro=8, no_sync_accumulation=True)
    assert memory.micro_batches(4, reduce_each) == 2
    assert memory.update_gradients(p, 4, no_sync) == 4 * p  # whatever the pool size
    update = memory.actor_rank(s, 4, no_sync)["phases"]["update"]
    assert update >= 4 * p  # the whole gradient, beside what the backward holds at its bottom block
    # It replaces the shards, and at the bottom block the inputs it overlaps with are gone.
    grown = update - memory.actor_rank(s, 4, reduce_each)["phases"]["update"]
    assert 0.8 * (4 * p - 4 * p / 4) < grown <= 4 * p - 4 * p / 4
    one_micro = Workload(mini=32, micro=8, no_sync_accumulation=True)  # 8 rows per rank: nothing to accumulate
    assert memory.update_gradients(p, 4, one_micro) == pytest.approx(4 * p / 4)


def test_vllm_adds_its_share_of_the_device_to_the_resident_state_only():
    """vLLM asleep (level 2) holds nothing; awake it holds utilization x device on top of what the
    trainer keeps, and the actor rank's peak is the larger of that and the training peak."""
    s = QWEN25["Qwen2.5-7B"]
    hf, vllm = Workload(), Workload(rollout="vllm", gpu_memory_utilization=0.5, device_gb=80)
    rank = memory.actor_rank(s, 4, vllm)
    assert rank["keep"]["rollout weights"] == 0.0
    assert rank["phases"]["vLLM awake"] == pytest.approx(40 * memory.GB)
    resident = sum(rank["keep"].values())
    assert rank["keep"]["NCCL communicators"] == 500 * memory.MB  # the pool's group (no other pool here)
    # fp32 shards + Adam, bf16 reference shards
    assert resident - rank["keep"]["NCCL communicators"] == pytest.approx((12 / 4 + 2 / 4) * s.params)
    training = {k: v for k, v in rank["phases"].items() if k != "vLLM awake"}
    assert rank["total"] == pytest.approx(resident + max(40 * memory.GB, *training.values()))
    hf_keep = memory.actor_rank(s, 4, hf)["keep"]
    assert hf_keep["rollout weights"] == 2 * s.params  # the HF copy: whole, in the rollout dtype


def test_bench_layouts_cut_each_ranks_mini_batch_into_micro_batches():
    """tools.bench.memory's a+c/k layouts: k micro-batches per mini-batch on every rank of both pools."""
    from tools.bench.memory import WORKLOAD, layout_overrides

    world, extra = layout_overrides("2+2/4-nosync", WORKLOAD)  # 8 rows per mini-batch, 4 per rank
    assert world == 4
    assert {"actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1",
            "actor.no_sync_accumulation=true", "critic.no_sync_accumulation=true"} <= set(extra)
    assert layout_overrides("2+2", WORKLOAD) == (4, ["placement.mode=split", "placement.pools=[]"])
    with pytest.raises(ValueError):
        layout_overrides("2+2/3", WORKLOAD)


def test_a_token_budget_of_the_padded_micro_batch_gives_the_padded_numbers():
    """With use_dynamic_bsz + use_remove_padding a micro-batch is sized by its token budget: a
    budget of micro rows x (prompt + response) holds what those padded rows hold."""
    s, row = QWEN25["Qwen2.5-7B"], 512 + 512
    padded = Workload(micro=8, log_prob_micro=32)
    same = replace(padded, ppo_max_token_len=8 * row, log_prob_max_token_len=32 * row, forward_max_token_len=32 * row)
    for pool in (1, 4):
        for rank in (memory.actor_rank, memory.critic_rank):
            assert rank(s, pool, same)["phases"] == pytest.approx(rank(s, pool, padded)["phases"])
    assert memory.micro_batches(4, same) == memory.micro_batches(4, padded) == 2


def test_a_smaller_token_budget_needs_less_and_a_larger_one_more():
    s = QWEN25["Qwen2.5-7B"]
    padded = Workload(micro=8, log_prob_micro=32)  # 8 x 1024 = 8192 tokens per update micro-batch
    half = replace(padded, ppo_max_token_len=4096, log_prob_max_token_len=4096, forward_max_token_len=4096)
    double = replace(padded, ppo_max_token_len=16384)
    for rank in (memory.actor_rank, memory.critic_rank):
        small, big, base = rank(s, 4, half)["phases"], rank(s, 4, double)["phases"], rank(s, 4, padded)["phases"]
        assert small["update"] < base["update"] < big["update"]
    assert memory.actor_rank(s, 4, half)["phases"]["log-probs"] < memory.actor_rank(s, 4, padded)["phases"]["log-probs"]
    assert memory.critic_rank(s, 4, half)["phases"]["values"] < memory.critic_rank(s, 4, padded)["phases"]["values"]
    # tokens, not rows: activations scale with the budget alone
    assert memory.activations(s, memory.micro_rows(8, 4096, padded), padded, True) == pytest.approx(
        memory.activations(s, 4, padded, True))
    assert memory.micro_batches(4, half) == 4 and memory.micro_batches(4, double) == 1


def test_the_fit_table_says_which_micro_batching_it_assumes(capsys):
    assert memory.main([]) == 0
    assert "fixed micro-batches of 8 rows" in capsys.readouterr().out
    assert memory.main(["--max-token-len", "16384"]) == 0
    out = capsys.readouterr().out
    assert "token budgets (use_dynamic_bsz + use_remove_padding, no padding): update 16384 tokens" in out
    assert "| Qwen2.5-7B | 7.62B | 4+4 | 60.3 (update) |" in out
    with pytest.raises(SystemExit):  # a budget must take the longest row whole
        memory.main(["--max-token-len", "1000"])


def test_nccl_buffers_count_the_communicators_a_rank_has_used():
    """Each rank: its pool's group, a two-rank communicator per rank of another pool it trades rows
    with, and the weight groups; none on CPU (gloo's buffers are host memory)."""
    s, w = QWEN25["Qwen2.5-7B"], Workload()
    ranks = memory.layout_ranks(s, 8, (6, 2), w)
    assert ranks["actor"]["keep"]["NCCL communicators"] == 2 * w.nccl_mb * memory.MB  # pool + 1 critic rank
    assert ranks["critic"]["keep"]["NCCL communicators"] == 4 * w.nccl_mb * memory.MB  # pool + 3 actor ranks
    assert memory.layout_ranks(s, 8, None, w)["all"]["keep"]["NCCL communicators"] == w.nccl_mb * memory.MB
    assert memory.actor_rank(s, 4, replace(w, cpu=True))["keep"]["NCCL communicators"] == 0


def test_a_rollout_pool_apart_never_sleeps_and_takes_a_weight_group_per_actor_rank():
    """rollout 2 | actor+critic 6 with vLLM: the rollout rank holds vLLM's whole share all the time,
    10 communicators (its pool, 6 weight groups, 3 train ranks it sends rows to) and, while it takes
    weights, the largest bucket (the embeddings), `in_flight` more and one tensor put together;
    the train ranks hold no engine and stream their buckets."""
    s, w = QWEN25["Qwen2.5-7B"], Workload(rollout="vllm", gpu_memory_utilization=0.8, device_gb=80)
    ranks = memory.layout_ranks(s, 8, ("rollout", 2, 6), w)
    rollout, train = ranks["rollout"], ranks["all"]
    assert rollout["keep"]["vLLM (never sleeps)"] == pytest.approx(0.8 * 80 * memory.GB)
    assert rollout["keep"]["NCCL communicators"] == 10 * w.nccl_mb * memory.MB
    embeddings = 2 * s.embed_params
    assert rollout["phases"]["weight sync"] == pytest.approx(2 * embeddings + 4 * 256 * memory.MB)
    assert train["keep"]["rollout weights"] == 0 and not any("vLLM" in k for k in train["phases"])
    assert train["phases"]["actor weight sync"] == pytest.approx(embeddings + 3 * 256 * memory.MB)
    # The presets' 0.8 fits at 7B with the 4 GB reserve; their old 0.9 did not, nor would 0.85.
    assert rollout["total"] < 76 * memory.GB
    for too_much in (0.85, 0.9):
        w = replace(w, gpu_memory_utilization=too_much)
        assert memory.layout_ranks(s, 8, ("rollout", 2, 6), w)["rollout"]["total"] > 76 * memory.GB
