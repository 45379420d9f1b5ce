"""A checkpoint whose optimizer moments hold NaN (weights clean, manifest rewritten to match) is refused on load with
one line naming the file and the tensor, for every ZeRO stage; ``no_load_optim: true`` resumes from its weights; a
save of non-finite moments is refused with ``latest`` unchanged. Through ``deepy.py`` with
``keep_last_n_checkpoints: 1``: exit 1, one line, and the only good checkpoint survives untouched."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import yaml

from tests.distributed.fns_poison import poison_moments, poisoned_resume_per_stage
from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import PYTHON, free_port, run_command, run_distributed

pytestmark = pytest.mark.distributed

NAMED = r"optimizer state exp_avg_sq of (sequential\.\S+) holds 100 NaN/inf value\(s\) of \d+; "


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("poison") / "data")


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (the save folder's lock excluded: a run holds it while it runs)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".neox-run.lock"
    }


@pytest.mark.slow
def test_poisoned_moments_are_refused_for_every_zero_stage(data: dict[str, str], tmp_path: Path) -> None:
    """fp32 ZeRO 0-3 and bf16 ZeRO 0-1 (DeepSpeed's ZeRO-0 bf16 wrapper keeps per-parameter fp32 copies; bf16 ZeRO-1
    state reaches the engine through optimizer_carry, so its line names the checkpoint folder)."""
    stages = [(0, False), (1, False), (2, False), (3, False), (0, True), (1, True)]
    configs = [
        tiny_config(data, eval_interval=100, zero_optimization={"stage": stage}, keep_last_n_checkpoints=1)
        | ({"bf16": {"enabled": True}} if bf16 else {})
        for stage, bf16 in stages
    ]
    results = run_distributed(poisoned_resume_per_stage, 1, configs, str(tmp_path), timeout=600)[0]
    for stage, result in zip(stages, results):
        line = result["resume"]
        where = Path(result["file"]).parent if stage == (1, True) else result["file"]
        assert line.startswith(f"{where}: optimizer state exp_avg_sq of sequential.0.word_embeddings.weight "), line
        assert re.search(NAMED, line) and "no_load_optim: true" in line and "\n" not in line, (stage, line)
        assert result["left"] == ["global_step2", "latest"], (stage, result)  # nothing saved, nothing deleted
        assert result["way_out"] == 3, stage  # no_load_optim: the weights with a fresh optimizer state
        if "save" in result:  # an engine whose moments hold inf: no checkpoint, latest unchanged
            assert "not saving checkpoint global_step3: optimizer state exp_avg_sq of" in result["save"], result
            assert "the previous checkpoint and 'latest' are intact" in result["save"]
        assert result["latest"] == "global_step2" and "global_step3" not in result["after_save"], (stage, result)
    assert all("save" in r for r in results)  # every engine holds state after loading it


def test_poisoned_moments_through_deepy_keep_the_only_good_checkpoint(data: dict[str, str], tmp_path: Path) -> None:
    """The red team's case: ``exp_avg_sq`` poisoned, ``keep_last_n_checkpoints: 1``, load = save."""
    save = tmp_path / "ckpt"
    cfg = tiny_config(data, eval_interval=100, train_iters=2, checkpoint_factor=2, save=str(save))
    cfg["zero_optimization"] = {"stage": 1}
    run_distributed(run_pretrain, 1, cfg, timeout=300)
    poisoned = poison_moments(save / "global_step2")
    before = tree_hashes(save)
    run = {**cfg, "load": str(save), "train_iters": 4, "checkpoint_factor": 1, "keep_last_n_checkpoints": 1}
    run["use_checkpoint_lr_scheduler"] = True  # the schedule of the 2-step run continues
    run.update(master_port=free_port(), num_gpus=1)
    run.pop("global_num_gpus")
    config_file = tmp_path / "run.yml"
    config_file.write_text(yaml.safe_dump(run))
    result = run_command([PYTHON, "deepy.py", "train.py", str(config_file)], timeout=300, check=False)
    assert result.returncode == 1, result.describe()
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert errors and "Traceback" not in result.stderr, result.describe()
    assert errors[0].startswith(f"error: {poisoned}: optimizer state exp_avg_sq of sequential."), errors[0]
    assert re.search(NAMED, errors[0]) and "set no_load_optim: true" in errors[0], errors[0]
    assert tree_hashes(save) == before  # nothing trained, saved or deleted: the good weights are still there
