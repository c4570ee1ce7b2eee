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
- echo:    the environment task (spmdsplit/agent/echo.py, configs/environment_echo.yaml): each row an
           episode of a small stateful environment that shows a digit, takes the policy's answer,
           and shows the next digit, which depends on that answer.
- lookup:  the agentic task (spmdsplit/agent/, configs/agent_lookup.yaml): "37?" -> a code ("7777",
           one random digit four times) that only the row's lookup tool knows
           (extra_info.tools_kwargs), so no policy can score above chance without calling it. Its
           prompts are chat messages for the embedded agent model's chat template; the call is the
           compact format's "@".

Set data.max_response_length to the answer's length + 1, room for the EOS that ends it.
"""

from __future__ import annotations

import random

from spmdsplit.data.parquet import ENVIRONMENT_AGENT

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


AGENT_TASKS = ("lookup", "echo")  # tasks whose rows are agent episodes; the embedded agent model serves them
TASKS["lookup"] = None  # its answer is drawn at random, not computed from the prompt (make_dataset)
TASKS["echo"] = None  # an environment's episodes (agent/echo.py): the environment scores them
TOOL_CALL, TOOL_OPEN, TOOL_CLOSE, QUESTION = "@", "=", ";", "?"  # the agent model's extra characters


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
        if task == "echo":
            rows.append(echo_row(i))
            continue
        if task in AGENT_TASKS:
            # One digit four times: a 2-layer model learns to copy it from the tool's response in
            # minutes; a code of four independent digits had not moved the score in 90 steps.
            rows.append(lookup_row(digits, rng.choice(DIGITS) * ANSWER_LEN, i))
            continue
        rows.append(
            {
                "prompt": digits + SEPARATOR,
                "data_source": data_source(task),
                "reward_model": {"ground_truth": TASKS[task](digits), "style": "rule"},
                "extra_info": {"index": i},
            }
        )
    return rows


def lookup_row(key: str, code: str, index: int) -> dict:
    """A row of the lookup task in verl's agent data format: chat messages, `agent_name`, and the
    tool's per-row arguments in extra_info.tools_kwargs (the code, which the prompt never shows)."""
    return {
        "prompt": [{"role": "user", "content": key + QUESTION}],
        "data_source": data_source("lookup"),
        "reward_model": {"ground_truth": code, "style": "rule"},
        "extra_info": {"index": index, "tools_kwargs": {"lookup": {"create_kwargs": {"code": code}}}},
        "agent_name": "tool_agent",
    }


def echo_row(index: int) -> dict:
    """A row of the echo task: an episode of the embedded environment (agent/echo.py), which draws
    the episode's digits from its reset seed and scores every turn; the prompt only opens it."""
    return {
        "prompt": [{"role": "user", "content": QUESTION}],
        "data_source": data_source("echo"),
        "reward_model": {"ground_truth": "", "style": "environment"},
        "extra_info": {"index": index},
        "agent_name": ENVIRONMENT_AGENT,
    }


def prompt_vocabulary() -> list[str]:
    """Every character a task prompt or answer can hold: the embedded tokenizer's word list."""
    return list(DIGITS) + [SEPARATOR]


def agent_vocabulary() -> list[str]:
    """The embedded agent model's word list: the tasks' characters, the lookup prompt's "?", the
    compact call "@" and the ";" that closes a tool response (which opens with "=")."""
    return prompt_vocabulary() + [QUESTION, TOOL_CALL, TOOL_CLOSE]
