"""DAPO's dynamic sampling (algorithm.filter_groups, spmdsplit/dynamic_sampling.py): which groups
are kept and where they go, on real gloo ranks under NCCL's rules, with the real rule reward; the
config's refusals. The jobs in every layout, and exact resume: tests/test_dynamic_sampling_e2e.py."""

import pytest
import torch
from omegaconf import OmegaConf

from spmdsplit.batch import Batch
from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.preflight import check_config
from spmdsplit.dynamic_sampling import DynamicSampling, NoSpreadError, groups_with_spread
from tests.support.launch import run_ranks

N = 2  # responses per prompt
GROUPS_PER_RANK = 3  # prompt groups each rank generates per generation batch
TRUTH = "5555"


def test_a_group_is_kept_when_its_responses_differ_and_a_group_of_one_always():
    uids, keep = groups_with_spread([1.0, 1.0, 0.0, 1.0, 0.5, 0.1, 0.1, 0.1], ["a", "a", "b", "b", "c", "d", "d", "d"])
    assert uids == ["a", "b", "c", "d"]
    # "d": three equal scores of 0.1 are dropped (verl's np.std > 0 keeps them: its sum rounds)
    assert keep == [False, True, True, False]


def spread(gen_batch: int, rank: int, group: int) -> bool:
    """The test's plan: which generated groups score apart (about one in three)."""
    return (gen_batch * 7 + rank * 3 + group) % 3 == 0


def rows_of(tokenizer, gen_batch: int, rank: int, world: int) -> Batch:
    """Rank `rank`'s rows of a generation batch, as an engine returns them (left-padded prompt,
    responses as wide as their longest: the width differs by batch): a kept group's two responses
    score 1.0 and 0.25, a dropped group's both 1.0."""
    width = 4 + gen_batch % 3
    responses, uids, rows = [], [], []
    for group in range(GROUPS_PER_RANK):
        first = (gen_batch - 1) * GROUPS_PER_RANK * world + rank * GROUPS_PER_RANK + group
        for i in range(N):
            text = "5000" if spread(gen_batch, rank, group) and i == 1 else TRUTH
            responses.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            uids.append(f"{gen_batch}-{first}")
            rows.append(len(rows))
    ids = torch.zeros(len(responses), width, dtype=torch.long)
    for r, t in enumerate(responses):
        ids[r, : len(t)] = torch.tensor(t)
    mask = (torch.arange(width) < torch.tensor([len(t) for t in responses]).unsqueeze(1)).long()
    prompt = torch.ones(len(responses), 3, dtype=torch.long)
    first_row = rank * GROUPS_PER_RANK * N
    attention_mask = torch.cat([torch.ones_like(prompt), mask], 1)
    return Batch({"responses": ids, "response_mask": mask, "input_ids": torch.cat([prompt, ids], 1),
                  "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
                  "row_index": torch.arange(first_row, first_row + len(responses))},
                 {"data_source": ["synthetic/repeat"] * len(responses), "ground_truth": [TRUTH] * len(responses),
                  "extra_info": [{}] * len(responses), "uid": uids})


def expected_step(train_groups: int, world: int, first_batch: int) -> tuple[list[str], int]:
    """verl's order: generation batch by batch, in a batch rank by rank; the first train_groups
    kept groups, and the next generation batch after them."""
    kept, batch = [], first_batch
    while len(kept) < train_groups:
        for rank in range(world):
            for group in range(GROUPS_PER_RANK):
                if spread(batch, rank, group):
                    kept.append(f"{batch}-{(batch - 1) * GROUPS_PER_RANK * world + rank * GROUPS_PER_RANK + group}")
        batch += 1
    return kept[:train_groups], batch


def sampler_of(tokenizer, world, train_groups, max_num_gen_batches, metric="seq_reward") -> DynamicSampling:
    import torch.distributed as dist

    from spmdsplit.roles.reward import RuleReward

    cfg = OmegaConf.create({"algorithm": {"filter_groups": {"metric": metric,
                                                            "max_num_gen_batches": max_num_gen_batches}},
                            "data": {"train_batch_size": train_groups, "gen_batch_size": GROUPS_PER_RANK * world},
                            "rollout": {"n": N}})
    group = dist.new_group(list(range(world)))
    return DynamicSampling(cfg, RuleReward(tokenizer), list(range(world)), group, torch.device("cpu"))


def filled(sampler, step, tokenizer, rank, world):
    """Step `step`'s rows, the stages as the row source runs them (spmdsplit/generation/sources.py)."""
    sampler.begin(step)
    while sampler.wants_more(step):
        sampler.add(rows_of(tokenizer, sampler.next_gen_batch, rank, world))
    return sampler.take(step)


def fill_steps(rank, world, model_path, train_groups, max_num_gen_batches, steps, metric="seq_reward"):
    from spmdsplit.models import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    sampler = sampler_of(tokenizer, world, train_groups, max_num_gen_batches, metric)
    out = []
    for step in range(1, steps + 1):
        try:
            rows = filled(sampler, step, tokenizer, rank, world)
        except (NoSpreadError, ValueError) as e:
            out.append(("error", str(e)))
            break
        out.append((rows["uid"], rows["row_index"].tolist(), rows["responses"].shape[1], sampler.next_gen_batch,
                    sampler.pop_metrics(step)))
    return out


def test_the_kept_groups_fill_each_step_in_verls_order_and_every_rank_gets_its_even_share(embedded_model_dir):
    world, train_groups, steps = 3, 6, 3
    per_rank = train_groups // world
    results = run_ranks(fill_steps, world, embedded_model_dir, train_groups, 0, steps)
    first_batch = 1
    for step in range(steps):
        kept, next_batch = expected_step(train_groups, world, first_batch)
        for rank, out in enumerate(results):
            uids, row_index, width, position, metrics = out[step]
            # whole groups, the rank's contiguous share of verl's order, numbered as the step's batch
            assert uids == [u for u in kept[rank * per_rank:(rank + 1) * per_rank] for _ in range(N)]
            assert row_index == list(range(rank * per_rank * N, (rank + 1) * per_rank * N))
            assert position == next_batch  # the data position: every prompt generated counts
            assert metrics["train/num_gen_batches"] == next_batch - first_batch
            generated = (next_batch - first_batch) * GROUPS_PER_RANK * world
            kept_all = sum(spread(b, r, g) for b in range(first_batch, next_batch) for r in range(world)
                           for g in range(GROUPS_PER_RANK))
            assert metrics["train/filter_groups/kept_ratio"] == kept_all / generated
            assert width >= 4  # rows of batches of other widths, padded to one
        assert next_batch - first_batch > 1  # the plan keeps a third: a step takes several batches
        first_batch = next_batch


def test_a_step_that_needs_more_than_max_num_gen_batches_stops_every_rank_with_the_reason(embedded_model_dir):
    results = run_ranks(fill_steps, 2, embedded_model_dir, 6, 2, 1)  # 2 batches keep about 4 of the 6 groups
    for out in results:
        kind, message = out[0]
        assert kind == "error"
        assert "max_num_gen_batches=2" in message and "of the 6 prompt groups" in message


def test_a_metric_the_reward_function_does_not_return_is_named_with_what_it_does_return(embedded_model_dir):
    kind, message = run_ranks(fill_steps, 1, embedded_model_dir, 3, 0, 1, "acc")[0][0]
    assert kind == "error"
    assert "algorithm.filter_groups.metric=acc" in message and "a plain score" in message


def decoding_one_step(rank, world, model_path, train_groups):
    """One step of dynamic sampling, then the training score of its rows as the critic group
    computes it (on the columns it receives, scoring.score_rollout): {what: (responses the
    tokenizer decoded, decode calls)} for the filter and for the training score, the responses
    generated, and the training scores next to those of the rows decoded afresh."""
    from spmdsplit.messages import row_columns
    from spmdsplit.models import load_tokenizer
    from spmdsplit.roles.reward import RESPONSE_TEXT, RuleReward
    from spmdsplit.scoring import score_rollout

    tokenizer = load_tokenizer(model_path)
    sampler = sampler_of(tokenizer, world, train_groups, 0)
    # transformers 5: decode and batch_decode each end in one `_decode` per response decoded.
    cls, counts = type(tokenizer), {}
    _decode, decode = cls._decode, cls.decode

    def counting(name, real):
        def counted(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(self, *args, **kwargs)
        return counted

    cls._decode, cls.decode = counting("responses", _decode), counting("calls", decode)
    try:
        rows = filled(sampler, 1, tokenizer, rank, world)
        filtered, counts = counts, {}
        scores = score_rollout(RuleReward(tokenizer), row_columns(rows))["token_level_scores"]
        trained = counts
    finally:
        cls._decode, cls.decode = _decode, decode
    undecoded = Batch(rows.tensors, {k: v for k, v in rows.non_tensors.items() if k != RESPONSE_TEXT})
    fresh, _ = RuleReward(tokenizer).compute(undecoded)
    generation_batches = int(sampler.pop_metrics(1)["train/num_gen_batches"])
    return filtered, trained, generation_batches, len(rows), scores, fresh


def test_each_response_is_decoded_once_in_one_call_per_generation_batch(embedded_model_dir):
    """Issue 36: the filter decoded every generated response a row at a time, and the critic
    group decoded the kept ones again to score them for training; now each response is decoded
    once, one call per generation batch (its rows share one skip_special_tokens), and the kept
    rows carry their texts to the training score, which is the same."""
    for filtered, trained, batches, kept, scores, fresh in run_ranks(decoding_one_step, 2, embedded_model_dir, 6):
        assert kept == 6 // 2 * N and batches > 1
        assert filtered == {"responses": batches * GROUPS_PER_RANK * N, "calls": batches}
        assert trained == {}  # nothing decoded again
        assert torch.equal(scores, fresh) and scores.sum() > 0


def regroup_with_a_plan_of_its_own(rank, world):
    import torch.distributed as dist

    from spmdsplit.exchange import Message, ProtocolError, regroup_rows

    rows = Batch({"x": torch.arange(4)})
    try:  # each rank with its own plan
        regroup_rows(Message("FILTER_GROUPS", 1), rows, [0, 1, 0, 1], [0, 1], dist.group.WORLD, "cpu", fingerprint=rank)
    except ProtocolError as e:
        return str(e)
    return None


def test_a_plan_the_ranks_disagree_on_is_a_protocol_error_not_a_silent_mix():
    for message in run_ranks(regroup_with_a_plan_of_its_own, 2):
        assert message and "in another order" in message


# --------------------------------------------------------------------------- config


def dapo(*overrides):
    return load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=4", "placement.mode=colocate",
                              "algorithm.filter_groups.enable=true", *overrides])


@pytest.mark.parametrize("overrides, says", [
    (["rollout.n=1", "algorithm.adv_estimator=gae"], "set rollout.n >= 2"),
    (["reward.model.path=/some/rm"], "reward.model.path scores on the critic group"),
    (["rollout.stream_chunks=2"], "nothing to stream"),
    (["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"], "use seq_reward"),
])
def test_what_dynamic_sampling_cannot_do_is_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        check_config(dapo(*overrides))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_generation_batch_size_needs_dynamic_sampling():
    with pytest.raises(ConfigError, match="data.gen_batch_size=256 differs from data.train_batch_size=128"):
        check_config(load_config(None, ["data.gen_batch_size=256"]))
    check_config(dapo("data.gen_batch_size=256"))
