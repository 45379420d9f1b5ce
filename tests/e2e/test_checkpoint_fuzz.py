"""Fuzz the checkpoint reader with random damage to a real checkpoint (written by a 1-rank ZeRO-1 run): every read
succeeds or raises the project's one-line error, none hangs, none changes a file (``tests/distributed/fns_ckpt_fuzz``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.fns_ckpt_fuzz import fuzz_reader, read_like_a_resume
from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

SEED = 36
CASES = 150


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    data = make_tiny_data(root / "data")
    save = root / "ckpt"
    cfg = tiny_config(data, train_iters=2, checkpoint_factor=1, eval_interval=100, save=str(save))
    cfg["zero_optimization"] = {"stage": 1}
    run_distributed(run_pretrain, 1, cfg, timeout=300)
    for extra in ("zero_to_fp32.py", "zero_to_torch.py", ".neox-run.lock"):
        (save / extra).unlink(missing_ok=True)  # DeepSpeed's scripts: not read by a load
    assert read_like_a_resume(save) == "loaded global_step2"
    return save


def test_reader_fuzz_one_line_error_or_success(pristine: Path, tmp_path: Path) -> None:
    result = run_distributed(fuzz_reader, 1, str(pristine), str(tmp_path), SEED, CASES, timeout=240)[0]
    summary = [v.splitlines()[0][:300] for v in result["violations"]]
    assert not result["violations"], "\n".join(summary) + "\n\n" + "\n\n".join(result["violations"][:3])
    outcomes = result["outcomes"]
    assert sum(outcomes.values()) == CASES and outcomes.get("error", 0) > CASES // 4, outcomes
    assert outcomes.get("loaded", 0) > 0, outcomes  # damage a read tolerates (an older checkpoint, unused files)
