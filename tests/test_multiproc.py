import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_ranks


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
        run_ranks(_only_rank0_joins, 2, timeout=15)


def test_run_ranks_reports_a_failing_rank():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_rank1_raises, 2, timeout=30)
