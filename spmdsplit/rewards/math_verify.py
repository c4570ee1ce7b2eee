r"""Math-Verify's scorer (`pip install -e '.[math]'`), as verl's `math_verify.compute_score`
(verl/utils/reward_score/math_verify.py): the ground truth is read as `\boxed{<ground truth>}` (LaTeX),
the response as a plain expression or LaTeX (its last `\boxed{}` first), and the two are compared
symbolically and numerically (6 decimals): `0.5`, `1/2`, `\frac{1}{2}` and `\boxed{\dfrac12}` are
all right for `\frac{1}{2}`. 1.0 when they match, else 0.0; also 0.0 for a ground truth Math-Verify
cannot read, and for a call that runs past TIMEOUT_S (verl's `timeout_score`).

verl's `default_compute_score` routes no data_source to it (its MATH branch names it as the
alternative to edit in); here the data_source `math_verify` selects it (DATA_SOURCES), and a custom
reward function may call `compute_score(solution_str, ground_truth)` for any other.

Math-Verify bounds its own parse and verify with `signal.alarm`, which raises off the main thread
(the reward may be computed on any thread). Those timeouts are off here, and the whole call is
bounded instead by usercode.call_within, from whatever thread.
"""

from __future__ import annotations

from spmdsplit.usercode import Overrun, call_within

DATA_SOURCES = ("math_verify",)
TIMEOUT_S = 10.0  # the whole call: two parses and the comparison (Math-Verify's own bounds are 5 s each)
PRECISION = 6  # decimals compared, Math-Verify's math_metric default, which verl's scorer uses
INSTALL = "math-verify is not installed; install the extra: pip install -e '.[math]'"


def _score(solution_str: str, ground_truth: str) -> float:
    try:
        from math_verify import (
            ExprExtractionConfig,
            LatexExtractionConfig,
            parse,
            verify,
        )
    except ImportError:
        raise ImportError(INSTALL) from None
    gold = parse("\\boxed{" + ground_truth + "}", [LatexExtractionConfig()], parsing_timeout=None)
    if not gold:
        return 0.0
    pred = parse(solution_str, [ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=None)
    return 1.0 if verify(gold, pred, PRECISION, timeout_seconds=None) else 0.0


def compute_score(solution_str: str, ground_truth, timeout_score: float = 0.0) -> float:
    try:
        return call_within(TIMEOUT_S, _score, solution_str, str(ground_truth))
    except Overrun:
        return timeout_score
