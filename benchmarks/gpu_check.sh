#!/usr/bin/env bash
# The GPU check: layer-wise vs standard optimizers on one CUDA device, under 6 minutes in all on one H200.
#   bash benchmarks/gpu_check.sh [gpu_check.py arguments]    # from anywhere; GPU_CHECK_TIMEOUT=300, PYTHON=...
# Interpreter: $PYTHON if set (that one only); else the first of this checkout's .venv/bin/python, python3 and python
# whose torch sees CUDA (a .venv without torch or with the CPU build is passed over, saying why). It needs torch,
# transformers and accelerate, nothing else (layerwise_hf from this checkout; bitsandbytes optional: its checks are
# skipped without it). Installs and downloads nothing. Checks, criteria, the JSON: benchmarks/README.md.
# Exit status: 0 every check that ran passed, 1 a check failed, 2 no CUDA interpreter / missing package, 124 time limit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LIMIT="${GPU_CHECK_TIMEOUT:-330}" # seconds for the Python part; choosing the interpreter takes a few more

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 # deterministic cuBLAS (with torch.use_deterministic_algorithms)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

echo "gpu_check: $(date -u +%FT%TZ) in $ROOT"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "gpu_check: nvidia-smi not found"

if [[ -n "${PYTHON:-}" ]]; then
    candidates=("$PYTHON")
else
    candidates=()
    [[ -x "$ROOT/.venv/bin/python" ]] && candidates+=("$ROOT/.venv/bin/python")
    for name in python3 python; do
        command -v "$name" >/dev/null 2>&1 && candidates+=("$(command -v "$name")")
    done
fi
# Prints one line: the torch it found; exits 0 only when that torch sees a CUDA device.
PROBE='import sys, torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"torch {torch.__version__} ({build}), torch.cuda.is_available() is {torch.cuda.is_available()}")
sys.exit(0 if torch.cuda.is_available() else 3)'
PY=""
for candidate in "${candidates[@]}"; do
    set +e
    found="$(timeout 120 "$candidate" -c "$PROBE" 2>&1)"
    rc=$?
    set -e
    found="$(printf '%s\n' "$found" | tail -n 1)"
    if [[ $rc -eq 0 ]]; then
        PY="$candidate"
        echo "gpu_check: using $candidate: $found"
        break
    fi
    echo "gpu_check: not $candidate: ${found:-exit $rc}"
done
if [[ -z "$PY" ]]; then
    echo "gpu_check: FAILED TO START: no interpreter whose torch sees CUDA among: ${candidates[*]:-none}. Set PYTHON" \
        "to one, or for a CPU dry run: python benchmarks/gpu_check.py --tiny" >&2
    exit 2
fi

# The checks run on one device (with several visible, Trainer would wrap the model in DataParallel).
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES%%,*}"
export GPU_CHECK_PYTHON="$PY"

set +e
timeout --signal=TERM --kill-after=20 "$LIMIT" "$PY" benchmarks/gpu_check.py --device cuda --time_limit "$((LIMIT - 10))" "$@"
rc=$?
set -e
case $rc in
    0) echo "gpu_check: every check that ran PASSED (benchmarks/results/gpu_check.json says which ran)" ;;
    1) echo "gpu_check: some check FAILED (see the table above and benchmarks/results/gpu_check.json)" ;;
    124 | 137) echo "gpu_check: stopped at the ${LIMIT}s limit; the JSON holds what finished" ;;
    *) echo "gpu_check: gpu_check.py exited with status $rc" ;;
esac
exit "$rc"
