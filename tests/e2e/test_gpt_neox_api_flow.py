"""GPT-NeoX's scripting flow, as its own tests drive it (tests/common.py: ``simulate_deepy_env``,
``save_random_model``), through our package on one CPU rank: ``get_deepspeed_main_args()`` →
``train.main(input_args, overwrite_values)`` with ``train_iters: 0`` + ``extra_save_iters: [0]`` (the initial model
is saved) → ``generate.main`` → finetune → ``setup_model_and_optimizer`` / ``save_checkpoint`` / ``load_checkpoint``
/ ``generate_samples_from_prompt`` → ``convert_neox_to_hf.main(input_args, overwrite_values)``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.fns_gpt_neox_api import gpt_neox_flow
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import load_tool, run_distributed
from tests.s3_server import make_bucket, moto_s3, s3_env


def test_gpt_neox_scripting_flow_on_one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(make_tiny_data(tmp_path / "data"), world=1)
    with moto_s3() as endpoint:  # the API's save_checkpoint with s3_path uploads before it returns
        make_bucket(endpoint, "neox-api")
        for key, value in s3_env(endpoint, tmp_path).items():
            monkeypatch.setenv(key, value)
        (out,) = run_distributed(gpt_neox_flow, 1, cfg, str(tmp_path), "s3://neox-api/ckpts", timeout=600)
    assert out["main_args_tail"] == ["--deepspeed_config", "--megatron_config"]
    assert out["train_code"] == 0
    assert out["saved"] == ["global_step0", "latest"]  # train_iters 0: only the initial model
    assert out["generate_code"] == 0 and [r["context"] for r in out["generated"]] == ["hello", "world"]
    assert all(r["length"] <= 4 for r in out["generated"])
    assert out["finetune_code"] == 0 and out["finetuned"] == "global_step2"
    assert out["loaded_iteration"] == 0 and out["is_mp_rank_0"] is True and out["engine_holds_the_lr_schedule"]
    assert len(out["api_generated"]) == 1
    assert out["latest_after_save"] == "global_step5" and out["load_iteration"] == 0
    manifest = json.loads((tmp_path / "random" / "global_step5" / "manifest.json").read_text())
    uploaded = {f"ckpts/random/global_step5/{name}" for name in [*manifest["files"], "manifest.json"]}
    assert out["s3_after_save"] == sorted({*uploaded, "ckpts/random/latest"})

    convert = load_tool("tools/ckpts/convert_neox_to_hf.py")
    hf = tmp_path / "hf"
    argv = ["--config_file", str(tmp_path / "tiny.yml"), "--input_dir", str(tmp_path / "random" / "global_step0")]
    assert convert.main(input_args=[*argv, "--output_dir", str(hf)], overwrite_values={"seq_length": 32}) == 0
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
