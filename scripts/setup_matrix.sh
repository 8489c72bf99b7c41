#!/usr/bin/env bash
# Builds a virtual environment with this package and its test extras on one tested combination of versions, pinned in
# ci/NAME.txt (oldest, default, newest: the README's tested matrix). Idempotent.
#   bash scripts/setup_matrix.sh oldest                # -> .venv-matrix/oldest
#   bash scripts/setup_matrix.sh newest /tmp/venv-new  # -> a venv of your choice
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:?usage: scripts/setup_matrix.sh oldest|default|newest [VENV]}
PINS=ci/$NAME.txt
if [ ! -f "$PINS" ]; then
  echo "setup_matrix.sh: no $PINS; choose one of: $(cd ci && ls -- *.txt | sed 's/\.txt$//' | tr '\n' ' ')" >&2
  exit 2
fi
VENV=${2:-.venv-matrix/$NAME}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# NOTE: torch first, on its own: a torch requirement resolved with no torch installed may pull a multi-GB CUDA build
# other than the pinned one; the pins (torch 2.13.0 CPU, 2.14.1) are the two that install here from local files.
"$VENV/bin/python" -m pip install --quiet -c "$PINS" torch
"$VENV/bin/python" -m pip install --quiet -c "$PINS" -e ".[test]"
"$VENV/bin/python" - "$PINS" <<'PY'
import sys
from importlib.metadata import version

# Every pinned package installed at its pin (a constraints file only constrains what something asks for).
pins = dict(line.split("#")[0].strip().split("==") for line in open(sys.argv[1]) if line.split("#")[0].strip())
wrong = {p: version(p) for p, v in pins.items() if version(p).split("+")[0] != v}
if wrong:
    sys.exit(f"setup_matrix.sh: not at the pins of {sys.argv[1]}: {wrong}")
print(f"{sys.argv[1]}: " + ", ".join(f"{p} {version(p)}" for p in pins))
PY
