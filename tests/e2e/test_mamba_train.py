"""GPT-NeoX's mamba-130M.yml, shrunk (tests/e2e/shrink.py), trains, saves and resumes exactly; a mixed Mamba +
attention model trains on 2 tensor-parallel ranks, and the Mamba model on 2 pipeline stages, each with the losses of
one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.distributed.fns_train import make_tiny_data, run_pretrain, run_pretrain_many
from tests.e2e.shrink import load_raw, shrink
from tests.harness import run_distributed
from tests.shared_files import SHARED

pytestmark = pytest.mark.distributed

REAL = SHARED / "reference" / "gpt-neox-configs"
FP16 = {"NEOX_FORGE_ALLOW_CPU_FP16": "1"}
# the shrunk config in fp32 without checkpointing or the fused-kernel key: the runs compared with one process
FP32_PLAIN = dict(
    fp16={"enabled": False},
    precision="fp32",
    checkpoint_activations=False,
    partition_activations=False,
    mamba_inner_func_fusion=False,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


def _mamba_130m(data: dict[str, str], out: Path, **overrides: object) -> dict:
    if not (REAL / "mamba" / "mamba-130M.yml").exists():
        pytest.skip("GPT-NeoX reference configs not present")
    raw = {**load_raw([REAL / "mamba" / "mamba-130M.yml"]), "tokenizer_type": "HFTokenizer"}
    files = {"data_path": data["data_path"], "hf_tokenizer": data["vocab_file"], "spm_model": "", "gpt2_vocab": ""}
    cfg, world = shrink(raw, files, out)
    assert world == 1 and cfg["attention_config"] == [[["mamba"], 1], [["mamba"], 1]]
    assert cfg["fp16"]["enabled"] and cfg["checkpoint_activations"] and cfg["mamba_inner_func_fusion"]
    return {**cfg, **overrides}


def test_shrunk_mamba_130m_trains_saves_and_resumes(data: dict[str, str], tmp_path: Path) -> None:
    common = {"train_iters": 4, "checkpoint_factor": 2, "keep_last_n_checkpoints": 4, "eval_interval": 4}
    full = run_distributed(run_pretrain, 1, _mamba_130m(data, tmp_path, save=str(tmp_path / "a"), **common), FP16)[0]
    losses = full["train_losses"]
    assert full["saved"] == [2, 4] and len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert full["skipped_iters"] < 4 and full["params_dtype"] == "float16"
    state = torch.load(tmp_path / "a" / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    mixer = {k.removeprefix("sequential.2.") for k in state["module"] if k.startswith("sequential.2.")}
    assert {"norm.scale", "mixer.A_log", "mixer.D", "mixer.in_proj.weight", "mixer.conv1d.bias"} <= mixer

    resumed = run_distributed(
        run_pretrain,
        1,
        _mamba_130m(data, tmp_path, load=str(tmp_path / "a"), iteration=2, save=str(tmp_path / "b"), **common),
        FP16,
    )[0]
    assert resumed["start_iteration"] == 2 and resumed["iteration"] == 4
    assert resumed["train_losses"] == losses[2:]  # bit-exact continuation


def test_mixed_mamba_attention_on_two_tensor_parallel_ranks(data: dict[str, str], tmp_path: Path) -> None:
    """``attention_config`` [mamba, global], TP=2 and a 1-stage pipeline engine, fp32: the loss falls, as in the
    single-process run of the same model and batches."""
    mixed = dict(attention_config=[[["mamba", "global"], 1]], pipe_parallel_size=1, train_iters=6, **FP32_PLAIN)
    cfg = _mamba_130m(data, tmp_path / "tp2", model_parallel_size=2, global_num_gpus=2, **mixed)
    out = run_distributed(run_pretrain_many, 2, [cfg], {})
    losses = out[0][0]["train_losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] and out[1][0]["train_losses"] == losses
    ref = _mamba_130m(data, tmp_path / "one", model_parallel_size=1, global_num_gpus=1, **mixed)
    assert losses == pytest.approx(run_distributed(run_pretrain_many, 1, [ref], {})[0][0]["train_losses"], rel=1e-4)


def test_mamba_on_two_pipeline_stages_equals_one_process(data: dict[str, str], tmp_path: Path) -> None:
    """The shrunk mamba-130M (2 Mamba layers), fp32, over 2 pipeline stages (one layer each, the partition method
    matching its layers) trains with the losses of one process running the same 2 micro-batches per step."""
    fp32 = dict(
        **FP32_PLAIN,
        train_iters=4,
        gradient_accumulation_steps=2,
        train_batch_size=4,
        pipe_partition_method="type:transformerlayer|mlp|mamba",
    )
    cfg = _mamba_130m(data, tmp_path / "pp2", pipe_parallel_size=2, global_num_gpus=2, **fp32)
    out = run_distributed(run_pretrain_many, 2, [cfg], {})
    losses = out[0][0]["train_losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    ref = _mamba_130m(data, tmp_path / "one", pipe_parallel_size=1, global_num_gpus=1, **fp32)
    assert losses == pytest.approx(run_distributed(run_pretrain_many, 1, [ref], {})[0][0]["train_losses"], rel=1e-4)
