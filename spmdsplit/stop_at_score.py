"""trainer.stop_at_score: has the run learned what it was asked to? The mean training score of the
last `window` steps against a threshold, kept by the ranks that compute the score (the critic
group's, where critic/score/mean is reduced over the pool, so every one of them holds the same
numbers and reaches the same answer at the same step). Pure: the vote that makes every rank of
the world stop together is spmdsplit/preempt.py's."""

from __future__ import annotations

from collections import deque


class ScoreTarget:
    def __init__(self, threshold: float | None, window: int):
        """`threshold`: None never stops the run."""
        self.threshold, self.window = threshold, window
        self.scores: deque[float] = deque(maxlen=window)
        self.reached_at: int | None = None  # the first step whose window reached the threshold

    def add(self, step: int, score: float) -> bool:
        """Step `step`'s score; True at the first step whose window's mean reaches the threshold."""
        self.scores.append(score)
        if self.threshold is None or self.reached_at is not None or len(self.scores) < self.window:
            return False
        if self.mean() >= self.threshold:
            self.reached_at = step
            return True
        return False

    @property
    def reached(self) -> bool:
        return self.reached_at is not None

    def mean(self) -> float:
        return sum(self.scores) / len(self.scores)

    def state_dict(self) -> dict:
        """For a checkpoint: a resumed run stops at the step the uninterrupted one would have."""
        return {"scores": list(self.scores), "reached_at": self.reached_at}

    def load_state_dict(self, state: dict) -> None:
        self.scores = deque(state["scores"], maxlen=self.window)
        self.reached_at = state["reached_at"]
