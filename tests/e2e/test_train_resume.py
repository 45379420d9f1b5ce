"""Resume: a run restarted from its step-N/2 checkpoint continues with exactly the uninterrupted losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


def test_resume_equals_uninterrupted_run(data: dict[str, str], tmp_path: Path) -> None:
    common = {
        "hidden_dropout": 0.1,  # dropout makes the RNG state part of what must be restored
        "zero_optimization": {"stage": 1},
        "train_iters": 8,
        "checkpoint_factor": 4,
        "keep_last_n_checkpoints": 5,
        "checkpoint_validation_with_forward_pass": True,  # logits stored at save, compared after load
    }
    full = run_distributed(run_pretrain, 2, tiny_config(data, world=2, save=str(tmp_path / "a"), **common), timeout=300)
    assert full[0]["saved"] == [4, 8] and full[0]["dp"] == 2
    losses = full[0]["train_losses"]
    assert len(losses) == 8 and losses == full[1]["train_losses"]  # rank-reduced loss is the same everywhere

    step4 = tmp_path / "a" / "global_step4"
    names = {p.name for p in step4.iterdir()}
    assert {"mp_rank_00_model_states.pt", "configs", "manifest.json"} <= names
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names
    assert (tmp_path / "a" / "latest").read_text().strip() == "global_step8"
    state = torch.load(step4 / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert state["iteration"] == 4 and state["args"]["hidden_size"] == 64
    assert state["lr_scheduler"]["num_iters"] == 4 and "torch_rng_state" in state
    assert state["checkpoint_validation_logits"].shape == (1, 32, 512)
    assert any(k.startswith("sequential.") for k in state["module"])
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert manifest["iteration"] == 4 and "mp_rank_00_model_states.pt" in manifest["files"]

    resumed = run_distributed(
        run_pretrain,
        2,
        tiny_config(data, world=2, load=str(tmp_path / "a"), iteration=4, save=str(tmp_path / "b"), **common),
        timeout=300,
    )
    assert resumed[0]["start_iteration"] == 4 and resumed[0]["iteration"] == 8
    assert resumed[0]["train_losses"] == losses[4:]  # bit-exact continuation (fp32, CPU)
    assert resumed[0]["valid"] == full[0]["valid"] and resumed[0]["test"] == full[0]["test"]


def test_finetune_and_fresh_start(data: dict[str, str], tmp_path: Path) -> None:
    first = run_distributed(
        run_pretrain, 1, tiny_config(data, train_iters=4, save=str(tmp_path / "a"), checkpoint_factor=4), timeout=300
    )[0]
    assert first["saved"] == [4]
    # finetune: weights only, iteration restarts at 0 and the LR schedule starts from warmup again.
    tuned = run_distributed(
        run_pretrain, 1, tiny_config(data, train_iters=4, load=str(tmp_path / "a"), finetune=True), timeout=300
    )[0]
    assert tuned["start_iteration"] == 0 and tuned["iteration"] == 4
    assert tuned["train_losses"][0] < first["train_losses"][0] - 0.1  # starts from the trained weights
    # load equal to save (or load: auto) with nothing there yet is a fresh start (auto-resume), not an error
    auto = {"save": str(tmp_path / "empty"), "checkpoint_factor": 100}
    fresh = run_distributed(run_pretrain, 1, tiny_config(data, train_iters=2, load="auto", **auto), timeout=300)[0]
    assert fresh["start_iteration"] == 0 and fresh["train_losses"][0] == first["train_losses"][0]
    # any other missing load folder is a typo: an error naming it
    with pytest.raises(DistributedTestError, match=f"load directory {tmp_path / 'typo'} does not exist"):
        run_distributed(run_pretrain, 1, tiny_config(data, train_iters=2, load=str(tmp_path / "typo")), timeout=300)


def test_checkpoint_validation_detects_a_changed_checkpoint(data: dict[str, str], tmp_path: Path) -> None:
    flag = {"checkpoint_validation_with_forward_pass": True, "train_iters": 2, "checkpoint_factor": 2}
    run_distributed(run_pretrain, 1, tiny_config(data, save=str(tmp_path / "a"), **flag), timeout=300)
    path = tmp_path / "a" / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["checkpoint_validation_logits"] += 1.0  # as if the weights no longer matched what was saved
    torch.save(state, path)
    with pytest.raises(DistributedTestError, match="does not reproduce the logits"):
        run_distributed(run_pretrain, 1, tiny_config(data, load=str(tmp_path / "a"), **flag), timeout=300)
