"""Agent episodes in continuous generation (spmdsplit/generation/continuous.py with rollout.multi_turn), on
the real HF engine and the embedded lookup task in this process: each episode's next turn enters
the engine as soon as its tool calls return, and the engine runs other episodes' turns while a
slow tool answers (batch mode's loop would wait for the whole turn). The rows are batch mode's
agent rows (tool tokens masked, the policy's log-probs kept, verl's num_turns), and a checkpoint
taken while calls are out keeps their answers."""

from __future__ import annotations

import torch


SLOW_S = 0.3
SLOW_TOOL = f'''import asyncio

from spmdsplit.agent.lookup import LookupTool


class SlowLookup(LookupTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep({SLOW_S})
        return await super().execute(instance_id, parameters, **kwargs)
'''


def make_stream(cfg, tokenizer, eos_ids, rows, tmp_path, prompts_per_batch=8, n=2):
    from omegaconf import OmegaConf

    from spmdsplit.agent.loop import AgentLoop
    from spmdsplit.agent.parsers import build_parser
    from spmdsplit.agent.tools import load_tools
    from spmdsplit.generation.continuous import ContinuousGeneration
    from spmdsplit.data.prompts import PromptDataset
    from spmdsplit.generation.shares import step_prompts
    from spmdsplit.inference import build_generator

    (tmp_path / "slow.py").write_text(SLOW_TOOL)
    (tmp_path / "tools.yaml").write_text(
        f"tools:\n  - class_name: {tmp_path / 'slow.py'}:SlowLookup\n    config: {{type: native}}\n"
        "    tool_schema: {type: function, function: {name: lookup, description: the code, "
        "parameters: {type: object, properties: {}, required: []}}}\n")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([
        "rollout.continuous=true", "rollout.hf_step_tokens=1", f"rollout.n={n}", "rollout.staleness=4",
        f"data.train_batch_size={prompts_per_batch}", "rollout.per_row_seed=false"]))
    torch.manual_seed(5)
    base = build_generator(cfg, cfg.model.path, tokenizer, eos_ids, torch.device("cpu"), torch.float32, seed=3).engine
    tools = load_tools(str(tmp_path / "tools.yaml"), timeout_s=5, max_response_chars=8)
    agent = AgentLoop(base, tokenizer, eos_ids, tools, build_parser("compact", tools.schemas), cfg.rollout.multi_turn,
                      cfg.data.max_response_length, "tool_agent")
    weights = {k: v.clone() for k, v in base.model.state_dict().items()}
    dataset = PromptDataset(rows, prompts_per_batch, shuffle=False, seed=0)
    state = {}

    def take_weights(step):  # version 0 at the start; no later version is ever sent
        assert "stream" not in state, "the stream waited for weights nobody sends"
        base.wake_up(weights.items())
        return 0

    stream = ContinuousGeneration(cfg, base, lambda t: step_prompts(cfg, dataset, tokenizer, t, [0], 0), take_weights,
                                  lambda: False, 0, 1, tokenizer.pad_token_id, eos_ids, torch.device("cpu"), agent=agent)
    stream.version = take_weights(1)
    state["stream"] = stream
    return stream


def holes(rows):
    """Per row: whether it holds tool tokens (attended, not trained) between the policy's."""
    R = rows["responses"].shape[1]
    return ((rows["attention_mask"][:, -R:] == 1) & (rows["response_mask"] == 0)).any(1)


def test_episodes_flow_one_by_one_and_tools_run_while_others_generate(lookup_setup, tmp_path):  # noqa: F811
    cfg, tokenizer, eos_ids, rows = lookup_setup
    stream = make_stream(cfg, tokenizer, eos_ids, rows, tmp_path)
    batch = stream.next_batch(1)
    metrics = stream.pop_metrics()
    assert len(batch) == 16 and batch["row_index"].tolist() == list(range(16))
    called = holes(batch)
    assert called.sum() >= 2, "the random model should call the tool"
    # The rows are batch mode's agent rows: the tool's answer (this row's code) masked, the policy's
    # log-probs on its own tokens only, verl's turn counts.
    for i in called.nonzero().flatten().tolist():
        R = batch["responses"].shape[1]
        tool = (batch["attention_mask"][i, -R:] == 1) & (batch["response_mask"][i] == 0)
        assert f"={batch['ground_truth'][i]};" in tokenizer.decode(batch["responses"][i][tool], skip_special_tokens=False)
        assert batch["num_turns"][i] >= 3 and batch["tool_calls"][i] >= 1
    assert (batch["rollout_log_probs"][batch["response_mask"] == 0] == 0).all()
    assert torch.equal(batch["token_weights_version"][batch["response_mask"].bool()],
                       torch.zeros(int(batch["response_mask"].sum()), dtype=torch.int64))
    assert batch["extra_info"][0]["num_turns"] == batch["num_turns"][0]
    # The engine went on with other episodes while a call slept: batch mode's loop runs no engine
    # step while a turn's calls are out.
    assert metrics["rollout/engine_steps_during_tools"] > 0, metrics
    assert metrics["rollout/engine_steps_during_tools"] > metrics["rollout/tool_waits"], metrics


def test_a_checkpoint_with_tool_calls_out_keeps_their_answers(lookup_setup, tmp_path):  # noqa: F811
    cfg, tokenizer, eos_ids, rows = lookup_setup
    stream = make_stream(cfg, tokenizer, eos_ids, rows, tmp_path)
    for _ in range(400):  # until a call is out
        stream.engine_step()
        if stream.tooling:
            break
    out = [(t.response, len(t.response.tokens)) for t in stream.tooling]
    assert out, "no episode called the tool in 400 engine steps"
    state = stream.state()  # waits for the calls: their answers are in the state, none is run again
    assert not stream.tooling
    for response, before in out:
        assert len(response.tokens) > before  # the tool's tokens appended
        assert response.episode.tool_calls >= 1
    held = {len(r["tokens"]) for g in state["in_flight"] + state["complete"] for r in g["responses"]}
    assert state["tokens_held"] == sum(len(r["tokens"]) for g in state["in_flight"] + state["complete"]
                                       for r in g["responses"]) and max(held) > 0

    resumed = make_stream(cfg, tokenizer, eos_ids, rows, tmp_path)
    resumed.load_state(state, same_layout=True)
    batch = resumed.next_batch(1)
    assert resumed.pop_metrics()["rollout/tokens_resumed"] == state["tokens_held"]
    assert len(batch) == 16 and holes(batch).any()



def test_validation_ended_by_tool_answers_returns_without_waiting_for_weights(lookup_setup, tmp_path):  # noqa: F811
    """Validation's episodes beside nothing else (no group admitted): when the last calls' answers
    end them, `generate` returns. It once went on to wait for the next weights, which the actor
    pool, itself waiting for these rows, never sends: a vLLM job hung so."""
    from spmdsplit.data.prompts import collate_prompts

    cfg, tokenizer, eos_ids, rows = lookup_setup
    stream = make_stream(cfg, tokenizer, eos_ids, rows, tmp_path)
    stream.admits = lambda: False
    prompts = collate_prompts(rows[:16], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
    batch = stream.generate(prompts, validate=True)
    assert len(batch) == 16 and batch["tool_calls"].sum() > 0 and not stream.live and not stream.tooling


def test_a_call_that_returns_while_the_stream_looks_is_not_lost(lookup_setup, tmp_path):  # noqa: F811
    """A call's future may turn done between the stream's looks at it (the tools' thread sets it at
    any moment): it must land as still running or as answered, never in neither."""
    import concurrent.futures

    from spmdsplit.generation.continuous import ToolCalls

    class ReturnsWhileLooked(concurrent.futures.Future):
        """Not done at the first look, done from the second on: the tools' thread finishing it in between."""

        looks = 0

        def done(self):
            self.looks += 1
            if self.looks == 2:
                self.set_result(results)
            return super().done()

    cfg, tokenizer, eos_ids, rows = lookup_setup
    stream = make_stream(cfg, tokenizer, eos_ids, rows, tmp_path)
    for _ in range(400):
        stream.engine_step()
        if stream.tooling:
            break
    call = stream.tooling[0]
    results = call.results.result()
    stream.tooling = [ToolCalls(call.group, call.member, call.response, call.calls, call.turn_end, ReturnsWhileLooked())]
    stream.take_tool_results(wait=False)
    assert stream.tooling or any(g is call.group and m == call.member for g, m in stream.live.values()) \
        or call.response.finished
