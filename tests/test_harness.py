"""Agent harnesses that drive the model themselves through the OpenAI API (rollout.agent.harness,
spmdsplit/agent/harness.py), with the real `openai` client: the embedded echo task played by an
async harness learns as the environment's own loop does; harnesses that raise, hang or return
garbage are contained and counted, and a batch whose every episode failed stops in one line."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.support.jobs import POOL, ROOT, learning_run
from tests.support.launch import job

PRESET = f"{ROOT}/configs/environment_echo.yaml"
HARNESS = ["rollout.multi_turn.enable=false", "rollout.agent.harness=tests.support.harnesses.echo_harness"]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["batch_split", "continuous_rollout_pool"])
def test_an_openai_client_harness_learns_the_echo_task_through_the_endpoint(tmp_path, mode):
    """tests/support/harnesses.py echo_harness: 3 chat calls an episode, each a one-token answer,
    on 2 ranks, in split and with continuous generation on a rollout pool one batch ahead; a random
    policy scores ~0.05, and the run ends once 5 steps in a row average 0.9 (33 and 44 steps by
    hand), as the environment's own loop learns it."""
    layout = ["placement.mode=split"] if mode == "batch_split" else [*POOL, "rollout.continuous=true"]
    stdout, first, best = learning_run(tmp_path, PRESET, 0.9, *layout, *HARNESS, "trainer.num_threads=1")
    assert first <= 0.15 and best >= 0.9, (first, best, stdout[-1500:])


@pytest.mark.e2e
def test_a_harness_episodes_rows_that_do_not_extend_each_other_are_all_trained(tmp_path):
    """forgetful_echo_harness (3 calls an episode, none extending the one before) with
    rollout.agent.rows_per_episode=3 under GRPO, on a rollout pool of its own, 2 steps of 8 prompts
    x 2: the dumps hold every episode's 3 rows in order, each with the episode's score, and the
    step counts the 32 rows beyond the episodes' first (with one row an episode: 16 rows, none)."""
    import json

    from tools.jobs import read_scalars

    dumps = tmp_path / "dumps"
    result = job(2, "--config", PRESET, "rollout.multi_turn.enable=false",
                 "rollout.agent.harness=tests.support.harnesses.forgetful_echo_harness",
                 "rollout.agent.rows_per_episode=3", "algorithm.adv_estimator=grpo", "rollout.n=2",
                 *POOL, "trainer.total_steps=2", "data.train_batch_size=8",
                 "actor.ppo_mini_batch_size=4", "trainer.num_threads=1", f"trainer.rollout_data_dir={dumps}",
                 f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=", "trainer.output_dir=", timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (dumps / "2.jsonl").read_text().splitlines()]
    assert sorted(r["episode_row"] for r in rows) == [0] * 16 + [1] * 16 + [2] * 16, rows[:3]
    assert all(r["row_index"] % 3 == r["episode_row"] for r in rows), rows[:3]  # an episode's rows in order
    by_episode = {}
    for r in sorted(rows, key=lambda r: r["row_index"]):
        by_episode.setdefault(r["row_index"] // 3, []).append(r["score"])
    assert all(len(set(scores)) == 1 for scores in by_episode.values()), by_episode
    assert read_scalars(str(tmp_path / "tb"))["agent/harness/rows_extra"] == {1: 32.0, 2: 32.0}


async def raises(client, row):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "3"}], max_tokens=1)
    raise KeyError("no such tool")


async def hangs(client, row):
    await asyncio.sleep(60)


async def garbage(client, row):
    return {"reward": float("nan")}


async def plays(client, row):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "3"}],
                                                 max_tokens=2)
    return 1.0 if reply.choices[0].message.content else 0.5


@pytest.fixture(scope="module")
def rollout_of(embedded_cache):
    from spmdsplit.config import load_config
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import eos_token_ids, load_tokenizer
    from spmdsplit.inference import build_generator

    cfg = load_config(PRESET, [*HARNESS, "rollout.agent.harness_timeout_s=5"])
    cfg.model.path = ensure_embedded_model(agent=True)
    tokenizer = load_tokenizer(cfg.model.path)
    rows, _ = build_rows(cfg.data, tokenizer, "train")
    prompts = collate_prompts(rows[:8], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
    rollout = build_generator(cfg, cfg.model.path, tokenizer, eos_token_ids(cfg.model.path, tokenizer),
                              torch.device("cpu"), torch.float32, seed=3)

    def make(harness):  # one engine and server for the module, each test's harness
        rollout.harness = harness
        return rollout, prompts
    yield make
    rollout.close()


def test_harnesses_that_fail_are_contained_counted_and_scored_zero(rollout_of):
    from spmdsplit.rewards.rule import ENVIRONMENT_REWARD

    rollout, prompts = rollout_of(plays)
    good = rollout.generate(prompts)
    assert [info[ENVIRONMENT_REWARD] for info in good["extra_info"]] == [1.0] * 8
    assert good["response_mask"].sum(-1).tolist() == [2] * 8 and good["input_ids"].shape[0] == 8
    calls = {"n": 0}

    async def mixed(client, row):
        calls["n"] += 1
        return await (raises, hangs, garbage, plays)[int(row["uid"].split("-")[1]) % 4](client, row)
    rollout.harness = mixed
    batch = rollout.generate(prompts)
    assert [info[ENVIRONMENT_REWARD] for info in batch["extra_info"]] == [0.0, 0.0, 0.0, 1.0] * 2
    from spmdsplit.agent.tools import ERROR_KINDS

    errors = dict(zip(ERROR_KINDS, batch["tool_errors"].sum(0).tolist()))
    assert errors == {"bad_call": 0, "unknown_tool": 0, "bad_arguments": 0, "exception": 2, "timeout": 2, "not_text": 2}
    assert batch["tool_calls"].tolist() == [1, 0, 0, 1] * 2 and batch["harness_rows_dropped"].sum() == 0
    assert batch["response_mask"][0].sum() == 1  # what a failed episode's calls made is kept


def test_calls_that_do_not_extend_the_row_before_are_the_episodes_further_rows(rollout_of):
    """forgetful_echo_harness: 3 calls an episode, none extending the one before. With
    rollout.agent.rows_per_episode=4 each episode trains its 3 rows (one token each) and an empty
    one, each row says which of its episode's it is, and generate_rows places row j of prompt row i
    at 4 i + j of the global batch; with 2, the third row is dropped and counted."""
    from spmdsplit.generation.shares import generate_rows
    from spmdsplit.rewards.rule import ENVIRONMENT_REWARD
    from tests.support.harnesses import forgetful_echo_harness

    rollout, prompts = rollout_of(forgetful_echo_harness)
    prompts = prompts.slice(0, 4)
    prompts["row_index"] = torch.arange(10, 14)
    try:
        rollout.cfg.rows_per_episode = 4
        batch = generate_rows(rollout, prompts, torch.device("cpu"))
        assert batch["episode_row"].tolist() == [0, 1, 2, -1] * 4
        assert batch["response_mask"].sum(-1).tolist() == [1, 1, 1, 0] * 4
        assert batch["row_index"].tolist() == list(range(40, 56))
        assert batch["uid"] == [uid for uid in prompts["uid"] for _ in range(4)]
        rewards = [info[ENVIRONMENT_REWARD] for info in batch["extra_info"]]
        assert rewards == [r for r in rewards[::4] for _ in range(4)]  # the episode's, on each of its rows
        assert batch["harness_rows_dropped"].sum() == 0
        rollout.cfg.rows_per_episode = 2
        batch = rollout.generate(prompts)
        assert batch["episode_row"].tolist() == [0, 1] * 4 and batch["harness_rows_dropped"].tolist() == [1] * 8
        validation = rollout.generate(prompts, validate=True)  # scored once an episode: its first row
        assert len(validation) == 4 and "episode_row" not in validation
    finally:
        rollout.cfg.rows_per_episode = 1


def test_a_batch_whose_every_harness_episode_failed_stops_in_one_line(rollout_of):
    from spmdsplit.agent.harness import EveryHarnessEpisodeFailed

    rollout, prompts = rollout_of(raises)
    with pytest.raises(EveryHarnessEpisodeFailed) as e:
        rollout.generate(prompts)
    assert "\n" not in str(e.value) and "rollout.agent.harness" in str(e.value)
    assert "exception: 8" in str(e.value) and "KeyError" in str(e.value), str(e.value)


def test_a_bad_harness_stops_the_job_before_it_starts_with_one_line(tmp_path):
    from spmdsplit.agent import check_harness
    from spmdsplit.config import load_config
    from spmdsplit.errors import ConfigError

    (tmp_path / "h.py").write_text("async def one(client):\n    return 1\nnot_callable = 3\n")
    cases = [([f"rollout.agent.harness={tmp_path}/h.py:gone"], "has no attribute 'gone'"),
             ([f"rollout.agent.harness={tmp_path}/h.py:one"], "a harness takes (client, row)"),
             ([f"rollout.agent.harness={tmp_path}/h.py:not_callable"], "expected a function"),
             ([HARNESS[1], "rollout.multi_turn.enable=true"], "drives the turns itself")]
    for overrides, expected in cases:
        cfg = load_config(PRESET, ["rollout.multi_turn.enable=false", *overrides])
        with pytest.raises(ConfigError) as e:
            check_harness(cfg)
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rows_per_episode_is_refused_in_one_line_where_an_episodes_advantage_is_not_one_number():
    from spmdsplit.config import load_config
    from spmdsplit.errors import ConfigError
    from spmdsplit.preflight import check_config

    rows, grpo = "rollout.agent.rows_per_episode=2", ["algorithm.adv_estimator=grpo", "rollout.n=2"]
    cases = [(["rollout.agent.harness="], "rollout.agent.harness is empty"),
             (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator=gae does not compute; use one of grpo, rloo"),
             (["algorithm.use_kl_in_reward=true"], "use actor.use_kl_loss"),
             (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.enable=true")]
    for overrides, expected in cases:
        cfg = load_config(PRESET, [*HARNESS, rows, *grpo, *overrides])
        with pytest.raises(ConfigError) as e:
            check_config(cfg)
        assert expected in str(e.value) and rows in str(e.value) and "\n" not in str(e.value), str(e.value)
    check_config(load_config(PRESET, [*HARNESS, rows, *grpo]))


def test_a_fixed_port_in_use_stops_the_job_before_it_starts_and_a_free_one_is_served(monkeypatch):
    """rollout.agent.port: local rank k's endpoint at port + k; one taken is one line naming the
    key before the first collective."""
    import socket

    from spmdsplit.agent import check_harness
    from spmdsplit.agent.harness import endpoint_port
    from spmdsplit.config import load_config
    from spmdsplit.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("LOCAL_RANK", "1")
        cfg = load_config(PRESET, [*HARNESS, f"rollout.agent.port={port - 1}"])  # local rank 1's
        with pytest.raises(ConfigError) as e:
            check_harness(cfg)
        assert str(e.value).startswith(f"rollout.agent.port={port - 1}: 127.0.0.1:{port}, the endpoint of local rank 1")
        assert "in use" in str(e.value) and "\n" not in str(e.value)
    check_harness(cfg)  # freed
    assert endpoint_port(0, 3) == 0 and endpoint_port(9000, 3) == 9003


@pytest.fixture(scope="module")
def harness_stream(embedded_cache):
    """A continuous generation stream of the echo harness's episodes on the HF engine
    (tests/support/streams.py: 8 prompts a batch, 2 episodes each, one token a step)."""
    from spmdsplit.config import load_config
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import eos_token_ids, load_tokenizer
    from tests.support.streams import agent_stream_factory

    cfg = load_config(PRESET, HARNESS)
    cfg.model.path = ensure_embedded_model(agent=True)
    tokenizer = load_tokenizer(cfg.model.path)
    rows, _ = build_rows(cfg.data, tokenizer, "train")
    made = []

    def make():
        made.append(agent_stream_factory(cfg, tokenizer, eos_token_ids(cfg.model.path, tokenizer), rows)())
        return made[-1]
    yield make
    for stream in made:
        stream.harness.close()


def midway(stream) -> None:
    """Engine steps until some episode is running with a call answered."""
    for _ in range(200):
        stream.engine_step()
        if any(stream.harness.episodes.get(g.responses[m].episode.episode).calls for g, m in stream.playing):
            return
    raise AssertionError("no episode got midway")


def test_continuous_generation_runs_harness_episodes_one_by_one_and_a_checkpoint_restarts_those_running(harness_stream):
    """Under continuous generation the stream steps the engine for the harness's calls: a batch's
    rows are whole episodes (3 calls, 3 trained tokens, each with the version that sampled it). A
    checkpoint keeps the finished episodes and starts those running again from their prompts (a
    harness's state cannot be saved); the resumed stream hands whole episodes over."""
    import io

    stream = harness_stream()
    batch = stream.next_batch(1)
    assert len(batch) == 16 and batch["num_turns"].tolist() == [4] * 16
    assert batch["response_mask"].sum(-1).tolist() == [3] * 16
    assert (batch["token_weights_version"][batch["response_mask"].bool()] == 0).all()
    midway(stream)
    state = stream.state()
    saved = [r for g in state["in_flight"] + state["complete"] for r in g["responses"]]
    assert state["running"] and not any(r["tokens"] and not r["finished"] for r in saved)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = harness_stream()
    resumed.load_state(torch.load(buffer, weights_only=False), same_layout=True)
    batch = resumed.next_batch(2)
    assert len(batch) == 16 and batch["num_turns"].tolist() == [4] * 16
    assert batch["response_mask"].sum(-1).tolist() == [3] * 16


def test_a_harness_episode_holding_tokens_too_old_is_given_up_and_played_again(harness_stream):
    """Staleness under continuous generation: an episode still running whose first token is older
    than the batch allows (its tokens on the server, answered or not) is cancelled, its calls
    refused from then on, and played again from its prompt; one whose first call has no token yet
    plays on (its tokens will be the new version's); the batch trains the new version's tokens only."""
    stream = harness_stream()
    midway(stream)
    playing = [g.responses[m].episode for g, m in stream.playing]
    old = [p for p in playing if p.first_version() is not None]
    stream.version = 1
    stream.restart_stale(6)  # allows versions >= 6 - 1 - staleness 4 = 1
    assert old and stream.counts["restarted"] >= len(old) and all(p.outcome.cancelled() for p in old)
    assert not any(stream.harness.episodes.is_open(p.episode) for p in old)
    assert not any(p.outcome.cancelled() for p in playing if p not in old)
    batch = stream.next_batch(1)
    assert len(batch) == 16 and batch["num_turns"].tolist() == [4] * 16
    assert (batch["token_weights_version"][batch["response_mask"].bool()] == 1).all()
