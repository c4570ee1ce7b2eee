"""LoRA jobs end to end (spmdsplit/lora.py, docs/lora.md): the engines sample from the adapter they
were given, in every layout and with both engines; a job resumes exactly from an adapter-only
checkpoint; the export loads with PEFT (or, merged, with transformers).

"The engine samples from the adapter it was given" is checked against an oracle outside the job:
tests/jobs/lora_probe.py writes down each step's rows as the engine generated them (its own
log-probs included) and the policy's adapter after every update, and the test scores each row with
plain transformers + PEFT under the adapter of the version the row says it was generated with. That
holds at any staleness (a rollout pool's rows are one update behind the trainer), and it tells the
adapter from the base: after a few updates at a large learning rate the base is far off."""

import glob
import importlib.util
import os
import re

import pytest
import torch

from tests.support.launch import job
from tests.support.outputs import scalars

pytestmark = pytest.mark.e2e
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO, "tests", "jobs", "lora_probe.py")
GRPO_ROLLOUT_ACTOR = os.path.join(REPO, "configs", "grpo_rollout_actor.yaml")
RANK, ALPHA, TEMPERATURE = 8, 16.0, 0.7
# A large learning rate from the first step: the adapter moves far from the base (B starts at 0).
LORA = [f"model.lora_rank={RANK}", f"model.lora_alpha={ALPHA}", "actor.optim.lr=0.05", "actor.optim.lr_warmup_steps=0",
        f"rollout.temperature={TEMPERATURE}", "trainer.progress_bar=false", "trainer.timeline=",
        "rollout.kv_cache_memory_gb=0.0625"]
LAYOUTS = {
    "colocate": (1, ["placement.mode=colocate", "data.train_batch_size=16"]),
    "split": (2, ["placement.mode=split", "data.train_batch_size=16"]),
    # GRPO on a rollout pool of its own at staleness 1: batch k is generated with the adapter of update k-2
    "rollout-pool-staleness-1": (2, ["--config", GRPO_ROLLOUT_ACTOR, "data.train_batch_size=16"]),
    # the critic pool's engines too, fed by the actor pool's first rank's broadcast
    "rollout-ranks-all": (2, ["placement.mode=split", "rollout.ranks=all", "data.train_batch_size=16"]),
}
STEPS = 4
PROBABILITY_TOLERANCE = 1e-4  # verl's rollout_probs_diff, |p_engine - p_adapter|, in fp32


def probed_job(out, nproc, *overrides, steps=STEPS, skip_sync=False):
    os.makedirs(out, exist_ok=True)
    result = job(nproc, *LORA, f"trainer.total_steps={steps}", f"trainer.log_dir={out}/tb",
                 f"trainer.default_local_dir={out}/ckpt", "trainer.output_dir=", *overrides, script=PROBE, cwd=REPO,
                 env={"PROBE_DIR": str(out), "PROBE_SKIP_SYNC": "1" if skip_sync else "0"}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def peft_policy(adapter: dict | None = None):
    """The embedded model with an adapter of the job's shape, holding `adapter` (a probe's
    adapter_v<k>.pt: the model's own names)."""
    from spmdsplit import lora
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import load_causal_lm

    model = lora.apply(load_causal_lm(ensure_embedded_model(), torch.float32, "cpu", 0),
                       lora.LoraSpec(RANK, ALPHA), "causal_lm", trained=False).eval()
    if adapter is not None:
        missing, unexpected = model.load_state_dict(adapter, strict=False)
        assert not unexpected and not [n for n in missing if ".lora_" in n]
    return model


def response_log_probs(model, rows) -> torch.Tensor:
    with torch.no_grad():
        width = rows["responses"].shape[1]
        logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                       position_ids=rows["position_ids"]).logits[:, -width - 1:-1].float() / TEMPERATURE
        return torch.log_softmax(logits, -1).gather(-1, rows["responses"][..., None])[..., 0]


def engine_against_its_adapter(out) -> dict[int, tuple[float, float]]:
    """step -> (max |p_engine - p_adapter|, max |p_engine - p_base|) over every rank's response
    tokens, p_adapter under the adapter of the version each row was generated with."""
    model = peft_policy()
    found: dict[int, tuple[float, float]] = {}
    for path in sorted(glob.glob(os.path.join(out, "rows_s*_r*.pt"))):
        step = int(re.search(r"rows_s(\d+)_", path).group(1))
        rows = torch.load(path)
        for version in rows["version"].unique().tolist():
            model.load_state_dict(torch.load(os.path.join(out, f"adapter_v{version}.pt")), strict=False)
            picked = {k: v[rows["version"] == version] for k, v in rows.items()}
            mask = picked["response_mask"].bool()
            engine = picked["rollout_log_probs"].exp()
            adapter = (engine - response_log_probs(model, picked).exp()).abs()[mask].max().item()
            with model.disable_adapter():
                base = (engine - response_log_probs(model, picked).exp()).abs()[mask].max().item()
            was = found.get(step, (0.0, 0.0))
            found[step] = (max(was[0], adapter), max(was[1], base))
    assert sorted(found) == list(range(1, STEPS + 1)), found
    return found


# Split 1+1 on the HF engine, the value model with an adapter too, checkpointed after steps 2 and 4 and
# exported: one job, once a module, read by the engine check's (hf, split) case and as the resume
# test's uninterrupted run (each ran a split job of its own before).
SPLIT_ADAPTERS = [*LAYOUTS["split"][1], "rollout.name=hf", "critic.model.lora_rank=4", "trainer.save_freq=2",
                  "actor.use_kl_loss=true"]


@pytest.fixture(scope="module")
def split_adapters_job(tmp_path_factory):
    """(its folder: the probe's rows and adapters, tb/, ckpt/, hf/; its CompletedProcess)."""
    out = tmp_path_factory.mktemp("split_adapters")
    return out, probed_job(out, 2, *SPLIT_ADAPTERS, f"trainer.output_dir={out}/hf")


@pytest.mark.parametrize("engine, layout", [(engine, layout) for engine in ("hf", "vllm") for layout in LAYOUTS
                                            # vLLM with rollout.ranks=all: the same engine and broadcast as HF's
                                            if (engine, layout) != ("vllm", "rollout-ranks-all")])
def test_the_engine_samples_from_the_adapter_it_was_given(tmp_path, engine, layout, request):
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    nproc, overrides = LAYOUTS[layout]
    if (engine, layout) == ("hf", "split"):  # this layout's job is the resume test's uninterrupted run
        out, _ = request.getfixturevalue("split_adapters_job")
    else:
        out = tmp_path
        probed_job(out, nproc, *overrides, f"rollout.name={engine}")
    found = engine_against_its_adapter(out)
    for step, (adapter, base) in found.items():
        assert adapter < PROBABILITY_TOLERANCE, (step, found)
    # The test can tell: once the adapter has moved, the base's probabilities are far off.
    assert max(base for _, base in found.values()) > 0.05, found
    if layout != "rollout-pool-staleness-1":  # verl's own metric agrees (the trainer's log-probs, same weights)
        diff = scalars(str(out / "tb"))["training/rollout_probs_diff_max"]
        assert [s for s, _ in diff] == list(range(1, STEPS + 1)) and max(v for _, v in diff) < PROBABILITY_TOLERANCE


@pytest.mark.parametrize("engine, layout", [("hf", "colocate"), pytest.param("vllm", "rollout-pool-staleness-1",
                                                                              marks=needs_vllm)])
def test_the_same_check_fails_when_the_engine_skips_the_sync(tmp_path, engine, layout):
    """The syncs stream, and the engine keeps the first adapter it was given: the check above fails
    from the step after the first update on."""
    nproc, overrides = LAYOUTS[layout]
    probed_job(tmp_path, nproc, *overrides, f"rollout.name={engine}", skip_sync=True)
    found = engine_against_its_adapter(tmp_path)
    stale_from = 3 if layout == "rollout-pool-staleness-1" else 2  # the first rows of a version after the first
    assert all(found[s][0] > 10 * PROBABILITY_TOLERANCE for s in range(stale_from, STEPS + 1)), found


def test_an_adapter_checkpoint_resumes_exactly_and_exports_a_peft_folder(tmp_path, split_adapters_job):
    """Split 1+1, the policy and the value model each with an adapter: a job of 4 steps checkpoints
    after steps 2 and 4; a job resumed from step 2 logs steps 3 and 4 bit for bit as it did. The
    checkpoint holds the adapters and their optimizer state only; the export is an adapter folder
    that PEFT loads onto the base, computing as the policy did."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from safetensors.torch import load_file

    from spmdsplit import lora
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import load_causal_lm

    whole, result = split_adapters_job
    sizes = re.findall(r"checkpoint of step (\d) written to \S+ \(([\d.]+) MB\)", result.stdout)
    assert [s for s, _ in sizes] == ["2", "4"] and all(float(mb) < 2 for _, mb in sizes), sizes
    for group in ("actor", "critic"):  # the adapters (and the value model's score head) and their optimizer state
        saved = dcp.FileSystemReader(str(whole / "ckpt" / "global_step_2" / group / "engine")).read_metadata()
        weights = [k.removeprefix("model.") for k in saved.state_dict_metadata if k.startswith("model.")]
        assert weights and all(lora.is_adapter(k) or ".modules_to_save." in k for k in weights), weights

    resumed = tmp_path / "resumed"
    result = job(2, *LORA, f"trainer.total_steps={STEPS}", *SPLIT_ADAPTERS, f"trainer.log_dir={resumed}/tb",
                 f"trainer.default_local_dir={resumed}/ckpt", f"trainer.resume={whole}/ckpt/global_step_2",
                 "trainer.output_dir=", cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    before, after = scalars(str(whole / "tb")), scalars(str(resumed / "tb"))
    compared = [tag for tag in before if not tag.startswith(("timing_s/", "perf/"))]
    assert "actor/pg_loss" in compared and "critic/vf_loss" in compared
    for tag in compared:
        assert after[tag] == [(s, v) for s, v in before[tag] if s > 2], tag

    exported = whole / "hf"
    final = torch.load(whole / f"adapter_v{STEPS}.pt")
    saved = load_file(str(exported / "adapter_model.safetensors"))
    assert saved.keys() == {lora.saved_name(n) for n in final}
    assert all(torch.equal(saved[lora.saved_name(n)], t) for n, t in final.items())
    loaded = PeftModel.from_pretrained(load_causal_lm(ensure_embedded_model(), torch.float32, "cpu", 0), str(exported)).eval()
    ids = torch.randint(4, 14, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, peft_policy(final)(input_ids=ids).logits)


def test_merged_weights_sync_and_export(tmp_path):
    """model.lora_merge: the HF engine takes the merged weights (the whole model) and still samples
    from the adapter; the export is a plain model folder that computes as base + adapter."""
    from transformers import AutoModelForCausalLM

    probed_job(tmp_path, 1, *LAYOUTS["colocate"][1], "model.lora_merge=true", f"trainer.output_dir={tmp_path}/hf")
    found = engine_against_its_adapter(tmp_path)
    assert all(adapter < PROBABILITY_TOLERANCE for adapter, _ in found.values()), found
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(4, 14, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = peft_policy(torch.load(tmp_path / f"adapter_v{STEPS}.pt"))(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_lora_preset_learns_the_embedded_task(tmp_path):
    """configs/lora_grpo_rollout_actor.yaml as a user runs it: GRPO with a rank-32 adapter, the
    adapter-only sync to a rollout pool of its own one step off-policy, from the random start (~0.03)
    to a solved task (5 steps in a row >= 0.9; the job ends there) within its 150 steps, within twice
    the default's 200."""
    from tests.support.jobs import learning_run

    output, first, last = learning_run(tmp_path / "run", "configs/lora_grpo_rollout_actor.yaml", 0.9)
    assert "rollout pool ranks [1] | actor+critic pool ranks [0]" in output
    assert first <= 0.1, f"the random policy already scores {first:.3f}: the task is too easy to show learning"
    assert last >= 0.9, f"score {first:.3f} -> {last:.3f}: the LoRA preset did not solve the embedded task"
