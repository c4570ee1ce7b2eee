"""The rollout group's engine and the policy's weights it holds: woken with them from their source,
each later version loaded in place on a pool of its own, asleep where it shares the device with
training."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from spmdsplit.timing import PhaseTimer


def counted(weights: Iterator[tuple[str, torch.Tensor]], event: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, its tensors' bytes added up in event["bytes"] as the engine takes them (the
    timeline's sync_weights: the whole policy, or a LoRA adapter)."""
    event["bytes"] = 0
    for name, tensor in weights:
        event["bytes"] += tensor.nbytes
        yield name, tensor


class EngineWeights:
    """The rollout group's engine on this rank and the policy's weights it holds: `take` wakes it
    with the weights from their source (`pull`: the actor pool's own shards, or the broadcast from
    them), or on a pool of its own loads each later version in place; `release` puts it to sleep
    where it shares the device with training."""

    def __init__(self, engine, pull, timer: PhaseTimer, shares_device: bool):
        """`pull(broadcast)` -> the weights' stream (weight_sync: PolicyWeights.pull on the actor
        pool, WeightBroadcast.pull elsewhere); `shares_device`: placement.engines_share_device."""
        self.engine, self.pull, self.timer, self.shares_device = engine, pull, timer, shares_device
        self.awake = False

    def take(self, step: int, broadcast: bool = True) -> None:
        """The policy's current weights into the engine (`broadcast=False`: for this pool's engines
        alone, as validation on the actor pool). A rollout pool's device is the engine's alone:
        it wakes once and takes every later version in place (a sleep and a wake would unmap and
        map its whole share each time)."""
        with self.timer.phase("sync_weights", step) as event:
            weights = counted(self.pull() if broadcast else self.pull(broadcast=False), event)
            event["engine"] = "update_weights" if self.awake else "wake_up"
            if self.awake:
                self.engine.update_weights(weights)
            else:
                self.engine.wake_up(weights)
                self.awake = True
            event.update(self.timer.device_in_use())  # the engine's share included (tools/device/gpu_check.py)

    def release(self, step: int) -> None:
        if self.shares_device:
            with self.timer.phase("rollout_sleep", step):
                self.engine.sleep()
            self.awake = False
