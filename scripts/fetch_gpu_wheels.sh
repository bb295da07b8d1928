#!/usr/bin/env bash
# Wheels for what scripts/gpu_check.sh needs beyond the GPU machine's own packages
# (Python 3.12, x86-64). They land in .whl/, which git ignores; carry `.whl` with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  pytest pluggy iniconfig platformdirs
ls .whl
