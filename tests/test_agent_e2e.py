"""Multi-turn tool episodes end to end, in real ranks under the NCCL-contract layer, in every
placement of the rollout group: colocate, split, rollout.ranks=all, and a rollout pool of its own
one batch ahead, with validation and checkpoints; and an exact resume across a stop with episodes
generated ahead. The embedded lookup task (configs/agent_lookup.yaml) calls its tool in about
half of the random policy's episodes, so every job moves rows with holes in their response_mask."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from tests.support.jobs import AGENT, POOL
from tests.support.launch import cached_job, job, stop_on_request
from tests.support.outputs import assert_repeats, scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {
    "split": (4, []),
    "colocate": (2, ["placement.mode=colocate", "placement.pools=[]"]),
    "rollout_ranks_all": (4, ["rollout.ranks=all"]),
    "rollout_pool_staleness_1": (2, POOL),
}


STEPS = {"rollout_pool_staleness_1": 5}  # that layout's job is also the uninterrupted run of the resume test
JOB = ("trainer.save_freq=2",)


def run(out, nproc, *overrides, steps=3):
    result = job(nproc, *AGENT, *overrides, f"trainer.total_steps={steps}", f"trainer.log_dir={out}/tb",
                 f"trainer.default_local_dir={out}/ckpt", *JOB, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    return result, scalars(str(out / "tb"))


def pool_run() -> pathlib.Path:
    """The rollout pool's job, straight through its 5 steps, once a session."""
    result, out = cached_job(2, *AGENT, *POOL, f"trainer.total_steps={STEPS['rollout_pool_staleness_1']}", *JOB,
                             timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    return pathlib.Path(out)


def verl_agent_files(folder: pathlib.Path) -> list[str]:
    """The verl files' test's parquet (half its rows the tool agent's, half the single-turn agent's)
    and tool config, written into `folder`: the overrides that train on them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spmdsplit.data.synthetic import make_dataset

    rows = make_dataset("lookup", 64, seed=5)
    for i, row in enumerate(rows):
        row["agent_name"] = "tool_agent" if i % 2 == 0 else "single_turn_agent"
        row["ability"] = "lookup"
    pq.write_table(pa.Table.from_pylist(rows), str(folder / "train.parquet"))
    tools = folder / "tool_config.yaml"
    tools.write_text(open(os.path.join(ROOT, "spmdsplit", "agent", "lookup_tools.yaml")).read())
    return [f"data.train_files={folder}/train.parquet", f"data.val_files={folder}/train.parquet",
            f"rollout.multi_turn.tool_config_path={tools}", "data.shuffle=false"]


@pytest.fixture(scope="module")
def colocate_verl_run(tmp_path_factory) -> pathlib.Path:
    """The colocate layout's job, on verl's agent files: once a module, for the layout test and the
    verl files' test (each ran a colocate job of its own before)."""
    out = tmp_path_factory.mktemp("colocate_verl")
    nproc, overrides = LAYOUTS["colocate"]
    run(out, nproc, *overrides, *verl_agent_files(out))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_multi_turn_job_runs_in_every_layout(tmp_path, layout, request):
    nproc, overrides = LAYOUTS[layout]
    if layout == "rollout_pool_staleness_1":
        out = pool_run()
    elif layout == "colocate":  # the verl files' job: its tool agent's rows call, answer after calls, validate
        out = request.getfixturevalue("colocate_verl_run")
    else:
        out = tmp_path
        run(out, nproc, *overrides)
    tb = scalars(str(out / "tb"))
    assert [s for s, _ in tb["critic/score/mean"]] == list(range(1, STEPS.get(layout, 3) + 1))
    assert sum(v for _, v in tb["tool/calls"]) > 0 and all(v >= 2 for _, v in tb["num_turns/min"])
    assert max(v for _, v in tb["num_turns/max"]) >= 4  # an answer after a tool response: holes in the mask
    assert "val-core/synthetic/lookup/reward/mean@1" in tb
    assert os.path.isdir(out / "ckpt" / "global_step_2")
    if layout == "rollout_ranks_all":
        # On-policy engines on both pools: their log-probs of the policy's tokens are the actor's
        # (fp32); masked tool tokens, or a row whose mask lost its holes in the exchange, would show here.
        assert all(v < 1e-4 for _, v in tb["training/rollout_probs_diff_max"])


@pytest.mark.e2e
def test_multi_turn_resume_across_a_stop_is_exact_with_episodes_generated_ahead(tmp_path):
    """A rollout pool one batch ahead, stopped by a signal after step 2: its checkpoint holds the
    next batch's episodes (generated ahead, holes and all); the resumed run's steps equal those
    of a run that never stopped, every logged number of them."""
    steps, straight = STEPS["rollout_pool_staleness_1"], pool_run()
    out = tmp_path / "stopped"
    argv = [*AGENT, *POOL, f"trainer.total_steps={steps}", f"trainer.log_dir={out}/tb",
            f"trainer.default_local_dir={out}/ckpt", *JOB, "trainer.progress_bar=false"]
    stopped_at = stop_on_request(2, argv, out / "ckpt", after="step 2:", rank=1)  # the rollout rank
    ahead = torch.load(out / "ckpt" / f"global_step_{stopped_at}" / "rollout" / "rank_1.pt", weights_only=False)["ahead"]
    assert list(ahead) == [stopped_at + 1] and "num_turns" in ahead[stopped_at + 1]
    result = job(2, *argv, timeout=400, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    assert_repeats(out / "tb", straight / "tb")


@pytest.mark.e2e
def test_a_verl_agent_parquet_and_tool_config_run_unchanged(colocate_verl_run):
    """verl's agent data as its preprocessing scripts write it (chat prompts, `agent_name`,
    `extra_info.tools_kwargs`, `reward_model.ground_truth`), a verl-format tool config naming a
    verl-style class, and rows of both agents: the job runs them as they are, the tool agent's rows
    call their own tool instance with their own create_kwargs, the single-turn rows never call."""
    tb = scalars(str(colocate_verl_run / "tb"))
    calls = [v for _, v in tb["tool/calls"]]
    assert all(0 < c <= 8 * 2 for c in calls), calls  # only the 8 tool-agent rows of a 16-row step call (<= 2 each)
    assert [s for s, _ in tb["critic/score/mean"]] == [1, 2, 3]
