from typing import Sequence

import pytest
import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.exchange import Link, Message, PendingSend, ProtocolError, recv_rows, row_pairs, row_ranges, send_rows
from tests.support.launch import run_ranks

SEQ = 6
KINDS = ["ROWS", "BACK", "OBJECT", "OTHER"]
# No test here passes a tag (nothing in the project does): every exchange below is correct by
# posting order alone, NCCL's rule, though gloo would honour tags.


def exchange_rows(link: Link, msg: Message, batch: Batch | None, src_ranks: Sequence[int], dst_ranks: Sequence[int],
                  num_rows: int) -> Batch | None:
    """Both sides of one message, for a test that runs the same code on every rank: sends (if a
    source), receives (if a destination), waits for its own sends. Sending first, non-blocking, is
    what keeps a rank in both lists from deadlocking."""
    me, src_ranks, dst_ranks = dist.get_rank() if dist.is_initialized() else 0, list(src_ranks), list(dst_ranks)
    pending = PendingSend()
    if me in src_ranks:
        if batch is None:
            raise ValueError(f"rank {me} is a source but was given no batch")
        pending = send_rows(link, msg, batch, src_ranks, dst_ranks, num_rows)
    result = recv_rows(link, msg, src_ranks, dst_ranks, num_rows) if me in dst_ranks else None
    pending.wait()
    return result


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


def _round_trip(link, rank, src, dst, num_rows, step):
    full = _global_batch(num_rows)
    mine = full.slice(*row_ranges(num_rows, len(src))[src.index(rank)]) if rank in src else None
    got = exchange_rows(link, Message("ROWS", step), mine, src, dst, num_rows)
    if rank in dst:
        rows = row_ranges(num_rows, len(dst))[dst.index(rank)]
        if rows[0] == rows[1]:
            assert len(got) == 0  # nobody sent this rank anything
        else:
            _assert_same(got, full.slice(*rows))
            got = _add_values(got)
    back = exchange_rows(link, Message("BACK", step), got, dst, src, num_rows)
    if rank in src:
        rows = row_ranges(num_rows, len(src))[src.index(rank)]
        _assert_same(back, _add_values(full.slice(*rows)))


# (name, src pool, dst pool, num_rows). All run in one 5-rank world, one after the other, with
# their own step numbers (ranks outside a case skip it): spawning a world per case costs ~4 s of torch
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
    """Connects every pair the cases will use first (as the trainer does at start-up: any pair a
    case uses but row_pairs missed then fails its send or receive), then runs the cases."""
    done, link = [], Link(KINDS)
    link.connect([pair for _, src, dst, rows in CASES for pair in row_pairs(src, dst, rows) + row_pairs(dst, src, rows)])
    for i, (name, src, dst, num_rows) in enumerate(CASES):
        if rank in src or rank in dst:
            try:
                _round_trip(link, rank, src, dst, num_rows, step=i)
            except Exception as e:
                raise AssertionError(f"round trip case {name!r} failed on rank {rank}") from e
            done.append(name)
    assert link.connected == {(a, b) for a in range(world_size) for b in range(a + 1, world_size)}  # all used
    unconnected = Link(KINDS)
    unconnected.connect([])
    with pytest.raises(ProtocolError, match="not connected at start-up"):
        unconnected.isend(Message("ROWS", 99), b"", None, (rank + 1) % world_size)
    return done


def test_round_trips_for_all_pool_splits():
    done = run_ranks(_all_round_trips, 5, timeout=120)
    for rank, names in enumerate(done):
        assert names == [n for n, src, dst, _ in CASES if rank in src or rank in dst]


def test_colocate_single_process_needs_no_process_group():
    b = _global_batch(4)
    got = exchange_rows(Link(KINDS), Message("ROWS", 1), b, [0], [0], 4)
    _assert_same(got, b)


def _objects(rank, world_size):
    link = Link(KINDS)
    if rank == 0:
        link.send_object({"loss": 0.5, "steps": [1, 2], "name": "critic"}, 1, Message("OBJECT", 1)).wait()
        return link.recv_object(1, Message("OBJECT", 2))
    obj = link.recv_object(0, Message("OBJECT", 1))
    link.send_object({**obj, "ack": True}, 0, Message("OBJECT", 2)).wait()
    return obj


def test_send_recv_object():
    sent = {"loss": 0.5, "steps": [1, 2], "name": "critic"}
    assert run_ranks(_objects, 2, timeout=120) == [{**sent, "ack": True}, sent]


def _send_does_not_block(rank, world_size):
    full = _global_batch(64)
    big = Batch({"x": torch.randn(64, 16384, generator=torch.Generator().manual_seed(0))})  # 4 MB: no socket buffer swallows it eagerly
    link, objects = Link(KINDS), Link(KINDS, dist.new_group(backend="gloo"))  # objects on a group of their own
    if rank == 0:
        p1 = send_rows(link, Message("ROWS", 1), full, [0], [1], 64)
        p2 = send_rows(link, Message("ROWS", 2), big, [0], [1], 64)
        # Rank 1 posts its row receives only after this round trip on the other group: had
        # send_rows blocked until they were posted, both ranks would hang here.
        objects.send_object("ping", 1, Message("OBJECT", 1)).wait()
        assert objects.recv_object(1, Message("OBJECT", 2)) == "pong"
        p1.wait()
        p2.wait()
        p1.wait()  # idempotent
        return True
    assert objects.recv_object(0, Message("OBJECT", 1)) == "ping"
    objects.send_object("pong", 0, Message("OBJECT", 2)).wait()
    _assert_same(recv_rows(link, Message("ROWS", 1), [0], [1], 64), full)  # in the order they were sent
    assert torch.equal(recv_rows(link, Message("ROWS", 2), [0], [1], 64)["x"], big["x"])
    return True


def test_send_rows_is_non_blocking():
    assert run_ranks(_send_does_not_block, 2, timeout=120) == [True, True]


def _bad_arguments(rank, world_size):
    full = _global_batch(6)
    src, dst, link, msg = [0], [1], Link(KINDS), Message("ROWS", 20)
    if rank == 0:
        with pytest.raises(ValueError, match="holds rows"):
            send_rows(link, msg, full.slice(0, 5), src, dst, 6)
        with pytest.raises(ValueError, match="not in src_ranks"):
            send_rows(link, msg, full, [1], [0], 6)
        with pytest.raises(ValueError, match="empty"):
            send_rows(link, msg, full, src, [], 6)
        with pytest.raises(ValueError, match="outside the world"):
            send_rows(link, msg, full, src, [7], 6)
    else:
        with pytest.raises(ValueError, match="not in dst_ranks"):
            recv_rows(link, msg, src, [0], 6)
    # Nothing went out before the errors: the link still carries exactly one clean exchange.
    got = exchange_rows(link, msg, full if rank == 0 else None, src, dst, 6)
    if rank == 1:
        _assert_same(got, full)
    return True


def test_bad_arguments_raise_before_any_communication():
    assert run_ranks(_bad_arguments, 2, timeout=120) == [True, True]


def _out_of_order(rank, world_size, sent: Message, expected: Message):
    link = Link(KINDS)
    if rank == 0:
        # Its body is never taken, so not waited for; but held until the end: a dropped work
        # object can cancel its send before the header went out.
        pending = send_rows(link, sent, _global_batch(4), [0], [1], 4)
        dist.barrier(group=dist.new_group(backend="gloo"))
        del pending
        return None
    with pytest.raises(ProtocolError) as error:
        recv_rows(link, expected, [0], [1], 4)
    dist.barrier(group=dist.new_group(backend="gloo"))
    return str(error.value)


@pytest.mark.parametrize("sent, expected, says", [
    (Message("OTHER", 3), Message("ROWS", 3), "expected ROWS of step 3 (message #0) from rank 0 on the link link, got OTHER of step 3 (message #0)"),
    (Message("ROWS", 2), Message("ROWS", 3), "expected ROWS of step 3 (message #0) from rank 0 on the link link, got ROWS of step 2 (message #0)"),
    (Message("ROWS", 3, 1), Message("ROWS", 3, 0), "got ROWS of step 3 chunk 1"),
])
def test_a_message_out_of_place_is_a_one_line_error(sent, expected, says):
    """What NCCL would do silently (hand the next message to whichever receive comes next) is
    caught by the header, before any body is read."""
    # A world of its own: the message sent out of place is never received, and must not be the next test's.
    _, message = run_ranks(_out_of_order, 2, sent, expected, timeout=120, fresh=True)
    assert says in message and "\n" not in message


def _self_delivery_twice(rank, world_size):
    link, msg = Link(KINDS), Message("ROWS", 1)
    send_rows(link, msg, _global_batch(2), [0], [0], 2)
    with pytest.raises(ProtocolError, match="sent itself ROWS of step 1 twice"):
        send_rows(link, msg, _global_batch(2), [0], [0], 2)
    with pytest.raises(ProtocolError, match="expected BACK of step 1 from itself"):
        recv_rows(link, Message("BACK", 1), [0], [0], 2)
    return True


def test_self_delivery_checks_what_it_parks():
    assert run_ranks(_self_delivery_twice, 1, timeout=60) == [True]
