"""Environments as episodes (spmdsplit/agent/environments.py, rollout.multi_turn.environment): how
observations and actions are read and built (ours, OpenEnv's, plain strings), the chat glue that
opens an episode, environments that raise, hang or return garbage, and whole episodes on the HF
engine with the embedded environment."""

from __future__ import annotations

import gc
import math
import threading
import time

import pytest
import torch

from spmdsplit.agent.chat import ToolChat
from spmdsplit.agent.environments import (
    EnvCall,
    Environments,
    EnvSlot,
    Observation,
    action_builder,
    load_environment,
    read_observation,
    read_returned,
)
from spmdsplit.agent.tools import ERROR_KINDS, ToolConfigError
from spmdsplit.seeds import reset_seed
from tests.support.agent_models import chat_tokenizer
from tests.support.streams import agent_stream_factory

pydantic = pytest.importorskip("pydantic")


class Say(pydantic.BaseModel):  # the shape of an OpenEnv Action: one required text field
    message: str
    metadata: dict = {}


class Board(pydantic.BaseModel):  # the shape of an OpenEnv Observation
    done: bool = False
    reward: float | None = None
    metadata: dict = {}
    board: str = ""


class Move(pydantic.BaseModel):  # an action of two fields: which one the text fills must be named
    x: str
    y: str


class Grid:
    def step(self, action: Move):
        return action


class SayEnv:
    def reset(self, seed=None, **kwargs):
        return Board(board=f"seed {seed} {sorted(kwargs.items())}")

    def step(self, action: Say) -> Board:
        return Board(board=action.message.upper(), reward=1.0, done=action.message == "stop")


def test_observations_are_read_from_ours_openenvs_and_strings():
    assert read_observation("hi") == ("hi", 0.0, False)
    assert read_observation(Observation("a", reward=0.5, done=True)) == ("a", 0.5, True)
    assert read_observation(Board(board="xo", reward=1)) == ("xo", 1.0, False)

    class TwoFields(Board):
        turn: int = 3
    text, _, _ = read_observation(TwoFields(board="xo"))
    assert text == '{"board": "xo", "turn": 3}'  # several fields: as JSON, done/reward/metadata left out
    for garbage in (7, None, Board(board="x", reward=math.nan), Observation("x", reward="high")):
        with pytest.raises(ValueError):
            read_observation(garbage)


def test_gymnasiums_tuples_are_read_with_terminated_and_truncated_apart():
    reset = read_returned(("start", {"level": 2, "name": "x", "hard": True}), reset=True)
    assert (reset.text, reset.reward, reset.terminated, reset.truncated) == ("start", 0.0, False, False)
    assert reset.info == {"level": 2.0, "hard": 1.0}  # the numbers only
    step = read_returned(({"board": "xo"}, 0.5, False, True, {"moves": 4}), reset=False)
    assert (step.text, step.reward, step.terminated, step.truncated, step.info) == ('{"board": "xo"}', 0.5, False, True,
                                                                                  {"moves": 4.0})
    assert read_returned((Board(board="xo"), 1, True, False, None), reset=False).terminated
    # gym before 0.26: done, a time limit said in info
    old = read_returned(("o", 1.0, True, {"TimeLimit.truncated": True}), reset=False)
    assert (old.terminated, old.truncated) == (False, True)
    assert read_returned(("o", 1.0, True, {}), reset=False).terminated
    # the protocol's other shapes as before
    assert read_returned(Observation("a", reward=0.5, done=True), reset=False).terminated
    for garbage, reset in ((("o", {}, 3), True), (("o", 1.0, False, False, {}), True), (("o", math.inf, False, False, {}), False),
                           (("o", "high", False, False, {}), False), ((object(), 1.0, False, False, {}), False)):
        with pytest.raises(ValueError):
            read_returned(garbage, reset=reset)


def test_a_step_annotated_with_an_action_model_gets_one_built_from_the_text():
    assert action_builder(SayEnv())("go") == Say(message="go")

    class Plain:
        def step(self, action):
            return action
    assert action_builder(Plain())("go") == "go"

    with pytest.raises(ValueError, match="environment_action_field"):
        action_builder(Grid())
    with pytest.raises(ValueError, match="has no such field"):
        action_builder(Grid(), "z")
    with pytest.raises(pydantic.ValidationError):  # y is required too: the step fails, counted as an exception
        action_builder(Grid(), "x")("a1")


def test_bad_environments_fail_at_load_with_one_line(tmp_path):
    (tmp_path / "envs.py").write_text(
        "class NoStep:\n    def __init__(self, **kw): pass\n    def reset(self): return ''\n"
        "class Broken:\n    def __init__(self, size=1):\n        raise RuntimeError(f'no board of {size}')\n"
        "    def reset(self): pass\n    def step(self, a): pass\n")
    cases = [("nowhere.Env", "cannot import module 'nowhere'"), (f"{tmp_path}/envs.py:Missing", "has no attribute"),
             (f"{tmp_path}/envs.py:NoStep", "needs reset and step"), (f"{tmp_path}/envs.py:Broken", "no board of 3")]
    for path, expected in cases:
        with pytest.raises(ToolConfigError) as e:
            load_environment(path, {"size": 3})
        assert expected in str(e.value) and "\n" not in str(e.value) and "rollout.multi_turn.environment" in str(e.value)


def environments(factory, timeout_s=2.0, chars=32):
    return Environments(factory, timeout_s=timeout_s, max_text_chars=chars, truncate_side="right")


def test_reset_and_steps_run_off_thread_and_close_when_done():
    closed = []

    class Env(SayEnv):
        def close(self):
            closed.append(self)
    envs = environments(Env)
    slot = EnvSlot()
    [opened] = envs.run([EnvCall(slot, None, {"level": 2}, seed=9)])
    assert opened.text == "seed 9 [('level', 2)]" and not opened.done and not closed
    [going, ] = envs.run([EnvCall(slot, "go")])
    assert (going.text, going.reward, going.done) == ("GO", 1.0, False)
    [stopped] = envs.run([EnvCall(slot, "stop")])
    assert stopped.done and len(closed) == 1 and slot.instance is None
    # An episode dropped unfinished (a continuous stream's restart) closes its environment when collected.
    dropped = EnvSlot()
    envs.run([EnvCall(dropped, None)])
    del dropped
    gc.collect()
    assert len(closed) == 2


def test_environments_that_raise_hang_or_return_garbage_end_their_episode_counted():
    release = threading.Event()

    class Bad(SayEnv):
        def step(self, action: Say):
            if action.message == "raise":
                raise KeyError("no such square")
            if action.message == "hang":
                release.wait()
            if action.message == "garbage":
                return 42
            return Board(board="y" * 100, reward=0.25)
    envs = environments(Bad, timeout_s=0.5)
    slots = [EnvSlot() for _ in range(4)]
    envs.run([EnvCall(s, None) for s in slots])
    start = time.monotonic()
    results = envs.run([EnvCall(s, a) for s, a in zip(slots, ["raise", "hang", "garbage", "flood"])])
    assert time.monotonic() - start < 2.0  # the hung one is given up at the timeout, not waited for
    assert [r.error for r in results] == ["exception", "timeout", "not_text", ""]
    assert all(r.done for r in results[:3]) and "KeyError" in results[0].text and "42" not in results[2].text
    assert results[3].text_cut and len(results[3].text) <= 32 + len("...[truncated]...")
    assert envs.stuck == 1 and all(e in ERROR_KINDS for e in ("exception", "timeout", "not_text"))
    release.set()


def test_an_episode_opens_with_its_observation_as_the_template_renders_it():
    """Prompt (rendered without the generation prompt) + opening glue + the policy's turn + a step's
    glue = the template's rendering of the whole conversation, token for token."""
    tokenizer = chat_tokenizer()
    chat = ToolChat(tokenizer)
    messages = [{"role": "user", "content": "play"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False),
                              add_special_tokens=False)
    opening = chat.opening_ids("board: x.o")
    policy = tokenizer.encode("b2", add_special_tokens=False) + [tokenizer.eos_token_id]
    step = chat.tool_turn_ids(["board: xxo"], tokenizer.eos_token, role="user")
    whole = tokenizer.apply_chat_template(messages + [{"role": "user", "content": "board: x.o"},
                                                      {"role": "assistant", "content": "b2"},
                                                      {"role": "user", "content": "board: xxo"}],
                                          add_generation_prompt=True, tokenize=False)
    assert prompt + opening + policy + step == tokenizer.encode(whole, add_special_tokens=False)
    # No first observation: only the generation prompt opens the episode.
    assert tokenizer.decode(chat.opening_ids("")) == "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def echo_setup(embedded_cache):
    from spmdsplit.agent import check_multi_turn, default_agent
    from spmdsplit.config import load_config
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import eos_token_ids, load_tokenizer
    from tests.support.jobs import ROOT

    cfg = load_config(f"{ROOT}/configs/environment_echo.yaml", [])
    cfg.model.path = ensure_embedded_model(agent=True)
    tokenizer = load_tokenizer(cfg.model.path)
    tools = check_multi_turn(cfg, tokenizer)
    rows, _ = build_rows(cfg.data, tokenizer, "train", tools=tools.schemas, default_agent=default_agent(cfg))
    return cfg, tokenizer, eos_token_ids(cfg.model.path, tokenizer), rows


def test_echo_episodes_on_the_hf_engine_mask_observations_and_carry_the_environments_reward(echo_setup):
    from spmdsplit.agent.echo import EchoDigits
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.rewards.rule import ENVIRONMENT_REWARD
    from spmdsplit.roles.reward import RuleReward
    from spmdsplit.inference import build_generator

    cfg, tokenizer, eos_ids, rows = echo_setup
    torch.manual_seed(5)
    rollout = build_generator(cfg, cfg.model.path, tokenizer, eos_ids, torch.device("cpu"), torch.float32, seed=3)
    prompts = collate_prompts(rows[:48], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
    batch = rollout.generate(prompts)
    digit_ids = tokenizer.convert_tokens_to_ids(list("0123456789"))
    _, scores = RuleReward(tokenizer, eos_ids).compute(batch)
    for i, info in enumerate(batch["extra_info"]):
        ids, mask = batch["responses"][i].tolist(), batch["response_mask"][i].tolist()
        n = int(batch["attention_mask"][i, -len(ids):].sum())
        # observation, action, observation, action, ...: every observation masked, every action the policy's
        assert mask[:n] == [i % 2 for i in range(n)] and ids[0] in digit_ids
        # Replayed from the reset seed: the same digits, the same reward, which is the row's score.
        env = EchoDigits(**cfg.rollout.multi_turn.environment_kwargs)
        shown, reward = env.reset(seed=reset_seed(batch["uid"][i], cfg.trainer.seed)), 0.0
        for t in range(0, n, 2):
            assert ids[t] == tokenizer.convert_tokens_to_ids(shown.text)
            if t + 1 < n:  # an EOS ends a turn: an empty action
                shown = env.step("" if ids[t + 1] in eos_ids else tokenizer.decode(ids[t + 1:t + 2]))
                reward += shown.reward
        assert info[ENVIRONMENT_REWARD] == pytest.approx(reward) == pytest.approx(scores[i].item())
        assert batch["num_turns"][i] == 1 + n // 2 + (n - 1) // 2 and batch["tool_calls"][i] == n // 2
    assert batch["tool_errors"].sum() == 0 and (batch["rollout_log_probs"][batch["response_mask"] == 0] == 0).all()


def gym_rollout(cfg, tokenizer, eos_ids, rows, environment: str):
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.inference import build_generator

    cfg = cfg.copy()
    cfg.rollout.multi_turn.environment = environment
    rollout = build_generator(cfg, cfg.model.path, tokenizer, eos_ids, torch.device("cpu"), torch.float32, seed=3)
    return rollout.generate(collate_prompts(rows[:16], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0))


def test_a_gymnasium_environments_episodes_say_how_they_ended_and_carry_its_info(echo_setup):
    batch = gym_rollout(*echo_setup, "tests.support.gym_envs.GymEcho")
    assert batch["env_truncated"].tolist() == [1] * 16 and batch["env_terminated"].tolist() == [0] * 16
    for info in batch["extra_info"]:
        assert info["environment_info"]["steps"] == 3 and 0 <= info["environment_info"]["match"] <= 1
        assert "task" not in info["environment_info"]  # a string: not a number to log
        assert len(info["environment_rewards"]) == 3


def test_a_batch_whose_every_episode_failed_stops_in_one_line_naming_the_environment(echo_setup):
    """Where every response would be empty (today a reset returning a gymnasium tuple of the wrong
    size killed the critic pool later: masked_whiten found no valid token)."""
    from spmdsplit.agent.loop import EveryEpisodeFailed

    with pytest.raises(EveryEpisodeFailed) as e:
        gym_rollout(*echo_setup, "tests.support.gym_envs.ResetReturnsGarbage")
    message = str(e.value)
    assert "\n" not in message and "rollout.multi_turn.environment=tests.support.gym_envs.ResetReturnsGarbage" in message
    assert "not_text: 16" in message and "returned a tuple of 3" in message, message


def test_a_continuous_checkpoint_restarts_the_environments_episodes_still_running(echo_setup, tmp_path):
    """An environment's state cannot be saved: a checkpoint of the stream keeps the finished
    episodes and starts those still running again from their prompt; the resumed stream hands over
    whole episodes, each scored by its own environment."""
    import io

    cfg, tokenizer, eos_ids, rows = echo_setup
    make_stream = agent_stream_factory(cfg, tokenizer, eos_ids, rows)

    stream = make_stream()
    for _ in range(200):  # until episodes are midway
        stream.engine_step()
        if any(r.tokens and not r.finished for g in stream.groups for r in g.responses):
            break
    state = stream.state()
    saved = [r for g in state["in_flight"] + state["complete"] for r in g["responses"]]
    assert saved and not any(r["tokens"] and not r["finished"] for r in saved)  # each starts again
    resumed = make_stream()
    resumed.load_state(state, same_layout=True)
    batch = resumed.next_batch(1)
    assert len(batch) == 16 and (batch["num_turns"] == 6).all()
    # Finished episodes are kept as they are; their environment's slot is saved empty.
    later = resumed.state()
    finished = [r for g in later["in_flight"] + later["complete"] for r in g["responses"] if r["finished"]]
    assert finished and all(len(r["tokens"]) == 6 and r["episode"].env.instance is None for r in finished)
    buffer = io.BytesIO()
    torch.save(later, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False)["tokens_held"] == later["tokens_held"]
    assert all(info["environment_reward"] == pytest.approx(sum(info["environment_rewards"])) for info in batch["extra_info"])
