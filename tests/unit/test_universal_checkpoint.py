"""Universal checkpoints without ranks: the metadata a save writes for DeepSpeed's converter, the config wiring of
``load_universal``, and the one-line errors of ``tools/ckpts/convert_to_universal.py`` and of the load.

The conversion and the loads themselves run in tests/distributed/test_universal_checkpoint.py (DeepSpeed's
``ds_to_universal`` and engines on 2 ranks) and tests/e2e/test_universal_checkpoint_training.py (``train.py``'s path).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron.checkpoint import CheckpointConfig, CheckpointError, TargetLayout, cli, write_checkpoint
from megatron.checkpoint.universal import read_latest_universal, universal_info
from megatron.model import GPTModelConfig, build_sequential_model
from megatron.neox_arguments import LaunchEnv, NeoXArgs
from tests.harness import load_tool

TOOL = load_tool("tools/ckpts/convert_to_universal.py")
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32}


def _cfg() -> GPTModelConfig:
    return GPTModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        activation="swiglu",
        mlp_multiple_of=8,
        padded_vocab_size=128,
        max_position_embeddings=32,
        no_weight_tying=True,
    )


def test_every_parameter_gets_deepspeeds_merge_rule() -> None:
    cfg = _cfg()
    shapes = {n: tuple(p.shape) for n, p in build_sequential_model(cfg).named_parameters()}
    info = universal_info(shapes, cfg, tp=2)

    def matched(key: str) -> set[str]:
        return {n for n in shapes if any(re.match(p, n) for p in info[key])}

    assert info["original_vocab_size"] == 128 and info["universal_checkpoint_version"] == 0.4
    assert matched("vocabulary_parameter_patterns") == {
        "sequential.0.word_embeddings.weight",
        "sequential.6.final_linear.weight",
    }
    assert matched("parameter_with_row_parallelism_patterns") == {
        f"sequential.{i}.{m}.weight" for i in (2, 3) for m in ("attention.dense", "mlp.linear2")
    }
    gated = {f"sequential.{i}.mlp.linear1.{w}" for i in (2, 3) for w in ("weight", "bias")}
    assert matched("parameter_with_2_sub_params_cat_dim_0") == gated
    gqa = info["parameter_with_sub_params"]
    assert {p for entry in gqa for p in entry["patterns"]} == set(info["sub_param_shard_widths"])
    assert all(entry["shape"][0] == (64, 32, 32) and entry["partition_dim"] == 0 for entry in gqa)
    assert all(widths == [[32, 32], [16, 16], [16, 16]] for widths in info["sub_param_shard_widths"].values())
    replicated = matched("parameter_to_average_patterns")
    assert "sequential.2.input_layernorm.weight" in replicated and "sequential.2.attention.dense.bias" in replicated
    assert not info["pipeline_replicated_parameter_patterns"]
    # each pattern names exactly one parameter (DeepSpeed's strict converter fails on an unmatched one)
    patterns = [p for k, v in info.items() if k.endswith("patterns") for p in v]
    assert all(sum(bool(re.match(p, n)) for n in shapes) == 1 for p in patterns)


def test_load_universal_reaches_deepspeeds_checkpoint_block_and_needs_load() -> None:
    env = LaunchEnv(world_size=1, on_cpu=True)
    args = NeoXArgs({**TINY, "train_micro_batch_size_per_gpu": 2, "load_universal": True}, env=env)
    assert args.deepspeed_config["checkpoint"] == {"load_universal": True}
    both = {
        **TINY,
        "train_micro_batch_size_per_gpu": 2,
        "load_universal": True,
        "checkpoint": {"tag_validation": "Warn"},
    }
    assert NeoXArgs(both, env=env).deepspeed_config["checkpoint"] == {"tag_validation": "Warn", "load_universal": True}
    assert "checkpoint" not in NeoXArgs({**TINY, "train_micro_batch_size_per_gpu": 2}, env=env).deepspeed_config
    with pytest.raises(CheckpointError, match="load_universal is set but load is not"):
        CheckpointConfig(load_universal=True).validate()


def test_latest_universal_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="latest_universal does not exist; convert a checkpoint"):
        read_latest_universal(tmp_path)
    (tmp_path / "latest_universal").write_text("../elsewhere")
    with pytest.raises(CheckpointError, match="must name a folder inside"):
        read_latest_universal(tmp_path)
    (tmp_path / "latest_universal").write_text("global_step2_universal")
    (tmp_path / "global_step2_universal").mkdir()
    with pytest.raises(CheckpointError, match="is not a universal checkpoint"):
        read_latest_universal(tmp_path)
    (tmp_path / "global_step2_universal" / "zero").mkdir()
    assert read_latest_universal(tmp_path) == "global_step2_universal"


def _fail(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.run(lambda: TOOL.main(argv)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_converter_refuses_bad_inputs_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg()
    full = build_sequential_model(cfg).state_dict()
    assert "does not exist" in _fail(["--input_dir", str(tmp_path / "missing")], capsys)
    write_checkpoint(full, cfg, tmp_path / "old", TargetLayout(1, 0), iteration=2)  # no universal info
    assert "has no universal_checkpoint_info" in _fail(["--input_dir", str(tmp_path / "old")], capsys)
    info = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}
    write_checkpoint(full, cfg, tmp_path / "z0", TargetLayout(1, 0), iteration=2, client_state=info)
    assert "has no ZeRO optimizer shards" in _fail(["--input_dir", str(tmp_path / "z0")], capsys)
    (tmp_path / "z0" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (tmp_path / "z0" / "global_step2" / "manifest.json").unlink()  # (a GPT-NeoX-style folder: no manifest)
    (tmp_path / "z0" / "global_step2_universal").mkdir()
    assert "already exists (pass --overwrite" in _fail(["--input_dir", str(tmp_path / "z0")], capsys)
    inside = str(tmp_path / "z0" / "global_step2" / "u")
    assert "must not be the checkpoint" in _fail(["--input_dir", str(tmp_path / "z0"), "--output_dir", inside], capsys)
    assert "--workers must be >= 1" in _fail(["--input_dir", str(tmp_path / "z0"), "--workers", "0"], capsys)
    # an empty shard: DeepSpeed's own converter fails, reported in one line and nothing left behind
    out = tmp_path / "z0" / "u"
    err = _fail(["--input_dir", str(tmp_path / "z0"), "--output_dir", str(out)], capsys)
    assert "DeepSpeed's ds_to_universal failed on" in err and not out.exists()


def test_load_refuses_before_touching_the_engine(tmp_path: Path) -> None:
    """``load_checkpoint`` with ``load_universal``: ``iteration`` and a folder without ``latest_universal`` are
    one-line errors raised before the engine is used (here: there is none)."""
    from megatron.checkpoint import load_checkpoint

    picked = CheckpointConfig(load=str(tmp_path), load_universal=True, iteration=2)
    with pytest.raises(CheckpointError, match="iteration 2 cannot pick another"):
        load_checkpoint(None, None, picked, checkpoint_args={})  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="latest_universal does not exist"):
        load_checkpoint(None, None, CheckpointConfig(load=str(tmp_path), load_universal=True), checkpoint_args={})  # type: ignore[arg-type]
