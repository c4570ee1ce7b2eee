"""How a judge's verdict becomes a score in [0, 1] (reward.judge.verdict): pure functions, one per
built-in parser. A text without a verdict raises NoVerdict; the judge (rewards/judge.py) scores
such a sample reward.judge.on_parse_error and counts it.

- last_number: the last number the judge wrote, which must lie in reward.judge.range [low, high];
  scored (number - low) / (high - low). Judges asked for "a score from 1 to 10" end with it.
- tag: the number inside the last <tag>...</tag> (reward.judge.tag), in the range, scored as above;
  for judges told to reason first and put the grade in tags.
- yes_no: no text at all: the judge's probability of its "yes" token against its "no" token at the
  position right after the prompt, from one forward pass (p_yes / (p_yes + p_no)).
"""

from __future__ import annotations

import math
import re

# Integers and decimals, signed, with an optional exponent: "7", "-2", "8.5", ".5", "1e-3".
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(NUMBER)


class NoVerdict(ValueError):
    """The judge's text holds no verdict the parser can read; the message says why, in a few words."""


def in_range(value: float, low: float, high: float) -> float:
    if not low <= value <= high:
        raise NoVerdict(f"{value:g} is outside the verdict's range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def last_number(text: str, low: float, high: float) -> float:
    numbers = _NUMBER.findall(text)
    if not numbers:
        raise NoVerdict("no number in the text")
    return in_range(float(numbers[-1]), low, high)


def tagged_number(text: str, tag: str, low: float, high: float) -> float:
    inside = re.findall(rf"<{re.escape(tag)}>\s*(.*?)\s*</{re.escape(tag)}>", text, flags=re.DOTALL)
    if not inside:
        raise NoVerdict(f"no <{tag}>...</{tag}> in the text")
    if not re.fullmatch(NUMBER, inside[-1]):
        raise NoVerdict(f"<{tag}> holds {inside[-1][:40]!r}, not a number")
    return in_range(float(inside[-1]), low, high)


def yes_probability(log_yes: float, log_no: float) -> float:
    """p(yes) / (p(yes) + p(no)) from the two tokens' log-probabilities (or logits)."""
    top = max(log_yes, log_no)
    if not math.isfinite(top):
        raise NoVerdict("neither the yes nor the no token has a finite probability")
    yes, no = math.exp(log_yes - top), math.exp(log_no - top)
    return yes / (yes + no)


def parse(text: str, verdict: str, low: float, high: float, tag: str) -> float:
    """The score of a generated verdict under reward.judge.verdict (last_number or tag)."""
    if verdict == "tag":
        return tagged_number(text, tag, low, high)
    return last_number(text, low, high)
