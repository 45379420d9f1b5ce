#!/usr/bin/env bash
# Create a peer framework's virtualenv: bash benchmarks/peers/setup.sh <peer-venv>   (e.g. litgpt)
#
# benchmarks/peers/.venv-<peer-venv> (gitignored), never the project's .venv. torch==2.13.0 goes in FIRST (pip takes
# the CPU build from this machine's disk), then requirements-<peer-venv>.txt, which is also the constraint file, so
# nothing a framework asks for can replace that torch. Not part of the project's requirements.
set -euo pipefail
peer="${1:?usage: bash benchmarks/peers/setup.sh <peer-venv>   (one of: $(cd "$(dirname "$0")" && ls requirements-*.txt | sed 's/requirements-//;s/\.txt//' | tr '\n' ' '))}"
here="$(cd "$(dirname "$0")" && pwd)"
req="$here/requirements-$peer.txt"
[[ -f "$req" ]] || { echo "no $req: unknown peer venv '$peer'" >&2; exit 2; }
venv="$here/.venv-$peer"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
torch_pin="$(grep -E '^torch==' "$req")"
"$venv/bin/pip" install -q "$torch_pin"
"$venv/bin/pip" install -q -c "$req" -r "$req"
"$venv/bin/python" - "$torch_pin" <<'PY'
import sys, torch
want = sys.argv[1].split("==")[1]
assert torch.__version__.split("+")[0] == want, f"torch {torch.__version__} replaced the pinned {want}"
print(f"peer venv ready: torch {torch.__version__}")
PY
