"""rollout.ranks=all: the critic pool generates its share of every step too, its engines fed by a
broadcast of the policy's weights from the actor pool (spmdsplit/weight_sync.py)."""

import pytest

from tests.support.extra_info_check import assert_every_split_scored, write_job_files
from tests.support.launch import job
from tests.support.outputs import scalars, timeline_events

COMMON = ["rollout.do_sample=false", "trainer.total_steps=3", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
          "critic.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
          "trainer.output_dir=", "trainer.progress_bar=false", "rollout.weight_bucket_mb=0.05",
          "algorithm.rollout_correction.rollout_is=sequence", "trainer.balance_batch=true"]


def test_every_rank_generates_and_the_steps_equal_actor_only_generation(tmp_path):
    """Greedy decoding: whoever generates a row, it is the same row, so the steps must equal those
    of actor-pool generation. From step 2 on the policy has moved, so a critic engine that missed
    the broadcast (or got a bucket wrong; the tiny bucket size makes it several) would answer
    differently."""
    runs = {}
    for ranks in ("actor", "all"):
        out = tmp_path / ranks
        # Scored by a custom function that checks each row gets its own extra_info (with
        # rollout.ranks=all the critic ranks' rows travel to the actor pool and back), validation on.
        checked, calls_log = write_job_files(out / "data")
        result = job(4, *COMMON, *checked, f"rollout.ranks={ranks}", f"trainer.log_dir={out}/tb",
                          f"trainer.timeline={out}/timeline.json", timeout=400)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert_every_split_scored(calls_log, [0, 1], [2, 3])
        runs[ranks] = (scalars(str(out / "tb")), timeline_events(str(out / "timeline.json")))
    (actor_only, _), (everyone, events) = runs["actor"], runs["all"]
    assert [s for s, _ in everyone["critic/score/mean"]] == [1, 2, 3]
    # The critic ranks' rows bring their engine's log-probs along (GENERATED): fp32 engines with
    # the broadcast weights agree with the actor, so the sequence weights are all but 1.
    assert all(v < 1e-5 for _, v in everyone["training/rollout_probs_diff_max"])
    assert all(v == pytest.approx(1.0, abs=1e-4) for _, v in everyone["rollout_corr/rollout_is_min"])
    assert everyone["critic/score/mean"] == actor_only["critic/score/mean"]
    for key in ("actor/pg_loss", "critic/vf_loss"):
        for (_, x), (_, y) in zip(actor_only[key], everyone[key]):
            assert y == pytest.approx(x, rel=1e-4, abs=1e-6), key
    # Every rank generated in every step, and the critic ranks took the weights first; the actor
    # ranks also take them before each validation (steps 2 and 3), which only they generate.
    for rank in range(4):
        for name in ("gen", "sync_weights", "rollout_sleep"):  # one wake and one sleep a step (and a validation)
            validations = [2, 3] if name != "gen" and rank in (0, 1) else []
            steps = sorted(e["args"]["step"] for e in events if e["name"] == name and e["pid"] == rank)
            assert steps == sorted([1, 2, 3] + validations), (name, rank)


def broadcast_three_syncs(rank, world_size):
    """Rank 0 streams three versions of the same weights through a WeightBroadcast to rank 1,
    counting the pickled-object broadcasts (the layout) on the way; then a stream of another shape."""
    import torch
    import torch.distributed as dist

    from spmdsplit.weight_sync import WeightBroadcast

    objects = []
    plain = dist.broadcast_object_list

    def counted(*args, **kwargs):
        objects.append(1)
        return plain(*args, **kwargs)

    dist.broadcast_object_list = counted
    sync = WeightBroadcast([0], [dist.new_group([0, 1])], torch.device("cpu"), bucket_mb=0.00004)  # 41 B: buckets of 1, 3, 1
    shapes = [(3, 4), (5,), (2, 2), (7,), (1, 3)]
    got = []
    for version in range(3):
        weights = [(f"w{i}", torch.full(shape, float(version * 10 + i), dtype=torch.bfloat16 if i % 2 else torch.float32))
                   for i, shape in enumerate(shapes)]
        if rank == 0:
            got.append([(n, t.clone()) for n, t in sync.send(iter(weights))])
        else:
            got.append([(n, t.clone()) for n, t in sync.receive()])
        objects.append("sync")
    error = None
    if rank == 0:  # a stream that no longer fits the layout fails on the sender, naming the bucket
        try:
            list(sync.send(iter([("w0", torch.zeros(3, 5))])))
        except RuntimeError as e:
            error = str(e)
    dist.broadcast_object_list = plain
    return {"got": got, "objects": objects, "buckets": len(sync.layout), "error": error}


def test_the_weight_broadcast_sends_its_layout_once():
    from tests.support.launch import run_ranks

    results = run_ranks(broadcast_three_syncs, 2, timeout=120)
    sender = results[0]
    for version in range(3):
        received, sent = results[1]["got"][version], sender["got"][version]
        assert [(n, t.dtype, t.tolist()) for n, t in received] == [(n, t.dtype, t.tolist()) for n, t in sent]
    assert sender["buckets"] >= 2
    # Layout messages: one per bucket and the end marker, in the first sync only.
    first, second, third = "".join("o" if x == 1 else "|" for x in sender["objects"]).split("|")[:3]
    assert (len(first), len(second), len(third)) == (sender["buckets"] + 1, 0, 0)
    assert "layout of the first sync" in sender["error"]


def broadcast_from_two_sources(rank, world_size):
    """Actor ranks 0 and 1 each hold their chunk of every weight (as FSDP2 cuts them: ceil(rows /
    2) rows on rank 0, the rest on rank 1) and each sends the buckets it owns, gathered from
    both, to rank 2 (a rollout pool apart), twice; rank 2 counts its broadcasts still pending
    when it takes each bucket."""
    import time

    import torch
    import torch.distributed as dist

    from spmdsplit.weight_sync import WeightBroadcast, WeightShard

    groups = [dist.new_group([0, 2]), dist.new_group([1, 2])]
    groups = [g if rank in (i, 2) else None for i, g in enumerate(groups)]
    actor_pool = dist.new_group([0, 1])
    sync = WeightBroadcast([0, 1], groups, torch.device("cpu"), bucket_mb=0.00004)
    pending, most = [], [0]
    plain = dist.broadcast

    def counted(tensor, src, group=None, async_op=False):
        work = plain(tensor, src, group=group, async_op=async_op)
        if async_op:
            pending.append(work)
            most[0] = max(most[0], sum(not w.is_completed() for w in pending))
        return work

    dist.broadcast = counted
    got = []
    for version in range(2):
        weights = [(f"w{i}", torch.full((4 + i,), float(version * 10 + i))) for i in range(6)]
        sync.ready()
        if rank < 2:
            # The sources start a moment after the receiver: what it has posted before taking its
            # first bucket is then counted, not a race with how fast the first one arrives.
            time.sleep(0.5)
            sync.push((WeightShard(n, t.chunk(2)[rank], tuple(t.shape), sharded=True) for n, t in weights), actor_pool)
        else:
            got.append([(n, t.tolist()) for n, t in sync.receive()])
        if version == 0:
            pending.clear()
            most[0] = 0
    dist.broadcast = plain
    return {"got": got, "in_flight": sync.in_flight, "most_pending": most[0], "buckets": len(sync.layout)}


def test_the_weight_broadcast_keeps_buckets_from_several_sources_in_flight():
    from tests.support.launch import run_ranks

    results = run_ranks(broadcast_from_two_sources, 3, timeout=120)
    receiver = results[2]
    assert receiver["got"][1] == [(f"w{i}", [10.0 + i] * (4 + i)) for i in range(6)]
    assert receiver["got"][0] == [(f"w{i}", [float(i)] * (4 + i)) for i in range(6)]
    assert receiver["buckets"] >= 3 and receiver["in_flight"] == 2
    # The second sync posts the next bucket (from the other source) before taking the current one.
    assert receiver["most_pending"] == 2
