r"""Writes tests/data/verl_prime_code_scores.json and tests/data/verl_sandbox_fusion_scores.json:
responses scored by verl's own code scorers, for tests/test_code_reward.py and
tests/test_sandbox_fusion.py to hold ours against (CI has no verl; the tests read only the files).

- prime_code: `verl.utils.reward_score.prime_code.compute_score(response, ground_truth,
  continuous=True)`, what `default_compute_score` calls for codecontests, apps, codeforces and taco
  without a SandboxFusion url. It runs each program in a fork of this process, as in verl.
- sandbox_fusion: `verl.utils.reward_score.sandbox_fusion.compute_score(url, None, 1024, response,
  ground_truth, continuous=True)`, what `default_compute_score` calls with a url, against
  tests/support/fake_sandbox_fusion.py's server.

Each case records verl's score (and, for prime_code, each single-test run's result when the
first run did not pass them all: True, False, -1 for a test that raised or a dead run, -2 for a
program that did not load). To regenerate (after adding cases below, or for another verl
release; about two minutes, most of it the cases that loop forever):

    .venv/bin/python tools/verl_code_fixtures.py --wheel /path/to/verl-0.9.1-py3-none-any.whl

The wheel is read, not installed: the scorer modules are taken out of it into a temporary folder
and imported from there (they need numpy and requests, no verl, Ray or torch).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRIME_OUT = ROOT / "tests" / "data" / "verl_prime_code_scores.json"
FUSION_OUT = ROOT / "tests" / "data" / "verl_sandbox_fusion_scores.json"


def fenced(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code}\n```\n\nIt reads the input and prints the answer."


def stdin_tests(*pairs) -> str:
    """An APPS-style ground truth (a JSON string): pairs of input and output texts."""
    return json.dumps({"inputs": [i for i, _ in pairs], "outputs": [o for _, o in pairs]})


def call_tests(fn_name: str, *pairs) -> str:
    """A LeetCode-style ground truth: each input a line of JSON per argument, each output JSON."""
    return json.dumps({"fn_name": fn_name, "inputs": [i for i, _ in pairs], "outputs": [o for _, o in pairs]})


SUM = "a, b = map(int, input().split())\nprint(a + b)"
SUM_TESTS = stdin_tests(("1 2\n", "3\n"), ("5 7\n", "12\n"), ("10 -4\n", "6\n"))
# Right when a <= b only: 2 of these 4.
SUM_IF_ORDERED = "a, b = map(int, input().split())\nprint(a + b if a <= b else a - b)"
SUM_HALF_TESTS = stdin_tests(("1 2\n", "3\n"), ("7 5\n", "12\n"), ("3 4\n", "7\n"), ("9 1\n", "10\n"))
# Twelve tests, right on the even ones: the score reads the first ten (5 of 10).
PARITY = "n = int(input())\nprint(n * 2 if n % 2 == 0 else n)"
TWELVE_TESTS = stdin_tests(*[(f"{n}\n", f"{n * 2}\n") for n in range(12)])
ECHO = "print(input())"

PRIME_CODE_CASES = [
    # right, wrong, partly right
    ("stdin-right", fenced(SUM), SUM_TESTS),
    ("stdin-right-dict-truth", fenced(SUM), json.loads(SUM_TESTS)),
    ("stdin-right-bare-code", SUM, SUM_TESTS),
    ("stdin-wrong", fenced("a, b = map(int, input().split())\nprint(a + b + 1)"), SUM_TESTS),
    ("stdin-half-right", fenced(SUM_IF_ORDERED), SUM_HALF_TESTS),
    ("stdin-first-ten-of-twelve", fenced(PARITY), TWELVE_TESTS),
    ("stdin-last-fence-wins", fenced("print('draft')") + "\nBetter:\n" + fenced(SUM), SUM_TESTS),
    # malformed
    ("no-code-block", "I would add the two numbers and print the sum.", SUM_TESTS),
    ("plain-fence-not-python", "Here:\n```\n" + SUM + "\n```\n", SUM_TESTS),
    ("syntax-error", fenced("a, b = map(int, input().split()\nprint(a + b)"), SUM_TESTS),
    ("empty-response", "", SUM_TESTS),
    ("empty-code-block", fenced(""), SUM_TESTS),
    ("truth-not-json", fenced(SUM), "inputs: 1 2, outputs: 3"),
    ("truth-json-list", fenced(SUM), "[1, 2]"),
    ("truth-empty-dict", fenced(SUM), "{}"),
    ("truth-no-outputs", fenced(SUM), json.dumps({"inputs": ["1 2\n"]})),
    ("truth-fewer-outputs", fenced(SUM), json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n"]})),
    ("truth-no-tests", fenced(SUM), json.dumps({"inputs": [], "outputs": []})),
    ("truth-no-tests-syntax-error", fenced("print(("), json.dumps({"inputs": [], "outputs": []})),
    ("truth-input-lines-as-list", fenced(SUM), json.dumps({"inputs": [["1 2"]], "outputs": ["3\n"]})),
    ("truth-output-not-text", fenced(SUM), json.dumps({"inputs": ["1 2\n"], "outputs": [3]})),
    ("truth-second-output-not-text", fenced(SUM), json.dumps({"inputs": ["1 2\n", "2 2\n"], "outputs": ["3\n", 4]})),
    # time: an infinite loop; one that loops on its second test of three
    ("stdin-infinite-loop", fenced("while True:\n    pass"), stdin_tests(("1\n", "1\n"))),
    ("stdin-loops-on-one-test", fenced("n = int(input())\nwhile n == 2:\n    pass\nprint(n)"),
     stdin_tests(("1\n", "1\n"), ("2\n", "2\n"), ("3\n", "3\n"))),
    # runtime errors
    ("stdin-raises", fenced("print(1 // 0)"), stdin_tests(("\n", "0\n"))),
    ("stdin-reads-past-input", fenced("a = input()\nb = input()\nprint(a)"), stdin_tests(("x\n", "x\n"))),
    ("stdin-exit-builtin", fenced("print(input())\nexit()"), stdin_tests(("7\n", "7\n"))),
    ("stdin-sys-exit", fenced("import sys\nprint(input())\nsys.exit(0)"), stdin_tests(("7\n", "7\n"))),
    ("stdin-os-getcwd", fenced("import os\nos.getcwd()\nprint(input())"), stdin_tests(("7\n", "7\n"))),
    ("stdin-import-subprocess", fenced("import subprocess\nprint(input())"), stdin_tests(("7\n", "7\n"))),
    ("stdin-stdout-close", fenced("import sys\nprint(input())\nsys.stdout.close()"), stdin_tests(("7\n", "7\n"))),
    # output comparison
    ("out-trailing-spaces", fenced("print(input() + '   ')"), stdin_tests(("ab\n", "ab\n"))),
    ("out-no-final-newline", fenced("import sys\nsys.stdout.write(input())"), stdin_tests(("ab\n", "ab\n"))),
    ("out-blank-lines-between", fenced("print(1)\nprint()\nprint(2)"), stdin_tests(("\n", "1\n2\n"))),
    ("out-line-indented", fenced("print('  1')\nprint('2  ')"), stdin_tests(("\n", "1\n2\n"))),
    ("out-expected-indented", fenced("print(1)\nprint(2)"), stdin_tests(("\n", " 1 \n  2\n"))),
    ("out-crlf", fenced("import sys\nsys.stdout.write('1\\r\\n2\\r\\n')"), stdin_tests(("\n", "1\n2\n"))),
    ("out-expected-crlf", fenced("print(1)\nprint(2)"), stdin_tests(("\n", "1\r\n2\r\n"))),
    ("out-case-differs", fenced("print('yes')"), stdin_tests(("\n", "YES\n"))),
    ("out-inner-spaces-differ", fenced("print('1  2')"), stdin_tests(("\n", "1 2\n"))),
    ("out-words-reordered", fenced("print('b a')"), stdin_tests(("\n", "a b\n"))),
    ("out-lines-reordered", fenced("print(2)\nprint(1)"), stdin_tests(("\n", "1\n2\n"))),
    ("out-float-close", fenced("print(1 / 3)"), stdin_tests(("\n", "0.333333\n"))),
    ("out-float-far", fenced("print(1 / 3)"), stdin_tests(("\n", "0.3333\n"))),
    ("out-float-lines", fenced("print(0.5)\nprint(2.0000001)"), stdin_tests(("\n", "0.5\n2\n"))),
    ("out-int-as-float", fenced("print(2.0)"), stdin_tests(("\n", "2\n"))),
    ("out-leading-zero-int", fenced("print('01')"), stdin_tests(("\n", "1\n"))),
    ("out-negative-as-float", fenced("print(-2.0)"), stdin_tests(("\n", "-2\n"))),
    ("out-two-floats-on-a-line", fenced("print('1.0 2.0')"), stdin_tests(("\n", "1 2\n"))),
    ("out-float-count-differs", fenced("print(1.0)\nprint(2.0)"), stdin_tests(("\n", "1\n"))),
    ("out-nan", fenced("print('nan')"), stdin_tests(("\n", "nan\n"))),
    ("out-inf-float", fenced("print(float('inf'))"), stdin_tests(("\n", "Infinity\n"))),
    ("out-empty-expected-empty", fenced("pass"), stdin_tests(("\n", "\n"))),
    ("out-empty-expected-text", fenced("pass"), stdin_tests(("\n", "1\n"))),
    # how the program is loaded and fed
    ("prelude-sqrt-without-import", fenced("print(int(sqrt(int(input()))))"), stdin_tests(("16\n", "4\n"))),
    ("prelude-counter-deque-gcd", fenced("c = Counter(input())\nd = deque([gcd(12, 18)])\nprint(c['a'], d[0])"),
     stdin_tests(("aab\n", "2 6\n"))),
    ("main-guard", fenced("def main():\n    print(int(input()) * 3)\n\nif __name__ == \"__main__\":\n    main()"),
     stdin_tests(("2\n", "6\n"))),
    ("main-guard-not-last", fenced("if __name__ == '__main__':\n    print(int(input()) * 3)\nx = 1"),
     stdin_tests(("2\n", "6\n"))),
    ("main-guard-else-dropped", fenced("if __name__ == '__main__':\n    print(1)\nelse:\n    print(2)"),
     stdin_tests(("\n", "1\n"))),
    ("sys-stdin-readline-keeps-newline", fenced("import sys\nprint(len(sys.stdin.readline()))"), stdin_tests(("abc\n", "4\n"))),
    ("sys-stdin-readline-alias", fenced("import sys\ninput = sys.stdin.readline\nn = int(input())\nprint(n + 1)"),
     stdin_tests(("41\n", "42\n"))),
    ("from-sys-stdin-readline-strips", fenced("from sys import stdin\nprint(len(stdin.readline()))"), stdin_tests(("abc\n", "3\n"))),
    ("bare-from-sys-stdin-readline-strips", "from sys import stdin\nprint(len(stdin.readline()))",
     stdin_tests(("abc\n", "3\n"))),
    ("bare-stdout-bound-at-load", "from sys import stdout\nstdout.write(input())", stdin_tests(("ab\n", "ab\n"))),
    ("stdin-global-readline-strips", fenced("print(len(stdin.readline()))"), stdin_tests(("abc\n", "3\n"))),
    ("stdin-global-iterates-nothing", fenced("for line in stdin:\n    print(line.strip())"), stdin_tests(("ab\n", "ab\n"))),
    ("stdin-global-read", fenced("print(stdin.read().split()[1])"), stdin_tests(("a b\n", "b\n"))),
    ("builtins-open-reads-input", fenced("import builtins\nprint(builtins.open('x').read().strip())"),
     stdin_tests(("ab\n", "ab\n"))),
    ("stdin-read-split", fenced("import sys\nprint(sum(map(int, sys.stdin.read().split())))"),
     stdin_tests(("1 2\n3\n", "6\n"))),
    ("stdin-readlines", fenced("import sys\nprint(len(sys.stdin.readlines()))"), stdin_tests(("a\nb\n", "2\n"))),
    ("stdin-iterate-lines", fenced("import sys\nfor line in sys.stdin:\n    print(line.strip()[::-1])"),
     stdin_tests(("ab\ncd\n", "ba\ndc\n"))),
    ("stdin-buffer-missing", fenced("import sys\nprint(sys.stdin.buffer.read().decode().strip())"), stdin_tests(("ab\n", "ab\n"))),
    ("open-zero-reads-nothing", fenced("print(open(0).read().strip())"), stdin_tests(("ab\n", "ab\n"))),
    ("stdout-bound-at-load", fenced("from sys import stdout\nstdout.write(input())"), stdin_tests(("ab\n", "ab\n"))),
    ("stdout-write", fenced("import sys\nsys.stdout.write(input() + '\\n')"), stdin_tests(("ab\n", "ab\n"))),
    ("stderr-ignored", fenced("import sys\nprint('noise', file=sys.stderr)\nprint(input())"), stdin_tests(("ab\n", "ab\n"))),
    ("state-kept-across-tests", fenced("import sys\nif hasattr(sys, 'seen'):\n    print('again')\nelse:\n"
                                       "    sys.seen = 1\n    print(input())"), stdin_tests(("a\n", "a\n"), ("b\n", "b\n"))),
    ("import-after-code-goes-inside", fenced("x = int(input())\nimport math\nprint(math.factorial(x))"),
     stdin_tests(("4\n", "24\n"))),
    ("tab-indented-code", fenced("def f(x):\n\treturn x * 2\nprint(f(int(input())))"), stdin_tests(("4\n", "8\n"))),
    ("numpy-import", fenced("import numpy as np\nprint(int(np.array([1, 2, 3]).sum()))"), stdin_tests(("\n", "6\n"))),
    ("recursion-deep", fenced("import sys\ndef f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nprint(f(20000))"),
     stdin_tests(("\n", "20000\n"))),
    # function-call (LeetCode-style) programs
    ("call-right", fenced("def add(a, b):\n    return a + b"), call_tests("add", ("1\n2", "3"), ("3\n4", "7"))),
    ("call-wrong", fenced("def add(a, b):\n    return a - b"), call_tests("add", ("1\n2", "3"), ("3\n4", "7"))),
    ("call-half-right", fenced("def add(a, b):\n    return a + b if a < 3 else 0"),
     call_tests("add", ("1\n2", "3"), ("3\n4", "7"))),
    ("call-solution-class", fenced("class Solution:\n    def twoSum(self, nums, target):\n"
                                   "        seen = {}\n        for i, n in enumerate(nums):\n"
                                   "            if target - n in seen:\n                return [seen[target - n], i]\n"
                                   "            seen[n] = i"),
     call_tests("twoSum", ("[2, 7, 11, 15]\n9", "[0, 1]"), ("[3, 2, 4]\n6", "[1, 2]"))),
    ("call-missing-function", fenced("def plus(a, b):\n    return a + b"), call_tests("add", ("1\n2", "3"))),
    ("call-tuple-for-list", fenced("def f(a):\n    return (a, a)"), call_tests("f", ("1", "[1, 1]"))),
    ("call-list-of-tuples", fenced("def f(a):\n    return [(a, a)]"), call_tests("f", ("1", "[[1, 1]]"))),
    ("call-list-of-tuples-wrapped", fenced("def f(a):\n    return [(a, a)]"), call_tests("f", ("1", "[[[1, 1]]]"))),
    ("call-dict-int-keys", fenced("def f(a):\n    return {a: a * 2}"), call_tests("f", ("3", '{"3": 6}'))),
    ("call-dict-str-keys", fenced("def f(a):\n    return {str(a): a * 2}"), call_tests("f", ("3", '{"3": 6}'))),
    ("call-dict-argument-int-keys", fenced("def f(d):\n    return sum(d.keys())"), call_tests("f", ('{"1": 5, "2": 6}', "3"))),
    ("call-expected-wrapped", fenced("def f(a):\n    return a"), call_tests("f", ("3", "[3]"))),
    ("call-returns-set", fenced("def f(a):\n    return {a}"), call_tests("f", ("3", "[3]"))),
    ("call-float-exact", fenced("def f():\n    return 0.1 + 0.2"), call_tests("f", ("", "0.30000000000000004"))),
    ("call-float-not-close-enough", fenced("def f():\n    return 0.1 + 0.2"), call_tests("f", ("", "0.3"))),
    ("call-returns-none", fenced("def f(a):\n    pass"), call_tests("f", ("1", "null"))),
    ("call-bool-is-int", fenced("def f(a):\n    return True"), call_tests("f", ("1", "1"))),
    ("call-prints-instead", fenced("def f(a):\n    print(a)"), call_tests("f", ("1", "1"))),
    ("call-sys-exit", fenced("import sys\ndef f(a):\n    sys.exit(0)"), call_tests("f", ("1", "1"))),
    ("call-main-guard-skipped", fenced("def f(a):\n    return a\nif __name__ == '__main__':\n    raise SystemExit"),
     call_tests("f", ("1", "1"))),
    ("call-state-kept", fenced("seen = []\ndef f(a):\n    seen.append(a)\n    return len(seen)"),
     call_tests("f", ("5", "1"), ("5", "1"))),
    ("call-infinite-loop", fenced("def f(a):\n    while True:\n        pass"), call_tests("f", ("1", "1"))),
    ("call-input-not-json", fenced("def f(a):\n    return a"), call_tests("f", ("not json", "1"))),
    ("call-output-not-json", fenced("def f(a):\n    return a"), call_tests("f", ("1", "not json"))),
]


FUSION_CASES = [
    ("stdin-right", fenced(SUM), SUM_TESTS),
    ("stdin-wrong", fenced("a, b = map(int, input().split())\nprint(a + b + 1)"), SUM_TESTS),
    ("stdin-half-right", fenced(SUM_IF_ORDERED), SUM_HALF_TESTS),
    ("stdin-first-ten-of-twelve", fenced(PARITY), TWELVE_TESTS),
    ("bare-fence", "Here:\n```\n" + SUM + "\n```\n", SUM_TESTS),
    ("bare-fence-language-name", "```py\n" + SUM + "\n```", SUM_TESTS),
    ("bare-fence-language-line-not-a-name", "```py3\n" + SUM + "\n```", SUM_TESTS),
    ("no-code-block", SUM, SUM_TESTS),
    ("truth-not-json", fenced(SUM), "inputs: 1 2"),
    ("truth-not-text", fenced(SUM), 42),
    ("truth-no-outputs", fenced(SUM), json.dumps({"inputs": ["1 2\n"]})),
    ("truth-count-mismatch", fenced(SUM), json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n"]})),
    ("truth-no-tests", fenced(SUM), json.dumps({"inputs": [], "outputs": []})),
    ("truth-input-not-text", fenced("print(input())"), json.dumps({"inputs": [["a", "b"]], "outputs": ["['a', 'b']"]})),
    ("assert-cases", fenced("def add(a, b):\n    return a + b"),
     json.dumps({"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]})),
    ("assert-cases-count-mismatch", fenced("def add(a, b):\n    return a + b"),
     json.dumps({"inputs": ["", ""], "outputs": [None, None], "assert_case": ["assert add(1, 2) == 3"]})),
    ("syntax-error", fenced("print(("), SUM_TESTS),
    ("runtime-error", fenced("print(1 // 0)"), SUM_TESTS),
    ("stdout-trailing-space-fails", fenced("print(input() + ' ')"), stdin_tests(("ab\n", "ab\n"))),
    ("stdout-no-final-newline", fenced("import sys\nsys.stdout.write(input())"), stdin_tests(("ab\n", "ab\n"))),
    ("infinite-loop", fenced("while True:\n    pass"), stdin_tests(("1\n", "1\n"))),
    ("call-right", fenced("def add(a, b):\n    return a + b"), call_tests("add", ("1\n2", "3"), ("3\n4", "7"))),
    ("call-half-right", fenced("def add(a, b):\n    return a + b if a < 3 else 0"),
     call_tests("add", ("1\n2", "3"), ("3\n4", "7"))),
    ("call-solution-class", fenced("class Solution:\n    def add(self, a, b):\n        return a + b"),
     call_tests("add", ("1\n2", "3"))),
    ("call-missing-function", fenced("def plus(a, b):\n    return a + b"), call_tests("add", ("1\n2", "3"))),
    ("call-returns-list", fenced("def f(a):\n    return [a, a]"), call_tests("f", ("1", "[1, 1]"))),
    ("call-returns-tuple", fenced("def f(a):\n    return (a, a)"), call_tests("f", ("1", "[1, 1]"))),
    ("call-returns-string", fenced("def f(a):\n    return 'x' * a"), call_tests("f", ("2", "xx"))),
    ("call-returns-set", fenced("def f(a):\n    return {a}"), call_tests("f", ("2", "{2}"))),
    ("call-no-arguments", fenced("def f():\n    return 5"), call_tests("f", ("", "5"))),
    ("http-504-then-ok", fenced(SUM + "\n#fake: 504 x1"), stdin_tests(("1 2\n", "3\n"))),
    ("http-504-always", fenced(SUM + "\n#fake: 504 x3"), stdin_tests(("1 2\n", "3\n"))),
    ("http-500", fenced(SUM + "\n#fake: 500"), stdin_tests(("1 2\n", "3\n"))),
    ("sandbox-error", fenced(SUM + "\n#fake: sandbox-error"), stdin_tests(("1 2\n", "3\n"))),
    ("response-not-json", fenced(SUM + "\n#fake: not-json"), stdin_tests(("1 2\n", "3\n"))),
]


def load_verl_scorers(wheel: str, folder: str):
    """verl's prime_code and sandbox_fusion packages, imported from the wheel (extracted into
    `folder`, which must outlive the calls)."""
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist()
                   if n.startswith("verl/utils/reward_score/") or n in ("verl/utils/import_utils.py", "verl/version/version")]
        if "verl/utils/reward_score/prime_code/__init__.py" not in members:
            sys.exit(f"{wheel}: no verl/utils/reward_score/prime_code in it")
        z.extractall(folder, members)
    # verl's package __init__s import Ray, tensordict and the model stack; the scorers need none of
    # it, so the packages are registered empty, pointing at the folders.
    for name in ("verl", "verl.utils", "verl.utils.reward_score"):
        package = types.ModuleType(name)
        package.__path__ = [str(Path(folder, *name.split(".")))]
        sys.modules[name] = package
    prime_code = importlib.import_module("verl.utils.reward_score.prime_code")
    sandbox_fusion = importlib.import_module("verl.utils.reward_score.sandbox_fusion")
    version = Path(folder, "verl", "version", "version").read_text().strip()
    return prime_code, sandbox_fusion, version


def prime_code_result(prime_code, response: str, truth) -> dict:
    score, metadata = prime_code.compute_score(response, truth, continuous=True)
    single = None
    if isinstance(metadata, list):  # the single-test runs' results (a dict when the first run passed)
        single = [entry["test_case"]["res"] for entry in metadata]
    return {"score": float(score), "single_runs": single}


def sandbox_fusion_result(sandbox_fusion, url: str, response: str, truth) -> dict:
    score, metadata = sandbox_fusion.compute_score(url, None, 1024, response, truth, continuous=True)
    statuses = [entry.get("status") for entry in metadata if isinstance(entry, dict)]
    return {"score": float(score), "statuses": statuses[:10]}


def check_names(cases) -> None:
    names = [c[0] for c in cases]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        sys.exit(f"case names used twice: {sorted(duplicated)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", required=True, help="a verl wheel (.whl), e.g. verl-0.9.1-py3-none-any.whl")
    parser.add_argument("--only", choices=("prime_code", "sandbox_fusion"), help="write one of the two files")
    args = parser.parse_args()
    check_names(PRIME_CODE_CASES)
    check_names(FUSION_CASES)
    sys.path.insert(0, str(ROOT))
    from tests.support.fake_sandbox_fusion import FakeSandboxFusion

    with tempfile.TemporaryDirectory(prefix="verl_scorers_") as folder:
        prime_code, sandbox_fusion, version = load_verl_scorers(args.wheel, folder)
        if args.only in (None, "prime_code"):
            cases = []
            for name, response, truth in PRIME_CODE_CASES:
                started = time.monotonic()
                cases.append({"name": name, "response": response, "ground_truth": truth,
                              "verl": prime_code_result(prime_code, response, truth)})
                print(f"prime_code {name}: {cases[-1]['verl']} ({time.monotonic() - started:.1f} s)", flush=True)
            write(PRIME_OUT, version, cases)
        if args.only in (None, "sandbox_fusion"):
            cases = []
            with FakeSandboxFusion() as server:
                for name, response, truth in FUSION_CASES:
                    cases.append({"name": name, "response": response, "ground_truth": truth,
                                  "verl": sandbox_fusion_result(sandbox_fusion, server.url, response, truth)})
                    print(f"sandbox_fusion {name}: {cases[-1]['verl']}", flush=True)
            write(FUSION_OUT, version, cases)


def write(path: Path, version: str, cases: list) -> None:
    fixture = {"verl_version": version, "written_by": "tools/verl_code_fixtures.py", "cases": cases}
    path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    scores = [c["verl"]["score"] for c in cases]
    print(f"{len(cases)} cases from verl {version} -> {path}: {scores.count(1.0)} score 1, {scores.count(0.0)} score 0, "
          f"{len(scores) - scores.count(1.0) - scores.count(0.0)} in between")


if __name__ == "__main__":
    main()
