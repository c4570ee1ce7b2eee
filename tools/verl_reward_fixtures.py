r"""Writes the fixtures tests/data/verl_<family>_scores.json: responses scored by verl's own rule
scorers, for our scorers to be held against (CI has no verl; the tests read only the files).

One file per family of data sources (`--family`, all by default):

- math_dapo (tests/test_rewards_dapo.py): `math_dapo`, `math`, `math_dapo_reasoning`, `aime*`;
- prime_math (tests/test_rewards_verl_parity.py): the six `numina_*` names;
- geo3k (the same test): `hiyouga/geometry3k`;
- search_r1 (the same test): the seven `searchR1_*` names.

Each case is scored as verl scores it:

- "route": `verl.utils.reward_score.default_compute_score(data_source, response, ground_truth)`,
  the call verl's reward managers make; a name it routes nowhere raises NotImplementedError,
  written as {"unknown": true};
- "strict_box" (math_dapo): `math_dapo.compute_score(response, ground_truth, strict_box_verify=True)`;
- "direct" (geo3k, search_r1): the family's `compute_score(response, ground_truth, **kwargs)`, with
  the case's "kwargs" (the options a custom reward function may set; the route sets none);
- "math_equal" (prime_math): `prime_math.grader.math_equal(response, ground_truth)`, the scorer's
  second test alone (its errors are lost in the score), as {"equal": bool}.

A result is what verl returned, as a dict: math_dapo's own ({"score", "acc", "pred"}); for the
others {"score"} (what default_compute_score returns, a float) with, for prime_math and search_r1,
"pred" (the answer verl's scorer read) and, for geo3k, "acc" and "format" (verl's acc_reward and
format_reward, the two parts of its score). {"error": "<exception type>"} when verl raises.

verl's search_r1 scorer prints one call in 64, drawn from Python's global `random`; here that
draw never prints, so the fixture is the same on every run (its score does not depend on it).

To regenerate (after adding cases below, or for another verl release):

    .venv/bin/python tools/verl_reward_fixtures.py --wheel /path/to/verl-0.9.1-py3-none-any.whl [--family prime_math]

The wheel is read, not installed: the scorer modules are taken out of it into a temporary folder
and imported from there, so no verl, Ray or vLLM is needed. math_dapo's and search_r1's need only
the standard library; prime_math's needs sympy and pylatexenc (and torch and numpy, which its
timeout helper's module imports), geo3k's needs mathruler: the `math` extra, in this .venv.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import types
import zipfile
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"

FILLER = " and so on"  # 10 characters: pushes an answer out of a tail window


def padded(answer: str, after: int) -> str:
    """`answer` followed by `after` characters of filler."""
    return answer + (FILLER * (after // len(FILLER) + 1))[:after]


# (name, call, data_source, response, ground truth)
DAPO_CASES = [
    # Minerva: "Answer: ..." lines
    ("answer-right", "route", "math_dapo", "Answer: 42", "42"),
    ("answer-wrong", "route", "math_dapo", "Answer: 41", "42"),
    ("answer-lowercase-no-space", "route", "math_dapo", "answer:42", "42"),
    ("answer-upper-spaced-colon", "route", "math_dapo", "ANSWER :   42", "42"),
    ("answer-on-next-line", "route", "math_dapo", "Answer:\n42", "42"),
    ("answer-then-more-lines", "route", "math_dapo", "Answer: 42\nThat is all.", "42"),
    ("answer-last-line-wins", "route", "math_dapo", "Answer: 41\nWait, no.\nAnswer: 42", "42"),
    ("answer-first-line-loses", "route", "math_dapo", "Answer: 42\nWait, no.\nAnswer: 41", "42"),
    ("answer-is-colon-not-matched", "route", "math_dapo", "The final answer is: 42", "42"),
    ("answer-in-a-sentence", "route", "math_dapo", "So the answer: 42", "42"),
    ("answer-words-after", "route", "math_dapo", "Answer: 42 is the result", "42"),
    ("answer-full-stop", "route", "math_dapo", "Answer: 42.", "42"),
    ("answer-article", "route", "math_dapo", "Answer: a 42", "42"),
    ("answer-dollars-math", "route", "math_dapo", "Answer: $42$", "42"),
    ("answer-two-math-spans", "route", "math_dapo", r"Answer: $\frac{1}{2}$ or $\frac{2}{4}$", r"\frac{1}{2}"),
    ("answer-boxed-inside", "route", "math_dapo", r"Answer: \boxed{42}", "42"),
    ("answer-lhs", "route", "math_dapo", "Answer: x = 42", "42"),
    ("answer-lhs-in-math", "route", "math_dapo", "Answer: $x = 3$", "3"),
    ("answer-thousands", "route", "math_dapo", "Answer: 1,000", "1000"),
    ("answer-millions", "route", "math_dapo", "Answer: 1,000,000", "1000000"),
    ("answer-thousands-truth", "route", "math_dapo", "Answer: 1000", "1,000"),
    ("answer-list-reads-as-number", "route", "math_dapo", "Answer: 3, 4", "34"),
    ("answer-list", "route", "math_dapo", "Answer: 3, 4", "3,4"),
    ("answer-text-and", "route", "math_dapo", r"Answer: 1 \text{and} 2", "1,2"),
    ("answer-decimal", "route", "math_dapo", "Answer: 3.75", "3.75"),
    ("answer-decimal-zero", "route", "math_dapo", "Answer: 3.750", "3.75"),
    ("answer-negative", "route", "math_dapo", "Answer: -5", "-5"),
    ("answer-negative-sign-wrong", "route", "math_dapo", "Answer: -5", "5"),
    ("answer-negative-fraction", "route", "math_dapo", r"Answer: -\frac{3}{4}", r"-\frac{3}{4}"),
    ("answer-fraction", "route", "math_dapo", r"Answer: \frac{1}{2}", r"\frac{1}{2}"),
    ("answer-frac-shorthand", "route", "math_dapo", r"Answer: \frac12", r"\frac{1}{2}"),
    ("answer-dfrac", "route", "math_dapo", r"Answer: \dfrac{1}{2}", r"\frac{1}{2}"),
    ("answer-ratio", "route", "math_dapo", "Answer: 1/2", r"\frac{1}{2}"),
    ("answer-half-decimal", "route", "math_dapo", "Answer: 0.5", r"\frac{1}{2}"),
    ("answer-sqrt-shorthand", "route", "math_dapo", r"Answer: 2\sqrt3", r"2\sqrt{3}"),
    ("answer-pi", "route", "math_dapo", r"Answer: 2\pi", r"2\pi"),
    ("answer-unit-cm", "route", "math_dapo", "Answer: 10 cm", "10"),
    ("answer-unit-text-cm", "route", "math_dapo", r"Answer: 10 \text{ cm}", "10"),
    ("answer-unit-mbox", "route", "math_dapo", r"Answer: 10 \mbox{ inches}", "10"),
    ("answer-unit-text-m", "route", "math_dapo", r"Answer: 5 \text{m}", "5"),
    ("answer-unit-square-units", "route", "math_dapo", "Answer: 12 square units", "12"),
    ("answer-unit-ways", "route", "math_dapo", "Answer: 7 ways", "7"),
    ("answer-unit-students", "route", "math_dapo", "Answer: 30 students", "30"),
    ("answer-degrees-circ", "route", "math_dapo", r"Answer: 90^\circ", "90"),
    ("answer-degrees-braced-circ", "route", "math_dapo", r"Answer: 90^{\circ}", "90"),
    ("answer-degrees-word", "route", "math_dapo", "Answer: 90 degrees", "90"),
    ("answer-dollar-sign", "route", "math_dapo", r"Answer: \$5", "5"),
    ("answer-dollars-word", "route", "math_dapo", "Answer: 5 dollars", "5"),
    ("answer-percent", "route", "math_dapo", r"Answer: 50\%", "50"),
    ("answer-ordinal", "route", "math_dapo", r"Answer: 100\mathrm{th}", "100"),
    ("answer-textbf", "route", "math_dapo", r"Answer: \textbf{7}", "7"),
    ("answer-overline", "route", "math_dapo", r"Answer: \overline{AB}", "AB"),
    ("answer-choice", "route", "math_dapo", r"Answer: \text{(B)}", "(B)"),
    ("answer-choice-bare-truth", "route", "math_dapo", r"Answer: \text{(B)}", "B"),
    ("answer-left-right", "route", "math_dapo", r"Answer: \left( 1, 2 \right)", "(1,2)"),
    ("answer-tuple", "route", "math_dapo", "Answer: (1, 2)", "(1,2)"),
    ("answer-thin-space", "route", "math_dapo", r"Answer: 1\;000", "1000"),
    ("answer-ldots", "route", "math_dapo", r"Answer: 1, 2, \ldots", "1,2,"),
    ("answer-quotes", "route", "math_dapo", 'Answer: "yes"', "yes"),
    ("answer-truth-in-dollars", "route", "math_dapo", "Answer: 42", "$42$"),
    ("answer-truth-boxed", "route", "math_dapo", "Answer: 42", r"\boxed{42}"),
    ("answer-truth-with-unit", "route", "math_dapo", "Answer: 42", "42 cm"),
    ("answer-beats-box", "route", "math_dapo", "\\boxed{42}\nAnswer: 41", "42"),
    ("answer-normalising-to-invalid-falls-to-box", "route", "math_dapo", "\\boxed{7}\nAnswer: [INVALID]", "7"),
    ("answer-empty-line-then-box", "route", "math_dapo", "Answer:\n\\boxed{7}", "7"),
    # \boxed{} fallback (no Answer: line), compared exactly
    ("box-right", "route", "math_dapo", r"\boxed{42}", "42"),
    ("box-in-sentence", "route", "math_dapo", r"So the result is $\boxed{42}$.", "42"),
    ("box-wrong", "route", "math_dapo", r"\boxed{41}", "42"),
    ("box-spaces", "route", "math_dapo", r"\boxed{ 42 }", "42"),
    ("box-nested-braces", "route", "math_dapo", r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    ("box-dfrac", "route", "math_dapo", r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
    ("box-thousands", "route", "math_dapo", r"\boxed{1,000}", "1000"),
    ("box-dollars", "route", "math_dapo", r"\boxed{\$5}", "5"),
    ("box-unit", "route", "math_dapo", r"\boxed{10 \text{ cm}}", "10"),
    ("box-negative", "route", "math_dapo", r"\boxed{-7}", "-7"),
    ("box-last-wins", "route", "math_dapo", r"\boxed{2} no, \boxed{3}", "3"),
    ("box-first-loses", "route", "math_dapo", r"\boxed{3} no, \boxed{2}", "3"),
    ("box-braceless", "route", "math_dapo", r"\boxed 5", "5"),
    ("box-fbox", "route", "math_dapo", r"\fbox{5}", "5"),
    ("box-unclosed", "route", "math_dapo", r"cut off: \boxed{\frac{1}{2}", r"\frac{1}{2}"),
    ("box-truth-boxed", "route", "math_dapo", r"\boxed{42}", r"\boxed{42}"),
    ("box-truth-padded", "route", "math_dapo", r"\boxed{42}", " 42"),
    # nothing to read
    ("no-answer", "route", "math_dapo", "I do not know.", "42"),
    ("no-answer-number-only", "route", "math_dapo", "42", "42"),
    ("empty-response", "route", "math_dapo", "", "42"),
    ("gsm8k-format", "route", "math_dapo", "#### 42", "42"),
    # the tail windows: 300 characters for everything, the last 100 of them for a box
    ("tail-answer-at-end-of-long", "route", "math_dapo", "x" * 2000 + "Answer: 42", "42"),
    ("tail-answer-just-inside", "route", "math_dapo", padded("Answer: 42\n", 289), "42"),
    ("tail-answer-just-outside", "route", "math_dapo", padded("Answer: 42\n", 290), "42"),
    ("tail-answer-cut-in-word", "route", "math_dapo", padded("Answer: 42\n", 293), "42"),
    ("tail-box-in-last-100", "route", "math_dapo", "x" * 250 + padded(r"\boxed{42}", 89), "42"),
    ("tail-box-just-outside-100", "route", "math_dapo", "x" * 250 + padded(r"\boxed{42}", 91), "42"),
    ("tail-box-in-300-not-100", "route", "math_dapo", padded(r"\boxed{42}", 150), "42"),
    ("tail-answer-in-300-not-100", "route", "math_dapo", padded("Answer: 42\n", 150), "42"),
    # ground truths that are not plain strings
    ("truth-int", "route", "math_dapo", "Answer: 42", 42),
    ("truth-invalid-and-no-answer", "route", "math_dapo", "I do not know.", "[INVALID]"),
    # strict_box_verify (a custom function's option): the box only
    ("strict-box-right", "strict_box", "math_dapo", r"\boxed{42}", "42"),
    ("strict-box-ignores-answer-line", "strict_box", "math_dapo", "Answer: 42", "42"),
    ("strict-box-over-answer-line", "strict_box", "math_dapo", "Answer: 41\n\\boxed{42}", "42"),
    ("strict-box-wrong", "strict_box", "math_dapo", r"\boxed{41}", "42"),
    ("strict-box-outside-100", "strict_box", "math_dapo", padded(r"\boxed{42}", 150), "42"),
    ("strict-box-no-box", "strict_box", "math_dapo", "nothing", "42"),
    # routing: which data_source names reach the DAPO scorer
    ("route-math", "route", "math", "Answer: 42", "42"),
    ("route-math-dapo-reasoning", "route", "math_dapo_reasoning", "Answer: 42", "42"),
    ("route-aime", "route", "aime", "Answer: 42", "42"),
    ("route-aime2024", "route", "aime2024", "Answer: 42", "42"),
    ("route-aime2025", "route", "aime2025", r"\boxed{42}", "42"),
    ("route-aime-2024-test", "route", "aime_2024_test", "Answer: 41", "42"),
    ("route-upper-AIME-unknown", "route", "AIME2024", "Answer: 42", "42"),
    ("route-dapo-unknown", "route", "dapo", "Answer: 42", "42"),
    ("route-math-dapo-suffix-unknown", "route", "math_dapo_v2", "Answer: 42", "42"),
]

NUMINA = "numina_olympiads"
# (name, call, data_source, response, ground truth)
PRIME_MATH_CASES = [
    # right, as written or in an equivalent form
    ("box-integer", "route", NUMINA, r"The answer is \boxed{42}", "42"),
    ("box-fraction", "route", NUMINA, r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    ("box-dfrac-vs-shorthand", "route", NUMINA, r"\boxed{\dfrac{1}{2}}", r"\frac12"),
    ("decimal-half-for-fraction", "route", NUMINA, r"\boxed{0.5}", r"\frac{1}{2}"),
    ("decimal-quarter-for-fraction", "route", NUMINA, r"\boxed{0.25}", r"\frac{1}{4}"),
    ("slash-for-fraction", "route", NUMINA, r"\boxed{1/2}", r"\frac{1}{2}"),
    ("unreduced-fraction-wrong", "route", NUMINA, r"\boxed{2/4}", r"\frac{1}{2}"),
    ("unreduced-latex-fraction-wrong", "route", NUMINA, r"\boxed{\frac{2}{4}}", "1/2"),
    ("decimal-third-wrong", "route", NUMINA, r"\boxed{0.333}", r"\frac{1}{3}"),
    ("fraction-for-decimal-truth", "route", NUMINA, r"\boxed{\frac{1}{3}}", "0.333"),
    ("float-integer", "route", NUMINA, r"\boxed{3.0}", "3"),
    ("near-integer-truncated", "route", NUMINA, r"\boxed{2.99999999}", "2"),
    ("wrong-decimal", "route", NUMINA, r"\boxed{3.5}", "3"),
    ("percent-of-truth", "route", NUMINA, r"\boxed{50}", "0.5"),
    ("percent-sign", "route", NUMINA, r"\boxed{50\%}", "50"),
    ("percent-for-decimal", "route", NUMINA, r"\boxed{5\%}", "0.05"),
    ("close-within-tolerance", "route", NUMINA, r"\boxed{3.14159}", "3.1416"),
    ("close-outside-tolerance", "route", NUMINA, r"\boxed{3.14}", "3.1416"),
    ("dollars", "route", NUMINA, r"\boxed{\$5}", "5"),
    ("dollars-decimal", "route", NUMINA, r"\boxed{\$5.50}", "5.5"),
    ("thousands-commas", "route", NUMINA, r"\boxed{1,000}", "1000"),
    ("power-of-ten-for-integer", "route", NUMINA, r"\boxed{10^6}", "1000000"),
    ("negative", "route", NUMINA, r"\boxed{-5}", "-5"),
    ("negative-spaced", "route", NUMINA, r"\boxed{- 5}", "-5"),
    ("sign-wrong", "route", NUMINA, r"\boxed{-5}", "5"),
    ("mixed-number", "route", NUMINA, r"\boxed{7\frac{3}{4}}", r"\frac{31}{4}"),
    ("sympy-commuted", "route", NUMINA, r"\boxed{x + 1}", "1 + x"),
    ("sympy-sqrt", "route", NUMINA, r"\boxed{2\sqrt{3}}", r"\sqrt{12}"),
    ("sympy-sqrt-over-two", "route", NUMINA, r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}"),
    ("sqrt-shorthand", "route", NUMINA, r"\boxed{3\sqrt2}", r"3\sqrt{2}"),
    ("sympy-expanded-square", "route", NUMINA, r"\boxed{x^2 + 2x + 1}", "(x+1)^2"),
    ("sympy-refused-power-parens", "route", NUMINA, r"\boxed{2^(x+1)}", "2*2^x"),
    ("integer-as-power-wrong", "route", NUMINA, r"\boxed{10^{2}}", "100"),
    ("sympy-refused-braced-power", "route", NUMINA, r"\boxed{x^{2}}", "x*x"),
    ("sympy-refused-three-letters", "route", NUMINA, r"\boxed{a+b+c}", "c+b+a"),
    ("infinity", "route", NUMINA, r"\boxed{\infty}", r"\infty"),
    # units and text
    ("unit-text-cm", "route", NUMINA, r"\boxed{10 \text{ cm}}", "10"),
    ("unit-word-meters", "route", NUMINA, r"\boxed{5 \text{meters}}", "5"),
    ("unit-inches", "route", NUMINA, "The answer is 12 inches", "12"),
    ("unit-liters", "route", NUMINA, r"\boxed{3 liters}", "3"),
    ("degrees", "route", NUMINA, r"\boxed{90^\circ}", "90"),
    ("million", "route", NUMINA, r"\boxed{3 million}", "3000000"),
    ("text-word", "route", NUMINA, r"\boxed{\text{Monday}}", "Monday"),
    ("text-word-case", "route", NUMINA, r"\boxed{\text{north}}", "North"),
    ("text-word-wrong", "route", NUMINA, r"\boxed{\text{Tuesday}}", "Monday"),
    ("choice-letter", "route", NUMINA, r"\boxed{\text{(B)}}", "B"),
    ("choice-letter-wrong", "route", NUMINA, r"\boxed{(C)}", "B"),
    # several answers: tuples, intervals, lists
    ("tuple", "route", NUMINA, r"\boxed{(1, 2)}", "(1,2)"),
    ("tuple-order-wrong", "route", NUMINA, r"\boxed{(2, 1)}", "(1,2)"),
    ("tuple-left-right", "route", NUMINA, r"\boxed{\left( 1, 2 \right)}", "(1, 2)"),
    ("interval-half-open", "route", NUMINA, r"\boxed{[0, 1)}", "[0,1)"),
    ("interval-brackets-wrong", "route", NUMINA, r"\boxed{(0, 1)}", "[0,1)"),
    ("list-plain", "route", NUMINA, r"\boxed{2, 3}", "2, 3"),
    ("list-order-wrong", "route", NUMINA, r"\boxed{3, 2}", "2,3"),
    ("list-and", "route", NUMINA, r"\boxed{2 \text{ and } 3}", "2, 3"),
    ("list-or", "route", NUMINA, r"\boxed{2 or 3}", "2, 3"),
    ("sympy-interval", "route", NUMINA, "The answer is Interval.Ropen(0, 1)", "[0, 1)"),
    ("sympy-point", "route", NUMINA, "The answer is Point(1, 2)", "(1, 2)"),
    ("point-empty-truth-raises", "route", NUMINA, "The answer is Point(1, 2)", ""),
    ("pmatrix-as-written", "route", NUMINA, r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}",
     r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    ("pmatrix-sympy-matrix", "route", NUMINA, "The answer is Matrix([[1], [2]])", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    ("pmatrix-sympy-matrix-sqrt", "route", NUMINA, "The answer is Matrix([[sqrt(4)], [2]])",
     r"\begin{pmatrix} 2 \\ 2 \end{pmatrix}"),
    ("pmatrix-sympy-matrix-wrong", "route", NUMINA, "The answer is Matrix([[1], [3]])", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    ("pmatrix-list", "route", NUMINA, r"\boxed{[1, 2]}", r"\begin{pmatrix}1\2\end{pmatrix}"),
    ("pmatrix-list-of-names", "route", NUMINA, r"\boxed{[x, 2]}", r"\begin{pmatrix}x\2\end{pmatrix}"),
    # pi: tried as 3.14159... and as 3.14
    ("pi-as-written", "route", NUMINA, r"\boxed{2\pi}", r"2\pi"),
    ("pi-for-3.14-multiple", "route", NUMINA, r"\boxed{2\pi}", "6.28"),
    ("pi-over-two-decimal", "route", NUMINA, r"\boxed{\pi/2}", "1.5708"),
    ("pi-truth-decimal-answer", "route", NUMINA, r"\boxed{3.14}", r"\pi"),
    ("pi-frac", "route", NUMINA, r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}"),
    ("pi-tuple", "route", NUMINA, r"\boxed{(0, \pi)}", r"(0, \pi)"),
    ("pi-wrong", "route", NUMINA, r"\boxed{3\pi}", r"2\pi"),
    ("pi-squared-xor", "route", NUMINA, r"\boxed{\pi^2}", "9.87"),
    ("pi-python-call", "route", NUMINA, r"\boxed{\pi*abs(-2)}", r"2\pi"),
    # a number in a base, and a `_` that is none
    ("base-subscript", "route", NUMINA, r"\boxed{1010_2}", "1010"),
    ("subscript-not-a-number", "route", NUMINA, r"\boxed{x_1}", "5"),
    # where the answer is read from
    ("answer-is-sentence", "route", NUMINA, "So the answer is 42.", "42"),
    ("answer-colon-then-work", "route", NUMINA, "Answer: 7\nbecause 3+4 = 7", "7"),
    ("equals", "route", NUMINA, "x = 5", "5"),
    ("we-get", "route", NUMINA, "Adding them we get 12", "12"),
    ("last-sentence-dropped", "route", NUMINA, "The result is 12. Then we stop", "12"),
    ("is-the-answer-after", "route", NUMINA, "12 is the answer", "12"),
    ("box-last-wins", "route", NUMINA, r"\boxed{2} no, \boxed{3}", "3"),
    ("box-first-loses", "route", NUMINA, r"\boxed{3} no, \boxed{2}", "3"),
    ("fbox", "route", NUMINA, r"\fbox{7}", "7"),
    ("box-braceless", "route", NUMINA, r"\boxed 7", "7"),
    ("box-empty", "route", NUMINA, r"\boxed{}", "0"),
    ("box-unclosed", "route", NUMINA, r"cut off: \boxed{\frac{1}{2}", r"\frac{1}{2}"),
    ("box-nested-braces", "route", NUMINA, r"\boxed{\frac{a^{2}}{b}}", r"\frac{a^2}{b}"),
    ("long-answer-cut-at-1000", "route", NUMINA, "The answer is " + "x" * 1200, "x" * 1000),
    # nothing to read
    ("no-answer", "route", NUMINA, "I do not know.", "5"),
    ("empty-response", "route", NUMINA, "", "5"),
    ("garbage", "route", NUMINA, "}}{{\\boxed{\\frac{", "3"),
    ("answer-without-digits", "route", NUMINA, "The answer is blue", "5"),
    # ground truths that are not plain strings (verl reads them as their text)
    ("truth-int", "route", NUMINA, r"\boxed{42}", 42),
    ("truth-float", "route", NUMINA, r"\boxed{\frac12}", 0.5),
    ("truth-boxed", "route", NUMINA, r"\boxed{42}", r"\boxed{42}"),
    # routing: every name verl sends to prime_math, and near misses
    ("route-aops-forum", "route", "numina_aops_forum", r"\boxed{7}", "7"),
    ("route-synthetic-math", "route", "numina_synthetic_math", r"\boxed{7}", "7"),
    ("route-amc-aime", "route", "numina_amc_aime", r"\boxed{7}", "7"),
    ("route-synthetic-amc", "route", "numina_synthetic_amc", r"\boxed{8}", "7"),
    ("route-cn-k12", "route", "numina_cn_k12", r"\boxed{7}", "7"),
    ("route-numina-unknown", "route", "numina", r"\boxed{7}", "7"),
    ("route-numina-math-unknown", "route", "numina_math", r"\boxed{7}", "7"),
    ("route-upper-unknown", "route", "Numina_olympiads", r"\boxed{7}", "7"),
    ("route-suffix-unknown", "route", "numina_olympiads_test", r"\boxed{7}", "7"),
    # ToRA's comparison alone (the scorer's second test), where its errors show: every part of a
    # list is compared, so a part that cannot be read fails the answer after an unequal one
    ("math-equal-every-part-compared", "math_equal", NUMINA, "$1, x_2", "2, 3"),
    ("math-equal-unequal-parts", "math_equal", NUMINA, "$1, 2", "2, 3"),
    ("math-equal-base", "math_equal", NUMINA, "1010_2", "1010"),
    ("math-equal-base-not-a-number", "math_equal", NUMINA, "x_2", "2"),
    ("math-equal-point-empty-reference", "math_equal", NUMINA, "Point(1)", ""),
    ("math-equal-matrix-list-of-names", "math_equal", NUMINA, "[x]", r"\begin{pmatrix}x\end{pmatrix}"),
    ("math-equal-percent", "math_equal", NUMINA, "50", "0.5"),
    ("math-equal-zero", "math_equal", NUMINA, "0", "x"),
]

GEO3K = "hiyouga/geometry3k"
# (name, call, data_source, response, ground truth[, kwargs])
GEO3K_CASES = [
    ("right-in-format", "route", GEO3K, "<think>The angles sum to 180.</think> The answer is \\boxed{5}", "5"),
    ("right-no-think", "route", GEO3K, r"The answer is \boxed{5}", "5"),
    ("wrong-in-format", "route", GEO3K, r"<think>x</think>\boxed{4}", "5"),
    ("wrong-no-format", "route", GEO3K, "4", "5"),
    ("think-newlines", "route", GEO3K, "<think>\nline one\nline two\n</think>\n\nSo \\boxed{5}.", "5"),
    ("think-no-box", "route", GEO3K, "<think>x</think> 5", "5"),
    ("box-before-think", "route", GEO3K, r"\boxed{5}<think>x</think>", "5"),
    ("think-not-first", "route", GEO3K, r" <think>x</think>\boxed{5}", "5"),
    ("think-unclosed", "route", GEO3K, r"<think>x \boxed{5}", "5"),
    ("two-thinks", "route", GEO3K, r"<think>a</think><think>b</think>\boxed{5}", "5"),
    ("box-unclosed", "route", GEO3K, r"<think>a</think>\boxed{5", "5"),
    ("box-empty", "route", GEO3K, r"<think></think>\boxed{}", "5"),
    ("box-last-wins", "route", GEO3K, r"\boxed{4} then \boxed{5}", "5"),
    ("box-first-loses", "route", GEO3K, r"\boxed{5} then \boxed{4}", "5"),
    ("fraction-for-decimal", "route", GEO3K, r"<think>a</think>\boxed{\frac{1}{2}}", "0.5"),
    ("decimal-for-fraction", "route", GEO3K, r"\boxed{8.5}", r"\frac{17}{2}"),
    ("sqrt-spaced", "route", GEO3K, r"\boxed{2\sqrt{3}}", r"2 \sqrt{3}"),
    ("sqrt-fraction-shorthand", "route", GEO3K, r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
    ("sqrt-sympy", "route", GEO3K, r"\boxed{\sqrt{12}}", r"2\sqrt{3}"),
    ("degrees", "route", GEO3K, r"\boxed{45^\circ}", "45"),
    ("unit-cm", "route", GEO3K, r"\boxed{12 \text{ cm}}", "12"),
    ("commuted", "route", GEO3K, r"\boxed{x+1}", "1+x"),
    ("tuple", "route", GEO3K, r"\boxed{(1,2)}", "(1, 2)"),
    ("text-choice", "route", GEO3K, r"\boxed{\text{A}}", "A"),
    ("decimal-approximation-wrong", "route", GEO3K, r"\boxed{1.73}", r"\sqrt{3}"),
    ("unreduced-fraction-wrong", "route", GEO3K, r"\boxed{2/4}", "1/2"),
    ("pi", "route", GEO3K, r"\boxed{2\pi}", r"2 \pi"),
    ("empty-response", "route", GEO3K, "", "5"),
    ("garbage", "route", GEO3K, "}{\\boxed{{", "5"),
    ("no-box-truth-none", "route", GEO3K, "no box here", "None"),
    ("truth-int", "route", GEO3K, r"<think>a</think>\boxed{5}", 5),
    ("direct-defaults", "direct", GEO3K, r"<think>a</think>\boxed{5}", "5", {}),
    ("direct-unboxed", "direct", GEO3K, "5", "5", {"use_boxed": False}),
    ("direct-unboxed-with-box", "direct", GEO3K, r"\boxed{5}", "5", {"use_boxed": False}),
    ("direct-format-weight", "direct", GEO3K, r"<think>a</think>\boxed{4}", "5", {"format_score": 0.5}),
    ("route-upper-unknown", "route", "hiyouga/Geometry3K", r"\boxed{5}", "5"),
    ("route-bare-unknown", "route", "geometry3k", r"\boxed{5}", "5"),
    ("route-suffix-unknown", "route", "hiyouga/geometry3k_test", r"\boxed{5}", "5"),
]

NQ = "searchR1_nq"
PARIS = {"target": ["Paris"]}
# (name, call, data_source, response, ground truth[, kwargs]); verl's ground truth is
# {"target": <the dataset's golden answers>}
SEARCH_R1_CASES = [
    ("right", "route", NQ, "<answer>Paris</answer>", PARIS),
    ("case-and-punctuation", "route", NQ, "<answer>paris.</answer>", PARIS),
    ("article", "route", NQ, "<answer>The Paris</answer>", PARIS),
    ("article-an", "route", NQ, "<answer>an apple</answer>", {"target": ["apple"]}),
    ("article-inside-word-kept", "route", NQ, "<answer>Theodore</answer>", {"target": ["odore"]}),
    ("extra-words-wrong", "route", NQ, "<answer>Paris, France</answer>", PARIS),
    ("spaces-and-newlines", "route", NQ, "<answer>\n  Paris \n</answer>", PARIS),
    ("inner-whitespace", "route", NQ, "<answer>New   York\tCity</answer>", {"target": ["new york city"]}),
    ("hyphen-dropped", "route", NQ, "<answer>Jean-Paul</answer>", {"target": ["Jean Paul"]}),
    ("hyphen-joins", "route", NQ, "<answer>Jean-Paul</answer>", {"target": ["JeanPaul"]}),
    ("thousands-comma", "route", NQ, "<answer>1,000</answer>", {"target": ["1000"]}),
    ("accent-kept", "route", NQ, "<answer>Zürich</answer>", {"target": ["Zurich"]}),
    ("accent-case", "route", NQ, "<answer>ZÜRICH</answer>", {"target": ["zürich"]}),
    ("one-of-several", "route", NQ, "<answer>new york city</answer>", {"target": ["NYC", "New York City"]}),
    ("none-of-several", "route", NQ, "<answer>Boston</answer>", {"target": ["NYC", "New York City"]}),
    ("target-string", "route", NQ, "<answer>Paris</answer>", {"target": "Paris"}),
    ("target-empty-answer", "route", NQ, "<answer></answer>", {"target": [""]}),
    ("empty-answer-wrong", "route", NQ, "<answer> </answer>", PARIS),
    ("typical-trajectory", "route", NQ,
     "<think>I need to search.</think><search>44th president</search><information>Doc 1: Barack Obama was"
     " the 44th president.</information><think>Found it.</think><answer> Barack Obama </answer>",
     {"target": ["Barack Obama", "Obama"]}),
    ("last-answer-wins", "route", NQ, "<answer>London</answer> no: <answer>Paris</answer>", PARIS),
    ("first-answer-loses", "route", NQ, "<answer>Paris</answer> no: <answer>London</answer>", PARIS),
    ("nested-open-tag", "route", NQ, "<answer>a<answer>Paris</answer>", PARIS),
    ("no-tags", "route", NQ, "Paris", PARIS),
    ("unclosed-tag", "route", NQ, "<answer>Paris", PARIS),
    ("close-before-open", "route", NQ, "</answer>Paris<answer>", PARIS),
    ("tags-case-sensitive", "route", NQ, "<Answer>Paris</Answer>", PARIS),
    ("empty-response", "route", NQ, "", PARIS),
    ("ten-answers-right", "route", NQ, "<answer>x</answer>" * 9 + "<answer>Paris</answer>", PARIS),
    ("eleven-answers-right", "route", NQ, "<answer>x</answer>" * 10 + "<answer>Paris</answer>", PARIS),
    ("eleven-answers-wrong", "route", NQ, "<answer>Paris</answer>" * 10 + "<answer>x</answer>", PARIS),
    ("eleven-closing-tags-right", "route", NQ, "</answer>" * 10 + "<answer>Paris</answer>", PARIS),
    # ground truths that are not verl's {"target": ...}
    ("truth-string", "route", NQ, "<answer>Paris</answer>", "Paris"),
    ("truth-string-no-answer", "route", NQ, "no answer", "Paris"),
    ("truth-list", "route", NQ, "<answer>Paris</answer>", ["Paris"]),
    ("truth-non-string-answer", "route", NQ, "<answer>1984</answer>", {"target": [1984]}),
    ("truth-without-target", "route", NQ, "<answer>Paris</answer>", {"answer": ["Paris"]}),
    # the options a custom reward function may set
    ("direct-format-score-wrong", "direct", NQ, "<answer>London</answer>", PARIS, {"format_score": 0.1}),
    ("direct-format-score-no-answer", "direct", NQ, "London", PARIS, {"format_score": 0.1}),
    ("direct-score-many-tags", "direct", NQ, "</answer>" * 11 + "<answer>Paris</answer>", PARIS, {"score": 2.0}),
    # routing: every name verl sends here, and near misses
    ("route-triviaqa", "route", "searchR1_triviaqa", "<answer>Paris</answer>", PARIS),
    ("route-popqa", "route", "searchR1_popqa", "<answer>Paris</answer>", PARIS),
    ("route-hotpotqa", "route", "searchR1_hotpotqa", "<answer>Paris</answer>", PARIS),
    ("route-2wikimultihopqa", "route", "searchR1_2wikimultihopqa", "<answer>Paris</answer>", PARIS),
    ("route-musique", "route", "searchR1_musique", "<answer>London</answer>", PARIS),
    ("route-bamboogle", "route", "searchR1_bamboogle", "<answer>Paris</answer>", PARIS),
    ("route-bare-unknown", "route", "searchR1", "<answer>Paris</answer>", PARIS),
    ("route-upper-unknown", "route", "searchR1_NQ", "<answer>Paris</answer>", PARIS),
    ("route-lower-unknown", "route", "searchr1_nq", "<answer>Paris</answer>", PARIS),
    ("route-underscored-unknown", "route", "search_r1_nq", "<answer>Paris</answer>", PARIS),
    ("route-suffix-unknown", "route", "searchR1_nq_test", "<answer>Paris</answer>", PARIS),
]


class Verl(types.SimpleNamespace):
    """verl's scorers, as imported from the wheel: default_compute_score and the family modules."""


def load_verl_scorers(wheel: str, folder: str, families) -> Verl:
    """verl's `default_compute_score` and the scorer module of each of `families`, imported from
    the wheel (extracted into `folder`, which must outlive the calls: verl imports them lazily)."""
    wanted = ("verl/utils/reward_score/", "verl/utils/metric/")
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.startswith(wanted)
                   or n in ("verl/utils/import_utils.py", "verl/utils/py_functional.py", "verl/version/version")]
        if "verl/utils/reward_score/math_dapo.py" not in members:
            sys.exit(f"{wheel}: no verl/utils/reward_score/math_dapo.py in it")
        z.extractall(folder, members)
    # verl/__init__.py and verl/utils/__init__.py import Ray, tensordict and the model stack; the
    # scorers need none of it, so both packages are registered empty, pointing at the folders.
    for name in ("verl", "verl.utils"):
        package = types.ModuleType(name)
        package.__path__ = [str(Path(folder, *name.split(".")))]
        sys.modules[name] = package
    reward_score = importlib.import_module("verl.utils.reward_score")
    verl = Verl(default_compute_score=reward_score.default_compute_score,
                version=Path(folder, "verl", "version", "version").read_text().strip())
    for family in families:
        setattr(verl, family, importlib.import_module(FAMILIES[family].module))
    if "search_r1" in families:
        verl.search_r1.random = types.SimpleNamespace(randint=lambda low, high: high)  # never the 1 that prints
    return verl


def dapo_result(verl: Verl, call: str, data_source: str, response: str, truth, kwargs) -> dict:
    if call == "route":
        result = verl.default_compute_score(data_source, response, truth)
    elif call == "strict_box":
        result = verl.math_dapo.compute_score(response, truth, strict_box_verify=True)
    else:
        raise ValueError(f"unknown call {call!r}")
    return {"score": float(result["score"]), "acc": bool(result["acc"]), "pred": result["pred"]}


def prime_math_result(verl: Verl, call: str, data_source: str, response: str, truth, kwargs) -> dict:
    if call == "math_equal":
        return {"equal": verl.prime_math.math_equal(response, truth)}
    assert call == "route", call
    score = float(verl.default_compute_score(data_source, response, truth))
    return {"score": score, "pred": verl.prime_math.compute_score(response, truth)[2]}


def geo3k_result(verl: Verl, call: str, data_source: str, response: str, truth, kwargs) -> dict:
    if call == "route":
        score = verl.default_compute_score(data_source, response, truth)
    else:
        score = verl.geo3k.compute_score(response, truth, **kwargs)
    return {"score": float(score), "acc": verl.geo3k.acc_reward(response, truth, kwargs.get("use_boxed", True)),
            "format": verl.geo3k.format_reward(response)}


def search_r1_result(verl: Verl, call: str, data_source: str, response: str, truth, kwargs) -> dict:
    if call == "route":
        score = verl.default_compute_score(data_source, response, truth)
    else:
        score = verl.search_r1.compute_score(response, truth, **kwargs)
    return {"score": float(score), "pred": verl.search_r1.extract_solution(response)}


class Family(types.SimpleNamespace):
    """A fixture file: its cases, the verl module that scores them and how a result is read."""


FAMILIES = {
    "math_dapo": Family(cases=DAPO_CASES, module="verl.utils.reward_score.math_dapo", result=dapo_result),
    "prime_math": Family(cases=PRIME_MATH_CASES, module="verl.utils.reward_score.prime_math", result=prime_math_result),
    "geo3k": Family(cases=GEO3K_CASES, module="verl.utils.reward_score.geo3k", result=geo3k_result),
    "search_r1": Family(cases=SEARCH_R1_CASES, module="verl.utils.reward_score.search_r1_like_qa_em",
                        result=search_r1_result),
}


def fixture_path(family: str) -> Path:
    return DATA / f"verl_{family}_scores.json"


def verl_result(verl: Verl, family: str, call: str, data_source: str, response: str, truth, kwargs) -> dict:
    try:
        return FAMILIES[family].result(verl, call, data_source, response, truth, kwargs)
    except NotImplementedError:
        return {"unknown": True}
    except Exception as e:  # noqa: BLE001 - verl's own failure on this input: recorded, the test pins ours
        return {"error": type(e).__name__}


def write_fixture(verl: Verl, family: str, out: Path) -> None:
    names = [c[0] for c in FAMILIES[family].cases]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        sys.exit(f"{family}: case names used twice: {sorted(duplicated)}")
    cases = []
    for name, call, source, response, truth, *options in FAMILIES[family].cases:
        case = {"name": name, "call": call, "data_source": source, "response": response, "ground_truth": truth}
        kwargs = options[0] if options else {}
        if options:
            case["kwargs"] = kwargs
        case["verl"] = verl_result(verl, family, call, source, response, truth, kwargs)
        cases.append(case)
    fixture = {"verl_version": verl.version, "written_by": "tools/verl_reward_fixtures.py", "cases": cases}
    out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    scores = [c["verl"].get("score") for c in cases]
    print(f"{family}: {len(cases)} cases from verl {verl.version} -> {out}: "
          f"{sum(s is not None and s > 0 for s in scores)} scored above 0, "
          f"{sum(s is not None and s <= 0 for s in scores)} at or below 0, "
          f"{sum('unknown' in c['verl'] for c in cases)} unknown data sources, {sum('error' in c['verl'] for c in cases)} errors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", required=True, help="a verl wheel (.whl), e.g. verl-0.9.1-py3-none-any.whl")
    parser.add_argument("--family", choices=sorted(FAMILIES), action="append",
                        help="the fixture to write (repeatable); all by default")
    parser.add_argument("--out-dir", default=str(DATA), help="where the verl_<family>_scores.json files go")
    args = parser.parse_args()
    families = args.family or list(FAMILIES)
    with tempfile.TemporaryDirectory(prefix="verl_scorers_") as folder:
        verl = load_verl_scorers(args.wheel, folder, families)
        for family in families:
            write_fixture(verl, family, Path(args.out_dir) / fixture_path(family).name)


if __name__ == "__main__":
    main()
