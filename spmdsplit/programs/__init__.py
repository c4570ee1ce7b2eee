"""Each role group's program, side by side, none importing another: rollout.py (a rollout pool of its
own), actor.py, critic.py, reward.py (a reward pool of its own). Generation is spmdsplit/generation.py
and scoring spmdsplit/scoring.py, whichever program runs them; the messages between the programs
are spmdsplit/messages.py.

A rank runs the programs of the role groups on its pool, each step's phases in the order of
STEP_PHASES (the schedule's). The actor and critic groups always run their own; the rollout and
reward groups run theirs only on a pool apart from their host, else the host's program does their
work (the actor's generates, the critic's scores), as it always has in split and colocate."""

from __future__ import annotations

from spmdsplit.placement import HOSTS, ROLE_GROUPS, TRAINED, Placement

# The role groups whose work their host's program does when they share its pool: those that train
# nothing (the rollout's engines, the reward's scorers); a trained group always runs its own.
HOSTED = {group: host for group, host in HOSTS.items() if group not in TRAINED}
# A step's phases: (role group, method), in the order of the message schedule.
STEP_PHASES = (("rollout", "step"), ("actor", "roll_out"), ("reward", "step"), ("critic", "step"),
               ("actor", "update"))


class Program:
    """What the trainer calls on a role group's program besides STEP_PHASES' methods (the same for
    every program, so the trainer needs to know none of their insides). Each overrides what it does."""

    engine = None  # what a checkpoint saves with DCP (weights, optimizer, LR schedule); None: nothing trained

    def start(self, step: int) -> None:
        """Before the first step (1, or the one after a checkpoint)."""

    def state(self, step: int) -> dict:
        """This rank's part of a checkpoint besides the engine's (the RNG and dynamic sampling are
        the checkpoint manager's)."""
        return {}

    def load_state(self, state: dict, same_layout: bool) -> None:
        """`state` as `state` returned it; `same_layout`: the role groups' ranks are those that wrote it."""

    def validate(self, step: int, val_rows: list[dict]) -> None:
        """Where the rollout group's work runs here: responses to the validation set, to the reward group."""

    def score_validation(self, step: int, num_rows: int, sources: list[str]) -> dict[str, float] | None:
        """Where the reward group's work runs here: the validation responses' scores (the metrics
        rank 0 logs, from the group's first rank); None elsewhere."""
        return None

    def export(self, output_dir: str, tokenizer) -> None:
        """At the end of a completed run: what the run trained, for use outside it (trainer.output_dir)."""


def own_programs(placement: Placement, rank: int) -> list[str]:
    """The role groups that run a program of their own on `rank`, in the order they are built."""
    return [g for g in ROLE_GROUPS if rank in placement.ranks(g) and (g not in HOSTED or placement.apart(g))]
