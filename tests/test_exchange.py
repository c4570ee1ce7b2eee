import pytest
import torch

from spmdsplit.batch import Batch
from spmdsplit.exchange import exchange_rows, recv_object, recv_rows, row_ranges, send_object, send_rows
from tests.multiproc import run_ranks

SEQ = 6


def test_row_ranges_even():
    assert row_ranges(6, 3) == [(0, 2), (2, 4), (4, 6)]


def test_row_ranges_uneven_puts_extra_rows_first():
    assert row_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert row_ranges(5, 2) == [(0, 3), (3, 5)]


def test_row_ranges_more_parts_than_rows():
    assert row_ranges(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert row_ranges(0, 2) == [(0, 0), (0, 0)]


def test_row_ranges_rejects_bad_arguments():
    with pytest.raises(ValueError):
        row_ranges(4, 0)
    with pytest.raises(ValueError):
        row_ranges(-1, 2)


def _global_batch(num_rows: int) -> Batch:
    """The same batch on every rank (fixed seed), so each rank knows what its rows must be."""
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, SEQ + 1, (num_rows,), generator=g)  # ragged valid lengths
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    return Batch(
        {
            "input_ids": torch.randint(0, 1000, (num_rows, SEQ), generator=g) * mask,
            "attention_mask": mask,
            "logprobs": torch.randn(num_rows, SEQ, generator=g) * mask,
            "ref_logprobs": torch.randn(num_rows, SEQ, generator=g).to(torch.bfloat16),
            "hidden": torch.randn(num_rows, SEQ, 3, generator=g),
            "reward": torch.randn(num_rows, generator=g),
        },
        {
            "prompt": ["q" * (i % 5) + f"#{i}" for i in range(num_rows)],
            "ground_truth": [{"row": i, "tags": ["t"] * (i % 3)} for i in range(num_rows)],
        },
    )


def _add_values(b: Batch) -> Batch:
    """What a 'critic' adds before sending rows back: a function of the row, so it is checkable."""
    b["values"] = (b["logprobs"].sum(-1) * 2).to(torch.bfloat16)
    b["critic_note"] = [f"seen {p}" for p in b["prompt"]]
    return b


def _assert_same(got: Batch, expected: Batch):
    assert sorted(got.keys()) == sorted(expected.keys())
    for k, v in expected.tensors.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k
    for k, v in expected.non_tensors.items():
        assert got[k] == v, k


def _round_trip(rank, src, dst, num_rows, tag):
    full = _global_batch(num_rows)
    mine = full.slice(*row_ranges(num_rows, len(src))[src.index(rank)]) if rank in src else None
    got = exchange_rows(mine, src, dst, num_rows, tag=tag)
    if rank in dst:
        rows = row_ranges(num_rows, len(dst))[dst.index(rank)]
        if rows[0] == rows[1]:
            assert len(got) == 0  # nobody sent this rank anything
        else:
            _assert_same(got, full.slice(*rows))
            got = _add_values(got)
    back = exchange_rows(got, dst, src, num_rows, tag=tag + 1)
    if rank in src:
        rows = row_ranges(num_rows, len(src))[src.index(rank)]
        _assert_same(back, _add_values(full.slice(*rows)))


# (name, src pool, dst pool, num_rows). All run in one 5-rank world, one after the other, with
# their own tags (ranks outside a case skip it): spawning a world per case costs ~4 s of torch
# imports per rank.
CASES = [
    ("1+1", [0], [1], 5),
    ("2+2", [0, 1], [2, 3], 8),
    ("3+1", [0, 1, 2], [3], 7),
    ("1+3", [0], [1, 2, 3], 7),
    ("colocate", [0, 1], [0, 1], 5),  # all self-delivery
    ("7rows-3+2", [0, 1, 2], [3, 4], 7),  # rows divisible by neither pool
    ("2rows-1+3", [0], [1, 2, 3], 2),  # fewer rows than destinations: rank 3 gets none
    ("overlap", [0, 1], [1, 2], 5),  # rank 1 in both pools: part self-delivered, part over the wire
    ("reversed", [4, 2], [3, 0, 1], 9),  # pool order, not rank order, decides who holds which rows
]


def _all_round_trips(rank, world_size):
    done = []
    for i, (name, src, dst, num_rows) in enumerate(CASES):
        if rank in src or rank in dst:
            try:
                _round_trip(rank, src, dst, num_rows, tag=100 + 2 * i)
            except Exception as e:
                raise AssertionError(f"round trip case {name!r} failed on rank {rank}") from e
            done.append(name)
    return done


def test_round_trips_for_all_pool_splits():
    done = run_ranks(_all_round_trips, 5, timeout=120)
    for rank, names in enumerate(done):
        assert names == [n for n, src, dst, _ in CASES if rank in src or rank in dst]


def test_colocate_single_process_needs_no_process_group():
    b = _global_batch(4)
    got = exchange_rows(b, [0], [0], 4, tag=3)
    _assert_same(got, b)


def _objects(rank, world_size):
    if rank == 0:
        send_object({"loss": 0.5, "steps": [1, 2], "name": "critic"}, dst=1, tag=5).wait()
        return recv_object(1, tag=6)
    obj = recv_object(0, tag=5)
    send_object({**obj, "ack": True}, dst=0, tag=6).wait()
    return obj


def test_send_recv_object():
    sent = {"loss": 0.5, "steps": [1, 2], "name": "critic"}
    assert run_ranks(_objects, 2, timeout=120) == [{**sent, "ack": True}, sent]


def _send_does_not_block(rank, world_size):
    full = _global_batch(64)
    big = Batch({"x": torch.randn(64, 16384, generator=torch.Generator().manual_seed(0))})  # 4 MB: no socket buffer swallows it eagerly
    if rank == 0:
        p1 = send_rows(full, [0], [1], 64, tag=10)
        p2 = send_rows(big, [0], [1], 64, tag=11)
        # Rank 1 posts its row receives only after this round trip: had send_rows blocked
        # until they were posted, both ranks would hang here.
        send_object("ping", dst=1, tag=12).wait()
        assert recv_object(1, tag=13) == "pong"
        p1.wait()
        p2.wait()
        p1.wait()  # idempotent
        return True
    assert recv_object(0, tag=12) == "ping"
    send_object("pong", dst=0, tag=13).wait()
    # Received in the other order than sent: the tags keep the two messages apart.
    assert torch.equal(recv_rows([0], [1], 64, tag=11)["x"], big["x"])
    _assert_same(recv_rows([0], [1], 64, tag=10), full)
    return True


def test_send_rows_is_non_blocking():
    assert run_ranks(_send_does_not_block, 2, timeout=120) == [True, True]


def _bad_arguments(rank, world_size):
    full = _global_batch(6)
    src, dst = [0], [1]
    if rank == 0:
        with pytest.raises(ValueError, match="holds rows"):
            send_rows(full.slice(0, 5), src, dst, 6, tag=20)
        with pytest.raises(ValueError, match="not in src_ranks"):
            send_rows(full, [1], [0], 6, tag=20)
        with pytest.raises(ValueError, match="empty"):
            send_rows(full, src, [], 6, tag=20)
        with pytest.raises(ValueError, match="outside the world"):
            send_rows(full, src, [7], 6, tag=20)
    else:
        with pytest.raises(ValueError, match="not in dst_ranks"):
            recv_rows(src, [0], 6, tag=20)
    # Nothing went out before the errors: the same tag still carries exactly one clean exchange.
    got = exchange_rows(full if rank == 0 else None, src, dst, 6, tag=20)
    if rank == 1:
        _assert_same(got, full)
    return True


def test_bad_arguments_raise_before_any_communication():
    assert run_ranks(_bad_arguments, 2, timeout=120) == [True, True]
