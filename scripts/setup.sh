#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and this package with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# NOTE: torch first, pinned, as the CPU build: on Linux x86_64 PyPI has only CUDA builds (`torch==2.13.0` from PyPI
# is the multi-GB CUDA one), and a bare `torch` requirement resolved later would pull one. The CPU build is
# `torch==2.13.0+cpu`: first from what pip already reaches without the CPU index (a local wheel store in pip's
# settings, `pip config list`; PyPI has no `+cpu` file, so this fails at once elsewhere), else from PyTorch's CPU
# index, where `torch==2.13.0` is the CPU build (and on macOS, whose builds are CPU ones, the only one).
if .venv/bin/python -m pip install --quiet "torch==$TORCH+cpu" 2>/dev/null; then
  echo "setup.sh: torch $TORCH+cpu (CPU build) from pip's configured sources"
else
  echo "setup.sh: no torch $TORCH+cpu in pip's configured sources; installing torch $TORCH from $CPU_INDEX"
  .venv/bin/python -m pip install --quiet --index-url "$CPU_INDEX" "torch==$TORCH"
fi
# The default tested combination (ci/default.txt): pyproject.toml has no upper bounds, so without the pins a later
# run would install whatever is newest then. `torch==2.13.0` there accepts the `+cpu` build installed above.
.venv/bin/python -m pip install --quiet -c ci/default.txt -e ".[test]"
.venv/bin/python -c "import torch; assert torch.version.cuda is None, 'a CUDA build of torch ' + torch.__version__; print('setup.sh: torch', torch.__version__)"
