"""Each role group's program, side by side, none importing another: rollout.py (wherever the
rollout group generates: a rollout pool of its own, the actor pool, rollout.ranks=all's critic
pool), actor.py, critic.py, reward.py (a reward pool of its own). Where the rollout program's rows
come from is spmdsplit/row_sources.py, scoring spmdsplit/scoring.py; the messages between the
programs are spmdsplit/messages.py.

A rank runs the programs of the role groups on its pool, each step's phases in the order of
SCHEDULE (the message schedule's). The rollout group's program runs on every rank that generates,
whether its pool is apart or shared: its rows go to the actor group as GENERATED, which the
exchange delivers to the rank itself without moving them where the two share it. The reward
group runs its own only on a pool apart from the critic's; else the critic's program scores."""

from __future__ import annotations

from typing import NamedTuple

from spmdsplit.placement import Placement

# The role groups whose work their host's program does when they share its pool: the reward
# group's scorers (cheap next to the critic's values, and read by its advantages right after).
HOSTED = {"reward": "critic"}
# The order a rank builds its programs in: the actor before the rollout group, whose engines
# take the policy's weights from the actor's stream (and are built after its models, as on a
# GPU the engine's memory is what the training models leave); the rollout group before the
# critic where rollout.ranks=all puts both on the critic pool, for the same reason reversed:
# its engine is sized before the critic's model exists, as it always was.
BUILD_ORDER = ("actor", "rollout", "critic", "reward")


class Phase(NamedTuple):
    group: str  # the role group whose program runs it
    method: str  # the program's method: (step) -> metrics or None; per chunk (step, chunk)


class Schedule(NamedTuple):
    """A step, in the order of the message schedule (spmdsplit/messages.py). `per_chunk` runs
    first, once per rollout chunk (rollout.stream_chunks), its phases interleaved: chunk c goes
    on to the critic group while chunk c+1 generates. Then `after`, each phase once."""

    per_chunk: tuple[Phase, ...]
    after: tuple[Phase, ...]


class Program:
    """What the trainer calls on a role group's program: the phases of SCHEDULE it has, and the
    same few calls on every program (so the trainer needs to know none of their insides). Each
    overrides what it does."""

    SCHEDULE = Schedule(
        per_chunk=(Phase("rollout", "generate"), Phase("actor", "take_rows")),
        after=(Phase("rollout", "end_step"), Phase("actor", "roll_out"), Phase("reward", "step"),
               Phase("critic", "step"), Phase("actor", "update")))

    engine = None  # what a checkpoint saves with DCP (weights, optimizer, LR schedule); None: nothing trained
    checkpointed = True  # whether a checkpoint holds a part of this program (its rank state, its engine)

    def start(self, step: int) -> None:
        """Before the first step (1, or the one after a checkpoint)."""

    def state(self, step: int) -> dict:
        """This rank's part of a checkpoint besides the engine's (the RNG and dynamic sampling are
        the checkpoint manager's)."""
        return {}

    def load_state(self, state: dict, same_layout: bool) -> None:
        """`state` as `state` returned it; `same_layout`: the role groups' ranks are those that wrote it."""

    def validate(self, step: int, val_set) -> None:
        """The rollout group's: responses to the validation set (generation.ValidationSet), to the reward group."""

    def score_validation(self, step: int, val_set) -> dict[str, float] | None:
        """Where the reward group's work runs here: the validation responses' scores (the metrics
        rank 0 logs, from the group's first rank); None elsewhere."""
        return None

    def export(self, output_dir: str, tokenizer) -> None:
        """At the end of a completed run: what the run trained, for use outside it (trainer.output_dir)."""

    def close(self) -> None:
        """At the job's end, on every rank at the same point: what the program holds besides its
        models (a judge's engine thread and endpoint, a reward function's workers) let go of."""


def own_programs(placement: Placement, rank: int) -> list[str]:
    """The role groups that run a program of their own on `rank`, in BUILD_ORDER: the rollout
    group's wherever it generates, a hosted group's only on a pool apart from its host."""
    def runs(group: str) -> bool:
        if group == "rollout":
            return rank in placement.generating_ranks
        return rank in placement.ranks(group) and (group not in HOSTED or placement.apart(group))

    return [g for g in BUILD_ORDER if runs(g)]
