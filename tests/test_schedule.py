"""The pools' conversation holds under NCCL's matching rule: messages between two ranks match in
the order they were posted, whatever their tags. Nothing in the project passes a tag, so every
multi-rank test of the suite runs under that rule; these are the cases that broke under it
before (spmdsplit/messages.py has the schedule):

- step k's metrics and step k+1's advantages from the critic pool's first rank to rank 0
  (every split job of more than one step: the metrics now travel on their own control link);
- rollout chunks and KL log-probs, sent R0 R1 L0 L1 and once received R0 L0 R1 L1;
- validation metrics sent while step metrics were still pending, and a checkpoint at a
  validation step.
"""

import pathlib
import re

import pytest

from tests.support.launch import job
from tests.support.outputs import scalars

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_point_to_point_call_passes_a_tag():
    """What would let a gloo test pass and an NCCL job fail: a tag that keeps two messages apart."""
    offenders = []
    for path in (ROOT / "spmdsplit").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(isend|irecv|send|recv|batch_isend_irecv|P2POp)\(.*\btag=", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


COMMON = ["rollout.do_sample=false", "algorithm.use_kl_in_reward=true", "trainer.total_steps=4", "trainer.val_freq=2",
          "trainer.save_freq=2", "data.train_batch_size=12", "actor.ppo_mini_batch_size=12", "critic.ppo_mini_batch_size=12",
          "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2", "trainer.timeline=",
          "trainer.output_dir=", "trainer.progress_bar=false"]


@pytest.mark.parametrize("layout", [["placement.mode=split"], ["placement.mode=custom", "placement.pools=[1,3]"]],
                         ids=["2+2", "1+3"])
def test_streamed_rollout_with_kl_in_reward_validation_and_checkpoints(tmp_path, layout):
    """Greedy rollouts, so streaming in two chunks gives the same first rollout as one chunk, and
    the same KL penalty and rewards: a log-prob row delivered to the wrong rows or read in the
    wrong order would change them. Later steps drift only by float noise (the critic pool holds
    other rows when streamed, so it sums its gradients in another order)."""
    runs = {}
    for name, chunks in (("whole", 1), ("streamed", 2)):
        out = tmp_path / name
        result = job(4, *COMMON, *layout, f"rollout.stream_chunks={chunks}", f"trainer.log_dir={out}/tb",
                          f"trainer.default_local_dir={out}/ckpt", timeout=400)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("global_step")) == \
            ["global_step_2", "global_step_4"]
        runs[name] = scalars(str(out / "tb"))
    whole, streamed = runs["whole"], runs["streamed"]
    assert [s for s, _ in whole["val-core/synthetic/repeat/reward/mean@1"]] == [2, 4]
    for key in ("critic/score/mean", "actor/reward_kl_penalty", "critic/rewards/mean", "actor/pg_loss", "critic/vf_loss"):
        assert [s for s, _ in streamed[key]] == [1, 2, 3, 4], key
        assert streamed[key][0][1] == pytest.approx(whole[key][0][1], rel=1e-5, abs=1e-7), key  # step 1: exact
        for (_, x), (_, y) in zip(whole[key], streamed[key]):
            assert y == pytest.approx(x, rel=0.05, abs=0.02), key
    for (_, x), (_, y) in zip(whole["val-core/synthetic/repeat/reward/mean@1"], streamed["val-core/synthetic/repeat/reward/mean@1"]):
        assert y == pytest.approx(x, abs=0.03)
