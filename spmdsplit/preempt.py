"""Stopping a job cleanly when Slurm (or a user) asks: finish the step, checkpoint, exit.

A signal may reach one rank, some ranks or all of them, at any moment of a step. The handler
only sets a flag: the step is never cut short, since a rank leaving mid-collective would hang
the others. At each step's start every rank casts its flag into a sum over a small gloo group
of the whole world, without waiting; at the step's end it reads the sum. By then every rank
has started the step (the step's exchanges depend on all of them), so reading costs nothing
and never stalls the overlap between pools, and all ranks see the same answer: stop after
this step, or not. A flag set during step k is cast at step k+1, so the job stops within two
steps of the signal. The same vote carries "the run reached its target score" (trainer.stop_at_score),
known to the critic group's ranks at the end of step k, so the job ends after step k+1.

The vote is the only world collective inside the loop; it is control, not a pool's work, and
runs on its own group so it never queues behind (or in front of) a pool's traffic.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

_stop = threading.Event()


def request_stop(signum=None, frame=None) -> None:
    if signum is not None and not _stop.is_set():
        # os.write, not print: print is not safe inside a signal handler that may interrupt print.
        rank = os.environ.get("RANK", "?")
        os.write(2, f"spmdsplit [rank {rank}]: got {signal.Signals(signum).name}: finishing the step, "
                    "then checkpointing and stopping\n".encode())
    _stop.set()


def stop_requested() -> bool:
    return _stop.is_set()


def install_handlers() -> None:
    """SIGUSR2 (Slurm's warning before the time limit, as submitit asks for it) and SIGTERM
    (preemption) set the stop flag instead of killing the rank. Under torchrun SIGTERM stays
    deadly: the agent sends it to tear down the survivors when a rank fails, and they must go
    at once rather than wait for a step that cannot finish; send SIGUSR2 there to stop cleanly."""
    if threading.current_thread() is not threading.main_thread():
        return
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    for sig in (signal.SIGUSR2,) if under_torchrun else (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, request_stop)


class StopVote:
    """Two reasons to stop, voted together: a stop request (a signal on any rank: checkpoint and
    exit EXIT_STOPPED, to go on later) and the run's target score reached (trainer.stop_at_score,
    on the ranks that compute the score: the run ends as after its last step). A request wins."""

    def __init__(self, group):
        """`group`: a gloo group over the world (`stop` in spmdsplit/groups.py): CPU tensors, also
        beside an NCCL world, and a timeout as long as a wait for the other pool, since a rank
        reads the vote only once every rank has started the step."""
        self.group = group
        self.pending = None

    def cast(self, target_reached: bool = False) -> None:
        flags = torch.tensor([int(stop_requested()), int(target_reached)])
        self.pending = (flags, dist.all_reduce(flags, group=self.group, async_op=True))

    def outcome(self) -> tuple[bool, bool]:
        """(a stop was requested, the target score was reached), the same on every rank."""
        flags, work = self.pending
        work.wait()
        requested, reached = (int(v) > 0 for v in flags.tolist())
        return requested, reached and not requested
