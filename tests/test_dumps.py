"""trainer.rollout_data_dir / trainer.validation_data_dir (spmdsplit/dumps.py): verl's JSONL per
step, read back and held against what the job logged, as a user reads them."""

from __future__ import annotations

import json

import pytest

from tests.support.launch import job
from tests.support.outputs import scalars

GRPO = "configs/grpo_rollout_actor.yaml"


def read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.e2e
def test_a_3_step_jobs_dumps_are_the_rows_it_trained_and_validated(tmp_path):
    """GRPO with a rollout pool one step ahead and a train pool of 2 ranks (each dumps its share, the
    first writes): every step's file holds the step's 32 responses once, in batch order, their mean
    score is the critic/score/mean the job logged, each carries the weights version it was
    generated with (within rollout.staleness=1); the validation file is the validation set's
    responses, its mean the val-core metric."""
    steps, batch, n = 3, 8, 4
    result = job(3, "--config", GRPO, "placement.pools={gen: 1, train: 2}", f"trainer.total_steps={steps}",
                 f"data.train_batch_size={batch}", "actor.ppo_mini_batch_size=4", "trainer.val_freq=3",
                 f"trainer.rollout_data_dir={tmp_path}/rollout", f"trainer.validation_data_dir={tmp_path}/val",
                 f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=", "trainer.output_dir=", timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    logged = scalars(str(tmp_path / "tb"))
    for step in range(1, steps + 1):
        lines = read(tmp_path / "rollout" / f"{step}.jsonl")
        assert [line["row_index"] for line in lines] == list(range(batch * n))
        assert {line["step"] for line in lines} == {step}
        assert all(line["input"] and isinstance(line["output"], str) and line["gts"] for line in lines)
        mean = sum(line["score"] for line in lines) / len(lines)
        assert mean == pytest.approx(dict(logged["critic/score/mean"])[step], abs=1e-6)
        assert {line["weights_version"] for line in lines} <= {max(0, step - 2), step - 1}
        assert len({line["uid"] for line in lines}) == batch  # n responses to each prompt
    val = read(tmp_path / "val" / f"{steps}.jsonl")
    [tag] = [t for t in logged if t.startswith("val-core/")]
    assert len(val) > 0 and sum(line["score"] for line in val) / len(val) == pytest.approx(dict(logged[tag])[steps],
                                                                                          abs=1e-6)
