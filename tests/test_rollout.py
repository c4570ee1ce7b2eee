"""HF rollout (spmdsplit/inference/hf.py): EOS masks, positions, and `HFEngine.generate` on the
embedded tiny model, with no process group."""

import pytest
import torch
import torch.distributed as dist

from spmdsplit.config import RolloutConfig
from spmdsplit.data.prompts import collate_prompts
from spmdsplit.data.synthetic import make_dataset
from spmdsplit.models import load_causal_lm, load_tokenizer
from spmdsplit.inference.hf import HFEngine, position_ids_from_mask, response_mask_until_eos
from tests.support.helpers import forcing_state_dict

EOS = 2
CPU = torch.device("cpu")
P, R = 8, 5  # DataConfig's max_prompt_length / max_response_length


# --------------------------------------------------------------------------- response_mask_until_eos


@pytest.mark.parametrize(
    "row, eos, expected",
    [
        ([2, 5, 6, 7], EOS, [1, 0, 0, 0]),  # EOS first
        ([5, 2, 6, 7], EOS, [1, 1, 0, 0]),  # EOS in the middle
        ([5, 6, 7, 2], EOS, [1, 1, 1, 1]),  # EOS last
        ([5, 6, 7, 8], EOS, [1, 1, 1, 1]),  # no EOS: all valid (truncated)
        ([5, 2, 2, 6, 2], EOS, [1, 1, 0, 0, 0]),  # several EOS: the first one ends it
        ([2, 2, 2], EOS, [1, 0, 0]),
        ([5, 7, 2, 6], [2, 7], [1, 1, 0, 0]),  # a list of EOS ids: any of them ends it
        ([5, 6, 2, 7], [2, 7], [1, 1, 1, 0]),
        ([5, 6, 8, 9], [2, 7], [1, 1, 1, 1]),
    ],
    ids=["first", "middle", "last", "absent", "several", "all-eos", "list-7-first", "list-2-first", "list-absent"],
)
def test_response_mask_until_eos(row, eos, expected):
    mask = response_mask_until_eos(torch.tensor([row]), eos)
    assert mask.tolist() == [expected]
    assert not mask.is_floating_point()


def test_response_mask_until_eos_rows_are_independent():
    responses = torch.tensor([[2, 5, 6], [5, 6, 7], [5, 2, 6]])
    assert response_mask_until_eos(responses, EOS).tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]


# --------------------------------------------------------------------------- position_ids_from_mask


def test_position_ids_count_real_tokens_only_under_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 1, 1, 1, 0]])
    pos = position_ids_from_mask(mask)
    assert pos.shape == mask.shape
    # Real tokens are numbered 0, 1, 2, ... from the first real one, whatever padding precedes it.
    assert pos[0, 2:].tolist() == [0, 1, 2]
    assert pos[1].tolist() == [0, 1, 2, 3, 4]
    assert pos[2, 4].item() == 0
    assert pos[3, 1:4].tolist() == [0, 1, 2]
    assert (pos >= 0).all()  # pads must still index the rotary table


# --------------------------------------------------------------------------- HFEngine.generate


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    return load_tokenizer(embedded_model_dir)


@pytest.fixture(scope="module")
def model(embedded_model_dir):
    return load_causal_lm(embedded_model_dir, torch.float32, CPU, seed=0)


def prompts_batch(tokenizer, n=6, seed=0, task="repeat"):
    rows = make_dataset(task, n, seed)
    return rows, collate_prompts(rows, tokenizer, P, step=1, first_row=0)


def check_rollout_layout(out, prompts, tokenizer, max_R):
    """`out` is as wide as its longest response (at most `max_R`): no column is padding in every row."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    B = len(prompts)
    R = out["responses"].shape[1]
    assert R == max(int(out["response_mask"].sum(-1).max()), 1) and R <= max_R
    assert out["prompts"].shape == (B, P)
    assert out["responses"].shape == (B, R)
    assert out["response_mask"].shape == (B, R)
    assert out["input_ids"].shape == (B, P + R)
    assert out["attention_mask"].shape == (B, P + R)
    assert out["position_ids"].shape == (B, P + R)
    assert torch.equal(out["prompts"], prompts["input_ids"])
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], dim=1))
    assert torch.equal(out["attention_mask"], torch.cat([prompts["attention_mask"], out["response_mask"]], dim=1))
    for i in range(B):
        resp, mask = out["responses"][i].tolist(), out["response_mask"][i].tolist()
        eos_at = resp.index(eos) if eos in resp else None
        valid = R if eos_at is None else eos_at + 1
        assert mask == [1] * valid + [0] * (R - valid), (i, resp, mask)
        assert resp[valid:] == [pad] * (R - valid), (i, resp)  # right padding after the first EOS
        assert eos not in resp[: valid - 1]
    # Real tokens of each row are numbered 0.. over prompt and response together.
    am, pos = out["attention_mask"], out["position_ids"]
    for i in range(B):
        real = am[i].nonzero().flatten()
        assert pos[i, real].tolist() == list(range(len(real)))


def test_prompts_are_left_padded(tokenizer):
    rows, batch = prompts_batch(tokenizer)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (len(rows), P)
    for i, row in enumerate(rows):
        n = len(row["prompt"])  # one token per character
        assert mask[i].tolist() == [0] * (P - n) + [1] * n
        assert ids[i, : P - n].tolist() == [tokenizer.pad_token_id] * (P - n)
        assert tokenizer.decode(ids[i, P - n :].tolist()) == row["prompt"]
    assert (mask == 0).any(), "the hand rows should need padding"


def test_generate_shapes_layout_and_columns(model, tokenizer):
    rows, prompts = prompts_batch(tokenizer, n=32, seed=3)
    torch.manual_seed(0)
    rollout = HFEngine(model, tokenizer, RolloutConfig(do_sample=True, temperature=1.5), R)
    out = rollout.generate(prompts)
    check_rollout_layout(out, prompts, tokenizer, R)
    # The sampled rows include ones that stopped early, so the right padding was exercised.
    assert (out["response_mask"].sum(-1) < R).any()
    # Non-tensor columns travel with the rows.
    assert out["ground_truth"] == [r["reward_model"]["ground_truth"] for r in rows]
    assert out["data_source"] == prompts["data_source"] and out["uid"] == prompts["uid"]


def test_greedy_is_deterministic_and_matches_a_teacher_forced_forward(model, tokenizer):
    _, prompts = prompts_batch(tokenizer, n=8, seed=5)
    rollout = HFEngine(model, tokenizer, RolloutConfig(do_sample=False), R)
    a, b = rollout.generate(prompts), rollout.generate(prompts)
    check_rollout_layout(a, prompts, tokenizer, R)
    for k in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(a[k], b[k]), k
    # A training pass over (input_ids, attention_mask, position_ids) must see what generation saw:
    # every valid response token is the argmax of the logits at the position before it.
    with torch.no_grad():
        logits = model(input_ids=a["input_ids"], attention_mask=a["attention_mask"],
                       position_ids=a["position_ids"]).logits
    width = a["responses"].shape[1]
    predicted = logits[:, P - 1 : P + width - 1].argmax(-1)
    valid = a["response_mask"].bool()
    assert torch.equal(predicted[valid], a["responses"][valid])


def test_rows_that_all_stop_at_once_give_one_column(embedded_model_dir, tokenizer):
    """The rollout is cut to its longest response (issue 20): here one column, the EOS."""
    model = load_causal_lm(embedded_model_dir, torch.float32, CPU, seed=0)
    rollout = HFEngine(model, tokenizer, RolloutConfig(do_sample=False), 7)
    _, prompts = prompts_batch(tokenizer, n=4, seed=1)
    before = rollout.generate(prompts)
    eos = tokenizer.eos_token_id
    assert before["responses"].shape[1] > 1, "the random model already emits only EOS"

    rollout.load_weights(forcing_state_dict(model, eos))
    out = rollout.generate(prompts)
    check_rollout_layout(out, prompts, tokenizer, 7)
    assert out["responses"].tolist() == [[eos]] * 4
    assert out["response_mask"].tolist() == [[1]] * 4
    assert out["input_ids"].shape == (4, P + 1)


def test_load_weights_changes_what_is_generated(embedded_model_dir, tokenizer):
    model = load_causal_lm(embedded_model_dir, torch.float32, CPU, seed=0)
    rollout = HFEngine(model, tokenizer, RolloutConfig(do_sample=True), R)
    _, prompts = prompts_batch(tokenizer, n=6, seed=2)
    digit7 = tokenizer.convert_tokens_to_ids("7")
    rollout.load_weights(forcing_state_dict(model, digit7))
    torch.manual_seed(0)
    out = rollout.generate(prompts)
    assert out["responses"].tolist() == [[digit7] * R] * 6
    assert out["response_mask"].tolist() == [[1] * R] * 6

    rollout.load_weights(forcing_state_dict(model, tokenizer.eos_token_id))
    out = rollout.generate(prompts)
    assert out["responses"].tolist() == [[tokenizer.eos_token_id]] * 6  # cut to the longest response
    assert out["response_mask"].tolist() == [[1]] * 6


def test_load_weights_is_strict(embedded_model_dir, tokenizer):
    model = load_causal_lm(embedded_model_dir, torch.float32, CPU, seed=0)
    rollout = HFEngine(model, tokenizer, RolloutConfig(), R)
    partial = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        rollout.load_weights(partial)


COLLECTIVES = [
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "gather", "scatter",
    "new_group", "init_process_group",
]


def test_generate_needs_no_process_group_and_calls_no_collective(model, tokenizer, monkeypatch):
    assert not dist.is_initialized()
    called = []

    def forbid(name):
        def fn(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"rollout called torch.distributed.{name}")
        return fn

    for name in COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, forbid(name))
    _, prompts = prompts_batch(tokenizer, n=4, seed=4)
    for do_sample in (True, False):
        out = HFEngine(model, tokenizer, RolloutConfig(do_sample=do_sample), R).generate(prompts)
        assert out["responses"].shape[0] == 4 and out["responses"].shape[1] <= R
    assert called == []
    assert not dist.is_initialized()


def test_checkpoint_generation_defaults_do_not_leak_into_the_rollout(embedded_model_dir, tokenizer, tmp_path):
    import json
    import shutil

    folder = tmp_path / "with-generation-defaults"
    shutil.copytree(embedded_model_dir, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    # What an instruct checkpoint ships (Qwen2.5-*-Instruct's values).
    gen.update(repetition_penalty=1.05, temperature=0.7, top_p=0.8, top_k=20, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    model = load_causal_lm(str(folder), torch.float32, CPU, seed=0)
    seven, eight = tokenizer.convert_tokens_to_ids("7"), tokenizer.convert_tokens_to_ids("8")
    state = forcing_state_dict(model, seven)  # logit 64 for "7", 0 for all else ...
    state["lm_head.weight"][eight] = 63 / 64  # ... but 63 for "8": a close second
    rollout = HFEngine(model, tokenizer, RolloutConfig(do_sample=False), R)
    rollout.load_weights(state)
    batch = collate_prompts([{"prompt": p, "data_source": "synthetic/repeat", "reward_model": {"ground_truth": "x"}}
                             for p in ("12=", "345=", "9=")], tokenizer, P, step=1, first_row=0)
    out = rollout.generate(batch)
    # The policy's greedy choice is "7" at every step; a penalty on repeats would pick "8" once "7" is out.
    assert out["responses"].tolist() == [[seven] * R] * 3


def test_eos_token_ids_include_the_checkpoints_generation_config(embedded_model_dir, tokenizer, tmp_path):
    """Chat checkpoints end a turn with a token other than the tokenizer's EOS (Qwen's
    <|im_end|>); a rollout that stopped only at the tokenizer's EOS would run past it."""
    import json
    import shutil

    from spmdsplit.models import eos_token_ids

    folder = tmp_path / "chat"
    shutil.copytree(embedded_model_dir, folder)
    equals = tokenizer.convert_tokens_to_ids("=")
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [equals, tokenizer.eos_token_id]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert eos_token_ids(str(folder), tokenizer) == [tokenizer.eos_token_id, equals]
    assert eos_token_ids(str(embedded_model_dir), tokenizer) == [tokenizer.eos_token_id]

    model = load_causal_lm(str(folder), torch.float32, CPU, seed=0)
    rollout = HFEngine(model, tokenizer, RolloutConfig(do_sample=False), R, eos_token_ids(str(folder), tokenizer))
    rollout.load_weights(forcing_state_dict(model, equals))  # always emits the chat-style stop token
    _, prompts = prompts_batch(tokenizer, n=2, seed=1)
    out = rollout.generate(prompts)
    assert out["response_mask"].tolist() == [[1]] * 2


# --------------------------------------------------------------------------- rollout_log_probs

def teacher_forced_log_probs(model, out, temperature: float, top_k: int = 0) -> torch.Tensor:
    """What the actor computes (roles/actor.py), log_softmax(logits / T) of the response tokens,
    here with top-k applied before the softmax when asked: the distribution the engine sampled from."""
    from spmdsplit import algo
    from spmdsplit.roles.forward import forward_response

    def head(logits, tokens):
        z = logits.float() / temperature
        if top_k:
            kth = z.topk(top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        return algo.logprobs_from_logits(z, tokens)

    with torch.no_grad():
        return forward_response(model, out, head)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_hf_rollout_log_probs_are_the_actors_in_fp32(model, tokenizer, temperature):
    """The HF engine returns what vLLM's does: the sampled tokens' log-probs after temperature,
    0 past each response. Its copy holds the actor's weights, so in fp32 they are the actor's."""
    _, prompts = prompts_batch(tokenizer, n=32, seed=3)
    torch.manual_seed(1)
    out = HFEngine(model, tokenizer, RolloutConfig(do_sample=True, temperature=temperature), R).generate(prompts)
    engine, mask = out["rollout_log_probs"], out["response_mask"]
    assert engine.dtype == torch.float32 and engine.shape == out["responses"].shape
    assert torch.equal(engine == 0, mask == 0)
    assert mask.sum() > 32 and (mask.sum(-1) < out["responses"].shape[1]).any()  # rows that ended early too
    assert (engine - teacher_forced_log_probs(model, out, temperature)).abs().max() < 1e-5


def test_hf_rollout_log_probs_are_of_the_truncated_distribution_under_top_k(model, tokenizer):
    """As vLLM's processed log-probs: the distribution the token was drawn from, after top-k."""
    _, prompts = prompts_batch(tokenizer, n=16, seed=4)
    torch.manual_seed(2)
    out = HFEngine(model, tokenizer, RolloutConfig(do_sample=True, temperature=1.5, top_k=3), R).generate(prompts)
    mask = out["response_mask"].bool()
    truncated = teacher_forced_log_probs(model, out, 1.5, top_k=3)
    full = teacher_forced_log_probs(model, out, 1.5)
    assert (out["rollout_log_probs"] - truncated)[mask].abs().max() < 1e-5
    assert (truncated - full)[mask].min() > 1e-3  # renormalised over 3 tokens: higher than under the full one


def test_greedy_rollout_log_probs_are_of_the_raw_logits(model, tokenizer):
    _, prompts = prompts_batch(tokenizer, n=8, seed=5)
    out = HFEngine(model, tokenizer, RolloutConfig(do_sample=False), R).generate(prompts)
    assert (out["rollout_log_probs"] - teacher_forced_log_probs(model, out, 1.0)).abs().max() < 1e-5
