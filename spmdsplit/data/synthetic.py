"""Built-in synthetic tasks: prompts of digits whose right answer a rule can check.

They exist so that a randomly initialised tiny model can show PPO learning on a laptop in
minutes, with no download. Each task maps a random digit string to a target digit string;
the reward (spmdsplit/rewards/rule.py) gives partial credit per position, so a random policy
scores above zero and the best score is exactly 1.0.

- repeat:  "2815=" -> "5555": the last digit, four times (the default: a 2-layer model learns
           it from a random start by PPO alone in ~100 steps of 128 prompts).
- count:   "345=" -> "6789": keep counting mod 10 (harder: a different next-token rule per digit).
- copy:    repeat the prompt's digits.
- reverse: the prompt's digits in reverse order.

Set data.max_response_length to the answer's length + 1, room for the EOS that ends it.
"""

from __future__ import annotations

import random

DIGITS = "0123456789"
SEPARATOR = "="  # ends every prompt: "345="
ANSWER_LEN = 4


def _count(digits: str) -> str:
    last = int(digits[-1])
    return "".join(str((last + i) % 10) for i in range(1, ANSWER_LEN + 1))


TASKS = {
    "repeat": lambda digits: digits[-1] * ANSWER_LEN,
    "count": _count,
    "copy": lambda digits: digits,
    "reverse": lambda digits: digits[::-1],
}


def data_source(task: str) -> str:
    return f"synthetic/{task}"


def make_dataset(task: str, num_samples: int, seed: int, min_digits: int = 2, max_digits: int = 5) -> list[dict]:
    """Rows in verl's schema (prompt, data_source, reward_model.ground_truth, extra_info), with the
    prompt as plain text rather than chat messages: the embedded tokenizer has no chat template."""
    if task not in TASKS:
        raise ValueError(f"data.task={task!r}: expected one of {sorted(TASKS)}")
    rng = random.Random(seed)
    rows = []
    for i in range(num_samples):
        digits = "".join(rng.choice(DIGITS) for _ in range(rng.randint(min_digits, max_digits)))
        rows.append(
            {
                "prompt": digits + SEPARATOR,
                "data_source": data_source(task),
                "reward_model": {"ground_truth": TASKS[task](digits), "style": "rule"},
                "extra_info": {"index": i},
            }
        )
    return rows


def prompt_vocabulary() -> list[str]:
    """Every character a task prompt or answer can hold: the embedded tokenizer's word list."""
    return list(DIGITS) + [SEPARATOR]
