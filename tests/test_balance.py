"""Issue 20 items 3 and 4: rollouts cut to their longest response (rows of different widths meet
in Batch.concat), and rows balanced over a pool's ranks (spmdsplit/balanced_order.py, the BALANCE
message of spmdsplit/messages.py, trainer.balance_batch in a real job)."""

import random

import pytest
import torch

from spmdsplit.balanced_order import balanced_group_order, karmarkar_karp, seqlen_metrics, slice_sums
from spmdsplit.batch import Batch
from spmdsplit.exchange import Message, ProtocolError, reorder_rows, row_ranges
from tests.support.launch import run_ranks


def long_tailed_lengths(n: int, seed: int) -> list[int]:
    """Prompt (20-60 tokens) + a response that ends at each token with probability 2% (EOS),
    capped at 256: the spread of a model's sampled answers."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(n):
        response = 1
        while response < 256 and rng.random() > 0.02:
            response += 1
        lengths.append(rng.randint(20, 60) + response)
    return lengths


# --------------------------------------------------------------------------- Karmarkar–Karp


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
def test_every_item_once_in_parts_of_equal_count(parts):
    weights = long_tailed_lengths(64, seed=parts)
    cut = karmarkar_karp(weights, parts)
    assert len(cut) == parts
    assert sorted(i for part in cut for i in part) == list(range(64))
    assert {len(part) for part in cut} == {64 // parts}


def test_long_tailed_lengths_are_balanced_where_contiguous_slices_are_not():
    worst_balanced, worst_contiguous = 0.0, 0.0
    for seed in range(50):
        weights = long_tailed_lengths(64, seed)
        for parts in (2, 4, 8):
            sums = [sum(weights[i] for i in part) for part in karmarkar_karp(weights, parts)]
            worst_balanced = max(worst_balanced, max(sums) / min(sums))
            contiguous = slice_sums(weights, parts)
            worst_contiguous = max(worst_contiguous, max(contiguous) / min(contiguous))
    assert worst_balanced <= 1.1, worst_balanced
    assert worst_contiguous > 1.5, worst_contiguous  # what balancing is there for


def test_a_hard_case_for_plain_differencing_is_evened_out():
    """Seed 20 of long_tailed_lengths cut 8 ways: largest differencing alone leaves 1.16x between
    the heaviest and the lightest part; the swaps that follow bring it within 1.1."""
    weights = long_tailed_lengths(64, seed=20)
    sums = [sum(weights[i] for i in part) for part in karmarkar_karp(weights, 8)]
    assert max(sums) / min(sums) <= 1.1


def test_balanced_order_is_a_permutation_whose_slices_are_even_for_both_pool_sizes():
    weights = long_tailed_lengths(48, seed=3)
    order = balanced_group_order(weights, 6)  # lcm of pools of 2 and 3 ranks
    assert sorted(order) == list(range(48))
    for ranks in (2, 3):
        sums = slice_sums([weights[g] for g in order], ranks)
        assert max(sums) / min(sums) <= 1.05, (ranks, sums)


def test_unequal_counts_are_refused():
    with pytest.raises(ValueError, match="equal count"):
        karmarkar_karp([1, 2, 3], 2)


def test_seqlen_metrics_names_and_values():
    assert seqlen_metrics([10, 30], [19, 21], "global_seqlen") == {
        "global_seqlen/min": 10, "global_seqlen/max": 30, "global_seqlen/minmax_diff": 20, "global_seqlen/mean": 20,
        "global_seqlen/balanced_min": 19, "global_seqlen/balanced_max": 21}


# --------------------------------------------------------------------------- rows of different widths


def rollout_part(rows: int, width: int, prompt_width: int = 3, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch({"responses": torch.randint(1, 9, (rows, width), generator=g),
                  "response_mask": torch.ones(rows, width, dtype=torch.long),
                  "input_ids": torch.randint(1, 9, (rows, prompt_width + width), generator=g),
                  "prompts": torch.randint(1, 9, (rows, prompt_width), generator=g),
                  "row_index": torch.arange(rows)},
                 {"uid": [f"u{i}" for i in range(rows)]})


def test_concat_pads_the_narrower_parts_on_the_right_with_zeros():
    narrow, wide = rollout_part(2, 3, seed=1), rollout_part(3, 5, seed=2)
    both = Batch.concat([narrow, wide], pad_to_widest=True)
    assert both["responses"].shape == (5, 5) and both["input_ids"].shape == (5, 8) and both["prompts"].shape == (5, 3)
    assert torch.equal(both["responses"][:2, :3], narrow["responses"]) and not both["responses"][:2, 3:].any()
    assert torch.equal(both["input_ids"][:2, :6], narrow["input_ids"]) and not both["input_ids"][:2, 6:].any()
    assert not both["response_mask"][:2, 3:].any()  # the padding is never a valid token
    assert torch.equal(both["responses"][2:], wide["responses"]) and both["uid"] == narrow["uid"] + wide["uid"]


def test_concat_pads_only_when_asked():
    with pytest.raises(ValueError, match="trailing shapes differ"):
        Batch.concat([rollout_part(2, 3), rollout_part(2, 5)])


def test_concat_refuses_a_column_that_differs_in_another_dim():
    a, b = rollout_part(2, 3), rollout_part(2, 3)
    a["hidden"], b["hidden"] = torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="trailing shapes differ"):
        Batch.concat([a, b], pad_to_widest=True)


def test_concat_refuses_a_part_short_by_two_different_widths():
    """Prompts of another width are not a narrower response: padding them on the right would
    shift every response against its prompt."""
    with pytest.raises(ValueError, match="not one response width"):
        Batch.concat([rollout_part(2, 3, prompt_width=4), rollout_part(2, 5, prompt_width=3)], pad_to_widest=True)


def test_with_width_cuts_and_pads_response_columns_and_keeps_row_columns():
    back = Batch({"advantages": torch.arange(12.0).view(2, 6), "row_index": torch.tensor([4, 5])})
    assert torch.equal(back.with_width(4)["advantages"], torch.arange(12.0).view(2, 6)[:, :4])
    assert torch.equal(back.with_width(8)["advantages"][:, 6:], torch.zeros(2, 2))
    assert torch.equal(back.with_width(8)["row_index"], torch.tensor([4, 5]))


# --------------------------------------------------------------------------- the BALANCE exchange

WIDTH = 6


def global_rows(num_rows: int) -> Batch:
    """The same rows on every rank, valid up to a ragged length and zero after it (as a rollout's
    columns are past its response), so a rank's part can be cut to its longest row."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, WIDTH + 1, (num_rows,), generator=g)
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()
    return Batch({"responses": torch.randint(1, 100, (num_rows, WIDTH), generator=g) * mask, "response_mask": mask,
                  "row_index": torch.arange(num_rows)}, {"uid": [f"row{i}" for i in range(num_rows)]})


def held_part(full: Batch, lo: int, hi: int) -> Batch:
    part = full.slice(lo, hi)
    return part.with_width(max(int(part["response_mask"].sum(1).max()), 1))  # as an engine cuts it


def _reorders(rank, world_size):
    for step, (num_rows, seed) in enumerate([(12, 0), (9, 1), (12, 2)]):
        full = global_rows(num_rows)
        order = list(range(num_rows))
        random.Random(seed).shuffle(order)
        if seed == 2:
            order = list(range(num_rows))  # nothing moves: every rank only delivers to itself
        ranges = row_ranges(num_rows, world_size)
        got = reorder_rows(Message("BALANCE", step), held_part(full, *ranges[rank]), range(world_size), order,
                           group=None, device="cpu")
        lo, hi = ranges[rank]
        expected = full.index(order[lo:hi])
        assert got["row_index"].tolist() == order[lo:hi]
        assert got["uid"] == expected["uid"]
        width = got["responses"].shape[1]
        assert width >= int(expected["response_mask"].sum(1).max())
        for name in ("responses", "response_mask"):
            assert torch.equal(got[name], expected.with_width(width)[name]), name
    return True


def test_reorder_rows_moves_every_row_to_its_new_place():
    """Three ranks holding rows cut to their own widths; the rows come out in the new order on
    the rank whose slice holds it, padded to one width, each with its own content."""
    assert run_ranks(_reorders, 3, timeout=120) == [True] * 3


def _disagree(rank, world_size):
    """Rank 1 balances another step, then another order: each is refused on every rank."""
    full, said = global_rows(4), []
    for step, order in (((1, 2)[rank], [3, 2, 1, 0]), (3, [[3, 2, 1, 0], [2, 3, 1, 0]][rank])):
        try:
            reorder_rows(Message("BALANCE", step), full.slice(2 * rank, 2 * rank + 2), range(2), order, None, "cpu")
        except ProtocolError as e:
            said.append(str(e))
    return said


def test_ranks_that_disagree_on_the_step_or_the_order_are_told_so():
    said = run_ranks(_disagree, 2)
    assert said[0][0] == "rank 0 balances BALANCE of step 1 while rank 1 of its pool balances BALANCE of step 2"
    assert said[1][1].endswith("in another order") and len(said[1]) == 2


def test_reorder_rows_on_one_rank_needs_no_process_group():
    full = global_rows(5)
    got = reorder_rows(Message("BALANCE", 1), full, [0], [4, 2, 0, 1, 3], group=None, device="cpu")
    assert got["row_index"].tolist() == [4, 2, 0, 1, 3]
    assert torch.equal(got["responses"], full["responses"][[4, 2, 0, 1, 3]])


# --------------------------------------------------------------------------- real jobs

PROMPTS_PER_STEP, SHORT, LONG = 32, 1, 24  # prompt digits


def write_skewed_prompts(folder) -> str:
    """verl parquet rows of the copy task whose every step's batch (no shuffle) has its short
    prompts first and its long ones last: contiguous slices put the short half on the first ranks
    and the long half on the last, the imbalance balancing must undo. The embedded model's
    random policy ends a response at each token with probability ~1/15 (EOS among ~15 tokens),
    so the responses add a long-tailed spread of their own."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    rows = []
    for step in range(3):
        for i in range(PROMPTS_PER_STEP):
            digits = "".join(rng.choice("0123456789") for _ in range(SHORT if i < PROMPTS_PER_STEP // 2 else LONG))
            rows.append({"prompt": digits + "=", "data_source": "synthetic/copy",
                         "reward_model": {"ground_truth": digits, "style": "rule"}})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    return str(folder / "train.parquet")


def balance_job(tmp_path, name: str, nproc: int, balance: bool, *overrides: str) -> dict:
    from tests.support.launch import job
    from tests.support.outputs import scalars

    out = tmp_path / name
    result = job(
        nproc, f"data.train_files={write_skewed_prompts(tmp_path / 'data')}", "data.shuffle=false",
        f"data.max_prompt_length={LONG + 1}", "data.max_response_length=32", "trainer.total_steps=2",
        f"data.train_batch_size={PROMPTS_PER_STEP}", "rollout.n=2",
        # One optimizer step per update: each sees all rows, wherever they sit, so balancing
        # changes no number beyond float rounding.
        f"actor.ppo_mini_batch_size={PROMPTS_PER_STEP}", f"critic.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        "actor.ppo_micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=16",
        f"trainer.balance_batch={str(balance).lower()}", f"trainer.log_dir={out}/tb", "trainer.timeline=",
        "trainer.output_dir=", *overrides, timeout=500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {k: [v for _, v in series] for k, series in scalars(str(out / "tb")).items()}


SAME_METRICS = ["critic/score/mean", "response_length/mean", "prompt_length/mean", "actor/pg_loss", "actor/entropy",
                "actor/grad_norm", "critic/advantages/mean", "critic/returns/mean"]


def assert_balanced_and_unchanged(on: dict, off: dict, pools: list[str]) -> None:
    for prefix in pools:
        before = [hi / lo for hi, lo in zip(on[f"{prefix}/max"], on[f"{prefix}/min"])]
        after = [hi / lo for hi, lo in zip(on[f"{prefix}/balanced_max"], on[f"{prefix}/balanced_min"])]
        print(prefix, "max/min tokens per rank before", before, "after", after)
        assert all(r <= 1.1 for r in after), (prefix, after)
        assert all(r >= 1.5 for r in before), (prefix, before)  # the skew the data puts there
    assert not any(k.startswith("global_seqlen") for k in off), "balance_batch=false balanced"
    for key in SAME_METRICS + [k for k in off if k.startswith("critic/v")]:
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key


def test_split_job_balances_both_pools_and_trains_the_same(tmp_path):
    """2+2 split, GAE with a critic: each pool's ranks carry even tokens after balancing (verl's
    global_seqlen/*), and the run's numbers are those of the unbalanced run."""
    on = balance_job(tmp_path, "on", 4, True, "placement.mode=split")
    off = balance_job(tmp_path, "off", 4, False, "placement.mode=split")
    assert_balanced_and_unchanged(on, off, ["global_seqlen", "global_seqlen/critic"])


def test_colocate_grpo_job_balances_whole_groups_and_trains_the_same(tmp_path):
    """Colocate, GRPO: a group's advantages are computed among its rows on one rank, so a
    balancing that split a group would change them (and the loss) against the unbalanced run."""
    on = balance_job(tmp_path, "on", 2, True, "placement.mode=colocate", "algorithm.adv_estimator=grpo")
    off = balance_job(tmp_path, "off", 2, False, "placement.mode=colocate", "algorithm.adv_estimator=grpo")
    assert "global_seqlen/critic/max" not in on  # one pool
    assert_balanced_and_unchanged(on, off, ["global_seqlen"])
