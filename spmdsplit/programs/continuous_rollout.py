"""The rollout group's program with rollout.continuous (a rollout pool of its own): the engine
never drains (spmdsplit/continuous.py keeps it full and hands a batch over as soon as this rank's
share of its groups is complete), and the weights of each update are taken between two engine
steps whenever the actor pool sends them (weight_sync.WeightsReady says so), not at a point of the
step. Messages: spmdsplit/messages.py (GENERATED k as in batch mode, the policy's weights after
every update but the last, each announced first).

Step k here: batch k out (generated meanwhile: while the other pools trained on batch k-1, this
engine went on with the requests it held), every version the actor pool sends taken as it comes.
With rollout.partial_rollout the requests wait instead, from the hand-off to the weights of update k.
Agent episodes flow one by one: a turn's tool calls run while other episodes generate.
Validation runs beside the requests held. A checkpoint keeps every request in flight (tokens,
log-probs, versions) and the prompts drawn: a resume submits them again where they stopped.
"""

from __future__ import annotations

from spmdsplit.continuous import ContinuousGeneration
from spmdsplit.exchange import PendingSend
from spmdsplit.generation import Generator, generate_validation_rows, step_prompts
from spmdsplit.messages import PoolChannel
from spmdsplit.programs import Program
from spmdsplit.staleness import next_version_sent, weights_needed
from spmdsplit.weight_sync import WeightsReady


class ContinuousRolloutProgram(Program):
    engine = None  # nothing trained: a checkpoint keeps the requests in flight

    def __init__(self, cfg, generator: Generator, channel: PoolChannel, ready: WeightsReady, eos_ids: list[int]):
        self.cfg, self.generator, self.channel, self.ready = cfg, generator, channel, ready
        pools, generating = generator.pools, list(generator.pools.placement.generating_ranks)
        part = generating.index(pools.rank)

        def prompts(t: int):  # this rank's share of the dataset's generation batch t
            return step_prompts(cfg, generator.dataset, generator.tokenizer, t, generating, pools.rank)

        self.more = True  # whether the actor pool sends another version after the one held
        # With rollout.multi_turn the generator's engine is the agent loop around the stepwise engine:
        # the stream drives the engine and runs the loop's turns and tools episode by episode.
        agent = generator.engine if cfg.rollout.multi_turn.enable else None
        self.stream = ContinuousGeneration(cfg, agent.engine if agent else generator.engine, prompts, self.take_weights,
                                           lambda: self.more and ready.arrived(), part, len(generating),
                                           generator.tokenizer.pad_token_id, eos_ids, pools.device, agent=agent)
        self.sends = PendingSend()

    def start(self, step: int) -> None:
        """Before the first step: the weights the actor pool holds (update step-1)."""
        self.take_weights(step)

    def step(self, step: int) -> dict[str, float]:
        """Batch `step` out as soon as this rank's share of it is complete, then generating on until
        the weights of update `step` are in: every rank ends step k after the actor's update k
        (the stop vote is the world's), and the engine does not stop meanwhile."""
        with self.generator.timer.phase("gen", step):
            rows = self.stream.next_batch(step)
        self.sends.wait()  # the previous batch's, long taken: one pending send at a time
        self.sends = PendingSend()
        self.sends.add(self.channel.send_generated(step, rows))
        with self.generator.timer.phase("gen_ahead", step):
            while self.stream.version < step and weights_needed(self.cfg, step):
                if self.cfg.rollout.partial_rollout:  # the answers running wait for these weights
                    self.stream.wait_for_weights()
                else:
                    self.stream.engine_step()
        if step == self.cfg.trainer.total_steps:
            self.sends.wait()
        return self.stream.pop_metrics()

    def validate(self, step: int, val_rows: list[dict]) -> None:
        """Responses to the validation set with the weights of update `step`, beside the requests held."""
        while self.stream.version < step:
            self.stream.wait_for_weights()
        generate_validation_rows(self.cfg, self.generator.pools, self.stream, self.channel, self.generator.timer,
                                 self.generator.tokenizer, step, val_rows)

    def take_weights(self, step: int) -> None:
        """The next version the actor pool sends (waiting for it if it is not sent yet)."""
        version = self.ready.wait()
        self.generator.wake(step)
        self.stream.loaded(version)
        self.more = next_version_sent(self.cfg, version) is not None

    def state(self, step: int) -> dict:
        return {"continuous": self.stream.state()}

    def load_state(self, state: dict, same_layout: bool) -> None:
        # Another rollout pool size cuts the prompts into other shares: the requests in flight are
        # dropped (counted in the log line) and generation starts from the next prompts drawn.
        self.stream.load_state(state["continuous"], same_layout)
