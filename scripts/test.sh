#!/usr/bin/env bash
# The test suite: installs what is missing, lints, type-checks, then runs pytest.
#   bash scripts/test.sh [pytest args]         everything (what CI runs)
#   bash scripts/test.sh --fast [pytest args]  the fast tier: no test that starts ranks, launchers, clusters or other
#                                              processes (marker `launches`, set by tests/conftest.py) and no `slow` one
# pytest exit code 5 (no tests collected) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--fast" ]; then
    shift
    tier=(-m "not launches and not slow")
fi
bash scripts/bootstrap.sh || exit 1
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
.venv/bin/python -m mypy || exit 1  # files and settings: [tool.mypy] in pyproject.toml
.venv/bin/python -m pytest "${tier[@]}" "$@"
rc=$?
if [ "$rc" = "5" ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
