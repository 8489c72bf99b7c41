#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and this package with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# NOTE: torch first, pinned: a bare `torch` requirement with no torch installed pulls a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
# The default tested combination (ci/default.txt): pyproject.toml has no upper bounds, so without the pins a later
# run would install whatever is newest then.
.venv/bin/python -m pip install --quiet -c ci/default.txt -e ".[test]"
