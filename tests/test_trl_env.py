"""Environments written for TRL's environment_factory (spmdsplit/agent/trl_env.py): which methods
are tools and their schemas, how the style is told from a gym one, one instance per episode, what
a call's return or exception reads as, calls and get_reward that raise, hang or return garbage, and
whole episodes on the HF engine with the embedded agent model."""

from __future__ import annotations

import asyncio
import collections
import json
import threading

import pytest
import torch

from spmdsplit.agent.environments import EnvCall, EnvResult, EnvSlot
from spmdsplit.agent.tools import Call, ToolConfigError, ToolResult
from spmdsplit.agent.trl_env import MethodCall, TrlEnvironments, is_trl_style, load_trl_environments, tool_names
from tests.support.streams import agent_stream_factory

# An environment as TRL's users write one: shows a digit; the policy answers by calling say (the
# embedded agent model's compact call "5@"); a say of the first three scores a tenth for the call and
# the rest when it repeats the digit shown, and shows the next; the first digit shown adds
# thousandths, so that episodes without a say still score apart from a rank that scored none. Each episode's end (get_reward) is logged with its calls, to LOG, set when written out.
TRL_ECHO = '''
import itertools, json, os, random

LOG = {log!r}
SERIAL = itertools.count()


class EchoGame:
    TURNS = 3

    def __init__(self):
        self.serial = (os.getpid(), next(SERIAL))
        self.said, self.hits, self.digit = [], 0, None

    def reset(self, **row) -> str:
        self.rng = random.Random(hash(self.serial))
        self.digit = self.rng.randrange(10)
        self.shown = [self.digit]
        return str(self.digit)

    def say(self, digit: str) -> str:
        """Says the digit shown.

        Args:
            digit: The digit the policy read.
        """
        if len(self.said) < self.TURNS:
            self.hits += 0.1 + 0.9 * (digit == str(self.digit))
        self.said.append(digit)
        self.digit = self.rng.randrange(10)
        self.shown.append(self.digit)
        return str(self.digit)

    def get_reward(self) -> float:
        reward = self.hits / self.TURNS + self.shown[0] / 1000
        with open(LOG, "a") as f:
            f.write(json.dumps({{"serial": self.serial, "said": self.said, "shown": self.shown, "reward": reward}}) + "\\n")
        return reward
'''


class Shop:
    """A TRL-style environment with every kind of member."""
    made = 0

    def __init__(self):
        Shop.made += 1
        self.number, self.basket = Shop.made, []

    def reset(self, **row) -> str | None:
        self.basket = list(row.get("start", []))
        return f"shop {self.number}" if row.get("greet") else None

    def add(self, item: str, count: int = 1) -> int:
        """Puts an item in the basket.

        Args:
            item: What to add.
            count: How many of it.
        """
        self.basket += [item] * count
        return len(self.basket)

    async def price(self, item: str) -> float:
        """The price of an item.

        Args:
            item: The item.
        """
        if item == "gold":
            raise ValueError("gold is not for sale")
        return 1.5

    def wait(self, seconds: float) -> str:
        """Waits.

        Args:
            seconds: How long.
        """
        threading.Event().wait(seconds)
        return "waited"

    def get_reward(self) -> float:
        if "bomb" in self.basket:
            raise RuntimeError("exploded")
        if "nan" in self.basket:
            return float("nan")
        if "text" in self.basket:
            return "ten"
        return float(len(self.basket))

    def _secret(self) -> None:
        pass

    @staticmethod
    def helper() -> None:
        pass

    @property
    def total(self) -> int:
        raise AssertionError("a property is never read to find the tools")


def shop(timeout_s: float = 2.0) -> TrlEnvironments:
    return load_trl_environments(Shop, "tests.Shop", {}, timeout_s=timeout_s, max_text_chars=64, truncate_side="middle")


def test_the_tools_are_the_public_methods_with_transformers_schemas():
    from transformers.utils import get_json_schema

    envs = shop()
    probe = Shop()
    assert tool_names(probe) == ["add", "price", "wait"]  # not reset, get_reward, _secret, a staticmethod, a property
    assert envs.schemas == [get_json_schema(getattr(probe, n)) for n in ("add", "price", "wait")]
    add = envs.schemas[0]["function"]
    assert add["parameters"]["properties"]["count"] == {"type": "integer", "description": "How many of it."}
    assert add["parameters"]["required"] == ["item"] and envs.has_reward


def test_bad_trl_classes_stop_the_job_at_load_with_one_line(tmp_path):
    class NoDoc:
        def reset(self, **row):
            return None

        def play(self, move: str) -> str:
            return move

    class NoTools:
        def reset(self, **row):
            return None

        def get_reward(self) -> float:
            return 0.0

    def load(target, kwargs=None):
        with pytest.raises(ToolConfigError) as e:
            load_trl_environments(target, "m.X", kwargs or {}, timeout_s=1, max_text_chars=8, truncate_side="left")
        assert "\n" not in str(e.value) and str(e.value).startswith("rollout.multi_turn.environment=m.X: ")
        return str(e.value)
    assert "method play: cannot build a schema for play()" in load(NoDoc)
    assert "at least one public method" in load(NoTools)
    assert "clear them with rollout.multi_turn.environment_kwargs={}" in load(Shop, {"turns": 3})


def test_the_style_is_told_by_the_class_or_named():
    class Gym:
        def reset(self, seed=None):
            return ""

        def step(self, action):
            return ""

    class TrlWithAStepTool(Gym):
        def get_reward(self) -> float:
            return 0.0

    assert is_trl_style(Shop) and is_trl_style(TrlWithAStepTool) and not is_trl_style(Gym)
    assert not is_trl_style(lambda: Shop())  # a factory function: gym unless named
    assert is_trl_style(Gym, "trl") and not is_trl_style(Shop, "gym")


def test_one_instance_per_episode_its_reset_text_first_and_calls_answered_as_trl_does():
    envs = shop()
    made = Shop.made
    a, b = EnvSlot(), EnvSlot()
    opened = envs.run([EnvCall(a, None, {"greet": True}), EnvCall(b, None, {"start": ["x"]})])
    assert Shop.made == made + 2 and a.instance is not b.instance
    assert all(isinstance(r, EnvResult) and not r.error and not r.done for r in opened)
    assert [r.text for r in opened] == [f"shop {a.instance.number}", ""]  # reset's None: nothing to read
    calls = [Call("add", {"item": "pear", "count": 2}), Call("price", {"item": "pear"}),
             Call("price", {"item": "gold"}), Call("sell", {}), Call("add", {"count": 1}), Call("", None, parse_error="x")]
    results = envs.run(envs.bind(a, calls) + envs.bind(b, calls[:1]))
    assert all(isinstance(r, ToolResult) for r in results)
    assert [r.text for r in results] == ["2", "1.5", "{'error': 'gold is not for sale'}", "{'error': 'Tool sell not found.'}",
                                         "{'error': \"add() missing required argument 'item'\"}",
                                         "{'error': 'bad tool call: x'}", "3"]
    assert [r.error for r in results] == ["", "", "exception", "unknown_tool", "bad_arguments", "bad_call", ""]
    assert a.instance.basket == ["pear", "pear"] and b.instance.basket == ["x", "pear", "pear"]
    assert envs.rewards([a, b, None]) == [(2.0, ""), (3.0, "")] + [(None, "")]
    assert a.instance is None and b.instance is None  # dropped once scored


def test_a_call_that_hangs_is_counted_and_its_instance_never_called_again():
    envs = shop(timeout_s=0.3)
    slot = EnvSlot()
    envs.run([EnvCall(slot, None, {})])
    hung, after = envs.run(envs.bind(slot, [Call("wait", {"seconds": 2.0}), Call("add", {"item": "pear"})]))
    assert (hung.error, after.error) == ("timeout", "exception") and "did not return within 0.3 s" in hung.text
    assert slot.broken and slot.instance.basket == []
    assert envs.rewards([slot]) == [(0.0, "")]  # its fault is counted once, at the call


def test_get_reward_that_raises_or_returns_no_number_is_counted_and_scores_zero():
    envs = shop()
    slots = [EnvSlot() for _ in range(4)]
    envs.run([EnvCall(s, None, {"start": [item]}) for s, item in zip(slots, ["bomb", "nan", "text", "pear"])])
    assert envs.rewards(slots) == [(0.0, "exception"), (0.0, "not_text"), (0.0, "not_text"), (1.0, "")]

    class Free(Shop):  # no reward of its own: the reward function scores its rows
        get_reward = None
    free = load_trl_environments(Free, "m.Free", {}, timeout_s=1, max_text_chars=8, truncate_side="left")
    slot = EnvSlot()
    free.run([EnvCall(slot, None, {})])
    assert not free.has_reward and free.rewards([slot]) == [(None, "")]


def test_a_reset_that_fails_ends_its_episode_counted():
    class Broken(Shop):
        def reset(self, **row):
            raise KeyError("answer")
    envs = load_trl_environments(Broken, "m.B", {}, timeout_s=1, max_text_chars=64, truncate_side="left")
    slot = EnvSlot()
    (result,) = envs.run([EnvCall(slot, None, {})])
    assert result.error == "exception" and result.done and "reset KeyError: 'answer'" in result.text
    assert envs.rewards([slot]) == [(0.0, "")]


@pytest.fixture(scope="module")
def trl_echo(embedded_cache, tmp_path_factory):
    from spmdsplit.agent import check_multi_turn, default_agent, environment_tools
    from spmdsplit.config import load_config
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import eos_token_ids, load_tokenizer
    from tests.support.jobs import ROOT

    folder = tmp_path_factory.mktemp("trl_echo")
    log = folder / "episodes.jsonl"
    (folder / "game.py").write_text(TRL_ECHO.format(log=str(log)))
    cfg = load_config(f"{ROOT}/configs/environment_echo.yaml", [
        f"rollout.multi_turn.environment={folder}/game.py:EchoGame", "rollout.multi_turn.environment_kwargs={}",
        "rollout.multi_turn.max_turn_length=2", "data.max_response_length=16"])
    cfg.model.path = ensure_embedded_model(agent=True)
    tokenizer = load_tokenizer(cfg.model.path)
    tools = check_multi_turn(cfg, tokenizer)
    rows, _ = build_rows(cfg.data, tokenizer, "train", tools=tools.schemas, default_agent=default_agent(cfg),
                         environment_tools=environment_tools(cfg))
    return cfg, tokenizer, eos_token_ids(cfg.model.path, tokenizer), rows, log


def test_trl_episodes_on_the_hf_engine_open_with_reset_call_methods_and_are_scored_by_get_reward(trl_echo):
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.rewards.rule import ENVIRONMENT_REWARD
    from spmdsplit.roles.reward import RuleReward
    from spmdsplit.inference import build_generator

    cfg, tokenizer, eos_ids, rows, log = trl_echo
    assert rows[0]["tools"][0]["function"]["name"] == "say"  # the prompt is rendered with the methods' schemas
    torch.manual_seed(5)
    rollout = build_generator(cfg, cfg.model.path, tokenizer, eos_ids, torch.device("cpu"), torch.float32, seed=3)
    prompts = collate_prompts(rows[:32], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
    batch = rollout.generate(prompts)
    _, scores = RuleReward(tokenizer, eos_ids).compute(batch)
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(episodes) == 32 and len({tuple(e["serial"]) for e in episodes}) == 32  # an instance each, scored once
    seen = collections.Counter()
    for i, info in enumerate(batch["extra_info"]):
        ids, mask = batch["responses"][i].tolist(), batch["response_mask"][i].tolist()
        n = int(batch["attention_mask"][i, -len(ids):].sum())
        turns, turn = [], None  # the policy's turns: its runs of unmasked tokens
        for j in range(n):
            if mask[j]:
                turn = (turn or "") + tokenizer.decode(ids[j:j + 1])
            elif turn is not None:
                turns, turn = turns + [turn], None
        turns += [turn] if turn is not None else []
        # The opening (reset's digit) is masked; a turn that spends the budget is not run, as a tool agent's.
        assert mask[0] == 0 and tokenizer.decode(ids[:1]) in "0123456789"
        run_turns = turns if n < cfg.data.max_response_length else turns[:-1]
        assert batch["tool_calls"][i] == sum(t.endswith("@") for t in run_turns)
        said = [t[:-1] for t in run_turns if t.endswith("@") and t[:-1]]
        assert info[ENVIRONMENT_REWARD] == pytest.approx(scores[i].item())
        seen[(int(tokenizer.decode(ids[:1])), tuple(said), round(info[ENVIRONMENT_REWARD], 6))] += 1
    logged = collections.Counter((e["shown"][0], tuple(e["said"]), round(e["reward"], 6)) for e in episodes)
    assert seen == logged
    assert sum(batch["tool_calls"].tolist()) > 0 and (batch["rollout_log_probs"][batch["response_mask"] == 0] == 0).all()


def test_a_trl_class_the_config_cannot_run_stops_the_job_with_one_line(embedded_cache, tmp_path):
    """Through the job's own check, before anything distributed: the echo preset's constructor
    arguments left in place, a TRL class forced to the gym shape, a style that does not exist."""
    from spmdsplit.agent import check_multi_turn
    from spmdsplit.config import load_config
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.errors import ConfigError
    from spmdsplit.models import load_tokenizer
    from tests.support.jobs import ROOT

    tokenizer = load_tokenizer(ensure_embedded_model(agent=True))
    (tmp_path / "game.py").write_text(TRL_ECHO.format(log=str(tmp_path / "log")))
    env = f"rollout.multi_turn.environment={tmp_path}/game.py:EchoGame"
    cases = [([env], "clear them with rollout.multi_turn.environment_kwargs={}"),
             ([env, "rollout.multi_turn.environment_kwargs={}", "rollout.multi_turn.environment_style=gym"],
              "needs reset and step methods; it has no step"),
             ([env, "rollout.multi_turn.environment_style=openai"], "rollout.multi_turn.environment_style")]
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as e:
            check_multi_turn(load_config(f"{ROOT}/configs/environment_echo.yaml", overrides), tokenizer)
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_fault_outside_the_environments_calls_is_still_one_answer_per_call():
    """An instance whose attribute lookup raises fails here, before its method runs: the call is
    still answered and counted, the instance never called again, the other episodes unharmed."""
    class Sly(Shop):
        def __getattribute__(self, name):
            if name == "add" and object.__getattribute__(self, "basket") == ["trap"]:
                raise RuntimeError("trap")
            return object.__getattribute__(self, name)
    envs = load_trl_environments(Sly, "m.Sly", {}, timeout_s=1, max_text_chars=64, truncate_side="left")
    trapped, fine = EnvSlot(), EnvSlot()
    envs.run([EnvCall(trapped, None, {"start": ["trap"]}), EnvCall(fine, None, {})])
    results = envs.run(envs.bind(trapped, [Call("add", {"item": "x"})]) + envs.bind(fine, [Call("add", {"item": "x"})]))
    assert [(r.error, r.text) for r in results] == [("exception", "{'error': 'add failed: RuntimeError: trap'}"),
                                                      ("", "1")]
    assert trapped.broken and not fine.broken


def test_a_continuous_checkpoint_keeps_no_trl_episode_whose_reward_is_unread(trl_echo):
    """get_reward is read when an episode's group is handed over; a checkpoint cannot hold the
    instance it reads, so the stream's checkpoint keeps no TRL episode, finished or not: each
    starts again from its prompt, and every handed-over row is scored by a get_reward call."""
    cfg, tokenizer, eos_ids, rows, log = trl_echo
    make_stream = agent_stream_factory(cfg, tokenizer, eos_ids, rows)

    stream = make_stream()
    for _ in range(200):  # until some episodes have finished in groups not yet complete
        stream.engine_step()
        if any(r.finished for g in stream.groups for r in g.responses):
            break
    state = stream.state()
    saved = [r for g in state["in_flight"] + state["complete"] for r in g["responses"]]
    assert saved and not any(r["tokens"] for r in saved)  # every one starts again
    resumed = make_stream()
    resumed.load_state(state, same_layout=True)
    batch = resumed.next_batch(1)
    logged = collections.Counter(round(json.loads(line)["reward"], 6) for line in log.read_text().splitlines())
    assert len(batch) == 16
    assert not collections.Counter(round(i["environment_reward"], 6) for i in batch["extra_info"]) - logged
