"""The test layer that holds every multi-rank test to NCCL's point-to-point contract
(tests/support/nccl_p2p.py), shown to hold: what gloo forgives and NCCL does not fails, with a message
naming the ranks and the group, within seconds; what NCCL allows passes. Also the layer is on in
the worlds and jobs the suite starts."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.exchange import Link, Message, PendingSend, _pack, _unpack, reorder_rows, row_ranges
from tests.support.launch import run_ranks


def test_the_suite_turns_the_layer_on():
    assert os.environ.get("SPMDSPLIT_P2P_CONTRACT") == "1"
    assert any(p.endswith("nccl_site") for p in os.environ["PYTHONPATH"].split(os.pathsep))


def _is_on(rank, world):
    from tests.support import nccl_p2p

    return nccl_p2p.installed() and dist.isend is nccl_p2p.isend


def test_worlds_of_the_suite_run_under_it():
    assert run_ranks(_is_on, 2) == [True, True]


# ---- the contract's rules, each shown on two ranks


def _cross_sends_then_receives(rank, world):
    """Each rank sends the other a piece, and only then receives: gloo's eager sends let it pass."""
    peer = 1 - rank
    out, into = torch.full((1000,), float(rank)), torch.empty(1000)
    send = dist.isend(out, peer)
    dist.irecv(into, peer).wait()
    send.wait()
    return into[0].item()


def test_two_ranks_that_send_each_other_before_receiving_fail_in_seconds_naming_both():
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_cross_sends_then_receives, 2, timeout=60)
    assert time.monotonic() - start < 30  # a bounded wait, not a hang
    text = str(failed.value)
    assert "NCCL point-to-point contract: ranks 0 and 1 each wait to send to the other on group" in text, text
    assert "ranks [0, 1]" in text and "test_nccl_contract.py" in text  # the group's ranks, where it was posted


def _cross_exchange_grouped(rank, world):
    peer = 1 - rank
    out, into = torch.full((1000,), float(rank)), torch.empty(1000)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]):
        w.wait()
    return into[0].item()


def test_a_grouped_call_lets_both_directions_progress_together():
    assert run_ranks(_cross_exchange_grouped, 2) == [1.0, 0.0]


def _tags_do_not_match(rank, world):
    if rank == 0:
        a, b = torch.tensor([1.0]), torch.tensor([2.0])
        works = [dist.isend(a, 1, tag=7), dist.isend(b, 1, tag=8)]
        for w in works:
            w.wait()
        return None
    first, second = torch.empty(1), torch.empty(1)
    dist.recv(first, 0, tag=8)  # under gloo this would take the message tagged 8, the second
    dist.recv(second, 0, tag=7)
    return first.item(), second.item()


def test_tags_are_ignored_messages_match_in_posting_order():
    assert run_ranks(_tags_do_not_match, 2)[1] == (1.0, 2.0)


def _send_waits_for_the_receive(rank, world):
    if rank == 0:
        work = dist.isend(torch.ones(4), 1)
        time.sleep(1.0)
        done_before = work.is_completed()
        dist.barrier()  # rank 1 posts its receive after this
        work.wait()
        return done_before
    dist.barrier()
    dist.recv(torch.empty(4), 0)
    return None


def test_a_send_completes_only_once_the_peer_started_the_receive():
    assert run_ranks(_send_waits_for_the_receive, 2)[0] is False


# ---- the row-balancing exchange as it was (every rank sent all its pieces, then received):
#      it deadlocks at step 1 of any job with two or more actor ranks on NCCL


def _reorder_rows_as_it_was(link, msg, batch, ranks, order):
    ranks, me = list(ranks), dist.get_rank()
    ranges = row_ranges(len(order), len(ranks))
    holder = [r for r, (lo, hi) in enumerate(ranges) for _ in range(lo, hi)]
    old_lo, old_hi = ranges[ranks.index(me)]
    pending = PendingSend()
    for d, (lo, hi) in zip(ranks, ranges):
        theirs = [order[p] - old_lo for p in range(lo, hi) if old_lo <= order[p] < old_hi]
        if not theirs:
            continue
        piece = batch.index(theirs)
        if d == me:
            link.park(msg, piece)
        else:
            pending.add(link.isend(msg, *_pack(piece, link.device), d))
    new_lo, new_hi = ranges[ranks.index(me)]
    sources = sorted({holder[order[p]] for p in range(new_lo, new_hi)})
    bodies = link.recv_bodies(link.recv_headers(msg, [ranks[s] for s in sources if ranks[s] != me]))
    pieces = [link.unpark(msg) if ranks[s] == me else _unpack(*bodies[ranks[s]]) for s in sources]
    pending.wait()
    return Batch.concat(pieces)


def _balance_rows(rank, world, exchange):
    order = [3, 2, 1, 0]  # every rank's rows go to the other
    rows = Batch({"x": torch.arange(2 * rank, 2 * rank + 2)}, {})
    if exchange == "as it was":
        link = Link(["BALANCE"], None, "cpu", "bulk")
        out = _reorder_rows_as_it_was(link, Message("BALANCE", 1), rows, range(world), order)
    else:
        out = reorder_rows(Message("BALANCE", 1), rows, range(world), order, group=None, device="cpu")
    return out["x"].tolist()


def test_the_balancing_exchange_as_it_was_is_stopped_naming_the_ranks_and_the_group():
    with pytest.raises(AssertionError) as failed:
        run_ranks(_balance_rows, 2, "as it was", timeout=60)
    text = str(failed.value)
    assert "ranks 0 and 1 each wait to send to the other on group" in text, text
    assert "in _reorder_rows_as_it_was" in text


def test_the_balancing_exchange_now_passes():
    assert run_ranks(_balance_rows, 2, "now") == [[3, 2], [1, 0]]


CROSS_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
peer = 1 - dist.get_rank()
send = dist.isend(torch.ones(10), peer)
dist.irecv(torch.empty(10), peer).wait()
send.wait()
"""


@pytest.mark.e2e
def test_ranks_started_by_torchrun_run_under_it(tmp_path):
    """What every torchrun job of the suite inherits (PYTHONPATH and the switch, from conftest):
    the same cross sends, from a script under real torchrun, fail with the contract's message."""
    import subprocess

    from tests.support.launch import base_env, torchrun_cmd

    script = tmp_path / "cross.py"
    script.write_text(CROSS_SCRIPT)
    result = subprocess.run(torchrun_cmd(2, script=str(script)), capture_output=True, text=True, timeout=120,
                            env=base_env())
    assert result.returncode != 0
    assert "ranks 1 and 0 each wait to send to the other" in result.stderr or \
        "ranks 0 and 1 each wait to send to the other" in result.stderr, result.stderr[-3000:]


def _warm_up(rank, world):
    from tests.support import nccl_p2p

    link = Link(["ROWS"], dist.new_group([0, 1, 2]), "cpu", "bulk")
    link.connect([(2, 0), (1, 2), (0, 2)])
    name = dist.distributed_c10d._get_process_group_name(link.group)
    return {peer: (s.sent, s.received) for (group, peer), s in nccl_p2p._STATE.streams.items() if group == name}


def test_start_up_warms_each_connected_pair_in_both_directions_once():
    """NCCL sets up each direction of a pair at its first use: the rows generated (rollout ->
    actor) and the advantages (critic -> actor) flow from higher ranks to lower, so a one-way
    warm-up would leave their direction to the first step."""
    assert run_ranks(_warm_up, 3) == [{2: (1, 1)}, {2: (1, 1)}, {0: (1, 1), 1: (1, 1)}]


def test_the_layer_is_on_in_every_rank_of_a_warm_job(tmp_path):
    """Training jobs run warm (tests/support/launch.py forks their ranks): each installs the layer itself,
    so a planted cross exchange in a job fails there as under torchrun."""
    from tests.support.launch import job

    script = tmp_path / "check.py"
    script.write_text("import os\nfrom tests.support import nccl_p2p\nprint('rank', os.environ['RANK'], 'layer on:', nccl_p2p.installed())\n")
    result = job(2, script=str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(line for line in result.stdout.splitlines() if "layer on" in line) == \
        ["rank 0 layer on: True", "rank 1 layer on: True"]
