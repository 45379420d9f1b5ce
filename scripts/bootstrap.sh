#!/usr/bin/env bash
# Creates (or reuses) .venv at the repository root and installs everything neox-forge needs.
# Idempotent: a stamp keyed on the requirement files skips the installs when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[bootstrap] creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
stamp_key=$(cat requirements/*.txt setup.py | sha256sum | cut -c1-16)
stamp=".venv/.neox-forge-installed-$stamp_key"
if [ -f "$stamp" ]; then
    exit 0
fi
export DS_BUILD_OPS=0 DS_ACCELERATOR=cpu PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from its pin: any other order lets pip resolve a multi-GB CUDA build for deepspeed.
torch_pin=$(grep -E '^torch==' requirements/requirements.txt)
echo "[bootstrap] installing $torch_pin"
.venv/bin/pip install -q "$torch_pin"
echo "[bootstrap] installing requirements (runtime, eval, dev) and the megatron package"
.venv/bin/pip install -q -r requirements/requirements-dev.txt
.venv/bin/pip install -q --no-deps -e .
n_torch=$(.venv/bin/pip list 2>/dev/null | grep -c -E '^torch ' || true)
if [ "$n_torch" != "1" ] || ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')"; then
    echo "[bootstrap] error: expected exactly one torch 2.13.0 in .venv" >&2
    exit 1
fi
rm -f .venv/.neox-forge-installed-*
touch "$stamp"
echo "[bootstrap] done"
