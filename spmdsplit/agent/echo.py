"""The embedded environment (data.task=echo, configs/environment_echo.yaml): small enough for the
tiny character model to learn by RL alone, stateful so that what it sees depends on what it did.

reset shows a digit s drawn from the episode's seed. Each turn the policy answers; the step scores
the answer's positional match with s over the episode's turns (so an episode earns at most 1.0,
and an answer that starts right but runs on earns part of a turn's share), then moves s by the
answer and a draw of the episode's own generator: s' = (s + a + r) mod 10 for the answer's first
digit a (0 without one) and r in 1..9, and shows s'. (Without r a right answer would map s to
2s + 1, and the even digits would be seen only at reset: too few for a tiny model to learn them.)
The episode is done after `turns` steps. The policy that reads its digit back scores 1.0; one
that ignores the observations, or copies an earlier one, does not.
"""

from __future__ import annotations

import random

from spmdsplit.agent.environments import Observation
from spmdsplit.rewards.rule import positional_match_score


class EchoDigits:
    def __init__(self, turns: int = 3):
        if not (isinstance(turns, int) and turns > 0):
            raise ValueError(f"turns={turns!r}: expected a positive integer")
        self.turns = turns
        self.digit, self.steps, self.rng = 0, 0, random.Random()

    def reset(self, seed: int | None = None) -> Observation:
        self.rng = random.Random(seed)
        self.digit, self.steps = self.rng.randrange(10), 0
        return Observation(str(self.digit))

    def step(self, action: str) -> Observation:
        reward = positional_match_score(action, str(self.digit)) / self.turns
        first = next((c for c in action if c.isdigit()), None)
        self.digit = (self.digit + (int(first) if first is not None else 0) + self.rng.randint(1, 9)) % 10
        self.steps += 1
        return Observation(str(self.digit), reward=reward, done=self.steps >= self.turns)
