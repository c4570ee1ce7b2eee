"""Tool calls of a tensor-parallel vLLM engine (rollout.tensor_model_parallel_size > 1) run once per
call, on the engine's first rank, and every rank of the engine continues from the same answers.
The tool here answers each call with the number of calls made so far, on any rank, and writes down
which process ran it: were each rank to run its own tools, the ranks' contexts would differ (and
vLLM's lockstep with them) and the file would count every call twice. The same engine then runs a
TRL-style environment's episodes (agent/trl_env.py): its instances, calls and get_reward live on
the first rank, and every rank gets the same answers and rewards; and an agent harness's episodes
(agent/harness.py), played on the first rank through its endpoint, their rows handed to the other.

Sampled, the ranks must also draw alike: every row carries a seed the engine's ranks share, so a
tool that moves numpy's and torch's global generators on the first rank alone changes nothing."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re

import numpy as np
import pytest
import torch
import yaml

from spmdsplit.agent.tools import BaseTool, ToolResponse
from spmdsplit.config import load_config
from tests.support.launch import run_ranks
from tests.test_trl_env import TRL_ECHO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = 32

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


class CountingTool(BaseTool):
    """The lookup tool's name and schema; answers each call with how many calls have been made so
    far (counted in `config.calls_file`, one line per call naming the process that ran it)."""

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        with open(self.config["calls_file"], "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # the ranks of an engine share the file
            f.write(f"{os.getpid()}\n")
            f.flush()
            f.seek(0)
            count = len(f.readlines())
        if self.config.get("draws"):  # what a user's tool may do: the first rank's global generators move
            np.random.random(1000)
            torch.rand(1000)
        return ToolResponse(text=str(count)), 0.0, {}


def tensor_parallel_episodes(rank, world_size, model_dir, tool_config, calls_file, game, harness_log):
    """Every rank: one engine of tensor parallel 2, multi-turn episodes of the same prompts, three
    times: greedy (validation's sampling); sampled as a training step's rows are, with
    rollout.per_row_seed=false; and sampled from rows that come without seeds."""
    from spmdsplit.agent import build_agent_rollout, check_multi_turn, default_agent, environment_tools
    from spmdsplit.batch import Batch
    from spmdsplit.data.prompts import PromptDataset, collate_prompts
    from spmdsplit.data.sources import build_rows
    from spmdsplit.generation.shares import engine_shares
    from spmdsplit.models import eos_token_ids, load_causal_lm, load_tokenizer
    from spmdsplit.inference import build_generator
    from spmdsplit.inference.vllm_engine import init_vllm_distributed, shutdown_vllm_distributed

    cfg = load_config(os.path.join(ROOT, "configs", "agent_lookup.yaml"), [
        "rollout.name=vllm", f"model.path={model_dir}", "rollout.kv_cache_memory_gb=0.0625",
        "rollout.tensor_model_parallel_size=2", f"rollout.multi_turn.tool_config_path={tool_config}",
        f"data.train_batch_size={PROMPTS // 4}", "rollout.n=4", "rollout.per_row_seed=false"])
    init_vllm_distributed(cfg, model_dir, torch.device("cpu"), torch.float32)
    try:
        tokenizer = load_tokenizer(model_dir)
        rows, _ = build_rows(cfg.data, tokenizer, "train", tools=check_multi_turn(cfg, tokenizer).schemas)
        engine = build_generator(cfg, model_dir, tokenizer, eos_token_ids(model_dir, tokenizer), torch.device("cpu"),
                                 torch.float32, 0)
        engine.wake_up(load_causal_lm(model_dir, torch.float32, torch.device("cpu"), 0).state_dict().items())
        greedy = engine.generate(collate_prompts(rows[:PROMPTS], tokenizer, cfg.data.max_prompt_length, step=1,
                                                 first_row=0), validate=True)
        greedy_calls = len(open(calls_file).read().split())
        # The step's prompts as the job makes them, each with the seed of its engine's step; then the
        # same rows without seeds (a caller of its own): they take the engine's own.
        shares = engine_shares(cfg, PromptDataset(rows, PROMPTS // 4, shuffle=False, seed=0), tokenizer, 1, [0, 1])
        prompts = Batch.concat(shares.shares)
        sampled = engine.generate(prompts)
        unseeded = engine.generate(prompts.select([k for k in prompts.keys() if k != "sample_seed"]))
        width = greedy["responses"].shape[1]
        tool_tokens = (greedy["response_mask"] == 0) & (greedy["attention_mask"][:, -width:] == 1)
        answers = [int(a) for row, holes in zip(greedy["responses"], tool_tokens)
                   for a in re.findall(r"\d+", tokenizer.decode(row[holes]))]
        # A TRL-style environment's greedy episodes on the same engine (the echo preset's rows).
        trl = load_config(os.path.join(ROOT, "configs", "environment_echo.yaml"), [
            "rollout.name=vllm", f"model.path={model_dir}", "rollout.tensor_model_parallel_size=2",
            f"rollout.multi_turn.environment={game}:EchoGame", "rollout.multi_turn.environment_kwargs={}",
            "rollout.multi_turn.max_turn_length=2", "data.max_response_length=16"])
        trl_rows, _ = build_rows(trl.data, tokenizer, "train", tools=check_multi_turn(trl, tokenizer).schemas,
                                 default_agent=default_agent(trl), environment_tools=environment_tools(trl))
        episodes = build_agent_rollout(trl, engine.engine, tokenizer, eos_token_ids(model_dir, tokenizer)).generate(
            collate_prompts(trl_rows[:PROMPTS], tokenizer, trl.data.max_prompt_length, step=1, first_row=0),
            validate=True)
        played = harness_episodes(engine.engine, tokenizer, model_dir, harness_log,
                                  collate_prompts(trl_rows[:PROMPTS], tokenizer, trl.data.max_prompt_length, step=1,
                                                  first_row=0))
        columns = {f"{run} {k}": out[k] for run, out in (("greedy", greedy), ("sampled", sampled), ("unseeded", unseeded),
                                                         ("trl", episodes), ("harness", played))
                   for k in ("responses", "response_mask", "num_turns", "tool_calls", "rollout_log_probs")}
        return {"columns": columns, "answers": answers, "greedy_calls": greedy_calls, "pid": os.getpid(),
                "trl_rewards": [info["environment_reward"] for info in episodes["extra_info"]],
                "harness_rewards": [info["environment_reward"] for info in played["extra_info"]]}
    finally:
        shutdown_vllm_distributed()


def harness_episodes(engine, tokenizer, model_dir, log, prompts):
    """The echo harness (tests/support/harnesses.py) over the engine's endpoint, each episode
    written down with the process that played it; validation's sampling (greedy)."""
    from spmdsplit.agent import engine_ranks
    from spmdsplit.agent.harness import HarnessRunner
    from tests.support.harnesses import echo_harness

    cfg = load_config(os.path.join(ROOT, "configs", "environment_echo.yaml"), [
        "rollout.name=vllm", f"model.path={model_dir}", "rollout.tensor_model_parallel_size=2",
        "rollout.multi_turn.enable=false", "rollout.agent.harness=tests.support.harnesses.echo_harness"])

    async def written_down(client, row):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return await echo_harness(client, row)
    rollout = HarnessRunner(engine, tokenizer, written_down, cfg.rollout.agent, cfg.data.max_response_length,
                            sampling=cfg.rollout, val_sampling=cfg.rollout.val_kwargs, **engine_ranks(engine))
    try:
        return rollout.generate(prompts, validate=True)
    finally:
        rollout.close()


@pytest.fixture(scope="module")
def episodes(tmp_path_factory, agent_model_dir):
    """Both ranks' episodes, with a tool that counts its calls in a file and, on every call, draws
    from np.random and torch.rand (what a user's tool may do: the global generators of the rank it
    runs on move)."""
    tmp_path = tmp_path_factory.mktemp("tp_episodes")
    calls_file, tool_config = tmp_path / "calls.txt", tmp_path / "tools.yaml"
    with open(os.path.join(ROOT, "spmdsplit", "agent", "lookup_tools.yaml")) as f:
        entry = yaml.safe_load(f)["tools"][0]
    entry.update(class_name=f"{__name__}.CountingTool",
                 config={"type": "native", "calls_file": str(calls_file), "draws": True})
    tool_config.write_text(yaml.safe_dump({"tools": [entry]}))
    game, log = tmp_path / "game.py", tmp_path / "episodes.jsonl"
    game.write_text(TRL_ECHO.format(log=str(log)))
    harness_log = tmp_path / "harness.txt"
    first, second = run_ranks(tensor_parallel_episodes, 2, agent_model_dir, str(tool_config), str(calls_file),
                              str(game), str(harness_log), timeout=300, kind="vllm")
    first["harness_played"] = harness_log.read_text().split()
    return first, second, calls_file.read_text().split(), [json.loads(line) for line in log.read_text().splitlines()]


def test_a_tensor_parallel_engine_runs_each_tool_call_once_and_its_ranks_agree(episodes):
    first, second, calls_made, _ = episodes
    for name, column in first["columns"].items():
        if name.startswith("greedy"):
            assert torch.equal(column, second["columns"][name]), name
    calls = int(first["columns"]["greedy tool_calls"].sum())
    assert calls >= 3, "the boosted model should call the tool in some episodes"
    assert first["greedy_calls"] == second["greedy_calls"] == calls
    assert calls_made[:calls] == [str(first["pid"])] * calls  # once per call, on the first rank
    assert first["answers"] == second["answers"] and sorted(first["answers"]) == list(range(1, calls + 1))


def test_sampled_ranks_draw_alike_beside_a_tool_that_moves_the_global_generators(episodes):
    """rollout.per_row_seed=false, sampled at temperature 1: the tool's draws from np.random and
    torch.rand on the engine's first rank (where tools run) leave both ranks sampling the same
    tokens, since no row draws from a global generator (on CPU vLLM's V1 sampler would take an
    unseeded row's noise from torch's, on CUDA V2 its seed from numpy's); rows without seeds take
    the engine's own. Without either, the ranks' contexts part and vLLM's collectives fail."""
    first, second, calls_made, _ = episodes
    for run in ("sampled", "unseeded"):
        assert int(first["columns"][f"{run} tool_calls"].sum()) >= 3, "the model should call the tool in some episodes"
    assert set(calls_made) == {str(first["pid"])}  # the draws happened on the first rank only
    for name, column in first["columns"].items():
        assert torch.equal(column, second["columns"][name]), name
    # Sampled indeed: the rollout.n responses to one prompt are not all alike.
    responses = first["columns"]["sampled responses"]
    assert any(not torch.equal(responses[i], responses[i + 1]) for i in range(0, len(responses), 4))


def test_a_tensor_parallel_engine_runs_a_trl_environment_on_its_first_rank_and_its_ranks_agree(episodes):
    """Each episode's instance, its calls and its get_reward run once, on the engine's first rank;
    both ranks continue from the same answers and carry the same rewards."""
    first, second, _, logged = episodes
    for name in [n for n in first["columns"] if n.startswith("trl")]:
        assert torch.equal(first["columns"][name], second["columns"][name]), name
    assert first["trl_rewards"] == second["trl_rewards"]
    assert len(logged) == PROMPTS and {e["serial"][0] for e in logged} == {first["pid"]}  # scored once, on the first rank
    assert sorted(first["trl_rewards"]) == sorted(e["reward"] for e in logged)
    assert int(first["columns"]["trl tool_calls"].sum()) >= 3, "the boosted model should call the method in some episodes"


def test_a_tensor_parallel_engine_plays_a_harness_on_its_first_rank_and_hands_its_rows_to_the_other(episodes):
    """Each episode of the harness is played once, on the engine's first rank, whose calls the
    other rank's engine steps in lockstep; both ranks hand over the same rows and rewards."""
    first, second, _, _ = episodes
    for name in [n for n in first["columns"] if n.startswith("harness")]:
        assert torch.equal(first["columns"][name], second["columns"][name]), name
    assert first["harness_played"] == [str(first["pid"])] * PROMPTS  # once each, on the first rank
    assert first["harness_rewards"] == second["harness_rewards"]
    assert first["columns"]["harness tool_calls"].tolist() == [3] * PROMPTS  # the echo harness's three calls
