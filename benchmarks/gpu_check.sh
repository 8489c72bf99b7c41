#!/usr/bin/env bash
# The GPU check: layer-wise vs standard optimizers on CUDA, at most ~8 minutes in all on one H200.
#
#   bash benchmarks/gpu_check.sh                 # from anywhere; extra arguments go to gpu_check.py
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh --checks parity,fp16
#   GPU_CHECK_TIMEOUT=300 bash benchmarks/gpu_check.sh
#
# Interpreter: $PYTHON if set, else this checkout's .venv/bin/python (what scripts/setup.sh creates), else python,
# else python3. The preflight prints which one, its torch build (CPU or CUDA) and the devices it sees.
#
# Installing for CUDA. scripts/setup.sh pins torch==2.13.0 and installs it before anything else:
#   - on a GPU machine with plain PyPI, `bash scripts/setup.sh` resolves torch==2.13.0 to PyPI's Linux x86_64
#     wheel, which is the CUDA build (it pulls the nvidia-* runtime wheels, several GB); then run this script as is
#     (it finds .venv/bin/python). The preflight must say "CUDA build".
#   - on the machine the project is developed on, pip also finds torch-2.13.0+cpu on local disk (find-links), which
#     satisfies the same pin and wins: that .venv is a CPU build, and this script refuses it with exit 2, saying so.
#     Do not carry that .venv to a GPU machine.
#   - on a GPU machine without network, use its own CUDA torch: PYTHON=python3 bash benchmarks/gpu_check.sh, with
#     transformers, accelerate and bitsandbytes importable by it (bitsandbytes as a carried wheel, e.g. installed
#     with pip --target into a folder on PYTHONPATH). layerwise_hf itself is always used from this checkout.
#
# Checks (see benchmarks/gpu_check.py): parity of adamw_torch / adamw_8bit / sgd against their _layerwise forms
# (fp32, GA 1 and 2, exact clipping, bit-exact), fp16 with the CUDA GradScaler and an injected overflow step, an
# overflow in the stepping backward only (after fp16's measuring one), adamw_8bit_layerwise under FSDP2 (1 rank, and
# 2 when two GPUs are visible) against the same optimizer stepped by hand on the local shards, peak CUDA memory of a
# ~1.1B bf16 Llama with adamw_8bit vs adamw_8bit_layerwise next to the estimator's prediction and to
# `layerwise-hf plan`'s simulated peak (measured / planned printed per optimizer), and the step time of
# the same model with and without bitsandbytes' per-parameter device sync, and host offload (layerwise_offload
# "gradients" and "optimizer"): parity against adamw_torch on the small model, then max_memory_allocated and step time
# of the ~1B model with adamw_torch, adamw_torch_layerwise and it with each offload mode (one process for the four).
# Writes benchmarks/results/gpu_check.json (rewritten after every check) and prints a table.
#
# Installs nothing and downloads nothing (models are built from configs).
# Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA / missing package, 124 time limit reached.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
elif command -v python >/dev/null 2>&1; then
    PY=python
else
    PY=python3
fi
LIMIT="${GPU_CHECK_TIMEOUT:-455}" # seconds for the Python part; the preflight below takes a few more

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 # deterministic cuBLAS (with torch.use_deterministic_algorithms)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

echo "gpu_check: $(date -u +%FT%TZ) in $ROOT with $PY"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "gpu_check: nvidia-smi not found"

# The preflight (on stderr) sees every GPU visible to this script, as the FSDP2 check may use two; it prints the count.
set +e
preflight="$("$PY" - <<'EOF'
import sys
try:
    import torch
except Exception as e:
    print(f"gpu_check: cannot import torch: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
build = f"CUDA build (CUDA {torch.version.cuda})" if torch.version.cuda else "CPU build"
print(f"gpu_check: {sys.executable}: torch {torch.__version__}, {build}", file=sys.stderr)
try:
    import accelerate, bitsandbytes, transformers  # noqa: F401
    import layerwise_hf  # noqa: F401
except Exception as e:
    print(f"gpu_check: cannot import what the check needs: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
print(f"gpu_check: transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
      f"bitsandbytes {bitsandbytes.__version__}", file=sys.stderr)
if not torch.cuda.is_available():
    hint = ("this torch is a CPU build: install the CUDA build (see the header of benchmarks/gpu_check.sh) or set "
            "PYTHON to an interpreter that has it" if not torch.version.cuda else "no CUDA device or driver found")
    print(f"gpu_check: FAILED TO START: torch.cuda.is_available() is False (torch {torch.__version__}, {build}, "
          f"{sys.executable}): {hint}. For a CPU dry run use: python benchmarks/gpu_check.py --tiny", file=sys.stderr)
    sys.exit(2)
count = torch.cuda.device_count()
print(f"gpu_check: device 0 = {torch.cuda.get_device_name(0)} "
      f"({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB), {count} visible", file=sys.stderr)
print(f"GPU_CHECK_DEVICE_COUNT={count}")
EOF
)"
rc=$?
set -e
[[ "$preflight" == GPU_CHECK_DEVICE_COUNT=* ]] || printf '%s\n' "$preflight" | grep -v '^GPU_CHECK_DEVICE_COUNT=' || true
if [[ $rc -ne 0 || "$preflight" != *GPU_CHECK_DEVICE_COUNT=* ]]; then
    exit 2
fi
export GPU_CHECK_DEVICE_COUNT="${preflight##*GPU_CHECK_DEVICE_COUNT=}"
# The checks run on one device (Trainer would wrap several in DataParallel); the FSDP2 launches get back what was
# visible here.
export GPU_CHECK_CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-all}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES%%,*}"

set +e
timeout --signal=TERM --kill-after=20 "$LIMIT" "$PY" benchmarks/gpu_check.py --device cuda --time_limit "$((LIMIT - 10))" "$@"
rc=$?
set -e
case $rc in
    0) echo "gpu_check: all checks PASSED (benchmarks/results/gpu_check.json)" ;;
    1) echo "gpu_check: some check FAILED (see the table above and benchmarks/results/gpu_check.json)" ;;
    124 | 137) echo "gpu_check: stopped at the ${LIMIT}s limit; the JSON holds what finished" ;;
    *) echo "gpu_check: gpu_check.py exited with status $rc" ;;
esac
exit "$rc"
