"""Environments of gymnasium's signature, as users of gymnasium-style libraries (GEM, TextArena,
verifiers' GymEnv) write them: reset(seed, options) -> (observation, info), step(action) ->
(observation, reward, terminated, truncated, info). gymnasium itself is not needed."""

from __future__ import annotations

import random

from spmdsplit.rewards.rule import positional_match_score


class GymEcho:
    """The embedded echo task (spmdsplit/agent/echo.py) in gymnasium's shape: the episode is cut by
    a time limit after `turns` steps (truncated, never terminated: repeating digits has no end
    state), and its info carries numbers (the step's match, the steps so far) and a string (not
    logged)."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, seed: int | None = None, options: dict | None = None):
        self.rng = random.Random(seed)
        self.digit, self.steps = self.rng.randrange(10), 0
        return str(self.digit), {"steps": 0, "task": "echo"}

    def step(self, action: str):
        match = positional_match_score(action, str(self.digit))
        first = next((c for c in action if c.isdigit()), None)
        self.digit = (self.digit + (int(first) if first is not None else 0) + self.rng.randint(1, 9)) % 10
        self.steps += 1
        info = {"steps": self.steps, "match": match, "task": "echo"}
        return str(self.digit), match / self.turns, False, self.steps >= self.turns, info


class ResetReturnsGarbage(GymEcho):
    """A reset that returns a tuple of three: no episode can start."""

    def reset(self, seed: int | None = None, options: dict | None = None):
        return "0", {}, "extra"
