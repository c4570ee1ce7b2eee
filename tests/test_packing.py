"""Padding-free forward passes (model.use_remove_padding) and token-budget micro-batches
(use_dynamic_bsz) compute what the padded, fixed micro-batches compute: log-probs, entropy,
values, reward-model scores and gradients, on the plain model and through both engines."""

import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmdsplit.batch import Batch
from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.roles.micro_batches import (fixed_bins, in_row_order, micro_batches, split_to_count,
                                           token_budget_bins)
from tests.support.helpers import full_weights
from tests.support.launch import run_ranks
from tests.support.ragged import PROMPT_LENGTHS, RESPONSE_LENGTHS, R, actor_on_pool, ragged_batch

TOLERANCE = dict(rtol=0, atol=1e-5)


def logprob_head(entropy="grad"):
    from spmdsplit import algo

    return lambda logits, tokens: algo.logprobs_and_entropy(logits, tokens, 0.7, entropy)


def unpadded_reference(model, batch: Batch, head) -> tuple:
    """Each row on its own, its valid tokens only, no mask: what padding and packing must both give."""
    out = [torch.zeros(len(batch), R), torch.zeros(len(batch), R)]
    for i in range(len(batch)):
        valid = batch["attention_mask"][i].bool()
        n = int(batch["response_mask"][i].sum())
        logits = model(input_ids=batch["input_ids"][i][valid][None]).logits[:, -n - 1 : -1]
        results = head(logits, batch["responses"][i, :n][None])
        for k, result in enumerate(results if isinstance(results, tuple) else (results,)):
            out[k][i, :n] = result[0]
    return tuple(out)


# ------------------------------------------------------------------ the planner (pure functions)

def test_token_budget_bins_hold_the_budget_and_a_long_row_alone():
    lengths = [9, 3, 4, 20, 5, 1, 7]
    bins = token_budget_bins(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [3] in bins  # longer than the budget: on its own
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins if b != [3])
    assert len(bins) == 4  # first-fit decreasing: 20 | 9+1 | 7+3 | 5+4


def test_split_to_count_keeps_the_budget_then_adds_dummies():
    lengths = [6, 3, 3, 2]
    bins = split_to_count([[0, 1], [2, 3]], lengths, 3)
    assert len(bins) == 3 and sorted(i for b in bins for i in b) == [0, 1, 2, 3]
    assert [0] in bins and [1] in bins  # the heaviest bin (9 tokens) was halved
    bins = split_to_count([[0, 1], [2, 3]], lengths, 6)
    assert sorted(bins) == [[], [], [0], [1], [2], [3]]  # no more to split: two dummies


def test_in_row_order_puts_rows_back_and_drops_dummies():
    bins = [[2, 0], [], [1]]
    outputs = [torch.tensor([[20.0], [0.0]]), torch.tensor([[99.0]]), torch.tensor([[10.0]])]
    assert in_row_order(outputs, bins, 3).flatten().tolist() == [0.0, 10.0, 20.0]


# ------------------------------------------------------------------ one process, the plain model

def test_packed_and_trimmed_actor_log_probs_entropy_and_gradients_match(embedded_model_dir):
    from spmdsplit.models import load_causal_lm

    padded_and_packed_match(load_causal_lm(embedded_model_dir, torch.float32, torch.device("cpu"), seed=3))


def padded_and_packed_match(model, after=lambda stage: None):
    """The actor's log-probs, entropy and gradients, padded and packed, equal each row run alone;
    `after(stage)` runs after each stage: "alone" (the reference), "padded", "packed"."""
    from spmdsplit.roles.forward import forward_response

    batch = ragged_batch(model.config.vocab_size)
    weights = torch.randn(len(batch), R, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = unpadded_reference(model, batch, logprob_head())
    after("alone")
    grads = {}
    for packed in (False, True):
        model.zero_grad()
        log_prob, entropy = forward_response(model, batch, logprob_head(), packed, response_only=True)
        torch.testing.assert_close(log_prob, expected[0], **TOLERANCE, msg=f"log-probs, packed={packed}")
        torch.testing.assert_close(entropy, expected[1], **TOLERANCE, msg=f"entropy, packed={packed}")
        ((log_prob + 0.1 * entropy) * weights).sum().backward()
        grads[packed] = {n: p.grad.clone() for n, p in model.named_parameters()}
        after("packed" if packed else "padded")
    assert max(g.abs().max() for g in grads[False].values()) > 1e-3
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "varlen"])
def test_packed_critic_values_match(embedded_model_dir, attention):
    from spmdsplit.models import ModelSource
    from spmdsplit.roles.forward import forward_response
    from spmdsplit.roles.critic import value_head

    model = ModelSource("value", embedded_model_dir, torch.float32, 3, attn_implementation=attention).read("cpu")
    assert model.config._attn_implementation == attention
    batch = ragged_batch(model.config.vocab_size)
    with torch.no_grad():
        expected, _ = unpadded_reference(model, batch, value_head)
        padded = forward_response(model, batch, value_head)
        packed = forward_response(model, batch, value_head, remove_padding=True)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(padded, expected, **TOLERANCE)
    torch.testing.assert_close(packed, expected, **TOLERANCE)


def test_packed_reward_model_scores_match(embedded_model_dir):
    from spmdsplit.models import load_tokenizer
    from spmdsplit.roles.reward_model import RewardModel
    from tests.support.helpers import PlainEngine, load_reward_model

    model = load_reward_model(embedded_model_dir, torch.float32, torch.device("cpu"), seed=11)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))  # scores of size ~1
    tokenizer = load_tokenizer(embedded_model_dir)
    batch = ragged_batch(model.config.vocab_size)
    scores = {}
    for packed, budget in ((False, None), (True, None), (True, 12)):
        rm = RewardModel(PlainEngine(model), tokenizer, tokenizer, micro_batch_size=3, device="cpu",
                         max_tokens=budget, remove_padding=packed)
        lengths = [len(ids) for ids in rm.encode([p + a for p, a in zip(*rm.texts(batch))], 100)]
        assert len(set(lengths)) > 2
        scores[packed, budget] = rm.compute(batch)[1]
    assert scores[False, None].abs().max() > 1e-2
    torch.testing.assert_close(scores[True, None], scores[False, None], **TOLERANCE)
    torch.testing.assert_close(scores[True, 12], scores[False, None], **TOLERANCE)


# ------------------------------------------------------------------ FlashAttention-2's packed path

def test_flash_varlen_kwargs_are_the_rows_starts_and_the_longest_row():
    from spmdsplit.roles.forward import flash_varlen_kwargs

    kwargs = flash_varlen_kwargs(torch.tensor([3, 1, 5, 2]))
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 4, 9, 11] and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 5 and type(kwargs["max_length_q"]) is int


def varlen_stand_in(calls: list):
    """A CPU stand-in for transformers' flash_attention_2 function (the real one needs a GPU): like
    the varlen kernel it attends causally within each row of the packed sequence, and it must be
    given the rows' boundaries (a KeyError otherwise: it does not derive them from position ids)."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        assert attention_mask is None
        starts = kwargs["cu_seq_lens_q"]
        calls.append(kwargs)
        groups = query.shape[1] // key.shape[1]  # grouped-query attention: each KV head serves `groups`
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = torch.zeros_like(query)
        for start, end in zip(starts[:-1].tolist(), starts[1:].tolist()):
            rows = slice(start, end)
            out[:, :, rows] = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, rows], key[:, :, rows], value[:, :, rows], is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return attention


@pytest.fixture
def flash_stand_in(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls: list = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", varlen_stand_in(calls))
    return calls


def test_flash_attention_is_given_the_rows_boundaries_once_per_micro_batch(embedded_model_dir, flash_stand_in):
    """Every layer gets the same cu_seq_lens tensor (computed once, not re-derived per layer) and
    the packed result equals each row run alone."""
    import itertools

    from spmdsplit.models import load_causal_lm
    from spmdsplit.roles.forward import forward_response

    model = load_causal_lm(embedded_model_dir, torch.float32, torch.device("cpu"), seed=3)
    batch = ragged_batch(model.config.vocab_size)
    with torch.no_grad():
        expected = unpadded_reference(model, batch, logprob_head())
        model.config._attn_implementation = "flash_attention_2"
        log_prob, entropy = forward_response(model, batch, logprob_head(), True, response_only=True)
    torch.testing.assert_close(log_prob, expected[0], **TOLERANCE)
    torch.testing.assert_close(entropy, expected[1], **TOLERANCE)
    assert len(flash_stand_in) == model.config.num_hidden_layers
    lengths = [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]
    first = flash_stand_in[0]
    assert first["cu_seq_lens_q"].tolist() == [0, *itertools.accumulate(lengths)]
    assert first["max_length_q"] == max(lengths)
    assert all(call["cu_seq_lens_q"] is first["cu_seq_lens_q"] for call in flash_stand_in)


def test_the_packed_reward_model_gives_flash_attention_the_boundaries_too(embedded_model_dir, flash_stand_in):
    from spmdsplit.models import load_tokenizer
    from spmdsplit.roles.reward_model import RewardModel
    from tests.support.helpers import PlainEngine, load_reward_model

    model = load_reward_model(embedded_model_dir, torch.float32, torch.device("cpu"), seed=11)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    tokenizer = load_tokenizer(embedded_model_dir)
    batch = ragged_batch(model.config.vocab_size)

    def scores(packed):
        return RewardModel(PlainEngine(model), tokenizer, tokenizer, micro_batch_size=3, device="cpu",
                           remove_padding=packed).compute(batch)[1]
    padded = scores(False)
    model.config._attn_implementation = "flash_attention_2"
    torch.testing.assert_close(scores(True), padded, **TOLERANCE)
    assert len(flash_stand_in) == 3 * model.config.num_hidden_layers  # 8 rows, 3 a micro-batch


# ------------------------------------------------------------------ varlen: no mask, each row on its own

def test_auto_picks_flash_attn_only_where_transformers_takes_it(tmp_path, monkeypatch, capsys):
    """`auto` asks what transformers asks before it takes flash_attention_2: a `flash_attn` package
    from the `flash-attn` distribution at >= 2.3.3, and one that imports. Each stub distribution
    below (one folder on sys.path with the package and its dist-info) that transformers would refuse
    gives varlen and one warning line naming why, however often a model is built; flash-attn-4
    (which installs a `flash_attn` package too) and an old flash-attn were taken before; a
    flash_attn whose compiled extension does not load (a wheel built for another torch: found by
    find_spec, failing on import) was refused already. Explicitly asked for, the same reason stops
    the job at start-up."""
    import sys

    from spmdsplit import models
    from spmdsplit.models import attention_implementation
    from spmdsplit.preflight import check_flash_attn_installed

    def installed(distribution: str | None, version: str = "2.7.4", body: str = ""):
        for earlier in tmp_path.iterdir():  # one stub installed at a time
            while str(earlier) in sys.path:
                sys.path.remove(str(earlier))
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        (folder / "flash_attn").mkdir(parents=True)
        (folder / "flash_attn" / "__init__.py").write_text(body)
        if distribution:
            info = folder / f"{distribution.replace('-', '_')}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
            (info / "top_level.txt").write_text("flash_attn\n")
        monkeypatch.syspath_prepend(str(folder))
        models.flash_attn_unavailable.cache_clear()
        sys.modules.pop("flash_attn", None)

    def auto_warns() -> list[str]:
        assert attention_implementation("auto", "cuda:0") == attention_implementation("auto", "cuda:1") == "varlen"
        return capsys.readouterr().err.splitlines()

    prefix = "spmdsplit: warning: model.attn_implementation=auto: "
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        models.flash_attn_unavailable.cache_clear()
        assert attention_implementation("auto", "cpu") == attention_implementation("auto", "cuda:0") == "varlen"
        assert capsys.readouterr().err == ""  # not installed: nothing to say
        installed("flash-attn-4", "4.0.0b4")
        assert auto_warns() == [prefix + "the flash_attn package comes from the flash-attn-4 distribution, not from "
                                "flash-attn, which transformers requires for flash_attention_2; using varlen"]
        cfg = load_config(None, ["model.attn_implementation=flash_attention_2"])
        with pytest.raises(ConfigError, match="^model.attn_implementation=flash_attention_2: the flash_attn package "
                                              "comes from the flash-attn-4 distribution"):
            check_flash_attn_installed(cfg)
        installed(None)  # a bare folder named flash_attn, no distribution at all
        assert auto_warns() == [prefix + "the flash_attn package comes from no installed distribution, not from "
                                "flash-attn, which transformers requires for flash_attention_2; using varlen"]
        installed("flash-attn", "2.3.2")
        assert auto_warns() == [prefix + "flash-attn 2.3.2 is installed; transformers takes flash_attention_2 from "
                                ">= 2.3.3 only; using varlen"]
        installed("flash-attn", body="raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')")
        assert auto_warns() == [prefix + "flash_attn is installed but does not load (ImportError: flash_attn_2_cuda.so: "
                                "undefined symbol: _ZN3c104cuda9SetDeviceEi); using varlen"]
        installed("flash-attn", "2.3.3")  # a flash-attn transformers takes, that loads
        assert attention_implementation("auto", "cuda:0") == "flash_attention_2"
        assert attention_implementation("auto", "cpu") == "varlen"
        assert attention_implementation("sdpa", "cuda") == "sdpa"
        check_flash_attn_installed(cfg)
        assert capsys.readouterr().err == ""
    finally:
        sys.modules.pop("flash_attn", None)
        models.flash_attn_unavailable.cache_clear()


@pytest.fixture
def varlen_calls(monkeypatch):
    """What every layer hands spmdsplit's registered varlen function, recorded on the way through."""
    from transformers import AttentionInterface

    from spmdsplit.attention import VARLEN, register

    register()
    real, calls = AttentionInterface._global_mapping[VARLEN], []

    def recorded(module, query, key, value, attention_mask, **kwargs):
        calls.append(dict(kwargs, attention_mask=attention_mask, heads=(query.shape[1], key.shape[1])))
        return real(module, query, key, value, attention_mask, **kwargs)
    monkeypatch.setitem(AttentionInterface._global_mapping, VARLEN, recorded)
    return calls


def test_varlen_packed_passes_carry_no_mask_and_match_each_row_alone(embedded_model_dir, varlen_calls):
    """The model loads with attn_implementation="varlen" (registered with transformers); a packed
    pass hands every layer no mask and the one boundaries tensor, a padded pass sdpa's mask; both
    give each row's log-probs, entropy and gradients as the row run alone."""
    import itertools

    from spmdsplit.models import ModelSource

    model = ModelSource("causal_lm", embedded_model_dir, torch.float32, 3, attn_implementation="varlen").read("cpu")
    assert model.config._attn_implementation == "varlen"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query heads reach it
    lengths = [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]

    def each_layer_got(stage):
        assert stage == "alone" or len(varlen_calls) == model.config.num_hidden_layers
        if stage == "packed":
            first = varlen_calls[0]
            assert first["cu_seq_lens_q"].tolist() == [0, *itertools.accumulate(lengths)]
            assert first["max_length_q"] == max(lengths) and first["heads"] == (2, 1)
            assert all(c["attention_mask"] is None and c["cu_seq_lens_q"] is first["cu_seq_lens_q"]
                       for c in varlen_calls)
        elif stage == "padded":  # left-padded rows: sdpa's mask, built by transformers from the 2-D one
            assert all(c["attention_mask"] is not None and "cu_seq_lens_q" not in c for c in varlen_calls)
        varlen_calls.clear()
    padded_and_packed_match(model, each_layer_got)


def _dense_reference(query, key, value, lengths, scale, window=None):
    """sdpa over the whole packed sequence with the dense block-causal mask (and a sliding window)."""
    from spmdsplit.roles.forward import block_causal_mask

    allowed = block_causal_mask(torch.tensor(lengths), torch.float32) == 0
    if window is not None:
        position = torch.arange(sum(lengths))
        allowed &= (position[:, None] - position[None, :] < window)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale,
                                                           enable_gqa=True)
    return out.transpose(1, 2)


def varlen_attn_stand_in(calls: list, new_signature: bool):
    """torch's varlen_attn on CPU, as its source documents it (torch/nn/attention/varlen.py): [T, heads,
    D] tensors; torch 2.11+: causal iff window_size == (-1, 0), `scale` (default D^-0.5), and KV heads
    fewer than query heads only with enable_gqa; torch 2.10: `is_causal` and none of the others."""
    def stand_in(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
        calls.append(kw)
        if new_signature:
            causal, scale, gqa = kw.get("window_size") == (-1, 0), kw.get("scale"), kw.get("enable_gqa", False)
        else:
            assert set(kw) <= {"is_causal"}
            causal, scale, gqa = kw.get("is_causal", False), None, False
        if q.shape[1] != k.shape[1] and not gqa:
            raise ValueError("Expect query and key/value to have the same number of heads")
        assert cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32 and max_q == max_k == int(cu_seq_q.diff().max())
        out = torch.empty_like(q)
        for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
            rows = slice(start, end)
            out[rows] = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), is_causal=causal,
                scale=scale, enable_gqa=gqa).transpose(0, 1)
        return out
    return stand_in


@pytest.mark.parametrize("kernel", ["rows one by one", "torch 2.11+ varlen_attn", "torch 2.10 varlen_attn"])
def test_varlen_attention_equals_sdpa_with_the_dense_mask(monkeypatch, kernel):
    """The registered function's math against sdpa with the block-causal mask: grouped-query heads,
    a scale that is not D^-0.5, causal. On CPU it runs the rows one by one; the cuda kernel's call
    runs against a CPU stand-in of torch's varlen_attn (the real one has no CPU kernel), in each
    signature torch has had, so what a missing keyword would have done must be done around it."""
    from types import SimpleNamespace

    import spmdsplit.attention as attention

    lengths, scale = [5, 1, 9, 3], 0.3
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, sum(lengths), 16, generator=g) for heads in (4, 2, 2))
    calls: list = []
    if kernel != "rows one by one":
        new = kernel.startswith("torch 2.11")
        stand_in = varlen_attn_stand_in(calls, new)
        params = {"window_size", "scale", "enable_gqa"} if new else {"is_causal"}
        monkeypatch.setattr(attention, "_torch_varlen", lambda: (stand_in, frozenset(params)))
        monkeypatch.setattr(attention, "_kernel_runs", lambda query: True)
    module = SimpleNamespace(is_causal=True)
    from spmdsplit.roles.forward import flash_varlen_kwargs

    out, _ = attention.varlen_attention_forward(module, query, key, value, None, scaling=scale,
                                                **flash_varlen_kwargs(torch.tensor(lengths)))
    torch.testing.assert_close(out, _dense_reference(query, key, value, lengths, scale), rtol=0, atol=1e-5)
    assert len(calls) == (0 if kernel == "rows one by one" else 1)
    if kernel == "rows one by one":  # and a sliding window shorter than a row
        out, _ = attention.varlen_attention_forward(module, query, key, value, None, scaling=scale, sliding_window=3,
                                                    **flash_varlen_kwargs(torch.tensor(lengths)))
        torch.testing.assert_close(out, _dense_reference(query, key, value, lengths, scale, 3), rtol=0, atol=1e-5)


def test_torch_accepts_the_varlen_kernel_call_on_meta_tensors():
    """torch's own varlen_attn, given what torch_varlen passes, on the meta device (its fake kernel:
    the argument checks and shapes of the real op, forward and backward, with no GPU)."""
    from spmdsplit.attention import _torch_varlen, torch_varlen

    if _torch_varlen() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    q = torch.empty(11, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = v = torch.empty(11, 1, 64, device="meta", dtype=torch.bfloat16)
    out = torch_varlen(q, k, v, torch.tensor([0, 3, 11], dtype=torch.int32, device="meta"), 8, 0.125, True, None)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    out.sum().backward()
    assert q.grad.shape == q.shape


# ------------------------------------------------------------------ two ranks, both engines


def _check_same(results, expected):
    (lp0, metrics, state), (lp1, _, _) = results
    (e0, e_metrics, e_state), (e1, _, _) = expected
    torch.testing.assert_close(torch.cat([lp0, lp1]), torch.cat([e0, e1]), **TOLERANCE)
    for name, value in e_state.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=5e-5, msg=name)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert metrics[key] == pytest.approx(e_metrics[key], rel=1e-5), key


def test_fsdp_actor_packed_with_token_budgets_matches_padded(embedded_model_dir):
    plain = run_ranks(actor_on_pool, 2, embedded_model_dir, "fsdp", False, False)
    _check_same(run_ranks(actor_on_pool, 2, embedded_model_dir, "fsdp", True, True), plain)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_zero3_actor_packed_with_token_budgets_matches_padded(embedded_model_dir):
    plain = run_ranks(actor_on_pool, 2, embedded_model_dir, "deepspeed", False, False, timeout=300, kind="deepspeed")
    _check_same(run_ranks(actor_on_pool, 2, embedded_model_dir, "deepspeed", True, True, timeout=300, kind="deepspeed"), plain)


def test_fixed_bins_are_consecutive_runs():
    assert fixed_bins(5, 2) == [[0, 1], [2, 3], [4]]
    batch = ragged_batch(20)
    micros = list(micro_batches(batch, [[1, 0], []]))
    assert [dummy for _, dummy, _ in micros] == [False, True]
    assert torch.equal(micros[0][0]["input_ids"], batch["input_ids"][[1, 0]])
    assert micros[1][0]["attention_mask"].sum() == 2 and micros[1][0]["response_mask"].sum() == 1


# ------------------------------------------------------------------ Dr. GRPO's horizon

def _dr_grpo_updates(rank, world_size, model_dir, extra_columns):
    """One actor and one critic update, loss_agg_mode=seq-mean-token-sum-norm, on the ragged batch
    with `extra_columns` all-padding response columns added (a rollout cut to another width): the
    weights after both updates."""
    from spmdsplit.config import ActorConfig, CriticConfig, OptimConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import load_causal_lm
    from spmdsplit.roles.actor import Actor
    from spmdsplit.roles.critic import Critic
    from tests.support.helpers import load_value_model

    device, mesh = torch.device("cpu"), DeviceMesh.from_group(dist.group.WORLD, "cpu")
    optim = OptimConfig(lr=1e-2, grad_clip=1e9)
    mode = dict(loss_agg_mode="seq-mean-token-sum-norm", ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4,
                shuffle=False)
    policy = load_causal_lm(model_dir, torch.float32, device, seed=3)
    batch = ragged_batch(policy.config.vocab_size)
    if extra_columns:
        wide = {k: torch.nn.functional.pad(v, (0, extra_columns)) for k, v in batch.tensors.items() if k != "prompts"}
        batch = Batch({**wide, "prompts": batch["prompts"]})
    actor = Actor(FSDPEngine(policy, mesh, optim), ActorConfig(optim=optim, **mode), 1.0, device, loss_horizon=16)
    critic = Critic(FSDPEngine(load_value_model(model_dir, torch.float32, device, seed=3), mesh, optim),
                    CriticConfig(optim=optim, **mode), device, loss_horizon=16)
    actor.update_policy(batch, seed=1)
    critic.update_critic(batch, seed=1)
    return {f"{role}.{k}": v for role, engine in (("actor", actor.engine), ("critic", critic.engine))
            for k, v in full_weights(engine).items()}


def test_dr_grpo_loss_does_not_depend_on_the_width_rows_were_cut_to(embedded_model_dir):
    """Rollouts are cut to their longest response, so a rank's rows have any width: the Dr. GRPO
    loss divides by a constant horizon (data.max_response_length, passed by the roles), not by it."""
    (cut,) = run_ranks(_dr_grpo_updates, 1, embedded_model_dir, 0)
    (wide,) = run_ranks(_dr_grpo_updates, 1, embedded_model_dir, 5)
    for name, value in cut.items():
        torch.testing.assert_close(wide[name], value, rtol=0, atol=1e-6, msg=name)
