"""Multi-turn, tool-using rollouts (spmdsplit/agent/): the masks, the math on masks with holes,
the parsers, the chat-template glue, and the agent loop on a real engine with a real tool."""

from __future__ import annotations

import json

import pytest
import torch

from spmdsplit import algo
from spmdsplit.agent.chat import ToolChat
from spmdsplit.agent.parsers import build_parser
from spmdsplit.roles.reward import on_last_token
from tests.support.agent_models import chat_tokenizer

LOOKUP_SCHEMA = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
SEARCH_SCHEMA = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


# ----------------------------------------------------------------------------- math on masks with holes

def verl_gae(rewards, values, mask, gamma, lam):
    """verl's masked GAE (core_algos.compute_gae_advantage_return), written out from its formula:
    on a masked token neither the next value nor the running estimate moves."""
    B, T = values.shape
    next_values, last = torch.zeros(B, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    out = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        candidate = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = candidate * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_skips_tool_tokens_as_verls_formula_does(gamma, lam):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0],   # policy, tool, policy, tool, policy, padding
                         [1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    values = torch.randn(mask.shape, dtype=torch.float64)
    rewards = on_last_token(torch.tensor([1.0, -0.5, 0.25]), mask.long()).double()
    advantages, returns = algo.compute_gae_advantage_return(rewards, values, mask.long(), gamma, lam)
    ref_adv, ref_returns = verl_gae(rewards, values, mask, gamma, lam)
    valid = mask.bool()
    torch.testing.assert_close(returns[valid], ref_returns[valid])
    torch.testing.assert_close(advantages[valid], algo.masked_whiten(ref_adv, mask)[valid])
    assert (advantages[~valid] == 0).all() and (returns[~valid] == 0).all()
    if gamma < 1:  # a hole changes the result: the tool tokens' values must not leak into the policy's estimate
        filled = algo.compute_gae_advantage_return(rewards, values, (mask > -1).long(), gamma, lam)[1]
        assert not torch.allclose(filled[valid], returns[valid])


def test_the_score_sits_on_the_policys_last_token_not_the_tools():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    out = on_last_token(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out[0].tolist() == [0, 0, 0, 0, 2.0, 0, 0]  # column 4, not column sum(mask)-1 = 2
    assert out[1].tolist()[0] == 3.0 and out[2].abs().sum() == 0


# ----------------------------------------------------------------------------- parsers

def test_hermes_reads_calls_and_reports_malformed_ones():
    parser = build_parser("hermes", SEARCH_SCHEMA)
    text = ('thinking <tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"query": </tool_call>'
            '<tool_call>["search"]</tool_call><tool_call>{"name": "search", "arguments": "{\\"query\\": \\"y\\"}"}</tool_call>')
    calls = parser.calls(text, {"search": {}})
    assert [(c.name, c.arguments, bool(c.parse_error)) for c in calls] == [
        ("search", {"query": "x"}, False), ("", None, True), ("", None, True), ("search", {"query": "y"}, False)]
    assert "not valid JSON" in calls[1].parse_error
    assert parser.calls("the answer is 4", {}) == []


def test_compact_calls_the_first_tool():
    assert [(c.name, c.arguments) for c in build_parser("compact", LOOKUP_SCHEMA).calls("thinking@", {})] == [("lookup", {})]
    assert build_parser("compact", LOOKUP_SCHEMA).calls("1234", {}) == []
    assert [(c.name, c.arguments) for c in build_parser("compact", SEARCH_SCHEMA).calls("cats@", {})] == [
        ("search", {"query": "cats"})]
    assert build_parser("compact", SEARCH_SCHEMA).calls("@", {})[0].parse_error
    with pytest.raises(ValueError, match="rollout.multi_turn.format='json5'"):
        build_parser("json5", [])


# ----------------------------------------------------------------------------- the template's glue

def test_token_in_token_out_equals_the_templates_whole_conversation():
    """Prompt tokens + the policy's turn as sampled + the glue ToolChat appends = the chat
    template's rendering of the whole conversation, token for token: the model is conditioned on
    exactly what the template would show it, and no policy token was re-encoded."""
    tokenizer = chat_tokenizer()
    chat = ToolChat(tokenizer)
    messages = [{"role": "user", "content": "find cats"}]
    turn = '<tool_call>{"name": "search", "arguments": {"query": "cats"}}</tool_call>'
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=SEARCH_SCHEMA, add_generation_prompt=True,
                                                            tokenize=False), add_special_tokens=False)
    policy = tokenizer.encode(turn, add_special_tokens=False) + [tokenizer.eos_token_id]
    glue = chat.tool_turn_ids(["3 cats", "no dogs"], tokenizer.eos_token)
    whole = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": turn},
                                                      {"role": "tool", "content": "3 cats"},
                                                      {"role": "tool", "content": "no dogs"}],
                                          tools=SEARCH_SCHEMA, add_generation_prompt=True, tokenize=False)
    assert prompt + policy + glue == tokenizer.encode(whole, add_special_tokens=False)
    # A turn that stopped on a parser's stop token instead of the EOS gets the template's end markup.
    assert chat.tool_turn_ids(["x"], "@")[0] == tokenizer.eos_token_id


# ----------------------------------------------------------------------------- the loop on a real engine


def agent_rollout(cfg, tokenizer, eos_ids):
    from spmdsplit.inference import build_generator

    engine = build_generator(cfg, cfg.model.path, tokenizer, eos_ids, torch.device("cpu"), torch.float32, seed=3)
    return engine


def trainer_log_probs(model, batch):
    """What the actor computes for the rollout (roles/forward.forward_response, padded path)."""
    from spmdsplit.roles.forward import forward_response

    def head(logits, tokens):
        return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        return forward_response(model, batch, head)


def test_episodes_on_the_hf_engine_mask_tool_tokens_and_keep_the_policys_log_probs(lookup_setup):
    from spmdsplit.data.prompts import collate_prompts

    from spmdsplit.agent import check_multi_turn

    cfg, tokenizer, eos_ids, rows = lookup_setup
    torch.manual_seed(11)
    rollout = agent_rollout(cfg, tokenizer, eos_ids)
    # The tools the start-up check loaded are the engine's: a tool's constructor runs once per process.
    assert rollout.tools is check_multi_turn(cfg, tokenizer)
    prompts = collate_prompts(rows[:48], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
    batch = rollout.generate(prompts)
    mask, attention = batch["response_mask"], batch["attention_mask"][:, -batch["responses"].shape[1]:]
    # Holes: tool tokens (attended, not trained) between policy tokens, in some rows.
    holes = (attention == 1) & (mask == 0)
    after = [bool(mask[i, holes[i].nonzero().max() + 1:].any()) if holes[i].any() else False for i in range(len(batch))]
    assert holes.any(1).sum() >= 5 and sum(after) >= 3, "the random model should call the tool and go on"
    assert (batch["rollout_log_probs"][mask == 0] == 0).all()
    # Each masked span is the template's tool message with this row's code (tools_kwargs reached the tool).
    for i in holes.any(1).nonzero().flatten().tolist():
        text = tokenizer.decode(batch["responses"][i][holes[i]], skip_special_tokens=False)
        assert f"={batch['ground_truth'][i]};" in text, text
        assert batch["num_turns"][i] >= 3 and batch["tool_calls"][i] >= 1
    # The engine's log-probs of the policy's tokens are the trainer's (fp32), on the policy's tokens only.
    actor = trainer_log_probs(rollout.engine.model, batch)
    assert (actor[mask == 1] - batch["rollout_log_probs"][mask == 1]).abs().max() < 1e-5
    # The scorer sees the whole response, and extra_info carries verl's num_turns.
    assert all(info["num_turns"] == n for info, n in zip(batch["extra_info"], batch["num_turns"].tolist()))
    # The same rollout through the padding-free forward (packing) scores the same tokens.
    from spmdsplit.roles.forward import forward_response
    packed = forward_response(rollout.engine.model, batch, lambda lg, t: torch.log_softmax(lg.float(), -1).gather(
        -1, t.unsqueeze(-1)).squeeze(-1), remove_padding=True)
    assert (packed[mask == 1] - actor[mask == 1]).abs().max() < 1e-5


def test_bad_tools_are_answered_and_counted_and_no_row_is_lost(lookup_setup, tmp_path):
    """Each failure of a tool becomes an error response the model reads; the episodes go on."""
    from spmdsplit.agent.loop import AgentLoop
    from spmdsplit.agent.parsers import build_parser
    from spmdsplit.agent.tools import ERROR_KINDS, load_tools
    from spmdsplit.data.prompts import collate_prompts

    cfg, tokenizer, eos_ids, rows = lookup_setup
    (tmp_path / "bad.py").write_text(
        "import threading, time\n"
        "def lookup() -> str:\n    '''Hangs, floods or raises, by turn.\n    '''\n"
        "    n = int(time.time() * 1000) % 3\n"
        "    if n == 0: threading.Event().wait()\n"
        "    if n == 1: return '7' * 5_000_000\n"
        "    raise RuntimeError('boom')\n")
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [{"class_name": str(tmp_path / "bad.py") + ":lookup"}]}))
    tools = load_tools(str(tmp_path / "tools.yaml"), timeout_s=0.5, max_response_chars=4)
    base = agent_rollout(cfg, tokenizer, eos_ids).engine
    rollout = AgentLoop(base, tokenizer, eos_ids, tools, build_parser("compact", tools.schemas), cfg.rollout.multi_turn,
                        cfg.data.max_response_length, "single_turn_agent")
    prompts = collate_prompts(rows[:32], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
    batch = rollout.generate(prompts)
    assert len(batch) == 32 and batch["tool_calls"].sum() > 0
    errors = dict(zip(ERROR_KINDS, batch["tool_errors"].sum(0).tolist()))
    assert errors["exception"] + errors["timeout"] > 0, errors
    assert batch["tool_errors"].sum() <= batch["tool_calls"].sum()


def test_single_turn_rows_of_a_multi_turn_job_answer_once_to_their_eos(lookup_setup):
    """rollout.agent.default_agent_loop / agent_name=single_turn_agent: one turn, all of it the
    policy's, ended only by the EOS or the budget (the compact format's "@" is plain text to it)."""
    from spmdsplit.data.prompts import collate_prompts

    cfg, tokenizer, eos_ids, rows = lookup_setup
    torch.manual_seed(11)
    rollout = agent_rollout(cfg, tokenizer, eos_ids)
    prompts = collate_prompts([{**r, "agent_name": "single_turn_agent"} for r in rows[:48]], tokenizer,
                              cfg.data.max_prompt_length, step=1, first_row=0)
    batch = rollout.generate(prompts)
    R = batch["responses"].shape[1]
    assert torch.equal(batch["response_mask"], batch["attention_mask"][:, -R:])  # no holes
    assert (batch["num_turns"] == 2).all() and batch["tool_calls"].sum() == 0
    at = tokenizer.convert_tokens_to_ids("@")
    lengths = batch["response_mask"].sum(1)
    inner = [row[: n - 1].tolist() for row, n in zip(batch["responses"], lengths)]
    assert any(at in ids for ids in inner), "some answer should hold an '@' it did not stop at"
