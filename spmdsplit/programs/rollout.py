"""The rollout group's program, on every rank that generates (a rollout pool of its own, the actor
pool where the engines share it, and with rollout.ranks=all the critic pool's ranks too): a step's
rows from its row source (spmdsplit/generation/sources.py: batch generation, or continuous generation),
chunk by chunk, each sent to the actor group as GENERATED as soon as it is there; then what the
source does once the step is handed over (generate ahead, take the next weights); the validation
responses to the reward group. Which weights the rows are generated with, and when the engine takes
them, is the source's; what goes out, and when, is this program's alone. Messages and their order:
spmdsplit/messages.py."""

from __future__ import annotations

from collections.abc import Iterator

from spmdsplit.batch import Batch
from spmdsplit.exchange import PendingSend
from spmdsplit.messages import PoolChannel
from spmdsplit.programs import Program


class RolloutProgram(Program):
    engine = None  # nothing trained

    def __init__(self, source, channel: PoolChannel):
        """`source`: generation.sources' BatchSource or ContinuousSource."""
        self.source, self.channel = source, channel
        self.checkpointed = source.keeps_state  # rows generated ahead, requests in flight
        self.chunks: Iterator[Batch] | None = None  # this step's rows, chunk by chunk
        self.sends = PendingSend()  # this step's GENERATED, waited for once the source is done with the step

    def start(self, step: int) -> None:
        self.source.start(step)

    def generate_chunk(self, step: int, chunk: int) -> None:
        """Chunk `chunk` of this rank's rows of `step`, generated (or taken from the rows generated
        ahead) and sent to the actor group."""
        if chunk == 0:
            self.chunks = self.source.batch(step)
        self.sends.add(self.channel.send_generated(step, chunk, next(self.chunks)))

    def after_hand_over(self, step: int) -> dict[str, float]:
        """The source's work after the hand-over; returns its metrics of the step."""
        metrics = self.source.after_hand_over(step)
        self.sends.wait()
        self.sends = PendingSend()
        return metrics

    def validate(self, step: int, val_set) -> None:
        """This rank's validation responses to the reward group (not balanced: scoring them is cheap
        next to a training step)."""
        rows = self.source.validation_rows(step, val_set)
        # The engine may be asleep by now (a training pool's): the rows outlive it, as vLLM's sleep
        # frees only what its CuMem pools hold (weights, KV cache, workspace: gpu_worker.py's
        # _maybe_get_memory_pool_context), and the engines build rows from token lists with torch's
        # own allocator (inference/vllm_engine.py generate). No send is pending through the sleep.
        if rows is not None:
            self.channel.send_val_rows(step, rows, val_set.responses).wait()

    def close(self) -> None:
        self.source.close()

    def state(self, step: int) -> dict:
        return self.source.state()

    def load_state(self, state: dict, same_layout: bool) -> None:
        self.source.load_state(state, same_layout)
