"""Reward functions that wait (spmdsplit/rewards/calls.py, spmdsplit/usercode.py): a custom function
as a plain def in threads or processes, an async def, a batch function, and a reward server over
HTTP (a real aiohttp server the test starts) all give the plain function's scores on the same rows,
concurrently (a function that waits costs about its latency per batch, not per sample); a call that
raises, overruns, returns garbage or kills its process is contained, and reward.on_error says what it
scores (fail: the job stops with the sample shown; a number: scored, counted per kind)."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

from spmdsplit.batch import Batch
from spmdsplit.config import load_config
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.errors import ConfigError
from spmdsplit.models import load_tokenizer
from spmdsplit.rewards.calls import RewardCalls, Sample, check_reward_function
from spmdsplit.rewards.custom import load_custom_reward_fn
from spmdsplit.rewards.remote import RemoteReward
from spmdsplit.roles.reward import RewardError, RuleReward
from tests.support.launch import run_ranks
from tools.serve.reward_server import serve

FUNCTIONS = """
    import asyncio, math, os, time

    def score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise ZeroDivisionError("the scorer blew up")
        if solution_str == "hang":
            time.sleep(60)
        if solution_str == "garbage":
            return "not a number"
        if solution_str == "nan":
            return math.nan
        if solution_str == "exit":
            os._exit(7)
        hits = sum(a == b for a, b in zip(solution_str, ground_truth))
        return {"score": hits / max(len(solution_str), len(ground_truth)), "hits": hits}

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.2)
        return score(data_source, solution_str, ground_truth, extra_info)

    async def async_slow(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            await asyncio.sleep(60)
        await asyncio.sleep(0.2)
        return score(data_source, solution_str, ground_truth, extra_info)

    def batch(data_sources, solution_strs, ground_truths, extra_infos):
        time.sleep(0.2)
        return [score(d, s, g, e) for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]

    def short_batch(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    def one_at_a_time(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0
"""


@pytest.fixture(scope="module")
def functions(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "functions.py"
    path.write_text(textwrap.dedent(FUNCTIONS))
    return str(path)


def reward_cfg(*overrides: str, fn_path: str = "", name: str = "score"):
    cfg = load_config(None, [f"reward.custom_fn.path={fn_path}", f"reward.custom_fn.name={name}", *overrides])
    return cfg.reward


def calls(functions, name, *overrides, remote=None) -> RewardCalls:
    r = reward_cfg(*overrides, fn_path=functions, name=name)
    fn = load_custom_reward_fn(functions, name) if name else None
    check_reward_function(r, fn)
    return RewardCalls(r, fn, remote)


def samples(n: int) -> list[Sample]:
    """Digit answers against ground truths they partly match (the embedded task's source)."""
    return [Sample("synthetic/copy", f"{i:04d}", f"{(i * 7) % 10000:04d}", {"index": i}, prompt_str=f"p{i}")
            for i in range(n)]


def plain_scores(functions, rows) -> list[tuple[float, dict]]:
    fn = load_custom_reward_fn(functions, "score")
    out = []
    for s in rows:
        r = fn(data_source=s.data_source, solution_str=s.solution_str, ground_truth=s.ground_truth, extra_info=s.extra_info)
        out.append((r["score"], {"hits": float(r["hits"])}))
    return out


@pytest.mark.parametrize("name, overrides", [
    ("slow", ()),  # naive: threads
    ("slow", ("reward.reward_manager.name=prime", "reward.num_workers=2")),  # worker processes
    ("async_slow", ()),  # the event loop
    ("batch", ("reward.reward_manager.name=batch",)),  # one call
])
def test_every_shape_gives_the_plain_functions_scores(functions, name, overrides):
    rows = samples(12)
    got = calls(functions, name, *overrides).score(rows)
    assert [(r.score, r.extras) for r in got] == plain_scores(functions, rows)
    assert all(r.error is None for r in got)


def test_a_reward_server_gives_the_built_in_scores(functions):
    """The server scores with spmdsplit's built-in scorer, in slime's answer shape and in
    OpenRLHF's; the request carries both projects' fields and verl's names."""
    from spmdsplit.rewards.rule import positional_match_score

    rows = samples(12)
    want = [positional_match_score(s.solution_str, s.ground_truth) for s in rows]
    for answer in ("slime", "openrlhf"):
        server = serve(answer=answer)
        try:
            got = calls(functions, "", "reward.remote_url=" + server.url,
                        remote=RemoteReward(server.url, 3, 64, 30)).score(rows)
        finally:
            server.stop()
        assert [r.score for r in got] == want and all(r.error is None for r in got), answer
    body = server.behaviour.bodies[0]
    assert {"prompt", "response", "label", "query", "prompts", "labels", "data_source", "ground_truth",
            "extra_info"} <= set(body)
    assert body["query"] == [body["prompt"] + body["response"]] and body["labels"] == [body["label"]]


def test_waiting_costs_its_latency_per_batch_not_per_sample(functions):
    """128 samples of a function that waits 0.2 s each: threads, the event loop, a server, the
    defaults all at once (with one call at a time it would be 25.6 s)."""
    rows = samples(128)
    timings = {}
    for what, make in [("threads", lambda: calls(functions, "slow")),
                       ("async", lambda: calls(functions, "async_slow"))]:
        start = time.monotonic()
        assert all(r.error is None for r in make().score(rows))
        timings[what] = time.monotonic() - start
    server = serve(sleep_s=0.2)
    try:
        start = time.monotonic()
        got = calls(functions, "", "reward.remote_url=" + server.url, remote=RemoteReward(server.url, 3, 64, 30)).score(rows)
        timings["server"] = time.monotonic() - start
    finally:
        server.stop()
    assert all(r.error is None for r in got)
    # One call at a time would take 25.6 s; the bench (tools.bench --reward) times it against its goal.
    assert all(t < 8 for t in timings.values()), timings


@pytest.mark.parametrize("name, overrides", [
    ("score", ()), ("score", ("reward.reward_manager.name=prime", "reward.num_workers=2")), ("async_slow", ())])
def test_faults_are_contained_and_named(functions, name, overrides):
    rows = [Sample("synthetic/copy", text, "1234", {}) for text in ("raise", "hang", "garbage", "nan", "1234")]
    got = calls(functions, name, "reward.timeout_s=1", *overrides).score(rows)
    kinds = [r.error for r in got]
    if name == "async_slow":  # its own checks come after the sleep: raise, garbage and nan score
        assert kinds[1] == "timeout" and got[4].score == 1.0
        return
    assert kinds == ["exception", "timeout", "bad_result", "bad_result", None], [(r.error, r.message) for r in got]
    assert "ZeroDivisionError: the scorer blew up" in got[0].message and "NaN" in got[3].message
    assert got[4].score == 1.0


def test_a_worker_process_that_dies_costs_its_sample_only(functions):
    c = calls(functions, "score", "reward.reward_manager.name=prime", "reward.num_workers=1")
    got = c.score([Sample("x", t, "1234", {}) for t in ("1234", "exit", "1234")])
    assert [r.error for r in got] == [None, "exception", None] and "exit code 7" in got[1].message


def test_a_batch_function_of_the_wrong_length_is_a_bad_result(functions):
    got = calls(functions, "short_batch", "reward.reward_manager.name=batch").score(samples(3))
    assert {r.error for r in got} == {"bad_result"} and "1 results for 3 samples" in got[0].message


def test_a_server_that_misbehaves_is_tried_again_then_named(functions):
    rows = samples(2)

    def scored_by(behaviour_kwargs, retries=2, timeout_s=30):
        server = serve(**behaviour_kwargs)
        try:
            c = calls(functions, "", "reward.remote_url=" + server.url, f"reward.timeout_s={timeout_s}",
                      remote=RemoteReward(server.url, retries, 64, timeout_s))
            return c.score(rows), server.behaviour.requests
        finally:
            server.stop()

    got, requests = scored_by({"statuses": [503, 502]})  # two failures, then answers: retried with backoff
    assert all(r.error is None for r in got) and requests == 4
    got, requests = scored_by({"statuses": [500] * 10})
    assert {r.error for r in got} == {"http_error"} and requests == 6 and "after 3 tries" in got[0].message
    got, _ = scored_by({"statuses": [404]})
    assert got[0].error == "http_error" and "HTTP 404" in got[0].message
    got, _ = scored_by({"answer": "garbage"})
    assert {r.error for r in got} == {"bad_result"} and "not JSON" in got[0].message
    got, _ = scored_by({"answer": "no_score"})
    assert {r.error for r in got} == {"bad_result"} and "no score" in got[0].message
    got, _ = scored_by({"sleep_s": 5}, retries=0, timeout_s=0.5)
    assert {r.error for r in got} == {"timeout"}
    down = serve()
    down.stop()  # its port is closed now: nothing answers
    got = calls(functions, "", "reward.remote_url=" + down.url,
                remote=RemoteReward(down.url, 1, 64, 30)).score(rows)
    assert {r.error for r in got} == {"unreachable"} and "after 2 tries" in got[0].message


# ------------------------------------------------------------------ what a failed sample scores

@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_embedded_model())


def batch_of(tokenizer, texts, truth="1234"):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    responses = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    prompt = torch.full((len(texts), 2), tokenizer.convert_tokens_to_ids("1"))
    return Batch({"responses": responses, "response_mask": mask,
                  "input_ids": torch.cat([prompt, responses], 1),
                  "attention_mask": torch.cat([torch.ones_like(prompt), mask], 1)},
                 {"data_source": ["synthetic/copy"] * len(texts), "ground_truth": [truth] * len(texts),
                  "extra_info": [{}] * len(texts)})


def test_on_error_a_number_scores_and_counts_each_kind(functions, tokenizer, capsys):
    """Digits are all the embedded tokenizer spells, so the faults are keyed on digit strings here."""
    path = functions.replace("functions.py", "digits.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent("""
            import time
            def score(data_source, solution_str, ground_truth, extra_info=None):
                if solution_str == "1":
                    raise ValueError("one")
                if solution_str == "2":
                    time.sleep(30)
                if solution_str == "3":
                    return "three"
                return float(solution_str == ground_truth)
        """))
    r = reward_cfg("reward.timeout_s=1", "reward.on_error=-1", fn_path=path)
    reward = RuleReward(tokenizer, calls=RewardCalls(r, load_custom_reward_fn(path, "score")))
    _, scores = reward.compute(batch_of(tokenizer, ["1234", "1", "2", "3", "1"]), keep_extras=True)
    assert scores.tolist() == [1.0, -1.0, -1.0, -1.0, -1.0]
    assert dict(reward.error_counts) == {"exception": 2, "timeout": 1, "bad_result": 1}
    assert capsys.readouterr().err == ""  # not all failed: nothing said
    _, scores = reward.compute(batch_of(tokenizer, ["1", "3"]), keep_extras=True)
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned == ["spmdsplit: warning: every one of this batch's 2 rewards failed (bad_result 1, exception 1; "
                      "the custom reward function): each scored reward.on_error=-1"], warned
    r = reward_cfg("reward.timeout_s=1", fn_path=path)  # fail: the first failed sample stops it, shown
    with pytest.raises(RewardError) as e:
        RuleReward(tokenizer, calls=RewardCalls(r, load_custom_reward_fn(path, "score"))).compute(
            batch_of(tokenizer, ["1234", "2"]))
    assert "sample 1" in str(e.value) and "did not return within" in str(e.value) and "reward.on_error" in str(e.value)


def pooled_error_metrics(rank, world_size, path):
    """Two ranks of one pool, one with failures: the pool's counts per kind, on both."""
    import torch.distributed as dist

    tokenizer = load_tokenizer(ensure_embedded_model())
    r = reward_cfg("reward.timeout_s=1", "reward.on_error=0", fn_path=path)
    reward = RuleReward(tokenizer, calls=RewardCalls(r, load_custom_reward_fn(path, "score")))
    texts = ["1234", "1", "3", "1"] if rank == 0 else ["1234", "1234"]
    reward.compute(batch_of(tokenizer, texts), keep_extras=True)
    return reward.pop_extra_metrics(dist.group.WORLD, torch.device("cpu"))


def test_the_pool_reports_each_kinds_count(functions):
    path = functions.replace("functions.py", "digits.py")  # written by the test above, or here
    with open(path, "w") as f:
        f.write(textwrap.dedent("""
            def score(data_source, solution_str, ground_truth, extra_info=None):
                if solution_str == "1":
                    raise ValueError("one")
                if solution_str == "3":
                    return "three"
                return float(solution_str == ground_truth)
        """))
    first, second = run_ranks(pooled_error_metrics, 2, path)
    assert first == second == {"reward/errors/exception": 2.0, "reward/errors/bad_result": 1.0}


@pytest.mark.parametrize("overrides, fn, message", [
    (["reward.remote_url=http://127.0.0.1:1/"], "score", "reward.custom_fn.path are both set"),
    (["reward.remote_url=127.0.0.1:1"], "", "expected an http:// or https:// address"),
    (["reward.reward_manager.name=batch"], "", "set reward.custom_fn.path"),
    (["reward.reward_manager.name=prime"], "async_slow", "is an async def: use naive"),
    (["reward.reward_manager.name=batch"], "score", "it lacks data_sources, solution_strs"),
])
def test_reward_settings_that_cannot_work_are_one_line(functions, overrides, fn, message):
    r = reward_cfg(*overrides, fn_path=functions if fn else "", name=fn or "compute_score")
    with pytest.raises(ConfigError, match=message) as e:
        check_reward_function(r, load_custom_reward_fn(functions, fn) if fn else None)
    assert "\n" not in str(e.value)
    assert "reward.on_error" in str(pytest.raises(ConfigError, load_config, None, ["reward.on_error=maybe"]).value)
