"""NeoXArgs: key set and defaults, loading/merging, derive(), validate(), the unsupported table, round trips."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from megatron.neox_arguments import KNOWN_KEYS, ConfigError, LaunchEnv, NeoXArgs, default_values, padded_vocab_size
from megatron.neox_arguments.derive import derive, expand_attention_config

TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "train_micro_batch_size_per_gpu": 2,
}
CPU1 = LaunchEnv(world_size=None, on_cpu=True)


def build(**overrides) -> NeoXArgs:
    """NeoXArgs from TINY + overrides on a 1-rank CPU environment."""
    return NeoXArgs({**TINY, **overrides}, env=CPU1)


def problems(**overrides) -> list[str]:
    with pytest.raises(ConfigError) as e:
        build(**overrides)
    return e.value.problems


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ---------------------------------------------------------------- key set


GPT_NEOX_DEFAULTS = {
    "pipe_parallel_size": 0,
    "model_parallel_size": 1,
    "norm": "layernorm",
    "layernorm_epsilon": 1.0e-5,
    "rms_norm_epsilon": 1.0e-8,
    "pos_emb": "learned",
    "rotary_pct": 1.0,
    "rotary_emb_base": 10000,
    "make_vocab_size_divisible_by": 128,
    "activation": "gelu",
    "init_method": "normal",
    "output_layer_init_method": "scaled_normal",
    "init_method_std": 0.02,
    "output_layer_parallelism": "column",
    "use_bias_in_norms": True,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "weight_decay": 0.1,
    "min_lr": 0.0,
    "lr_decay_style": "linear",
    "warmup": 0.01,
    "eval_interval": 1000,
    "eval_iters": 100,
    "split": "969, 30, 1",
    "data_impl": "infer",
    "pack_impl": "packed",
    "dataset_impl": "gpt2",
    "train_impl": "normal",
    "num_workers": 2,
    "seed": 1234,
    "checkpoint_scale": "linear",
    "checkpoint_num_layers": 1,
    "s3_chunk_size": 104857600,
    "tokenizer_type": "GPT2BPETokenizer",
    "log_interval": 100,
    "wandb_project": "neox",
    "wandb_host": "https://api.wandb.ai",
    "temperature": 0.0,
    "maximum_tokens": 64,
    "prompt_end": "\n",
    "sample_output_file": "samples.txt",
    "moe_num_experts": 1,
    "moe_router_type": "sinkhorn",
    "num_nodes": -1,
    "master_port": 29500,
    "launcher": "pdsh",
    "distributed_backend": "nccl",
    "hysteresis": 2,
    "loss_scale_window": 1000.0,
    "dpo_beta": 0.1,
    "allow_chopped": True,
    "use_shared_fs": True,
}


def test_key_set_covers_gpt_neox_with_its_defaults():
    assert len(KNOWN_KEYS) >= 318
    defaults = default_values()
    for key, value in GPT_NEOX_DEFAULTS.items():
        assert defaults[key] == value, key
    # The one deliberate difference (docs/gpt-neox-differences.md): GPT-NeoX's "type:transformer|mlp" also weighs
    # the parameter-free _pre/_post_transformer_block functions, which splits layers unevenly.
    assert defaults["pipe_partition_method"] == "type:transformerlayer|mlp"
    for key in ("hidden_size", "num_layers", "train_batch_size", "optimizer", "zero_optimization", "fp16", "bf16"):
        assert defaults[key] is None, key


def test_every_key_is_typed_and_documented():
    import dataclasses

    from megatron.neox_arguments.sections import SECTIONS

    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("doc", "")) > 10, f.name
            assert f.type, f.name


def test_flat_attribute_access_and_unknown_attribute():
    args = build()
    assert args.hidden_size == 64 and args.sections["model"].hidden_size == 64
    assert args.tokenizer is None
    with pytest.raises(AttributeError, match="no key 'hiden_size'"):
        _ = args.hiden_size


# ---------------------------------------------------------------- loading


def test_yaml_gpt_neox_style_merge_dash_underscore_and_exponents(tmp_path):
    a = write(
        tmp_path,
        "a.yml",
        '# comment\n{\n  "num-layers": 2, "hidden_size": 64, "num_attention_heads": 4,\n'
        '  "seq_length": 64, "max-position-embeddings": 64,\n'
        '  "optimizer": {"type": "Adam", "params": {"lr": 6e-4, "eps": 1e-8}},\n'
        '  "no_weight_tying": True,\n}\n',
    )
    b = write(tmp_path, "b.json", json.dumps({"train_micro_batch_size_per_gpu": 2, "min_lr": "1e-5"}))
    args = NeoXArgs.from_ymls([a, b], {"train-iters": 5})
    assert args.num_layers == 2 and args.max_position_embeddings == 64 and args.no_weight_tying is True
    assert args.lr == pytest.approx(6e-4) and args.optimizer["params"]["eps"] == pytest.approx(1e-8)
    assert args.min_lr == pytest.approx(1e-5) and args.train_iters == 5
    assert set(args.config_files) == {"a.yml", "b.json"}
    assert args.origins["num_layers"] == a and args.origins["train_iters"] == "the overrides"


@pytest.mark.parametrize("first,second", [("train_iters", "train-iters"), ("train-iters", "train_iters")])
def test_duplicate_key_across_files_names_both_files_and_spellings(tmp_path, first, second):
    a = write(tmp_path, "a.yml", json.dumps({**TINY, first: 10}))
    b = write(tmp_path, "b.yml", json.dumps({second: 20}))
    with pytest.raises(ConfigError) as e:
        NeoXArgs.from_ymls([a, b])
    msg = str(e.value)
    assert "'train_iters' is set in two files" in msg
    assert a in msg and b in msg and repr(first) in msg and repr(second) in msg


def test_duplicate_spellings_inside_one_file(tmp_path):
    a = write(tmp_path, "a.yml", '{\n  "seq_length": 64,\n  "seq-length": 32,\n}\n')
    with pytest.raises(ConfigError, match=r"a.yml: line 3.*duplicate key 'seq-length' \(first set on line 2\)"):
        NeoXArgs.from_ymls([a])


def test_unknown_key_suggests_closest(tmp_path):
    a = write(tmp_path, "a.yml", json.dumps({**TINY, "hiden_size": 3, "lr_decay_stlye": "cosine"}))
    with pytest.raises(ConfigError) as e:
        NeoXArgs.from_ymls([a])
    assert len(e.value.problems) == 2
    assert "unknown key 'hiden_size' in" in e.value.problems[0] and "'hidden_size'" in e.value.problems[0]
    assert "'lr_decay_style'" in e.value.problems[1]


def test_wrong_types_name_key_file_value_expected(tmp_path):
    a = write(tmp_path, "a.yml", json.dumps({**TINY, "log_interval": "often", "norm": "batchnorm", "seed": True}))
    with pytest.raises(ConfigError) as e:
        NeoXArgs.from_ymls([a])
    msgs = e.value.problems
    assert f"log_interval='often' in {a}: expected int" in msgs
    assert any(m.startswith("norm='batchnorm'") and "one of 'layernorm'" in m for m in msgs)
    assert any(m.startswith("seed=True") for m in msgs)


def test_yaml_syntax_error_has_line_number(tmp_path):
    a = write(tmp_path, "a.yml", '{\n  "log_interval": 5,\n  "eval_interval" 10,\n}\n')
    with pytest.raises(ConfigError, match=r"a.yml: line 3, column \d+: invalid YAML"):
        NeoXArgs.from_ymls([a])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        NeoXArgs.from_ymls([str(tmp_path / "nope.yml")])
    a = write(tmp_path, "a.yml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        NeoXArgs.from_ymls([a])


def test_literal_values_are_case_insensitive_and_canonicalised():
    assert build(tokenizer_type="hftokenizer").tokenizer_type == "HFTokenizer"


# ---------------------------------------------------------------- derive


@pytest.mark.parametrize(
    "given,world,expect",
    [
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 16}, 4, (16, 4, 1)),
        (
            {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
            2,
            (24, 4, 3),
        ),
    ],
)
def test_batch_triple_any_two_give_the_third(given, world, expect):
    cfg = {k: v for k, v in TINY.items() if k != "train_micro_batch_size_per_gpu"}
    args = NeoXArgs({**cfg, **given, "global_num_gpus": world}, env=CPU1)
    assert (args.train_batch_size, args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps) == expect
    assert args.batch_size == expect[1] and args.dp_world_size == world


def test_batch_triple_inconsistent():
    msgs = problems(train_batch_size=7, gradient_accumulation_steps=2)
    assert any("inconsistent batch sizes: train_batch_size=7" in m for m in msgs)


def test_world_size_sources():
    values = {**default_values(), **TINY}
    env_gpu = LaunchEnv(on_cpu=False, gpu_count=8)
    assert derive(values, set(TINY), env_gpu)[0]["global_num_gpus"] == 8
    assert derive({**values, "num_gpus": 2, "num_nodes": 3}, set(TINY), env_gpu)[0]["global_num_gpus"] == 6
    assert derive(values, set(TINY), CPU1)[0]["global_num_gpus"] == 1
    assert derive({**values, "num_gpus": 2}, set(TINY), CPU1)[0]["global_num_gpus"] == 2
    assert derive(values, set(TINY), LaunchEnv(world_size=4))[0]["global_num_gpus"] == 4
    hosts = LaunchEnv(on_cpu=False, hosts={"w0": 4, "w1": 4, "w2": 2})
    assert derive(values, set(TINY), hosts)[0]["global_num_gpus"] == 10
    assert derive({**values, "num_nodes": 2}, set(TINY), hosts)[0]["global_num_gpus"] == 8
    assert derive({**values, "include": "w0@w2:1"}, set(TINY), hosts)[0]["global_num_gpus"] == 5
    assert derive({**values, "global_num_gpus": 3}, set(TINY), hosts)[0]["global_num_gpus"] == 3


def test_dp_size_with_tp_and_pp():
    args = build(global_num_gpus=8, model_parallel_size=2, pipe_parallel_size=2)
    assert args.dp_world_size == 2 and args.is_pipe_parallel and args.train_batch_size == 4
    assert any("not divisible" in m for m in problems(global_num_gpus=6, model_parallel_size=4))


def test_precision_zero_optimizer_and_misc_derived():
    args = build(fp16={"enabled": True, "loss_scale": 0}, optimizer={"type": "Adam", "params": {"lr": 3e-4}})
    assert args.precision == "fp16" and args.params_dtype == torch.float16 and args.lr == pytest.approx(3e-4)
    assert args.optimizer_type == "adam" and args.zero_stage == 0 and args.zero_optimization["stage"] == 0
    assert args.dynamic_loss_scale is True and args.clip_grad == 1.0 and args.text_gen_type == "unconditional"
    bf = build(precision="bfloat16", zero_optimization={"stage": 2, "reduce_bucket_size": 1000})
    assert bf.bf16 == {"enabled": True} and bf.params_dtype == torch.bfloat16
    assert bf.zero_stage == 2 and bf.zero_reduce_bucket_size == 1000 and bf.zero_allgather_bucket_size == 500000000
    assert build().precision == "fp32" and build().params_dtype == torch.float32 and build().lr == 0.001
    assert build(sample_input_file="p.txt").text_gen_type == "input-file"
    assert any("both true" in m for m in problems(fp16={"enabled": True}, bf16={"enabled": True}))
    assert any("conflicts" in m for m in problems(precision="fp32", bf16={"enabled": True}))


def test_attention_config_expansion():
    assert expand_attention_config(None, 3) == ["global"] * 3
    assert expand_attention_config([[["local", "global"], "all"]], 4) == ["local", "global"] * 2
    assert expand_attention_config([[["flash"], 2], [["global"], 1]], 3) == ["flash", "flash", "global"]
    assert build(attention_config=[[["flash"], 2]]).attention_config == ["flash", "flash"]
    assert any("describes 3 layers" in m for m in problems(attention_config=[[["global"], 3]]))
    assert any("unknown attention type" in m for m in problems(attention_config=[[["glbal"], 2]]))


def test_padded_vocab_size_and_data_weights():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    args = build(train_data_paths=["a", "b"], valid_data_paths=["c"], test_data_paths=["d"])
    assert args.train_data_weights == [1.0, 1.0] and args.valid_data_weights == [1.0]


# ---------------------------------------------------------------- validate and unsupported


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({"num_attention_heads": None}, "missing required key 'num_attention_heads'"),
        ({"model_parallel_size": 3, "global_num_gpus": 3}, "num_attention_heads=4 is not divisible by"),
        ({"hidden_size": 66}, "hidden_size=66 is not divisible by num_attention_heads=4"),
        ({"num_kv_heads": 3}, "num_kv_heads=3"),
        ({"seq_length": 128}, "seq_length=128 exceeds max_position_embeddings=64"),
        ({"pipe_parallel_size": 1, "zero_optimization": {"stage": 3}}, "DeepSpeed's pipeline engine supports ZeRO"),
        (
            {"data_path": "x", "train_data_paths": ["a"], "valid_data_paths": ["b"], "test_data_paths": ["c"]},
            "exclusive",
        ),
        ({"train_data_paths": ["a"]}, "missing valid_data_paths, test_data_paths"),
        (
            {**{f"{s}_data_paths": ["a"] for s in ("train", "valid", "test")}, "train_data_weights": [1, 2]},
            "train_data_weights has 2",
        ),
        ({"save": "ckpt"}, "needs checkpoint_factor or extra_save_iters"),
        ({"min_lr": 0.5}, "min_lr=0.5 is larger than the learning rate"),
        ({"optimizer": {"type": "adamax", "params": {}}}, "optimizer.type='adamax'"),
        ({"fp16_lm_cross_entropy": True}, "needs fp16 precision"),
        ({"train_epochs": 1, "train_iters": 3}, "not both"),
        ({"train_impl": "dpo"}, "needs dataset_impl: pairwise"),
        ({"train_impl": "rm", "dataset_impl": "pairwise", "pipe_parallel_size": 1}, "does not run on the pipeline"),
        ({"train_impl": "kto", "train_micro_batch_size_per_gpu": 1}, "kto needs train_micro_batch_size_per_gpu >= 2"),
        ({"rotary_pct": 0.0}, "rotary_pct=0.0 must be in (0, 1]"),
        ({"keep_last_n_checkpoints": 0}, "keep_last_n_checkpoints=0 must be >= 1"),
        ({"log_interval": 0}, "log_interval=0 must be >= 1"),
        ({"train_epochs": 2, "pack_impl": "unpacked"}, "train_epochs needs pack_impl: packed"),
        ({"text_gen_type": "input-file"}, "needs sample_input_file"),
        ({"moe_num_experts": 4, "moe_top_k": 6}, "moe_top_k=6 must be an int in [1, moe_num_experts=4]"),
        ({"moe_num_experts": 4, "pipe_parallel_size": 2}, "not supported yet: moe_num_experts=4 with pipe_parallel"),
        ({"moe_num_experts": 4, "zero_optimization": {"stage": 2}}, "needs ZeRO stage 0 or 1"),
        ({"moe_num_experts": 3, "model_parallel_size": 2}, "must be divisible by model_parallel_size=2"),
        ({"moe_num_experts": 4, "moe_router_type": "topk", "moe_loss_weight": -1}, "moe_loss_weight=-1"),
    ],
)
def test_validation_rules(overrides, expected):
    assert any(expected in m for m in problems(**overrides)), problems(**overrides)


def test_all_violations_reported_together():
    msgs = problems(hidden_size=66, seq_length=128, save="x")
    assert len(msgs) == 3


def test_unsupported_features_refused_default_values_accepted():
    msgs = problems(te_mha=True, te_layernorm_mlp=True)
    assert msgs == [msgs[0]] and msgs[0].startswith("not supported yet: te_layernorm_mlp=True, te_mha=True")
    assert build(moe_num_experts=8).moe_num_experts == 8  # implemented now (docs/moe.md)
    assert build(attention_config=[[["mamba"], 2]]).attention_config == ["mamba", "mamba"]  # docs/model.md#mamba
    assert problems(attention_config=[[["mamba"], 2]], mamba_inner_func_fusion=True, mamba_use_bias_in_linears=True)[
        0
    ].startswith("mamba_inner_func_fusion=True cannot be combined with mamba_use_bias_in_linears=True")
    assert "norm=te_rmsnorm" in problems(norm="te_rmsnorm")[0]
    assert build(te_mha=False, moe_num_experts=1, use_mup=False).te_mha is False


# ---------------------------------------------------------------- round trips and runtime values


def test_to_dict_from_dict_round_trip_and_save(tmp_path):
    args = build(global_num_gpus=2, bf16={"enabled": True}, attention_config=[[["global"], 2]])
    again = NeoXArgs.from_dict(args.to_dict())
    assert again == args and again.to_dict() == args.to_dict()
    path = tmp_path / "cfg.json"
    args.save_config(str(path))
    assert NeoXArgs.from_dict(json.loads(path.read_text())) == args


def test_save_key_is_the_plain_directory_string(tmp_path):
    """``save`` is GPT-NeoX's checkpoint-directory key and nothing else (a plain ``str``, not callable)."""
    args = build(save=str(tmp_path / "ckpt"), checkpoint_factor=5)
    assert type(args.save) is str and args.save == str(tmp_path / "ckpt")
    assert not callable(args.save)
    assert build().save is None


def test_pickle_and_deepcopy(tmp_path):
    import copy
    import pickle

    args = build(save="ckpt", checkpoint_factor=2)
    assert pickle.loads(pickle.dumps(args)) == args and copy.deepcopy(args) == args
    assert pickle.loads(pickle.dumps(args.save)) == "ckpt"


def test_update_value():
    args = build()
    args.update_value("padded_vocab_size", 512)
    args.iteration = 7
    args.update_value("tokenizer", object())
    assert args.padded_vocab_size == 512 and args.iteration == 7 and args.tokenizer is not None
    assert "padded_vocab_size" in args.to_dict() and "tokenizer" not in args.to_dict()
    with pytest.raises(ValueError, match="unknown key 'paded_vocab_size'"):
        args.update_value("paded_vocab_size", 1)
    with pytest.raises(ValueError, match="expected int"):
        args.update_value("iteration", "seven")


def test_deepspeed_config():
    args = build(
        global_num_gpus=2,
        optimizer={"type": "Adam", "params": {"lr": 1e-3}},
        bf16={"enabled": True},
        wall_clock_breakdown=True,
        deepspeed_extra_args={"zero_allow_untested_optimizer": True},
    )
    ds = args.deepspeed_config
    assert ds["train_batch_size"] == 4 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 1 and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["stage"] == 0 and ds["wall_clock_breakdown"] is True
    assert ds["zero_allow_untested_optimizer"] is True and "deepspeed" not in ds and ds["steps_per_print"] == 10
    neox_style = build(fp16={"fp16": True, "type": "fp16", "enabled": True, "loss_scale": 0})
    assert neox_style.deepspeed_config["fp16"] == {"enabled": True, "loss_scale": 0}
    assert neox_style.fp16["fp16"] is True  # the key itself keeps the user's value
    # extra args may override a key left at its default, not one the user also set at top level
    assert build(deepspeed_extra_args={"wall_clock_breakdown": True}).deepspeed_config["wall_clock_breakdown"] is True
    clash = build(deepspeed_extra_args={"wall_clock_breakdown": True}, wall_clock_breakdown=True)
    with pytest.raises(ConfigError, match="also set at top level"):
        _ = clash.deepspeed_config


def test_consume_neox_args_json_and_base64(tmp_path, monkeypatch):
    args = build(global_num_gpus=2)
    path = tmp_path / "neox_config.json"
    args.save_config(str(path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    got = NeoXArgs.consume_neox_args(input_args=["--local_rank=1", "--neox_config", str(path), "--unknown_flag", "x"])
    assert got.rank == 1 and got.local_rank == 1 and got.world_size == 2 and got.hidden_size == 64
    b64 = base64.urlsafe_b64encode(json.dumps(args.to_dict()).encode()).decode()
    got2 = NeoXArgs.consume_neox_args(input_args=["--megatron_config", b64, "--deepspeed_config", "e30="])
    assert got2.to_dict() == got.to_dict()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="WORLD_SIZE=3 but the config was resolved for global_num_gpus=2"):
        NeoXArgs.consume_neox_args(input_args=["--neox_config", str(path)])
    with pytest.raises(ConfigError, match="no config given"):
        NeoXArgs.consume_neox_args(input_args=[])


def test_bad_input_never_escapes_as_a_crash(tmp_path):
    assert "log_interval=None in the configuration: expected int" in problems(log_interval=None)
    assert any("optimizer.params.lr=[1]" in m for m in problems(optimizer={"type": "adam", "params": {"lr": [1]}}))
    hosts = LaunchEnv(on_cpu=False, hosts={"w0": 2})
    with pytest.raises(ConfigError, match="hostfile resources: include: host 'w9' is not in the hostfile"):
        NeoXArgs({**TINY, "include": "w9"}, env=hosts)
    binary = tmp_path / "bin.yml"
    binary.write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(ConfigError, match="cannot read config file"):
        NeoXArgs.from_ymls([str(binary)])
    bad_hosts = write(tmp_path, "hosts", "w0 slots=two\n")
    cfg = write(tmp_path, "a.yml", json.dumps({**TINY, "hostfile": bad_hosts}))
    with pytest.raises(ConfigError, match=r"bad hostfile: .*hosts: line 1"):
        NeoXArgs.from_ymls([cfg])


def test_any_value_for_any_key_gives_a_config_error_or_a_valid_config():
    """Fuzz: odd values never escape as anything but ConfigError (no crash, no traceback in deepy)."""
    odd = [None, "x", -1, 0, 1.5, True, [], {}, [[1]], {"type": 1}, 10**12, "1e3"]
    for key in sorted(KNOWN_KEYS):
        for value in odd:
            try:
                args = NeoXArgs({**TINY, key: value}, env=CPU1)
                _ = args.deepspeed_config, args.to_dict(), args.format_config()
            except ConfigError:
                pass


def test_lr_decay_iters_wins_over_fraction_and_inverse_sqrt_is_selectable():
    assert build(train_iters=100, lr_decay_fraction=0.5).lr_decay_iters == 50
    assert build(train_iters=100, lr_decay_iters=80, lr_decay_fraction=0.5).lr_decay_iters == 80
    assert build(lr_decay_style="inverse_sqrt").lr_decay_style == "inverse_sqrt"


def test_config_layer_imports_neither_torch_nor_deepspeed() -> None:
    """deepy validates configs before anything heavy loads (and under any DS_ACCELERATOR value): the config layer
    must not import torch, DeepSpeed or the model code."""
    import subprocess
    import sys

    code = "import sys, megatron.neox_arguments; print(sorted(m for m in ('torch', 'deepspeed', 'megatron.model') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
