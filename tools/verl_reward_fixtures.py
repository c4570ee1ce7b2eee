r"""Writes tests/data/verl_math_dapo_scores.json: responses scored by verl's own DAPO scorer, for
tests/test_rewards_dapo.py to hold ours against (CI has no verl; the test reads only the file).

Each case is scored as verl scores it:

- "route": `verl.utils.reward_score.default_compute_score(data_source, response, ground_truth)`,
  the call verl's reward managers make (it picks math_dapo for math_dapo, math,
  math_dapo_reasoning and aime*; another name raises NotImplementedError, written as
  {"unknown": true});
- "strict_box": `verl.utils.reward_score.math_dapo.compute_score(response, ground_truth,
  strict_box_verify=True)`, the option a custom reward function may set.

A result is verl's dict ({"score", "acc", "pred"}), or {"error": "<exception type>"} when verl
raises. To regenerate (after adding cases below, or for another verl release):

    .venv/bin/python tools/verl_reward_fixtures.py --wheel /path/to/verl-0.9.1-py3-none-any.whl

The wheel is read, not installed: the scorer modules are taken out of it into a temporary folder
and imported from there (they need only the standard library), so no verl, Ray or vLLM is needed.
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

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "verl_math_dapo_scores.json"

FILLER = " and so on"  # 10 characters: pushes an answer out of a tail window


def padded(answer: str, after: int) -> str:
    """`answer` followed by `after` characters of filler."""
    return answer + (FILLER * (after // len(FILLER) + 1))[:after]


# (name, call, data_source, response, ground truth)
CASES = [
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


def load_verl_scorers(wheel: str, folder: str):
    """verl's `default_compute_score` and its `math_dapo` module, imported from the wheel
    (extracted into `folder`, which must outlive the calls: verl imports math_dapo lazily)."""
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist()
                   if n.startswith("verl/utils/reward_score/") or n in ("verl/utils/import_utils.py", "verl/version/version")]
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
    math_dapo = importlib.import_module("verl.utils.reward_score.math_dapo")
    version = Path(folder, "verl", "version", "version").read_text().strip()
    return reward_score.default_compute_score, math_dapo, version


def verl_result(call: str, data_source: str, response: str, truth, default_compute_score, math_dapo) -> dict:
    try:
        if call == "route":
            result = default_compute_score(data_source, response, truth)
        elif call == "strict_box":
            result = math_dapo.compute_score(response, truth, strict_box_verify=True)
        else:
            raise ValueError(f"unknown call {call!r}")
    except NotImplementedError:
        return {"unknown": True}
    except Exception as e:  # noqa: BLE001 - verl's own failure on this input: recorded, the test pins ours
        return {"error": type(e).__name__}
    return {"score": float(result["score"]), "acc": bool(result["acc"]), "pred": result["pred"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", required=True, help="a verl wheel (.whl), e.g. verl-0.9.1-py3-none-any.whl")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    names = [c[0] for c in CASES]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        sys.exit(f"case names used twice: {sorted(duplicated)}")
    with tempfile.TemporaryDirectory(prefix="verl_scorers_") as folder:
        default_compute_score, math_dapo, version = load_verl_scorers(args.wheel, folder)
        cases = [
            {"name": name, "call": call, "data_source": source, "response": response, "ground_truth": truth,
             "verl": verl_result(call, source, response, truth, default_compute_score, math_dapo)}
            for name, call, source, response, truth in CASES
        ]
    fixture = {"verl_version": version, "written_by": "tools/verl_reward_fixtures.py", "cases": cases}
    Path(args.out).write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    scores = [c["verl"].get("score") for c in cases]
    print(f"{len(cases)} cases from verl {version} -> {args.out}: {scores.count(1.0)} right, {scores.count(-1.0)} wrong, "
          f"{sum('unknown' in c['verl'] for c in cases)} unknown data sources, {sum('error' in c['verl'] for c in cases)} errors")


if __name__ == "__main__":
    main()
