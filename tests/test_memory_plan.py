"""tools/plan/memory_plan.py: our own step on fake tensors counts what the same step on real tensors
holds, phase by phase and by category (FSDPMemTracker over both, in one process: the fake
process group of a pool of 2, a tiny Qwen2 at the 0.5B preset's layout, packed micro-batches
under sdpa)."""

import json
import subprocess
import sys

import pytest

from tools.models import ModelShape
from tools.plan import memory_plan

REPO = memory_plan.__file__.rsplit("/tools/", 1)[0]
TINY = ["model.attn_implementation=sdpa", "data.max_prompt_length=16", "data.max_response_length=16",
        "actor.ppo_max_token_len_per_gpu=256", "actor.log_prob_max_token_len_per_gpu=512",
        "critic.ppo_max_token_len_per_gpu=256", "critic.forward_max_token_len_per_gpu=512"]


@pytest.fixture(scope="module")
def fake_and_real(tmp_path_factory):
    folder = memory_plan.write_config(ModelShape("tiny", 64, 2, 4, 2, 128, 2048), str(tmp_path_factory.mktemp("tiny")))
    out = subprocess.run([sys.executable, "-m", "tools.plan.memory_plan", "--config", "configs/gpu_qwen2.5_0.5b.yaml",
                          "--model", folder, "--world-size", "4", "--compare-real", *TINY],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_the_plan_on_fake_tensors_holds_what_the_real_step_holds(fake_and_real):
    fake, real = fake_and_real["fake"], fake_and_real["real"]
    assert [p["pool"] for p in fake] == ["actor", "critic"] and [p["ranks"] for p in fake] == [2, 2]
    assert set(fake[0]["tracked"]) == {"actor log-probs", "ref log-probs", "update actor"}
    assert set(fake[1]["tracked"]) == {"values", "update critic"}
    for f, r in zip(fake, real):
        for phase, tracked in f["tracked"].items():
            planned, measured = sum(tracked["bytes"].values()), sum(r["tracked"][phase]["bytes"].values())
            assert abs(planned / measured - 1) <= 0.10, (f["pool"], phase, planned, measured)
            assert planned > 0
        assert abs(f["peak"] / r["peak"] - 1) <= 0.10, (f["pool"], f["peak"], r["peak"])


def test_the_update_holds_optimizer_state_and_its_gradients(fake_and_real):
    """A steady-state step: AdamW's two fp32 moments of this rank's shards exist (8 B/param /
    pool), and the update's peak is above the log-prob pass's."""
    actor = fake_and_real["fake"][0]
    update = actor["tracked"]["update actor"]["bytes"]
    params = actor["params"]
    assert update["optimizer state"] == pytest.approx(8 * params / 2, rel=0.02)
    assert actor["totals"]["update actor"] > actor["totals"]["actor log-probs"] > 0
