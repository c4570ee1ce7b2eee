import os
import pathlib
import subprocess

import pytest
import torch
import torch.distributed as dist

from tests.support.launch import run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _only_rank0_joins(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: a hang the runner must report


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")


def test_run_ranks_returns_each_rank_result():
    assert run_ranks(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_run_ranks_reports_a_hang():
    with pytest.raises(AssertionError, match="hang"):
        run_ranks(_only_rank0_joins, 2, timeout=5)


def test_run_ranks_reports_a_failing_rank():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_rank1_raises, 2, timeout=30)


def _pid_and_env(rank, world_size, key):
    import os

    seen = os.environ.get(key)
    os.environ[key] = "set by the last test"
    return os.getpid(), seen


def test_a_world_is_reused_and_a_test_leaks_no_environment_into_the_next():
    first = run_ranks(_pid_and_env, 2, "SPMDSPLIT_LEAK_CHECK")
    second = run_ranks(_pid_and_env, 2, "SPMDSPLIT_LEAK_CHECK")
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # the same processes: no start-up
    assert [seen for _, seen in second] == [None, None]


def test_a_fresh_world_and_the_world_after_a_failure_are_new_processes():
    (kept, _), _ = run_ranks(_pid_and_env, 2, "X")
    (fresh, _), _ = run_ranks(_pid_and_env, 2, "X", fresh=True)
    assert fresh != kept and run_ranks(_pid_and_env, 2, "X")[0][0] == kept  # a fresh world is not kept
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_rank1_raises, 2, timeout=30)
    assert run_ranks(_pid_and_env, 2, "X")[0][0] != kept  # a world where a rank failed is not reused


def _leave_a_send_pending(rank, world_size):
    import os

    if rank == 0:
        dist.isend(torch.ones(1), 1)  # never received: on NCCL, the next receive from 0 would take it
    return os.getpid()


def test_a_world_left_with_a_send_pending_is_not_reused():
    (left, _) = run_ranks(_leave_a_send_pending, 2)
    assert run_ranks(_pid_and_env, 2, "X")[0][0] != left


# -- launch/torchrun_2x8.sh: the line each node runs, with `echo` for torchrun -----------------------------------


def test_the_two_node_torchrun_example_runs_the_rendezvous_and_passes_the_train_arguments():
    script = pathlib.Path(__file__).resolve().parents[1] / "launch" / "torchrun_2x8.sh"
    env = {**os.environ, "TORCHRUN": "echo", "HEAD": "node0", "RDZV_ID": "ppo-1"}
    out = subprocess.run(["bash", str(script), "--config", "configs/nodes_8+8.yaml", "trainer.total_steps=2"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "node0:29500", "--rdzv-id", "ppo-1", "-m", "spmdsplit.train", "--config",
                           "configs/nodes_8+8.yaml", "trainer.total_steps=2"]
    env.pop("HEAD")
    missing = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, check=False)
    assert missing.returncode != 0 and "HEAD" in missing.stderr
