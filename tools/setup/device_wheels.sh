#!/bin/bash
# bash tools/setup/device_wheels.sh [DIR]   (default .whl, ignored by git; PY=python3, the pip that downloads)
#
# The wheels a lent GPU machine lacks, downloaded here into one folder that travels with the working
# tree (the device tool carries at most 64 MiB), for tools/device/device_check.sh to install there with no
# index. That machine has Python 3.12, torch, transformers, peft, safetensors, tensorboard, pyarrow,
# numpy, pyyaml, cloudpickle, tqdm, packaging and typing_extensions, and no network; of pyproject.toml's
# runtime dependencies it lacks omegaconf and submitit (their own dependencies: PyYAML, cloudpickle,
# typing_extensions, all there; omegaconf 2.4 vendors its ANTLR runtime, so no antlr4-python3-runtime).
# Pinned to what the CPU venv runs (tools/setup/setup_cpu.sh). Prints each wheel and the total; fails over 60 MiB.
set -euo pipefail
DIR=${1:-.whl}; PY=${PY:-python3}
WHEELS=(omegaconf==2.4.0 submitit==1.5.4)
mkdir -p "$DIR"
for spec in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DIR" "$spec"
done
ls -l "$DIR"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "device_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $total bytes ($((total / 1024)) KiB) in $DIR"
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
    echo "device_wheels: over 60 MiB: the device tool carries at most 64 MiB with the working tree" >&2
    exit 1
fi
