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
# other than the pinned one. On x86_64 PyPI has only CUDA builds (torch 2.15.0 with its CUDA 13 libraries: about 3 GB,
# 2.5 minutes to download and install); they run on the CPU. A machine with a local wheel store may cap torch in pip's
# own settings (`pip config list`): then the pin cannot install there.
if ! "$VENV/bin/python" -m pip install --quiet -c "$PINS" torch; then
  echo "setup_matrix.sh: torch as pinned in $PINS did not install; pip's settings: $("$VENV/bin/python" -m pip config list | tr '\n' ' ')" >&2
  exit 1
fi
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
