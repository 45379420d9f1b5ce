"""The model YAML written next to a converted checkpoint (``hf_io.neox_config_yaml``) loads back into the same model
config: ``MODEL_KEYS`` is derived from ``GPTModelConfig``'s fields, so no architecture key can be left out."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron.checkpoint.hf_io import MODEL_KEYS, RUN_KEYS, neox_config_yaml
from megatron.config_utils import not_neox_keys
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.derive import LaunchEnv

_BASE = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "padded_vocab_size": 128}
CASES = {
    "llama-local": {
        **_BASE,
        "max_position_embeddings": 64,
        "seq_length": 64,  # the local layers' layouts are made at seq_length
        "pos_emb": "rotary",
        "rotary_emb_base": 500000,
        "norm": "rmsnorm",
        "activation": "swiglu",
        "use_bias_in_attn_linear": False,
        "sliding_window_width": 7,
        "attention_config": [[["global"], 1], [["local"], 2], [["global"], 1]],
        "use_qk_layernorm": True,
    },
    "gqa": {**_BASE, "max_position_embeddings": 64, "pos_emb": "rotary", "num_kv_heads": 2, "norm": "rmsnorm"},
    "neox-moe": {
        **_BASE,
        "max_position_embeddings": 32,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_expert_interval": 2,
    },
}


def test_model_keys_are_the_model_configs_fields() -> None:
    fields = {f.name for f in dataclasses.fields(GPTModelConfig)}
    assert set(MODEL_KEYS) | RUN_KEYS | set(not_neox_keys(GPTModelConfig)) == fields
    assert fields >= RUN_KEYS and not set(MODEL_KEYS) & RUN_KEYS


@pytest.mark.parametrize("name", CASES)
def test_the_yaml_loads_back_into_the_same_model(name: str) -> None:
    cfg = GPTModelConfig(**CASES[name])
    for tp in (1, 2):
        values = yaml.safe_load(neox_config_yaml(cfg, tp, 0))
        # seq_length: the local layers' default window (4 blocks of 16) must fit, as in GPT-NeoX
        setup = {
            "seq_length": cfg.max_position_embeddings,
            "train_micro_batch_size_per_gpu": 1,
            "train_iters": 1,
            "global_num_gpus": tp,
        }
        args = NeoXArgs({**values, **setup}, env=LaunchEnv(world_size=None, on_cpu=True))
        args.update_value("padded_vocab_size", cfg.padded_vocab_size)
        back = GPTModelConfig.from_neox_args(args)
        differ = {k: (getattr(cfg, k), getattr(back, k)) for k in MODEL_KEYS if getattr(cfg, k) != getattr(back, k)}
        assert not differ, differ
        assert back.layer_types == cfg.layer_types
