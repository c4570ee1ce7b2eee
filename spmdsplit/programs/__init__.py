"""Each role group's program, side by side, none importing another: rollout.py (wherever the
rollout group generates: a rollout pool of its own, the actor pool, rollout.ranks=all's critic
pool), actor.py, critic.py, reward.py (a reward pool of its own). Where the rollout program's rows
come from is spmdsplit/generation/sources.py, scoring spmdsplit/scoring.py; the messages between the
programs are spmdsplit/messages.py.

A rank runs the programs of the role groups on its pool (spmdsplit/builder.py builds them), each
step's phases in the message schedule's order (spmdsplit/trainer.py train_step). The rollout
group's program runs on every rank that generates, whether its pool is apart or shared: its rows
go to the actor group as GENERATED, which the exchange delivers to the rank itself without moving
them where the two share it. The reward group runs its own only on a pool apart from the
critic's; else the critic's program scores."""

from __future__ import annotations


class Program:
    """What the loop calls on every program alike (so it needs to know none of their insides);
    each overrides what it does. A step's phases are each program's own methods, which the loop
    calls by name in the schedule's order (spmdsplit/trainer.py train_step)."""

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
        """The rollout group's: responses to the validation set (generation.validation.ValidationSet), to the reward group."""

    def score_validation(self, step: int, val_set) -> dict[str, float] | None:
        """Where the reward group's work runs here: the validation responses' scores (the metrics
        rank 0 logs, from the group's first rank); None elsewhere."""
        return None

    def export(self, output_dir: str, tokenizer) -> None:
        """At the end of a completed run: what the run trained, for use outside it (trainer.output_dir)."""

    def close(self) -> None:
        """At the job's end, on every rank at the same point: what the program holds besides its
        models (a judge's engine thread and endpoint, a reward function's workers) let go of."""
