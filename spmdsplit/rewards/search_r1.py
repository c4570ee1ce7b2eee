"""The `searchR1_*` scorer (Search-R1's question-answering sets: `searchR1_nq`, `_triviaqa`,
`_popqa`, `_hotpotqa`, `_2wikimultihopqa`, `_musique`, `_bamboogle`), with verl 0.9.1's semantics
(verl/utils/reward_score/search_r1_like_qa_em.py, as `default_compute_score` calls it): exact match.

The answer is the text of the last `<answer>...</answer>` (the first `</answer>` after an
`<answer>`; line breaks allowed), stripped. It is right when, normalised as SQuAD's evaluation
does (lower case, punctuation dropped, the words a / an / the dropped, runs of whitespace made one
space), it equals one of the ground truth's answers normalised alike. Scores: `score` (1.0) when
right, but a quarter of it when the response holds more than MAX_ANSWER_TAGS `<answer>` or
`</answer>` tags (a guard against a policy that repeats them); `format_score` (0.0) when an answer
was found and is wrong; 0.0 when none was found.

The ground truth is verl's `{"target": [answers...]}` (Search-R1's preprocessing writes the
dataset's golden answers there), or `{"target": "answer"}`. Deliberately more lenient than verl,
which raises on these: a ground truth that is the answers themselves (a string or a list), and
answers that are not strings (read as their text). verl also prints one call in 64 (drawn from
Python's global `random`); this prints nothing and draws nothing.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping

DATA_SOURCES = tuple(f"searchR1_{name}" for name in
                     ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"))
MAX_ANSWER_TAGS = 10  # of either tag; past it a right answer earns a quarter

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLE = re.compile(r"\b(a|an|the)\b")
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_NO_PUNCTUATION)
    return " ".join(_ARTICLE.sub(" ", text).split())


def extract_answer(solution_str: str) -> str | None:
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def answers(ground_truth) -> list[str]:
    """The accepted answers: those under "target", or the ground truth itself when it is no mapping."""
    target = ground_truth["target"] if isinstance(ground_truth, Mapping) else ground_truth
    if isinstance(target, str) or not hasattr(target, "__iter__"):
        return [str(target)]
    return [str(answer) for answer in target]


def compute_score(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> float:
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    if normalize_answer(answer) not in {normalize_answer(a) for a in answers(ground_truth)}:
        return float(format_score)
    if solution_str.count("<answer>") > MAX_ANSWER_TAGS or solution_str.count("</answer>") > MAX_ANSWER_TAGS:
        return score / 4
    return float(score)
