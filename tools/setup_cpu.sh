#!/usr/bin/env bash
# Sets up .venv for CPU runs and tests, from nothing; a second run only checks and is quick.
# torch is pinned to the CPU build *before* the project: the project's open range (torch>=2.6)
# would otherwise let pip pick a multi-GB CUDA build. On GPU clusters, install the CUDA build
# of torch your cluster uses instead, then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
# The test extra brings DeepSpeed (an sdist: it builds no ops at install and needs no torch to
# build); the constraint keeps any dependency from swapping the CPU torch for another build.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" -c <(echo "torch==2.13.0")
