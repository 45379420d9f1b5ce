"""gMLP / aMLP through the configuration, the planner and deepy: accepted (no longer "not supported yet"), the
combinations GPT-NeoX refuses or the block cannot do refused with the key named, the planner's parameter counts
per TP rank, and ``--dry-run`` of GPT-NeoX's ``gmlp_small.yml``."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest

import deepy
from megatron.checkpoint.rules import merge_tensor, split_tensor
from megatron.model import GPTModelConfig
from megatron.model.tp_sharding import check_reshardable, merge_state_dicts
from megatron.neox_arguments import ConfigError, LaunchEnv, NeoXArgs
from megatron.neox_arguments.unsupported import UNSUPPORTED_KEYS, UNSUPPORTED_VALUES
from megatron.planner.params import count_params
from tests.shared_files import SHARED

REF = SHARED / "reference" / "gpt-neox-configs"
REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 16,
    "max_position_embeddings": 16,
    "attention_config": [[["amlp", "global"], 1]],
    "gmlp_attn_dim": 8,
    "train_micro_batch_size_per_gpu": 1,
}


def args(world: int = 1, **more: Any) -> NeoXArgs:
    return NeoXArgs({**BASE, **more}, env=LaunchEnv(world_size=world, on_cpu=True))


def test_gmlp_is_no_longer_refused() -> None:
    assert "gmlp_attn_dim" not in UNSUPPORTED_KEYS
    assert not {"gmlp", "amlp"} & set(UNSUPPORTED_VALUES["attention_config"])
    a = args()
    assert a.attention_config == ["amlp", "global"] and a.gmlp_attn_dim == 8
    a.update_value("padded_vocab_size", 64)
    cfg = GPTModelConfig.from_neox_args(a)
    assert cfg.layer_types == ("amlp", "global") and cfg.gmlp_attn_dim == 8 and cfg.seq_length == 16


@pytest.mark.parametrize(
    ("more", "world", "match"),
    [
        ({"partition_activations": True, "checkpoint_activations": True}, 1, "partition_activations=True"),
        ({"sequence_parallel": True, "model_parallel_size": 2}, 2, "sequence_parallel=True"),
        ({"moe_num_experts": 2}, 1, "not supported yet: moe_num_experts=2"),
        ({"gmlp_attn_dim": 0}, 1, "gmlp_attn_dim"),
    ],
)
def test_what_gmlp_cannot_combine_with_is_refused(more: dict, world: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        args(world, **more)


def test_a_model_config_without_seq_length_refuses_gmlp() -> None:
    common = dict(num_layers=1, hidden_size=8, num_attention_heads=2, padded_vocab_size=16, max_position_embeddings=8)
    with pytest.raises(ValueError, match="gmlp/amlp layers need seq_length"):
        GPTModelConfig(**common, attention_config=["gmlp"])


def _model(types: list[str]) -> GPTModelConfig:
    return GPTModelConfig(
        num_layers=len(types),
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=64,
        max_position_embeddings=16,
        seq_length=16,
        gmlp_attn_dim=8,
        attention_config=types,
    )


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["gmlp", "amlp"])
def test_planner_counts_a_gmlp_layer_per_tp_rank(kind: str, tp: int) -> None:
    """A gMLP layer's share of a TP rank (the model with it minus the model without it): GPT-NeoX's per-rank
    shapes, h=32, ff=128, seq 16, attention 8."""
    h, ff, s, a = 32, 128, 16, 8
    share = 2 * h + (2 * ff * h + 2 * ff) // tp + 2 * ff // tp + s * s + s + h * ff // tp + h
    if kind == "amlp":
        share += 3 * a * 2 * ff // tp + 3 * a + (ff * a + ff) // tp
    with_it = count_params(_model([kind, "global"]), tp, 0)
    without = count_params(_model(["global"]), tp, 0)
    assert with_it.stages[0].total - without.stages[0].total == share
    if tp == 1:
        assert with_it.total - without.total == share


def test_gmlp_checkpoints_are_not_resharded() -> None:
    check_reshardable("sequential.2.sgu.proj.weight", 1)
    check_reshardable("sequential.3.attention.dense.weight", 2)
    with pytest.raises(ValueError, match="cannot change tensor parallel size"):
        check_reshardable("sequential.2.input_linear.weight", 2)
    shard = {"sequential.2.sgu.proj.weight": _zeros(4, 4)}
    with pytest.raises(ValueError, match=r"sgu\.proj\.weight: gmlp/amlp layers cannot change tensor parallel size"):
        merge_state_dicts([shard, shard], _model(["gmlp"]))
    with pytest.raises(ValueError, match="cannot change tensor parallel size"):  # the checkpoint tools' rule
        split_tensor("sequential.2.sgu.proj.weight", _zeros(16, 16), _model(["gmlp"]), 2)
    assert merge_tensor("sequential.2.sgu.proj.weight", [_zeros(16, 16)], _model(["gmlp"])).shape == (16, 16)


def _zeros(*shape: int) -> Any:
    import torch

    return torch.zeros(*shape)


@pytest.mark.skipif(not (REF / "gmlp_small.yml").is_file(), reason="needs shared/reference/gpt-neox-configs")
def test_gmlp_small_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``deepy.py train.py gmlp_small.yml local_setup.yml --dry-run`` (and ``--plan``, which says what of its
    estimate is exact for gMLP layers) with only the eps typo corrected."""
    config = tmp_path / "gmlp_small.yml"
    config.write_text((REF / "gmlp_small.yml").read_text().replace("1.0e_8", "1.0e-8"))
    monkeypatch.chdir(tmp_path)  # local_setup's relative log_dir
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = deepy.main([str(REPO / "train.py"), str(config), str(REF / "local_setup.yml"), "--dry-run"])
    assert rc == 0, err.getvalue()
    text = out.getvalue()
    assert "attention_config ............................ ['gmlp'," in text and "gmlp_attn_dim" in text
    assert "launch command" in text

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = deepy.main([str(REPO / "train.py"), str(config), str(REF / "local_setup.yml"), "--plan"])
    assert rc == 0, err.getvalue()
    text = err.getvalue() + out.getvalue()
    assert "warning: 12 gmlp/amlp layers: parameters, activation memory and the step time's FLOPs counted" in text
    assert "activations/layer 4·(b·s·(p·h + p·f + 6·f)" in text
    assert "compute FLOPs " in text and "gMLP 24·s·h² + 8·h·s²" in text  # the step time's real count
    # 12 gMLP layers (h 768, ff 3072, sgu.proj 2048 x 2048), untied embedding and head (50304 rows), final norm
    h, ff, s, v = 768, 3072, 2048, 50304
    layer = 2 * h + (2 * ff * h + 2 * ff) + 2 * ff + (s * s + s) + (h * ff + h)
    assert f"parameters          {12 * layer + 2 * v * h + 2 * h:,} " in text


def test_incremental_decoding_and_hugging_face_export_are_refused() -> None:
    """gMLP mixes the whole sequence (no KV cache); Hugging Face has no gMLP model."""
    import torch

    from megatron.model import build_sequential_model
    from megatron.model.hf_mapping import neox_to_hf_config
    from megatron.model.inference_stage import InferenceStage
    from megatron.model.kv_cache import KVCache

    cfg = _model(["amlp", "global"])
    model = build_sequential_model(cfg)
    with pytest.raises(ValueError, match=r"kv_cache.*not supported with gmlp/amlp layers"):
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=KVCache())
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 64)
    stage = InferenceStage(cfg)  # generation's pipeline-stage model
    with pytest.raises(ValueError, match=r"kv_cache.*not supported with gmlp/amlp layers"):
        stage(torch.zeros(1, 4, dtype=torch.long), kv_cache=KVCache())
    with pytest.raises(ValueError, match="attention_config 'amlp' layers"):
        neox_to_hf_config(cfg.replace(pos_emb="rotary"))
