"""The benchmark harness and the placement planner: their pure math on hand-made events and
phase times, then one real `--short` bench run and one planner run, checked by shape (never by
timings: those belong to the machine)."""

import json

import pytest

from tests.support import launch
from tools import jobs
from tools.models import ModelShape
from tools.bench import analysis, async_rollout
from tools.bench import modes as bench_modes
from tools.bench import tokens as bench_tokens
from tools.bench.__main__ import parse_args
from tools.plan import efficiency, split

SHORT = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]


def ev(name, rank, step, ts, dur, **args):
    return {"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": ts, "dur": dur, "args": {"step": step, **args}}


def meta(rank, pool):
    return {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({pool})"}}


# ------------------------------------------------------------------ pure pieces

def test_ideal_speedup():
    assert analysis.ideal_speedup(1.0, 1.0) == 2.0
    assert analysis.ideal_speedup(1.0, 4.0) == pytest.approx(1.25)
    assert analysis.ideal_speedup(3.0, 1.0) == pytest.approx(4 / 3)
    assert analysis.ideal_speedup(None, 1.0) is None and analysis.ideal_speedup(0.0, 1.0) is None


def test_median_skips_warmup_steps():
    by_step = {1: 100.0, 2: 50.0, 3: 1.0, 4: 2.0, 5: 3.0}
    assert analysis.median_after_warmup(by_step, 2) == 2.0
    assert analysis.median_after_warmup(by_step, 0) == 3.0
    assert analysis.median_after_warmup({1: 5.0, 2: 6.0}, 2) is None


def test_update_span_from_the_earliest_start_to_the_latest_end():
    events = [
        ev("update_actor", 0, 1, ts=1_000_000, dur=500_000), ev("update_critic", 1, 1, ts=1_200_000, dur=600_000),
        ev("update_actor", 0, 2, ts=5_000_000, dur=300_000), ev("update_critic", 1, 2, ts=5_300_000, dur=200_000),
        ev("gen", 0, 2, ts=0, dur=9_000_000),  # other phases do not count
    ]
    assert analysis.update_spans(events) == {1: pytest.approx(0.8), 2: pytest.approx(0.5)}


def test_pool_phase_medians_sum_chunks_and_take_the_slowest_rank():
    trace = {"traceEvents": [meta(0, "actor"), meta(1, "actor"), meta(2, "critic")] + [
        # two gen chunks per step on rank 0, one slower gen on rank 1
        ev("gen", 0, s, 0, 100_000, chunk=0) for s in (1, 2, 3)] + [
        ev("gen", 0, s, 0, 100_000, chunk=1) for s in (1, 2, 3)] + [
        ev("gen", 1, s, 0, 300_000) for s in (1, 2, 3)] + [
        ev("values", 2, s, 0, s * 100_000) for s in (1, 2, 3)]}
    pools = jobs.pools_by_rank(trace)
    assert pools == {0: "actor", 1: "actor", 2: "critic"}
    medians = analysis.pool_phase_medians(analysis.complete_events(trace), pools, warmup=1)
    assert medians == {"actor": {"gen": pytest.approx(0.3)}, "critic": {"values": pytest.approx(0.25)}}


def test_exchange_stats_with_and_without_transfer_fields():
    step_times = {1: 10.0, 2: 2.0, 3: 4.0}
    events = [ev("exchange/rollout", 1, s, 0, 400_000, bytes=1_000_000, transfer_us=200_000) for s in (1, 2, 3)]
    events += [ev("exchange/advantages", 0, s, 0, 100_000, bytes=1_000_000, transfer_us=100_000) for s in (2, 3)]
    stats = analysis.exchange_stats(events, step_times, warmup=1)
    assert stats["transfer_s"] == pytest.approx(0.2)  # the busiest receiving rank
    assert stats["share"] == pytest.approx((0.2 / 2 + 0.2 / 4) / 2)
    assert stats["wait_share"] == pytest.approx((0.4 / 2 + 0.4 / 4) / 2)
    assert stats["bandwidth_MBps"] == pytest.approx(4e6 / 6e5)  # 4 MB in 0.6 s
    old = analysis.exchange_stats([ev("exchange/rollout", 1, 2, 0, 400_000)], step_times, warmup=1)
    assert old["share"] is None and old["bandwidth_MBps"] is None and old["wait_s"] == pytest.approx(0.4)


def test_peak_memory_and_overlap_summary():
    trace = {"traceEvents": [meta(0, "actor"), meta(1, "critic"),
                             {"name": "peak_memory", "ph": "C", "pid": 1, "ts": 0,
                              "args": {"rss_mb": 300.0, "cuda_max_allocated_mb": 0.0}}]}
    assert jobs.peak_memory(trace, jobs.pools_by_rank(trace)) == [
        {"rank": 1, "pool": "critic", "rss_mb": 300.0, "cuda_max_allocated_mb": 0.0}]
    modes = {"split-blocking": {"update": {"T_actor_s": 1.0, "T_critic_s": 1.0, "span_s": 2.0}},
             "split": {"update": {"T_actor_s": 1.0, "T_critic_s": 1.0, "span_s": 1.25}}}
    summary = bench_modes.overlap_summary(modes)
    assert summary["ideal"] == 2.0 and summary["measured"] == pytest.approx(1.6)
    assert bench_modes.overlap_summary({"split": modes["split"]}) == {}


def async_trace(s: int, gen: float, train: float, steps: int = 5):
    """rollout | train at staleness s, hand-made: rank 1 (rollout) generates batch k+s during step k
    (gen seconds) then takes update k's weights; rank 0 (actor+critic) waits for the rows, trains
    (train seconds, two phases), then pushes the weights, which waits until rank 1 takes them."""
    us = 1_000_000
    events, t_gen, t_train = [], 0.0, 0.0
    for k in range(1, steps + 1):
        t_gen += gen  # batch k+s generated
        events.append(ev("gen", 1, k + s, ts=round((t_gen - gen) * us), dur=round(gen * us)))
        start = max(t_train, t_gen if s == 0 else t_train)
        events.append(ev("exchange/generated", 0, k, ts=round(t_train * us), dur=round((start - t_train) * us)))
        events.append(ev("update_critic", 0, k, ts=round(start * us), dur=round(train / 2 * us)))
        events.append(ev("update_actor", 0, k, ts=round((start + train / 2) * us), dur=round(train / 2 * us)))
        end_train = start + train
        take = max(end_train, t_gen)  # both inside sync_weights for 0.1 s
        events.append(ev("sync_weights", 0, k, ts=round(end_train * us), dur=round((take + 0.1 - end_train) * us)))
        events.append(ev("sync_weights", 1, k, ts=round(t_gen * us), dur=round((take + 0.1 - t_gen) * us)))
        t_train = t_gen = take + 0.1
    return {"traceEvents": [meta(0, "actor+critic"), meta(1, "rollout")] + events}


def test_async_step_periods_from_rank_0s_step_ends():
    events = [ev("update_actor", 0, 1, ts=0, dur=1_000_000), ev("sync_weights", 0, 1, ts=1_000_000, dur=500_000),
              ev("update_actor", 0, 2, ts=2_000_000, dur=1_500_000), ev("update_actor", 0, 3, ts=4_000_000, dur=1_000_000),
              ev("gen", 1, 9, ts=0, dur=99_000_000)]  # other ranks do not count
    assert async_rollout.step_ends(events) == {1: 1.5, 2: 3.5, 3: 5.0}
    assert async_rollout.step_periods(events) == {2: pytest.approx(2.0), 3: pytest.approx(1.5)}


def test_async_weight_sync_and_busy_split_the_push_into_transfer_and_wait():
    trace = async_trace(s=1, gen=2.0, train=1.0)
    events, pools = analysis.complete_events(trace), jobs.pools_by_rank(trace)
    sync = async_rollout.weight_sync(events, pools)
    # train ends 1 s before the rollout pool is done generating: the push waits 1 s, moves 0.1 s
    assert sync["push"][3] == pytest.approx(1.1) and sync["transfer"][3] == pytest.approx(0.1)
    assert sync["take"][3] == pytest.approx(0.1)
    busy = async_rollout.busy_per_step(events, pools, staleness=1)
    assert busy["actor+critic"][3] == pytest.approx(1.1)  # train + transfer, no wait
    assert busy["rollout"][3] == pytest.approx(2.0)  # gen of batch 4 (during step 3), its take left out
    assert set(busy["rollout"]) == {1, 2, 3, 4, 5}  # batch 2 counts in step 1, batch 6 in step 5
    assert async_rollout.steady_steps(8, warmup=2, staleness=2) == range(3, 7)  # steps 7-8 only drain
    ends = async_rollout.step_ends(events)  # steps 3-4: 2.1 s each; train 1 s + transfer 0.1 s, gen 2 s
    shares = async_rollout.busy_share_in_window(events, pools, ends[2], ends[4])
    assert shares == {"actor+critic": pytest.approx(1.1 / 2.1, rel=1e-4), "rollout": pytest.approx(2.0 / 2.1, rel=1e-4)}
    # without a rollout pool apart, sync_weights is a local load: all of it transfer, all of it busy
    local = [ev("sync_weights", 0, 1, 0, 300_000), ev("gen", 0, 1, 300_000, 1_000_000),
             ev("exchange/advantages", 0, 1, 1_300_000, 500_000)]
    assert async_rollout.weight_sync(local, {0: "actor", 1: "critic"})["transfer"] == {1: pytest.approx(0.3)}
    assert async_rollout.busy_per_step(local, {0: "actor"}) == {"actor": {1: pytest.approx(1.3)}}


def test_async_analysis_targets_and_report_from_hand_made_runs():
    scalars = {"response_length/mean": {k: 192.0 for k in range(1, 6)}, "timing_s/step": {k: 2.1 for k in range(1, 6)}}
    modes = {}
    for name, s, (gen, train) in (("colocate", 0, (1.0, 1.0)), ("split", 0, (1.0, 1.0)),
                                  ("rollout|train s=0", 0, (1.0, 1.0)), ("rollout|train s=1", 1, (1.0, 1.0))):
        modes[name] = {"ranks": 2, **async_rollout.analyze(async_trace(s, gen, train), scalars, 2, 8, staleness=s)}
    s0, s1 = modes["rollout|train s=0"], modes["rollout|train s=1"]
    assert s0["step_time_s"] == pytest.approx(2.1) and s1["step_time_s"] == pytest.approx(1.1)
    assert s1["tokens_per_s"] == pytest.approx(192 * 8 / 1.1) and s1["steps_used"] == 2 and s0["steps_used"] == 3
    assert async_rollout.ideal_pipelining(s0) == {"gen_s": pytest.approx(1.0), "train_s": pytest.approx(1.1),
                                                "ideal": pytest.approx(2.1 / 1.1)}
    rows = {r["target"]: r for r in async_rollout.targets(modes)}
    speed = rows["rollout|train s=1 step rate vs best synchronous"]
    assert speed["value"] == pytest.approx(2.1 / 1.1) and speed["met"]
    assert rows["s=1 vs s=0: share of the ideal pipelining gain"]["value"] == pytest.approx(1.0)
    assert rows["weight sync on the actor pool / step at s=1 (transfer only)"]["value"] == pytest.approx(0.1 / 1.1, rel=1e-4)
    assert rows["s=1: actor+critic pool busy"]["met"] and rows["s=1: rollout pool busy"]["met"]
    markdown = async_rollout.render_markdown({"meta": {"device": "cpu", "torch": "x", "date": "d", "model": {},
                                                     "params": 330_000, "workload": ["a=1"], "steps": 5, "warmup": 2},
                                            "modes": modes, "targets": async_rollout.targets(modes)})
    assert "| rollout|train s=1 | 2 | 1.100 | 2.100 | 1.91x |" in markdown
    assert "| s=1 vs s=0: share of the ideal pipelining gain | 100% | >= 80% | met |" in markdown
    assert async_rollout.targets({})[0]["met"] is None  # a missing mode is n/a, not a failure


def test_async_rollout_flag_defaults_and_refuses_unknown_modes():
    args = parse_args(["--async-rollout"])
    assert (args.steps, args.warmup) == (12, 2) and args.async_modes == list(async_rollout.MODES)
    assert async_rollout.staleness_of(async_rollout.MODES["rollout|train s=2"][1]) == 2
    assert async_rollout.MODES["rollout|train s=1"][0] == 2 and async_rollout.MODES["rollout|actor|critic s=1"][0] == 3
    with pytest.raises(SystemExit):
        parse_args(["--async-rollout", "--async-modes", "rollout s=9"])


@pytest.mark.parametrize("first, other", [("tools.bench.__main__", "tools.bench.memory"), ("tools.bench.memory", "tools.bench.__main__")])
def test_bench_modules_import_alone_and_in_either_order(first, other):
    """Neither the bench command nor the memory bench imports the other (what they share lives in
    tools.jobs, tools.models and tools.report), so each imports alone, and both in either order."""
    code = (f"import sys, {first}; assert {other!r} not in sys.modules, 'pulled in {other}'; import {other}")
    result = launch.python(["-c", code], cwd=launch.REPO, timeout=120)  # a fresh interpreter: nothing imported yet
    assert result.returncode == 0, result.stderr


def test_mode_overrides_keep_a_custom_layout():
    assert bench_modes.mode_overrides("split", [], 1) == ["placement.mode=split", "placement.overlap=true"]
    custom = ["placement.mode=custom", "placement.pools=[3,1]"]
    assert bench_modes.mode_overrides("split-blocking", custom, 1) == ["placement.overlap=false"]
    assert "rollout.stream_chunks=4" in bench_modes.mode_overrides("split-stream", [], 4)
    assert bench_modes.mode_overrides("colocate", custom, 1) == ["placement.mode=colocate", "placement.pools=[]"]


def profile(actor_s, critic_s):
    """Phase times on 1+1 ranks, all the work in the update phases."""
    return {"actor_size": 1, "critic_size": 1, "exchange_s": 0.01,
            "actor": {"update_actor": actor_s, "exchange/advantages": 99.0},  # waits never count as busy
            "critic": {"update_critic": critic_s}}


def test_planner_prediction_is_linear_in_pool_size():
    p = profile(1.0, 2.0)
    p["actor"]["sync_weights"] = 0.1  # does not shrink with the pool
    got = split.predict(p, 2, 4)
    assert got["actor_s"] == pytest.approx(0.6) and got["critic_s"] == pytest.approx(0.5)
    assert got["step_s"] == pytest.approx(0.61)


def test_planner_says_when_every_rank_generating_pays_off():
    """Generation-bound: spreading gen over both pools wins despite the second weight transfer;
    update-bound (gen small, the critic's update hidden behind the next gen today): it does not."""
    gen_bound = {"actor_size": 1, "critic_size": 1, "exchange_s": 0.0,
                 "actor": {"sync_weights": 0.05, "gen": 2.0, "update_actor": 0.2}, "critic": {"update_critic": 0.2}}
    got = split.predict(gen_bound, 1, 1)
    assert got["step_s"] == pytest.approx(2.25)
    assert got["all_step_s"] == pytest.approx(2 * 0.05 + 1.0 + 0.2)
    update_bound = {**gen_bound, "actor": {"sync_weights": 0.05, "gen": 0.1, "update_actor": 1.0},
                    "critic": {"update_critic": 1.2}}
    got = split.predict(update_bound, 1, 1)
    assert got["all_step_s"] > got["step_s"] - 1e-9


def test_planner_gives_the_slower_pool_more_ranks():
    workload = ["data.train_batch_size=120", "actor.ppo_mini_batch_size=120", "critic.ppo_mini_batch_size=120",
                "actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1"]
    best, _ = split.rank_candidates(profile(1.0, 2.0), 8, None, workload)
    assert best[0]["pools"] == [3, 5]  # max(1/3, 2/5) beats max(1/2, 2/6) and max(1/4, 2/4)
    best, _ = split.rank_candidates(profile(2.0, 1.0), 8, None, workload)
    assert best[0]["pools"] == [5, 3]


def test_planner_only_ranks_splits_the_batch_sizes_allow():
    accepted, rejected = split.rank_candidates(profile(1.0, 3.0), 4, None, SHORT)
    assert [r["pools"] for r in accepted] == [[2, 2]]  # 16 rows do not split over 3 ranks
    assert sorted(r["pools"] for r in rejected) == [[1, 3], [3, 1]]
    assert all("divisible" in r["reason"] for r in rejected)


def test_planner_candidates_per_node_and_node_level():
    got = split.candidates(16, 8)
    assert ("ranks_per_node", 6, 2, 12, 4) in got and ("nodes", 1, 1, 8, 8) in got and len(got) == 8
    assert split.candidates(4) == [("ranks_per_node", a, 4 - a, a, 4 - a) for a in (1, 2, 3)]


# ------------------------------------------------------------------ tokens, not padding (bench_tokens)

def test_token_budgets_hold_a_fixed_micro_batchs_tokens():
    shapes = {**bench_tokens.LONG_TAIL}
    budgets = bench_tokens.token_budgets(shapes)
    assert budgets["actor.ppo_max_token_len_per_gpu"] == 4 * (64 + 256)
    assert budgets["critic.forward_max_token_len_per_gpu"] == 16 * (64 + 256)
    assert set(budgets) == set(bench_tokens.BUDGETS)
    assert set(bench_tokens.token_budgets(shapes, 1024).values()) == {1024}
    tokens, fixed = bench_tokens.mode_overrides("tokens", budgets), bench_tokens.mode_overrides("fixed", budgets)
    assert {"actor.use_dynamic_bsz=true", "model.use_remove_padding=true", "trainer.balance_batch=true",
            "actor.ppo_max_token_len_per_gpu=1280"} <= set(tokens)
    assert {"actor.use_dynamic_bsz=true", "model.use_remove_padding=false", "trainer.balance_batch=true",
            "critic.forward_max_token_len_per_gpu=5120"} <= set(bench_tokens.mode_overrides("budgets", budgets))
    # fixed spells every switch out: balance_batch is on by default
    assert {"actor.use_dynamic_bsz=false", "critic.use_dynamic_bsz=false", "model.use_remove_padding=false",
            "trainer.balance_batch=false"} <= set(fixed)
    assert not any("max_token_len" in o for o in fixed)


def test_response_lengths_from_the_dump_and_their_histogram():
    assert bench_tokens.response_tokens(0, 256) == 1  # the EOS alone
    assert bench_tokens.response_tokens(255, 256) == 256 and bench_tokens.response_tokens(256, 256) == 256
    lengths = [1, 2, 3, 10, 100, 256]
    assert bench_tokens.length_stats(lengths) == {"count": 6, "mean": pytest.approx(62.0), "median": 6.5,
                                                  "max": 256, "min": 1}
    assert bench_tokens.length_stats([])["median"] is None
    bins = bench_tokens.histogram(lengths, 256, bins=4)
    assert bins == [(1, 64, 4), (65, 128, 1), (129, 192, 0), (193, 256, 1)]
    text = bench_tokens.text_histogram(bins, bar=8)
    assert text[0].split() == ["1-64", "########", "4", "(67%)"] and text[2].split() == ["129-192", "0", "(0%)"]


def test_padding_share_from_logged_lengths_and_each_modes_rule():
    scalars = {"prompt_length/mean": {1: 10.0, 2: 20.0, 3: 30.0}, "response_length/mean": {1: 30.0, 2: 20.0, 3: 10.0},
               "prompt_length/max": {1: 20.0, 2: 30.0, 3: 40.0}, "response_length/max": {1: 50.0, 2: 50.0, 3: 60.0},
               "timing_s/step": {1: 9.0, 2: 2.0, 3: 4.0}}
    fixed = bench_tokens.step_tokens(scalars, rows=4, packed=False)
    assert fixed[2] == {"valid": 160.0, "processed": 4 * (30 + 50)}
    assert bench_tokens.padding_share(fixed, warmup=1) == pytest.approx(1 - (160 + 160) / (320 + 400))
    tokens = bench_tokens.step_tokens(scalars, rows=4, packed=True)
    assert bench_tokens.padding_share(tokens, warmup=1) == 0.0
    assert bench_tokens.tokens_per_second(fixed, scalars["timing_s/step"], warmup=1) == pytest.approx((80 + 40) / 2)
    assert bench_tokens.padding_share({}, warmup=0) is None


def test_micro_batches_as_the_runtime_plans_them_and_what_they_process():
    rows = [(10, 5), (2, 1), (4, 20), (4, 0), (1, 1)]
    # fixed micro-batches of 2 rows, each trimmed to its widest row:
    # [(10,5),(2,1)] -> 2 x 15, [(4,20),(4,0)] -> 2 x 24, [(1,1)] -> 2
    assert bench_tokens.pass_tokens([rows], 2, None, None, packed=False) == (48, 30 + 48 + 2)
    # mini-batches of 3 rows first: [(10,5),(2,1)], [(4,20)] | [(4,0),(1,1)]
    assert bench_tokens.pass_tokens([rows], 2, 3, None, packed=False) == (48, 30 + 24 + 2 * (4 + 1))
    # a budget of 25 tokens, first fit decreasing: [24 (4,20)], [15 (10,5), 4 (4,0), 3 (2,1), 2 (1,1)]
    assert bench_tokens.pass_tokens([rows], 2, None, 25, packed=False) == (48, 24 + 4 * (10 + 5))
    assert bench_tokens.pass_tokens([rows], 2, None, 25, packed=True) == (48, 48)
    # two ranks agree on the larger count: the second's one bin is split, then a dummy (2 tokens) is added
    assert bench_tokens.pass_tokens([rows, [(1, 1)]], 2, None, 25, packed=True) == (50, 48 + 2 + 2)
    assert bench_tokens.pass_tokens([[]], 2, None, None, packed=False) == (0, 0)


def test_padding_per_pass_from_the_length_dump():
    passes = {"old_log_prob": (4, None, None), "update_actor": (1, 2, None)}
    # one rank, 4 rows per step, 2 steps: step 1 is the warm-up
    per_rank = [[(1, 1)] * 4 + [(3, 1), (1, 3), (2, 2), (2, 2)]]
    got = bench_tokens.dump_pass_tokens(per_rank, rows_per_rank=4, passes=passes, packed=False, warmup=1)
    assert got == {"old_log_prob": {"valid": 16, "processed": 4 * 6}, "update_actor": {"valid": 16, "processed": 16}}
    shares = bench_tokens.padding_shares({}, per_rank, passes, packed=False, rows=4, warmup=1)
    assert shares["padding_by_pass"] == {"old_log_prob": pytest.approx(1 / 3), "update_actor": 0.0}
    assert shares["padding_share"] == pytest.approx(1 - 32 / 40) and shares["padding_how"] == "exact"
    packed = bench_tokens.padding_shares({}, per_rank, passes, packed=True, rows=4, warmup=1)
    assert packed["padding_share"] == 0.0 and packed["padding_how"] == "exact"
    rule = bench_tokens.padding_shares({2: {"valid": 5, "processed": 5}}, [], passes, packed=True, rows=4, warmup=1)
    assert rule == {"padding_share": 0.0, "padding_by_pass": {}, "padding_how": "rule"}
    bound = bench_tokens.padding_shares({2: {"valid": 5, "processed": 10}}, [], passes, packed=False, rows=4, warmup=1)
    assert bound["padding_share"] == 0.5 and bound["padding_how"] == "upper bound"
    shapes = {**bench_tokens.LONG_TAIL}
    assert bench_tokens.pass_shapes(shapes, 2, None) == {
        "old_log_prob": (16, None, None), "ref": (16, None, None), "values": (16, None, None),
        "update_actor": (4, 8, None), "update_critic": (4, 8, None)}
    assert bench_tokens.pass_shapes(shapes, 2, bench_tokens.token_budgets(shapes, 1024))["update_critic"] == (4, 8, 1024)


def test_train_phases_sum_and_compare_fixed_with_tokens():
    phases = {"actor": {"gen": 5.0, "old_log_prob": 1.0, "ref": 1.0, "update_actor": 3.0},
              "critic": {"values": 1.0, "update_critic": 2.0, "reward": 0.1}}
    got = bench_tokens.train_phase_seconds(phases)
    assert got == {"old_log_prob": 1.0, "ref": 1.0, "values": 1.0, "update_actor": 3.0, "update_critic": 2.0, "sum": 8.0}
    assert bench_tokens.train_phase_seconds({})["sum"] is None
    fixed = {"train_phases": got, "step_time_s": 10.0, "tokens_per_s": 100.0,
             "final": {"critic/score/mean": 0.50, "actor/pg_loss": 0.001}}
    tokens = {"train_phases": {k: v / 2 for k, v in got.items()}, "step_time_s": 8.0, "tokens_per_s": 125.0,
              "final": {"critic/score/mean": 0.56, "actor/pg_loss": -0.004}}
    c = bench_tokens.compare(fixed, tokens)
    assert c["phase_ratio"]["sum"] == pytest.approx(2.0) and c["step_ratio"] == pytest.approx(1.25)
    assert c["tokens_per_s_ratio"] == pytest.approx(1.25)
    assert c["final"]["critic/score/mean"]["agree"] is False  # 0.06 > 0.01 + 5% of 0.5
    assert c["final"]["actor/pg_loss"]["agree"] is True  # near 0: the absolute tolerance
    assert bench_tokens.agree(None, 1.0) is None


def test_balance_and_final_metrics_from_scalars():
    scalars = {"global_seqlen/min": {1: 100, 2: 100, 3: 50}, "global_seqlen/max": {1: 300, 2: 150, 3: 100},
               "global_seqlen/balanced_min": {1: 100, 2: 120, 3: 70}, "global_seqlen/balanced_max": {1: 300, 2: 126, 3: 77},
               "global_seqlen/mean": {1: 200, 2: 125, 3: 75}, "global_seqlen/critic/balanced_min": {2: 0},
               "global_seqlen/critic/balanced_max": {2: 9}, "actor/pg_loss": {1: 0.5, 3: 0.2, 2: 0.3}, "timing_s/step": {1: 1.0}}
    assert bench_tokens.balance_metrics(scalars, warmup=1) == {  # a step with a rank of no tokens has no ratio
        "actor max/min tokens per rank, before": pytest.approx(1.75), "actor max/min tokens per rank, after": pytest.approx(1.075)}
    assert bench_tokens.balance_metrics({"actor/pg_loss": {1: 0.5}}, warmup=0) == {}
    assert bench_tokens.final_metrics(scalars) == {"actor/pg_loss": 0.2}


def fake_run(workload, mode, layout, phase_s, balance=None):
    phases = {p: phase_s for p in bench_tokens.TRAIN_PHASES}
    return {"workload": workload, "mode": mode, "layout": layout, "wall_s": 30.0, "step_time_s": 6 * phase_s,
            "train_phases": {**phases, "sum": 5 * phase_s}, "tokens_per_s": 1000 / phase_s,
            "padding_share": 0.7 if mode == "fixed" else 0.0, "balance": balance or {}, "padding_how": "exact",
            "padding_by_pass": {p: 0.5 for p in bench_tokens.TRAIN_PHASES} if mode == "fixed" else {},
            "final": {"critic/score/mean": 0.02}, "response_lengths": bench_tokens.length_stats([1, 50, 256]),
            "response_length_tb": {"mean": 102.3, "max": 256.0, "min": 1.0},
            "histogram": bench_tokens.histogram([1, 50, 256], 256) if workload == "long-tail" else []}


def test_targets_and_the_report_from_hand_made_runs():
    balance = {"actor max/min tokens per rank, after": 1.2, "actor max/min tokens per rank, before": 2.0}
    runs = [fake_run("long-tail", "fixed", "2+2", 1.0), fake_run("long-tail", "tokens", "2+2", 0.5, balance),
            fake_run("default", "fixed", "2+2", 1.0), fake_run("default", "tokens", "2+2", 1.04)]
    comparisons = {"long-tail 2+2 tokens": bench_tokens.compare(runs[0], runs[1]),
                   "default 2+2 tokens": bench_tokens.compare(runs[2], runs[3]),
                   "default 2+2 budgets": bench_tokens.compare(runs[2], runs[3])}  # no target for budgets
    got = {t["target"]: (t["value"], t["met"]) for t in bench_tokens.targets(comparisons, runs)}
    assert got["long tail, 2+2: five phases fixed / tokens >= 1.8"] == (pytest.approx(2.0), True)
    assert got["default, 2+2: five phases tokens / fixed <= 1.05"] == (pytest.approx(1.04), True)
    assert got["long-tail 2+2: actor max/min tokens per rank, after <= 1.1"] == (1.2, False)
    assert len(got) == 3  # "before" is no target
    report = {"meta": {"device": "cpu", "torch": "x", "date": "d", "steps": 5, "default_steps": 20, "warmup": 1, "wall_s": 120.0,
                       "overrides": [], "budgets": {"long-tail": bench_tokens.token_budgets(bench_tokens.LONG_TAIL, 1024)}},
              "runs": runs, "comparisons": comparisons,
              "targets": bench_tokens.targets(comparisons, runs)}
    md = bench_tokens.render_markdown(report)
    tables = [block.splitlines() for block in md.split("\n\n") if block.startswith("|")]
    for table in tables:  # every row as many cells as its header
        assert len({line.count("|") for line in table}) == 1, table
    assert "| long-tail | 2+2 | fixed | 1.000 | 1.000 | 1.000 | 1.000 | 1.000 | 5.000 | 6.000 | 1000 | 70.0% | 30 |" in md
    assert "| long-tail | 2+2 | tokens | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x |" in md
    assert "| default | 2+2 | budgets | critic/score/mean | 0.0200 | 0.0200 | yes |" in md
    assert "long-tail: actor.ppo_max_token_len 1024, critic.ppo_max_token_len 1024," in md
    assert "| long tail, 2+2: five phases fixed / tokens >= 1.8 | 2.00 | yes |" in md
    assert "| long-tail | 2+2 | tokens | actor max/min tokens per rank, after | 1.200 |" in md
    assert "| long-tail | 2+2 | fixed | 50.0% | 50.0% | 50.0% | 50.0% | 50.0% |" in md  # padding per pass
    assert md.count("Response lengths, long-tail") == 1 and "mean 102.3, median 50.0, max 256" in md
    assert "Response lengths, long-tail 2+2, fixed = tokens (every response" in md  # the same rollouts: shown once
    assert "5 steps per long-tail job, 20 per default job" in md


def test_long_tail_prompts_and_the_length_dump(tmp_path):
    import importlib.util

    import pyarrow.parquet as pq

    bench_tokens.write_prompts(str(tmp_path / "p.parquet"), 200, (4, 64))
    rows = pq.read_table(str(tmp_path / "p.parquet")).to_pylist()
    lengths = [len(r["prompt"]) for r in rows]
    assert min(lengths) >= 4 and max(lengths) <= 64 and max(lengths) - min(lengths) > 40
    assert all(r["prompt"].endswith("=") and r["reward_model"]["ground_truth"] == r["prompt"][-2] * 4 for r in rows)
    overrides, dump = bench_tokens.length_dump(str(tmp_path / "job"))
    path = overrides[0].split("=", 1)[1]
    spec = importlib.util.spec_from_file_location("length_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert all(r["extra_info"]["prompt_tokens"] == len(r["prompt"]) for r in rows)
    assert module.compute_score(data_source="bench/long_tail", solution_str="7777", ground_truth="7777",
                                extra_info={"index": 0, "prompt_tokens": 9}) == 1.0
    module.compute_score(data_source="bench/long_tail", solution_str="", ground_truth="1111",
                         extra_info={"index": 1, "prompt_tokens": 4})
    assert bench_tokens.read_lengths(dump, 256) == [[(9, 5), (4, 1)]]  # one process: one list
    assert bench_tokens.length_dump(str(tmp_path / "job"))[1] == dump and bench_tokens.read_lengths(dump, 256) == []


def test_random_qwen2_draws_eos_at_the_rate_asked_and_no_other_special(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tools.models import build_random_qwen2

    build_random_qwen2(str(tmp_path), hidden=64, layers=2, heads=2, kv_heads=1, mlp=128, eos_rate=0.02)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    probs = torch.softmax(model(torch.randint(4, 15, (8, 32))).logits, -1)
    assert probs[..., 2].mean().item() == pytest.approx(0.02, rel=0.25)  # id 2: the embedded EOS
    assert probs[..., [0, 1, 3]].max().item() < 1e-6  # pad, bos, unk: never drawn


# ------------------------------------------------------------------ real runs

def run_module(module: str, *args):
    """`python -m <module> *args` with its jobs started warm (tools/jobs.py's LAUNCH swapped for
    tests/support/launch.py's): the tool's harness is the subject here, not torchrun's start-up."""
    import contextlib
    import importlib
    import io
    import types

    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        mp.setattr(jobs, "LAUNCH", launch.tool_job)
        code = importlib.import_module(module).main(list(args))
    assert code == 0, stdout.getvalue()[-3000:] + stderr.getvalue()[-5000:]
    return types.SimpleNamespace(stdout=stdout.getvalue(), stderr=stderr.getvalue())


@pytest.fixture(scope="module")
def short_bench(tmp_path_factory, embedded_cache):
    out = tmp_path_factory.mktemp("bench")
    result = run_module("tools.bench.__main__", "--short", "--out", str(out))
    with open(out / "bench.json") as f:
        return out, json.load(f), result.stdout


def test_bench_json_schema(short_bench):
    _, report, _ = short_bench
    assert report["schema"] == "spmdsplit.bench/1"
    assert {"device", "nproc", "torch", "date", "workload", "steps", "warmup"} <= set(report["meta"])
    assert report["meta"]["device"] in ("cpu", "cuda") and report["meta"]["nproc"] == 2
    assert report["p2p"]["bandwidth_MBps"] > 0 and len(report["p2p"]["samples_MBps"]) == report["p2p"]["repeats"]
    assert list(report["modes"]) == ["colocate", "split-blocking", "split"]
    expected_pools = {"colocate": {"actor+critic"}, "split-blocking": {"actor", "critic"}, "split": {"actor", "critic"}}
    for name, m in report["modes"].items():
        assert m["step_time_s"] > 0 and m["steps_used"] == report["meta"]["steps"] - report["meta"]["warmup"]
        assert set(m["phases"]) == expected_pools[name]
        for pool, phases in m["phases"].items():
            wanted = {"actor": {"gen", "update_actor"}, "critic": {"values", "update_critic"}}
            assert set().union(*(wanted[p] for p in pool.split("+"))) <= set(phases)
        assert m["update"]["span_s"] > 0 and m["update"]["T_actor_s"] > 0 and m["update"]["T_critic_s"] > 0
        assert {"transfer_s", "share", "wait_s", "wait_share", "bytes_per_step", "bandwidth_MBps"} <= set(m["exchange"])
        assert [r["rank"] for r in m["peak_memory"]] == [0, 1]
        assert all(r["pool"] in expected_pools[name] and r["rss_mb"] > 0 for r in m["peak_memory"])
    for name in ("split-blocking", "split"):  # real P2P between the pools
        ex = report["modes"][name]["exchange"]
        assert ex["bytes_per_step"] > 0 and ex["bandwidth_MBps"] > 0 and 0 <= ex["share"] < 1
    ov = report["overlap"]
    assert ov["ideal"] >= 1 and ov["measured"] > 0 and ov["span_blocking_s"] > 0 and ov["span_overlap_s"] > 0


def test_bench_markdown_table(short_bench):
    out, _, stdout = short_bench
    markdown = (out / "bench.md").read_text()
    assert markdown.strip() in stdout
    for column in ("mode", "median step (s)", "update span (s)", "exchange transfer share",
                   "exchange bandwidth (MB/s)", "raw p2p (MB/s)", "peak memory per rank (MB)"):
        assert f"| {column} |" in markdown
    assert "| measured | ideal |" in markdown
    assert "| phase | colocate actor+critic | split-blocking actor | split-blocking critic |" in markdown
    for mode in ("colocate", "split-blocking", "split"):
        assert f"\n| {mode} | " in markdown


def test_bench_timeline_pngs(short_bench):
    import matplotlib.image

    out, report, _ = short_bench
    for name, m in report["modes"].items():
        path = out / m["timeline_png"]
        assert path.name == f"timeline_{name}.png" and path.stat().st_size > 0
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(str(path))
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_plan_prints_an_override_line_the_job_accepts(tmp_path, embedded_cache):
    from spmdsplit.config import load_config
    from spmdsplit.preflight import check_against_pools
    from spmdsplit.placement import plan_placement

    result = run_module("tools.plan.__main__", "--world-size", "4", "--steps", "3", "--warmup", "1",
                        "--out", str(tmp_path), "--", *SHORT)
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("placement.mode=custom placement.pool_unit=ranks_per_node placement.pools=[")
    cfg = load_config(None, SHORT + line.split())
    placement = plan_placement(cfg.placement.mode, list(cfg.placement.pools), cfg.placement.pool_unit, 4, 4, 1)
    check_against_pools(cfg, {"actor": len(placement.ranks("actor")), "critic": len(placement.ranks("critic"))})
    assert json.loads((tmp_path / "plan.json").read_text())["candidates"][0]["override"] == line


def test_gpu_check_runs_and_reports_against_the_memory_model_and_the_chip(tmp_path):
    """tools.device.gpu_check is what a session with a GPU runs first (issue 11's one-GPU check); its
    --small CPU form keeps it from rotting where there is none. Its efficiency report (issue 37
    item 4) runs the same way on CPU: CPU ops for kernels, an fp32 matmul rate for the chip."""
    result = run_module("tools.device.gpu_check", "--device", "cpu", "--small", "--steps", "3", "--rollouts", "hf",
                        "--lora", "8", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    row = report["rollouts"]["hf"]
    assert row["step_s"] > 0 and row["peak_kind"] == "RSS" and row["peak_mb"] > 0 and row["predicted_mb"] > 0
    assert "| hf | " in result.stdout
    # issue 39 item 8: the same job with a LoRA policy beside it, no efficiency table of its own
    lora = report["rollouts"]["hf+lora8"]
    assert lora["step_s"] > 0 and lora["peak_mb"] > 0 and lora["predicted_mb"] is None
    assert "| hf+lora8 | " in result.stdout and set(report["efficiency"]) == {"hf"}
    # It runs what the GPU presets changed: packed passes.
    workload = report["meta"]["workload"]
    assert {"model.use_remove_padding=true", "model.attn_implementation=auto",
            "model.gradient_checkpointing=true"} <= set(workload)

    table = report["efficiency"]["hf"]
    assert (table["timed_steps"], table["profiled_steps"]) == ([2], [3]) and table["rows_per_step"] == 8
    assert (tmp_path / "hf" / "profile" / "rank0.json.gz").is_file()  # the profiled step's trace, for Perfetto
    assert table["matmul_rate"]["dtype"] == "float32" and table["matmul_rate"]["flops_per_s"] > 1e9
    phases = table["phases"]
    # One mini-batch: the update's forward gives the old log-probs (roles/actor.py update_is_one_pass).
    passes = [name for name in efficiency.FLOP_PHASES if name != "old_log_prob"]
    assert "old_log_prob" not in phases
    assert set(passes) <= set(phases) and {"reward", "adv", "sync_weights"} <= set(phases)
    assert all(0 <= p["idle"] <= 1 for p in phases.values())  # waits included (nothing to wait for here)
    scalars = jobs.read_scalars(str(tmp_path / "hf" / "tb"))
    for name in passes:
        p = phases[name]
        assert 0 < p["mfu"] < 1 and p["tokens_per_s"] > 0 and p["seconds"] > 0, (name, p)
        assert p["top_kernels"] and all(k["name"] and k["calls"] >= 1 and 0 <= k["share"] <= 1
                                        for k in p["top_kernels"]), name
        # The step's tokens from TensorBoard's mean lengths x the rows, through the formulas.
        tokens = efficiency.step_tokens(scalars, 2, 8)
        shape = ModelShape("small", hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, mlp=128, vocab=15)
        flops = efficiency.phase_flops(name, shape, tokens, checkpointing=True, head_in_chunks=True)
        assert p["flops"] == pytest.approx(sum(flops.values())) and p["flops_by_part"] == pytest.approx(flops)
    assert phases["gen"]["tokens"] == pytest.approx(8 * 8)  # every response runs to its 8 tokens
    assert any(k["name"].startswith("aten::") for k in phases["update_actor"]["top_kernels"])
    md = (tmp_path / "gpu_check.md").read_text()
    assert "### Efficiency per phase: rollout.name=hf" in md and "| update_actor | " in md


def test_lora_bench_runs_both_jobs_and_reads_memory_sync_and_checkpoint(tmp_path):
    """tools.bench.lora at the embedded shape (docs/lora.md holds its 76M run): both jobs' numbers
    read from what they left, by shape and by what holds on any machine."""
    result = run_module("tools.bench.lora", "--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1",
                        "--mlp", "128", "--steps", "2", "--out", str(tmp_path))
    report = json.loads((tmp_path / "bench_lora.json").read_text())
    full, adapter = report["full"], report["lora"]
    for row in (full, adapter):
        assert row["actor_peak_mb"] > row["actor_before_models_mb"] > 50 and row["step_s"] > 0
        assert row["syncs"] >= 1  # the rollout pool starts with the policy's weights
    # rank 8 on the 7 linear layers of each of 2 blocks: 8 x (in + out) parameters each, in fp32
    per_block = 8 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 3 * (64 + 128))
    assert adapter["sync_bytes"] == 2 * per_block * 4
    assert full["sync_bytes"] > 3 * adapter["sync_bytes"]
    assert adapter["actor_checkpoint_mb"] < full["actor_checkpoint_mb"] / 2
    assert "| bytes per sync to the engine | " in result.stdout


@pytest.mark.slow
@pytest.mark.e2e
def test_long_tail_bench_runs_fixed_and_tokens_and_reads_what_they_left(tmp_path):
    """`tools.bench --long-tail` end to end at its smallest (1+1, long tail, 3 steps): checked by
    shape and by what must hold whatever the machine (same rollouts in both modes, no padding in
    tokens mode, some in fixed), never by timings."""
    run_module("tools.bench.__main__", "--long-tail", "--layouts", "1+1", "--workloads", "long-tail", "--steps", "3",
               "--out", str(tmp_path))
    report = json.loads((tmp_path / "bench_tokens.json").read_text())
    fixed, tokens = report["runs"]
    assert (fixed["mode"], tokens["mode"]) == ("fixed", "tokens")
    assert "model.use_remove_padding=true" in tokens["overrides"] and "trainer.balance_batch=false" in fixed["overrides"]
    for r in (fixed, tokens):
        assert r["steps_used"] == 2 and all(r["train_phases"][p] > 0 for p in bench_tokens.TRAIN_PHASES)
        assert r["response_lengths"]["count"] == 3 * 32 and r["response_lengths"]["max"] <= 256
        # the dump and TensorBoard saw the same responses
        assert r["response_lengths"]["mean"] == pytest.approx(r["response_length_tb"]["mean"], rel=0.3)
    assert fixed["response_lengths"] == tokens["response_lengths"]  # the same rollouts
    assert 0.2 < fixed["padding_share"] < 0.9 and fixed["padding_how"] == "exact" and tokens["padding_share"] == 0.0
    assert set(tokens["balance"]) >= {"actor max/min tokens per rank, after"} and not fixed["balance"]
    assert report["comparisons"]["long-tail 1+1 tokens"]["final"]["critic/score/mean"]["agree"]
    assert "| long-tail | 1+1 | tokens |" in (tmp_path / "bench_tokens.md").read_text()


def test_continuous_bench_reads_occupancy_engine_steps_and_staleness_from_each_modes_scalars():
    from tools.bench import continuous as bc

    steady = {4: 0, 5: 0}
    rows = bc.PROMPTS * bc.N
    batches = {"response_length/mean": {4: 32.0, 5: 30.0}, "response_length/max": {4: 128.0, 5: 120.0}}
    continuous = {"rollout/occupancy": {3: 99.0, 4: 50.0, 5: 60.0}, "rollout/engine_steps": {4: 40.0, 5: 44.0},
                  "rollout/token_staleness_mean": {4: 0.5, 5: 0.7}}
    mode = {"steady": sorted(steady)}
    # a batch runs for its longest answer: rows x mean / longest requests per engine step
    assert bc.occupancy(mode, batches) == pytest.approx((rows * 32 / 128 + rows * 30 / 120) / 2)
    assert bc.engine_steps(mode, batches) == pytest.approx(124.0)
    assert bc.staleness(batches, set(steady), 1) == 1.0
    assert bc.occupancy(mode, continuous) == pytest.approx(55.0)  # counted, the steady steps only
    assert bc.engine_steps(mode, continuous) == pytest.approx(42.0)
    assert bc.staleness(continuous, set(steady), 1) == pytest.approx(0.6)
    assert "batches s=1" in bc.MODES  # the baseline every speedup is read against
