#!/usr/bin/env bash
# The GPU check: layer-wise vs standard optimizers on ONE CUDA device, at most ~8 minutes in all.
#
#   bash benchmarks/gpu_check.sh                 # from anywhere; extra arguments go to gpu_check.py
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh --checks parity,fp16
#   GPU_CHECK_TIMEOUT=300 bash benchmarks/gpu_check.sh
#
# Checks (see benchmarks/gpu_check.py): parity of adamw_torch / adamw_8bit / sgd against their _layerwise forms
# (fp32, GA 1 and 2, exact clipping), fp16 with the CUDA GradScaler and an injected overflow step, and peak CUDA
# memory of a ~1.1B bf16 Llama with adamw_8bit vs adamw_8bit_layerwise next to the estimator's prediction.
# Writes benchmarks/results/gpu_check.json (rewritten after every check) and prints a table.
#
# Needs: a CUDA GPU, and torch (CUDA build), transformers, accelerate, bitsandbytes importable by $PYTHON. Installs
# nothing and downloads nothing (models are built from configs); layerwise_hf is used from this checkout.
# Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA / missing package, 124 time limit reached.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif command -v python >/dev/null 2>&1; then
    PY=python
else
    PY=python3
fi
LIMIT="${GPU_CHECK_TIMEOUT:-450}" # seconds for the Python part; the preflight below takes a few more

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 # deterministic cuBLAS (with torch.use_deterministic_algorithms)
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" # one device: Trainer would wrap several in DataParallel
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

echo "gpu_check: $(date -u +%FT%TZ) in $ROOT with $PY"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "gpu_check: nvidia-smi not found"

if ! "$PY" - <<'EOF'; then
import sys
try:
    import accelerate, bitsandbytes, torch, transformers  # noqa: F401
    import layerwise_hf  # noqa: F401
except Exception as e:
    print(f"gpu_check: cannot import what the check needs: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, bitsandbytes {bitsandbytes.__version__}")
if not torch.cuda.is_available():
    print("gpu_check: FAILED TO START: torch.cuda.is_available() is False "
          f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). This check needs a CUDA GPU; "
          "for a CPU dry run use: python benchmarks/gpu_check.py --tiny", file=sys.stderr)
    sys.exit(2)
print(f"gpu_check: device 0 = {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible")
EOF
    exit 2
fi

set +e
timeout --signal=TERM --kill-after=20 "$LIMIT" "$PY" benchmarks/gpu_check.py --device cuda "$@"
rc=$?
set -e
case $rc in
    0) echo "gpu_check: all checks PASSED (benchmarks/results/gpu_check.json)" ;;
    1) echo "gpu_check: some check FAILED (see the table above and benchmarks/results/gpu_check.json)" ;;
    124 | 137) echo "gpu_check: stopped at the ${LIMIT}s limit; the JSON holds what finished" ;;
    *) echo "gpu_check: gpu_check.py exited with status $rc" ;;
esac
exit "$rc"
