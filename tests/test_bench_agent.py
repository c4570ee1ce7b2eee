"""tools/bench/agent.py's pure analysis on hand-made numbers and timelines (no jobs, no models)."""

import pytest

from tools.bench import agent as bench_agent, async_rollout
from tools.bench.agent import job_summary, render_markdown, targets, tool_turn


def ev(name, rank, step, ts, dur):
    return {"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": ts, "dur": dur, "args": {"step": step}}


def meta(rank, pool):
    return {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({pool})"}}


def trace(gen_s: float, steps: int = 6) -> dict:
    """Rank 0 trains 1 s per step (old_log_prob 0.3 + update_actor 0.7), rank 1 generates batch
    k + 1 during step k for gen_s seconds: the step period is max(1, gen_s)."""
    period = max(1.0, gen_s)
    events = [meta(0, "actor"), meta(1, "rollout")]
    for k in range(1, steps + 1):
        t0 = int(k * period * 1e6)
        events += [ev("old_log_prob", 0, k, t0, 300_000), ev("update_actor", 0, k, t0 + 300_000, 700_000),
                   ev("gen", 1, k + 1, t0, int(gen_s * 1e6))]
    return {"traceEvents": events}


def summary(gen_s: float, calls: float | None = None) -> dict:
    steady = async_rollout.steady_steps(6, warmup=1, staleness=1)
    scalars = {"tool/calls": {s: calls for s in range(1, 7)}} if calls is not None else {}
    return job_summary(async_rollout.analyze(trace(gen_s), scalars, warmup=1, batch=4, staleness=1), scalars, steady)


def test_tool_turn_is_the_median_difference_per_round():
    turn = tool_turn([0.21, 0.25, 0.22], [0.5, 0.45, 0.48], [0.25, 0.26, 0.24], rounds=[31], calls=31)
    assert turn["run_s"] == pytest.approx(0.22)
    assert turn["added_per_round_s"] == pytest.approx(0.48 - 0.25)
    assert (turn["rounds"], turn["calls"], turn["calls_per_round"]) == (1, 31, [31])
    two = tool_turn([0.2], [0.7], [0.3], rounds=[32, 30], calls=62)
    assert two["added_per_round_s"] == pytest.approx(0.2)
    assert tool_turn([0.2], [0.7], [0.3], rounds=[], calls=0)["added_per_round_s"] is None  # nobody called


def test_job_summary_reads_both_pools():
    s = summary(gen_s=0.5, calls=20.0)
    assert s["step_s"] == pytest.approx(1.0)
    assert s["gen_s"] == pytest.approx(0.5)
    assert s["train_busy_s"] == pytest.approx(1.0)
    assert s["train_pool"]["old_log_prob"] == pytest.approx(0.3)
    assert s["train_pool"]["update_actor"] == pytest.approx(0.7)
    assert s["train_pool"]["gen"] is None and s["gen_pool"]["update_actor"] is None
    assert s["tool/calls"] == 20.0 and s["num_turns/mean"] is None


def test_targets_met_and_missed():
    turn = tool_turn([0.21], [0.45], [0.25], rounds=[32], calls=32)
    met = {t["target"]: t for t in targets(turn, {"single-turn": summary(0.5), "multi-turn": summary(0.8),
                                                  "multi-turn, continuous": summary(0.9), "environment": summary(0.5),
                                                  "environment, harness": summary(0.6),
                                                  "environment, continuous": summary(0.5),
                                                  "environment, harness, continuous": summary(0.6)})}
    assert [t["met"] for t in met.values()] == [True] * 8
    growth = next(t for name, t in met.items() if "step period" in name)
    assert growth["value"] == pytest.approx(0.0)
    # gen outgrows training: the step period follows it, both targets of the jobs missed
    slow = targets(tool_turn([0.9], [1.5], [0.3], rounds=[32], calls=32),
                   {"single-turn": summary(0.5), "multi-turn": summary(1.5)})
    assert [t["met"] for t in slow] == [False, False, False, False, None, None, None, None]
    assert slow[2]["value"] == pytest.approx(0.5) and slow[3]["value"] == pytest.approx(1.5)
    # continuous: the train pool waits for rows (the rollout pool's gen_ahead never shows it)
    late = targets(turn, {"single-turn": summary(0.5), "multi-turn, continuous": summary(1.25)})
    assert late[4]["value"] == pytest.approx(0.25) and late[5]["value"] == pytest.approx(0.2)
    assert [t["met"] for t in late[4:6]] == [False, False]
    # the harness's episodes over 1.3x the agent loop's
    harness = targets(turn, {"environment": summary(0.5), "environment, harness": summary(0.7)})[6]
    assert harness["value"] == pytest.approx(1.4) and harness["met"] is False
    # continuous: the step periods (1.0 s where the train pool's 1 s work paces them, 2.0 s where gen does)
    streamed = targets(turn, {"environment, continuous": summary(0.5), "environment, harness, continuous": summary(2.0)})[7]
    assert streamed["value"] == pytest.approx(2.0) and streamed["met"] is False
    # a missing mode gives n/a, never an error
    assert [t["met"] for t in targets(turn, {})][2:] == [None] * 6
    assert "the 1 s tool" in targets(turn, {}, sleep_s=1.0)[0]["how"]  # the run's latency, not the default's


def test_markdown_shows_phases_targets_and_counts():
    turn = tool_turn([0.21], [0.45], [0.25], rounds=[32], calls=32)
    modes = {"single-turn": summary(0.5), "multi-turn, instant tool": summary(0.6),
             "multi-turn": summary(0.8, calls=40.0)}
    report = {"meta": {"device": "cpu", "torch": "x", "date": "d", "repeats": 1, "workload": ["a=1"], "steps": 6,
                       "warmup": 1}, "turn": turn, "modes": modes, "targets": targets(turn, modes)}
    md = render_markdown(report)
    for text in ("| seconds per step (median) | single-turn | multi-turn, instant tool | multi-turn |",
                 "| gen (rollout pool, per batch) | 0.500 | 0.600 | 0.800 |",
                 "| old_log_prob (train pool) | 0.300 | 0.300 | 0.300 |",
                 "| **step period (train pool)** | 1.000 | 1.000 | 1.000 |", "| tool/calls | n/a | n/a | 40.0 |",
                 "+0.0%", "| met |", "0.200 s"):
        assert text in md, text
    assert "**missed**" not in md and "sync_weights" not in md
    assert bench_agent.TARGETS == {"turn_added_s": 0.4, "step_growth": 0.10, "harness_gen": 1.3}
