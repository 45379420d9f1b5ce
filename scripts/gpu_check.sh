#!/usr/bin/env bash
# One-command GPU check (docs/benchmarks.md): CUDA logits == CPU logits (fp32), SDPA/flash attention == the
# reference path, a 1.3B-parameter bf16 training run of 30 steps (tokens/s, MFU against the GPU's peak), and a
# greedy generation, bitsandbytes' 8-bit Adam on the device and Transformer Engine's te.Linear (where installed).
# Prints one summary table; exits non-zero on any failure. Without CUDA the CUDA-only parts are
# skipped and their CPU halves run on tiny shapes (so the script itself stays tested).
#
#   bash scripts/gpu_check.sh [--steps 30] [--tiny]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/gpu_check.py "$@"
