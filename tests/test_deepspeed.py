"""The DeepSpeed engine (ZeRO 1/2/3) confined to its pool, with real processes on gloo.

Each multi-rank test runs a DeepSpeed pool *beside* another pool that does its own work and never
joins a world collective: a DeepSpeed call that still went to the world would hang there, and
run_ranks' timeout turns that hang into a failure.
"""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.support.helpers import PlainEngine, full_weights
from tests.support.launch import run_ranks
from tests.support.helpers import ROWS, after_each_backward, make_batch

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


def _role(role, model_dir, engine_for, micro):
    """An actor or critic on the embedded model, its engine made by `engine_for(model, optim)`;
    two optimizer steps (two mini-batches) per update, `micro` rows per micro-batch."""
    from spmdsplit.config import ActorConfig, CriticConfig, OptimConfig
    from spmdsplit.models import load_causal_lm
    from tests.support.helpers import load_value_model
    from spmdsplit.roles.actor import Actor
    from spmdsplit.roles.critic import Critic

    device = torch.device("cpu")
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=2, grad_clip=1e9)
    if role == "actor":
        cfg = ActorConfig(optim=optim, ppo_mini_batch_size=ROWS // 2, ppo_micro_batch_size_per_gpu=micro,
                          entropy_coeff=0.01, shuffle=False)
        model = load_causal_lm(model_dir, torch.float32, device, seed=3)
        return Actor(engine_for(model, optim), cfg, temperature=1.0, device=device), model.config.vocab_size
    cfg = CriticConfig(optim=optim, ppo_mini_batch_size=ROWS // 2, ppo_micro_batch_size_per_gpu=micro,
                       cliprange_value=0.05, shuffle=False)
    model = load_value_model(model_dir, torch.float32, device, seed=3)
    return Critic(engine_for(model, optim), cfg, device), model.config.vocab_size


def _whole_gradients(model) -> int:
    return sum(p.grad is not None for p in model.parameters())


UPDATE_CASES = [("actor", 1), ("actor", 2), ("actor", 3), ("critic", 3)]


def _updates_beside_unsharded(rank, world_size, model_dir):
    """Every case of UPDATE_CASES in one set of processes (start-up and DeepSpeed's import are
    most of a case's time), each with groups of its own, made in the same order on every rank."""
    return {case: _update_beside_unsharded(rank, world_size, model_dir, *case) for case in UPDATE_CASES}


def _update_beside_unsharded(rank, world_size, model_dir, role, stage):
    """Ranks 0-1: a DeepSpeed ZeRO-`stage` pool, each rank with half the rows, 2 micro-batches of one
    row per mini-batch. Rank 2: its own pool, FSDP2 on one rank = the unsharded update of all rows,
    at the same time, its rows ordered so that each of its mini-batches holds the same rows as the
    pool's (a pool's mini-batch k is rows k of every rank)."""
    from spmdsplit.engines.deepspeed import DeepSpeedEngine
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.exchange import row_ranges

    ds_pool, single_pool = dist.new_group([0, 1]), dist.new_group([2])
    if rank < 2:
        worker, vocab = _role(role, model_dir, lambda m, o: DeepSpeedEngine(m, ds_pool, stage, o), micro=1)
        start, end = row_ranges(ROWS, 2)[rank]
        mine = make_batch(vocab).slice(start, end)
    else:
        mesh = DeviceMesh.from_group(single_pool, "cpu")
        worker, vocab = _role(role, model_dir, lambda m, o: FSDPEngine(m, mesh, o), micro=ROWS // 2)
        mine = make_batch(vocab).index(torch.tensor([0, 1, 4, 5, 2, 3, 6, 7]))
    # ZeRO-2/3 move each whole `.grad` into this rank's partition within the backward.
    whole_after_micro = after_each_backward(worker.engine, _whole_gradients) if rank < 2 else []
    update = worker.update_policy if role == "actor" else worker.update_critic
    metrics = update(mine, seed=1)
    metrics2 = update(mine, seed=2)  # a second update: Adam's state and the LR warmup carry over
    state = full_weights(worker.engine)
    return state, metrics, metrics2, whole_after_micro


@pytest.fixture(scope="module")
def updates_beside_unsharded(embedded_model_dir):
    return run_ranks(_updates_beside_unsharded, 3, embedded_model_dir, timeout=480, kind="deepspeed")


@needs_deepspeed
@pytest.mark.parametrize("role, stage", UPDATE_CASES)
def test_zero_update_matches_unsharded_update(updates_beside_unsharded, embedded_model_dir, role, stage):
    ds0, ds1, plain = (by_case[role, stage] for by_case in updates_beside_unsharded)
    (state, m1, m2, whole_after_micro), (expected, e1, e2, _) = ds0, plain
    # 2 updates x 2 mini-batches x 2 micro-batches; ZeRO-1 keeps whole gradients by design.
    assert len(whole_after_micro) == 8
    assert all(whole_after_micro) if stage == 1 else not any(whole_after_micro), whole_after_micro
    from spmdsplit.models import load_causal_lm
    from tests.support.helpers import load_value_model

    load = load_causal_lm if role == "actor" else load_value_model
    initial = load(embedded_model_dir, torch.float32, torch.device("cpu"), seed=3).state_dict()
    assert max((expected[k] - initial[k]).abs().max().item() for k in expected) > 1e-3, "nothing moved"
    assert state.keys() == expected.keys()
    for name in expected:
        # A key bias shifts every score of a query by the same amount, which softmax ignores: its
        # true gradient is 0 and Adam turns the float noise of the reduction order (all-reduce vs
        # reduce-scatter) into steps of up to ~1e-4 here. Every other weight: 5e-5, with lr 1e-2 (the
        # same noise reaches single entries whose gradient is near 0: 2.6e-5 once in 8192 here; a real
        # error, a wrong gradient scale or a missed reduction, moves whole tensors by ~lr).
        atol = 2e-4 if name.endswith("k_proj.bias") else 5e-5
        torch.testing.assert_close(state[name], expected[name], rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(ds1[0][name], expected[name], rtol=0, atol=atol, msg=name)
    prefix = "actor" if role == "actor" else "critic"
    loss = "actor/pg_loss" if role == "actor" else "critic/vf_loss"
    for got, want in ((m1, e1), (m2, e2)):
        for key in (f"{prefix}/grad_norm", loss):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
        assert got[f"{prefix}/lr"] == want[f"{prefix}/lr"]


def _save_load_beside_training(rank, world_size, model_dir, stage, out_dir, other_pool_s=300.0):
    """Ranks 2-3: a DeepSpeed pool (its first rank is *not* global rank 0) updates, saves its whole
    training state, updates again, then a fresh engine loads the checkpoint and repeats that
    second update; and it exports the HF model. Ranks 0-1: an FSDP pool keeps training the whole
    time, until the DeepSpeed pool is done (or `other_pool_s` have passed, then leaves). Returns
    what each needs for the checks."""
    import time

    from spmdsplit.engines.deepspeed import DeepSpeedEngine
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.exchange import row_ranges
    from spmdsplit.models import load_tokenizer

    fsdp_pool, ds_pool = dist.new_group([0, 1]), dist.new_group([2, 3])
    done = os.path.join(out_dir, "ds-pool-done")
    if rank < 2:
        mesh = DeviceMesh.from_group(fsdp_pool, "cpu")
        worker, vocab = _role("critic", model_dir, lambda m, o: FSDPEngine(m, mesh, o), micro=2)
        mine = make_batch(vocab).slice(*row_ranges(ROWS, 2)[rank])
        spans, step, deadline = [], 0, time.time() + other_pool_s
        while True:
            start = time.time()
            worker.update_critic(mine, seed=step)
            spans.append((start, time.time()))
            step += 1
            flags = torch.tensor([float(os.path.exists(done) or time.time() > deadline)])
            dist.all_reduce(flags, group=fsdp_pool)  # both ranks stop after the same update
            if flags.item() > 0:
                break
        return {"spans": spans}

    def engine(m, o):
        return DeepSpeedEngine(m, ds_pool, stage, o)

    worker, vocab = _role("actor", model_dir, engine, micro=1)
    mine = make_batch(vocab).slice(*row_ranges(ROWS, 2)[rank - 2])
    worker.update_policy(mine, seed=1)
    checkpoint = os.path.join(out_dir, "ckpt")
    save_start = time.time()
    worker.engine.save_checkpoint(checkpoint)
    save_span = (save_start, time.time())
    after = worker.update_policy(mine, seed=2)
    expected = full_weights(worker.engine)

    fresh, _ = _role("actor", model_dir, engine, micro=1)  # initial weights, new optimizer and schedule
    fresh.engine.load_checkpoint(checkpoint)
    resumed = fresh.update_policy(mine, seed=2)
    got = full_weights(fresh.engine)
    # Another ZeRO stage cannot read these files: a clear error, not DeepSpeed's KeyError halfway.
    other, _ = _role("actor", model_dir, lambda m, o: DeepSpeedEngine(m, ds_pool, 5 - stage, o), micro=1)
    with pytest.raises(ValueError, match=f"saved by DeepSpeed ZeRO-{stage} on a pool of 2"):
        other.engine.load_checkpoint(checkpoint)
    fresh.engine.save_hf(os.path.join(out_dir, "hf"), load_tokenizer(model_dir), is_writer=rank == 2)
    if rank == 2:
        open(done, "w").close()
    return {"expected": expected, "got": got, "after": after, "resumed": resumed, "save_span": save_span,
            "files": sorted(os.listdir(checkpoint))}


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_save_and_load_in_one_pool_while_the_other_trains(embedded_model_dir, tmp_path, stage):
    fsdp0, _, ds2, ds3 = run_ranks(_save_load_beside_training, 4, embedded_model_dir, stage, str(tmp_path), timeout=300,
                                   kind="deepspeed")
    for ds in (ds2, ds3):
        for name, want in ds["expected"].items():
            torch.testing.assert_close(ds["got"][name], want, rtol=0, atol=1e-6, msg=name)
        assert ds["resumed"]["actor/lr"] == ds["after"]["actor/lr"]  # the LR schedule came back too
        assert ds["resumed"]["actor/grad_norm"] == pytest.approx(ds["after"]["actor/grad_norm"], rel=1e-6)
    assert ds2["files"] == ["engine"], "only the fixed tag's folder: no DeepSpeed 'latest' file"
    # The FSDP pool kept updating while the DeepSpeed pool saved: some update overlaps the save.
    s0, s1 = ds2["save_span"]
    assert len(fsdp0["spans"]) >= 2
    assert any(a < s1 and s0 < b for a, b in fsdp0["spans"]), "the other pool did not train during the save"

    # Full weights for the HF export on the pool's first rank (global rank 2), from ZeRO-3 shards.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    for name, want in ds2["got"].items():
        torch.testing.assert_close(exported[name], want, rtol=0, atol=0, msg=name)


@needs_deepspeed
@pytest.mark.parametrize(
    "stage, unscoped, where",
    [(3, "barrier", "_create_fp16_partitions_with_defragmentation"),  # ZeRO-3 optimizer set-up
     (3, "trace", "reset_step"),  # ZeRO-3 trace check after the first forward/backward
     (2, "barrier", "save_checkpoint"),  # no ZeRO-3 set-up barriers: the checkpoint's is the first
     (2, "tag_validation", "_checkpoint_tag_validation")],  # the checkpoint's barrier scoped, then this
)
def test_each_unscoped_call_hangs_beside_another_pool(embedded_model_dir, tmp_path, monkeypatch, stage, unscoped, where):
    """The job above with one of the pool scopings left out (SPMDSPLIT_DS_WITHOUT): that DeepSpeed
    call waits on the world, which the FSDP pool never joins. The FSDP pool leaves after one update,
    so the call fails (peer gone) where it would otherwise hang, whenever the DeepSpeed pool reaches
    it (before the FSDP pool left: at its leaving; after: at once); the traceback must show the
    DeepSpeed function the scoping is for. A call scoped to the pool never meets the FSDP ranks, and
    completes beside them (test_save_and_load_in_one_pool_while_the_other_trains). The FSDP pool
    used to train 10 s first, which only made each case wait."""
    monkeypatch.setenv("SPMDSPLIT_DS_WITHOUT", unscoped)  # the ranks see the test's environment
    with pytest.raises(AssertionError, match="hang|failed") as failure:
        run_ranks(_save_load_beside_training, 4, embedded_model_dir, stage, str(tmp_path), 0.0, timeout=90, kind="deepspeed")
    assert "rank(s) [2, 3]" in str(failure.value) or "rank(s) [2]" in str(failure.value) or "rank(s) [3]" in str(failure.value)
    assert where in str(failure.value)


def _shm_builds(rank, world_size):
    """How often DeepSpeed's communication start-up asks for the shared-memory op's JIT build. The
    builder is replaced by a counter that builds nothing: the build itself takes ~53 s."""
    import importlib

    from spmdsplit.engines.deepspeed_compat import init_deepspeed_comm

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    calls = []
    ds_torch.build_shm_op = lambda: calls.append(1)
    init_deepspeed_comm()
    return len(calls)


@needs_deepspeed
@pytest.mark.parametrize("left_out", [False, True])
def test_deepspeed_comm_init_would_build_the_shm_op(monkeypatch, left_out):
    """deepspeed_compat 1: DeepSpeed 0.19.8's TorchBackend asks for the JIT build of its CPU
    shared-memory all-reduce at start-up; with the workaround it is never asked."""
    if left_out:
        monkeypatch.setenv("SPMDSPLIT_DS_WITHOUT", "shm_build")
    assert run_ranks(_shm_builds, 1, timeout=120, kind="deepspeed") == [1 if left_out else 0]


def _zero3_build(rank, world_size, model_dir):
    """A ZeRO-3 pool of two builds an fp32 model from the checkpoint: its parameters' dtypes, and
    whether DeepSpeed's accelerator says this CPU supports fp16."""
    from deepspeed.accelerator import get_accelerator

    from spmdsplit.engines.deepspeed import DeepSpeedEngine
    from spmdsplit.models import ModelSource

    model = DeepSpeedEngine.from_source(ModelSource("causal_lm", model_dir, torch.float32), dist.group.WORLD, 3,
                                        torch.device("cpu")).model
    return sorted({str(p.dtype) for p in model.parameters()}), get_accelerator().is_fp16_supported()


@needs_deepspeed
@pytest.mark.parametrize("left_out, fails_with", [("", None), ("dynamo_import", "Signature mismatch"),
                                                  ("zero_init_dtype", "bfloat16")])
def test_zero_init_workarounds_are_needed(embedded_model_dir, monkeypatch, left_out, fails_with):
    """deepspeed_compat 5 and 6, in fresh processes: with both, the pool builds the fp32 model it
    was asked for; without the first import outside zero.Init, importing torch._dynamo under it fails (a signature mismatch);
    without leaving zero.Init's dtype to the config, the model comes out bf16 on a CPU whose fp16
    DeepSpeed's accelerator does not support (`Init._set_dtype` keeps the asked dtype only where it
    does: bf16 where the suite has run so far, fp32 on an Intel Xeon whose fp16 it supports)."""
    monkeypatch.setenv("SPMDSPLIT_DS_WITHOUT", left_out)
    built = lambda: run_ranks(_zero3_build, 2, embedded_model_dir, timeout=180, kind="cold")  # noqa: E731
    if fails_with is None:
        assert [dtypes for dtypes, _ in built()] == [["torch.float32"]] * 2
    elif left_out == "zero_init_dtype":
        (dtypes, fp16), _ = built()
        assert dtypes == ["torch.float32" if fp16 else "torch.bfloat16"]
    else:
        with pytest.raises(AssertionError, match=fails_with):
            built()


def _inference_beside_plain(rank, world_size, model_dir):
    """Ranks 0-1: a reference policy and a reward model under DeepSpeed ZeRO-3 and stage 0 (two
    engines of each in one process), each rank with half the rows. Rank 2, its own pool: the same
    models unwrapped, on all rows."""
    from spmdsplit.config import ActorConfig
    from spmdsplit.engines.deepspeed import DeepSpeedEngine
    from spmdsplit.exchange import row_ranges
    from spmdsplit.models import load_causal_lm
    from spmdsplit.roles.actor import Actor
    from tests.support.helpers import load_reward_model

    pool = dist.new_group([0, 1])
    dist.new_group([2])
    cpu = torch.device("cpu")
    cfg = ActorConfig(log_prob_micro_batch_size_per_gpu=2)
    batch = make_batch(load_causal_lm(model_dir, torch.float32, cpu, seed=3).config.vocab_size)
    if rank == 2:
        model = load_causal_lm(model_dir, torch.float32, cpu, seed=3)
        log_probs = Actor(PlainEngine(model), cfg, 1.0, cpu).compute_log_prob(batch)
        rm = load_reward_model(model_dir, torch.float32, cpu, seed=5).eval()
        with torch.no_grad():
            scores = rm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return {"plain": (log_probs, scores)}
    mine = batch.slice(*row_ranges(ROWS, 2)[rank])
    out = {}
    for stage in (3, 0):
        engine = DeepSpeedEngine(load_causal_lm(model_dir, torch.float32, cpu, seed=3), pool, stage)
        log_probs = Actor(engine, cfg, 1.0, cpu).compute_log_prob(mine)
        rm = DeepSpeedEngine(load_reward_model(model_dir, torch.float32, cpu, seed=5), pool, stage)
        with torch.no_grad():
            scores = rm(input_ids=mine["input_ids"], attention_mask=mine["attention_mask"]).logits
        sharded = stage == 3 and all(p.numel() == 0 for p in engine.model.parameters())
        out[stage] = (log_probs, scores, sharded)
    return out


@needs_deepspeed
def test_reference_and_reward_model_infer_under_zero3_and_stage0(embedded_model_dir):
    r0, r1, plain = run_ranks(_inference_beside_plain, 3, embedded_model_dir, timeout=240, kind="deepspeed")
    want_logp, want_scores = plain["plain"]
    for stage in (3, 0):
        logp = torch.cat([r0[stage][0], r1[stage][0]])
        scores = torch.cat([r0[stage][1], r1[stage][1]])
        torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5, msg=f"stage {stage}")
        torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-5, msg=f"stage {stage}")
    assert r0[3][2], "ZeRO-3 left some weight whole on a rank: not sharded"


def test_engine_choice_and_inference_stage_errors():
    """Which engine and stage each role gets, and the stages an inference-only model cannot take,
    caught by the config before anything starts (no DeepSpeed needed)."""
    from spmdsplit.config import load_config
    from spmdsplit.errors import ConfigError
    from spmdsplit.preflight import check_config
    from spmdsplit.engines import engine_choice

    cfg = load_config(overrides=["actor.engine=deepspeed", "actor.zero_stage=2", "critic.engine=deepspeed"]) \
        if importlib.util.find_spec("deepspeed") else None
    if cfg is not None:
        assert engine_choice(cfg, "actor") == ("deepspeed", 2)
        assert engine_choice(cfg, "ref") == ("deepspeed", 0)  # follows the actor; stage 2 -> whole weights
        assert engine_choice(cfg, "critic") == ("deepspeed", 3)
        assert engine_choice(cfg, "reward_model") == ("deepspeed", 3)  # follows the critic's ZeRO-3
    cfg = load_config()
    assert engine_choice(cfg, "ref") == ("fsdp", 3) and engine_choice(cfg, "actor")[0] == "fsdp"
    for key in ("ref.zero_stage", "reward.model.zero_stage"):
        for stage in (1, 2):
            with pytest.raises(ConfigError, match=rf"{key}={stage}: ZeRO stages 1 and 2"):
                load_config(overrides=[f"{key}={stage}"])
    for bad in ("actor.engine=megatron", "critic.zero_stage=4", "ref.engine=ds"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(overrides=[bad])
    # FSDP2's no-sync accumulation has no DeepSpeed counterpart to switch (its no_sync refuses ZeRO-2/3).
    for role in ("actor", "critic"):
        with pytest.raises(ConfigError, match=f"{role}.no_sync_accumulation=true is an FSDP2 option"):
            check_config(load_config(overrides=[f"{role}.engine=deepspeed", f"{role}.no_sync_accumulation=true"]))
        check_config(load_config(overrides=[f"{role}.no_sync_accumulation=true"]))


# DeepSpeed on one pool; on both pools (actor ZeRO-3, critic ZeRO-2) it is the uninterrupted run
# of the resume test below, which makes the same checks.
MIXES = {
    "actor-zero3+critic-fsdp": ["actor.engine=deepspeed", "actor.zero_stage=3"],
    "actor-fsdp+critic-zero3": ["critic.engine=deepspeed", "critic.zero_stage=3"],
}


@needs_deepspeed
@pytest.mark.parametrize("mix", list(MIXES))
def test_ppo_job_with_engine_mix_on_2_plus_2(tmp_path, monkeypatch, mix):
    """The real job under torchrun, 2+2 split, with DeepSpeed on one pool: the same metric
    names as the all-FSDP job, update_actor beside update_critic, and nothing JIT-compiled."""
    from tests.support.jobs import run_short

    extensions = tmp_path / "torch_extensions"  # where a JIT build of a DeepSpeed op would land
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    out, result = run_short(tmp_path, 4, "placement.mode=split", "trainer.dist_timeout_s=120", *MIXES[mix])
    check_a_2_plus_2_job(out, extensions)


def check_a_2_plus_2_job(out, extensions, beside=("update_actor",)):
    """`beside`: the actor pool's phases update_critic must run beside in 3 of the 4 steps."""
    from tests.support.outputs import overlapping_steps, scalars, timeline_events
    from tests.support.jobs import VERL_METRICS

    logged = scalars(str(out / "tb"))
    missing = [k for k in VERL_METRICS if k not in logged]
    assert not missing, f"metrics not in TensorBoard: {missing}"
    assert [s for s, _ in logged["actor/grad_norm"]] == [1, 2, 3, 4]
    assert all(v > 0 and v == v for _, v in logged["actor/grad_norm"] + logged["critic/grad_norm"])
    # The pools work at the same time: update_critic runs beside the actor pool's own work.
    events = timeline_events(str(out / "timeline.json"))
    both = sorted(set().union(*(overlapping_steps(events, phase, [0, 1], "update_critic", [2, 3]) for phase in beside)))
    assert len(both) >= 3, f"update_critic ran beside the actor pool's work only in steps {both}"
    assert not extensions.exists(), f"something was JIT-compiled: {list(extensions.iterdir())}"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out / "actor_hf"))  # the export from the actor's engine loads


@needs_deepspeed
def test_trainer_checkpoint_resume_through_deepspeed_repeats_the_uninterrupted_run(tmp_path, monkeypatch):
    """The trainer's checkpointing with DeepSpeed on both pools (actor ZeRO-3, critic ZeRO-2, 2+2):
    a job that stops after a checkpoint at step 2 and is started again logs steps 3-4 exactly as
    the job that ran straight through (weights, Adam moments, LR warmup and RNG all came back).
    The uninterrupted run is also the engine-mix check with DeepSpeed on both pools."""
    from tests.support.launch import job
    from tests.support.jobs import SHORT
    from tests.support.outputs import comparable

    extensions = tmp_path / "torch_extensions"  # where a JIT build of a DeepSpeed op would land
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    overrides = [*SHORT, "actor.engine=deepspeed", "actor.zero_stage=3", "critic.engine=deepspeed", "critic.zero_stage=2",
           "actor.optim.lr_warmup_steps=3", "trainer.timeline=", "trainer.output_dir=", "trainer.seed=3",
           "placement.mode=split", "trainer.dist_timeout_s=120"]

    def run(out, *extra):
        result = job(4, *overrides, f"trainer.log_dir={out}/tb", f"trainer.default_local_dir={out}/ckpt", *extra,
                     timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        return result.stdout

    straight = tmp_path / "straight"
    run(straight, "trainer.resume=disable", f"trainer.timeline={straight}/timeline.json",
        f"trainer.output_dir={straight}/actor_hf")
    # With the critic on ZeRO-2 and the actor on ZeRO-3, a quiet machine finishes update_critic
    # before update_actor starts: here it must run beside the actor pool's log-probs, reference or update.
    check_a_2_plus_2_job(straight, extensions, beside=("old_log_prob", "ref", "update_actor"))
    run(tmp_path / "stopped", "trainer.total_steps=2", "trainer.save_freq=2")
    assert "resuming from" in run(tmp_path / "stopped")  # the same folder: resume=auto finds step 2

    # Every scalar but wall-clock ones, each step logged once (a resumed run logs from step 3 on).
    straight, resumed = comparable(str(tmp_path / "straight" / "tb")), comparable(str(tmp_path / "stopped" / "tb"))
    assert resumed.keys() == straight.keys()
    for tag, values in straight.items():
        assert resumed[tag] == values, f"{tag} differs after resume"


def _non_finite_step(rank, world_size, model_dir):
    """For each ZeRO stage, on a 2-rank pool: a step whose gradients hold NaN must leave the weights
    as they were (as FSDPEngine does), and the next, finite step must still move them."""
    from spmdsplit.config import OptimConfig
    from spmdsplit.engines.deepspeed import DeepSpeedEngine
    from spmdsplit.models import load_causal_lm

    pool = dist.new_group([0, 1])
    out = {}
    for stage in (1, 2, 3):
        model = load_causal_lm(model_dir, torch.float32, torch.device("cpu"), seed=3)
        batch = make_batch(model.config.vocab_size)
        engine = DeepSpeedEngine(model, pool, stage, OptimConfig(lr=1e-2))
        before = full_weights(engine)

        def loss(scale):
            logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            return logits.float().mean() * scale

        engine.backward(loss(float("nan")))
        skipped = engine.step()
        after_skip = full_weights(engine)
        engine.backward(loss(1.0))
        taken = engine.step()
        moved = full_weights(engine)
        out[stage] = {
            "skipped_norm": skipped["grad_norm"], "taken_norm": taken["grad_norm"],
            "unchanged": all(torch.equal(before[k], after_skip[k]) for k in before),
            "moved": max((moved[k] - before[k]).abs().max().item() for k in before),
        }
    return out


@needs_deepspeed
def test_a_non_finite_gradient_skips_the_step(embedded_model_dir):
    import math

    for rank_result in run_ranks(_non_finite_step, 2, embedded_model_dir, timeout=180, kind="deepspeed"):
        for stage, r in rank_result.items():
            assert r["unchanged"], f"ZeRO-{stage}: a NaN gradient changed the weights"
            assert not math.isfinite(r["skipped_norm"]), f"ZeRO-{stage}: grad_norm {r['skipped_norm']}"
            assert math.isfinite(r["taken_norm"]) and r["moved"] > 1e-4, f"ZeRO-{stage}: the next step did not train"
