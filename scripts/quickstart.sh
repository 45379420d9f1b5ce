#!/usr/bin/env bash
# The quick start: installs what is missing, then runs the main job on this machine's CPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# Training is not wired up yet: check the installed stack and report what exists.
.venv/bin/python -c "import deepspeed, torch, megatron; print(f'neox-forge {megatron.__version__}: torch {torch.__version__}, deepspeed {deepspeed.__version__}; training entry point not built yet')"
