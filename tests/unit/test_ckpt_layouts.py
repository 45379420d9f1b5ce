"""megatron.checkpoint: write a full state dict in every (tp, pp) layout, read it back bit-identically; merge rules,
GPT-NeoX conventions (legacy names, summed row biases), optimizer-state resharding and bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpoint import CheckpointError, TargetLayout, detect_layout, read_checkpoint, write_checkpoint
from megatron.checkpoint.bias_layout import ROW_BIAS_KEY
from megatron.checkpoint.optimizer_state import (
    FullOptimizerState,
    gather_optimizer_state,
    scatter_optimizer_state,
    slice_param_names,
)
from megatron.checkpoint.reader import FORMAT_KEY
from megatron.checkpoint.rules import merge_tensor, rename_legacy, split_tensor
from megatron.model import GPTModelConfig, build_sequential_model

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64, max_position_embeddings=32)
CONFIGS = {
    "neox": GPTModelConfig(**BASE, pos_emb="rotary", rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True),
    "llama": GPTModelConfig(
        **BASE,
        pos_emb="rotary",
        num_kv_heads=2,
        activation="swiglu",
        intermediate_size=96,
        norm="rmsnorm",
        use_bias_in_attn_linear=False,
        use_bias_in_mlp=False,
        no_weight_tying=True,
    ),
    "tied-learned": GPTModelConfig(**BASE, pos_emb="learned"),
    "mamba-attention": GPTModelConfig(
        **BASE, attention_config=[[["mamba", "global"], 1]], norm="rmsnorm", mamba_use_bias_in_linears=True
    ),
}
LAYOUTS = [(1, 0), (2, 0), (1, 2), (2, 2), (4, 1)]


def random_state(cfg: GPTModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in build_sequential_model(cfg).state_dict().items()}


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_write_then_read_is_bit_identical(name: str, tp: int, pp: int, tmp_path: Path) -> None:
    cfg = CONFIGS[name]
    if cfg.kv_heads % tp:
        pytest.skip("tp must divide the KV heads")
    full = random_state(cfg)
    directory = write_checkpoint(full, cfg, tmp_path / "ck", TargetLayout(tp, pp), iteration=7)
    assert (tmp_path / "ck" / "latest").read_text() == "global_step7"
    names = {p.name for p in directory.iterdir()}
    stages = max(pp, 1)
    assert {f"mp_rank_{r:02d}_model_states.pt" for r in range(tp * stages)} <= names
    if pp:
        assert f"layer_02-model_{tp - 1:02d}-model_states.pt" in names
        assert ("layer_06-model_00-model_states.pt" in names) == (not cfg.tied_embeddings)
    layout = detect_layout(directory)
    assert (layout.tp, layout.pp, layout.is_pipe) == (tp, pp if pp else 0, pp > 0)
    back = read_checkpoint(tmp_path / "ck", model=cfg)
    assert back.iteration == 7 and set(back.state_dict) == set(full)
    for key, value in full.items():
        assert torch.equal(back.state_dict[key], value), key


def test_gqa_and_gated_shards_are_per_rank_blocks() -> None:
    cfg = CONFIGS["llama"]
    h, kv = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
    qkv = torch.arange(cfg.qkv_size, dtype=torch.float32)
    q, k, v = qkv.split([h, kv, kv])
    shards = split_tensor("sequential.2.attention.query_key_value.bias", qkv, cfg, 2)
    assert torch.equal(shards[1], torch.cat([q[h // 2 :], k[kv // 2 :], v[kv // 2 :]]))
    assert torch.equal(merge_tensor("sequential.2.attention.query_key_value.bias", shards, cfg), qkv)
    lin1 = torch.arange(cfg.mlp_sizes[0], dtype=torch.float32)
    up, gate = lin1.chunk(2)
    shards = split_tensor("sequential.2.mlp.linear1.weight", lin1, cfg, 2)
    assert torch.equal(shards[0], torch.cat([up[: len(up) // 2], gate[: len(gate) // 2]]))
    dense = torch.randn(cfg.hidden_size, cfg.hidden_size)
    assert torch.equal(split_tensor("sequential.2.attention.dense.weight", dense, cfg, 2)[1], dense[:, 16:])


def test_legacy_names_and_gpt_neox_row_biases(tmp_path: Path) -> None:
    up, gate, down = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    renamed = rename_legacy({"mlp.w1.weight": gate, "mlp.w3.weight": up, "mlp.w2.weight": down})
    assert torch.equal(renamed["mlp.linear1.weight"], torch.cat([up, gate])) and "mlp.linear2.weight" in renamed
    assert "mlp.linear1.bias" in rename_legacy({"mlp.dense_h_to_4h.bias": torch.zeros(2)})

    # A GPT-NeoX checkpoint (no neox-forge marker, no manifest) of a parallel-residual model at tp=2: the effective
    # row-parallel bias is the sum of what the ranks store.
    cfg = CONFIGS["neox"]
    full = random_state(cfg, seed=1)
    gpt_neox_checkpoint(full, cfg, tmp_path / "neox")
    key = "sequential.2.attention.dense.bias"
    for path in sorted((tmp_path / "neox" / "global_step1").glob("mp_rank_*")):  # each rank holds half
        assert torch.allclose(torch.load(path, weights_only=False)["module"][key], full[key] / 2)
    back = read_checkpoint(tmp_path / "neox", model=cfg)
    for name, value in full.items():
        assert torch.allclose(back.state_dict[name], value, atol=1e-6), name
    ours = read_checkpoint(tmp_path / "neox", model=cfg, row_bias="effective")
    assert torch.allclose(ours.state_dict[key], full[key] / 2)


def gpt_neox_checkpoint(
    full: dict[str, torch.Tensor],
    cfg: GPTModelConfig,
    root: Path,
    target: TargetLayout | None = None,
    iteration: int = 1,
) -> Path:
    """``full`` as GPT-NeoX would have saved it at tp=2: our writer's files without our markers."""
    directory = write_checkpoint(full, cfg, root, target or TargetLayout(2, 0), iteration=iteration)
    (directory / "manifest.json").unlink()
    for path in directory.glob("mp_rank_*"):
        state = torch.load(path, weights_only=False)
        assert state.pop(ROW_BIAS_KEY) == "split"
        del state[FORMAT_KEY]
        torch.save(state, path)
    return directory


@pytest.mark.parametrize("name", ["neox", "tied-learned"])
def test_optimizer_state_round_trips_through_layouts(name: str) -> None:
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(3)
    full = FullOptimizerState(
        group_hparams={"decay": {"lr": 0.1, "weight_decay": 0.01}, "no_decay": {"lr": 0.1, "weight_decay": 0.0}}
    )
    shapes = {k: v.shape for k, v in build_sequential_model(cfg).state_dict().items()}
    for pname in slice_param_names(cfg, 0, 0):
        full.per_param[pname] = {
            "step": torch.tensor(5.0),
            "exp_avg": torch.randn(shapes[pname], generator=g),
            "exp_avg_sq": torch.rand(shapes[pname], generator=g),
        }
    for tp, pp in [(2, 2), (1, 0), (2, 0), (1, 2)]:
        state_for = scatter_optimizer_state(full, cfg, tp, pp)
        optimizers = [state_for(stage, t) for stage in range(max(pp, 1)) for t in range(tp)]
        shard_shape = {k: tuple(split_tensor(k, torch.empty(s), cfg, tp)[0].shape) for k, s in shapes.items()}
        back = gather_optimizer_state(optimizers, lambda n, _t, sh=shard_shape: sh[n], cfg, tp, pp)
        assert set(back.per_param) == set(full.per_param)
        for pname, state in full.per_param.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(back.per_param[pname][key], state[key]), (tp, pp, pname)
        assert back.group_hparams["decay"]["weight_decay"] == 0.01
    with pytest.raises(CheckpointError, match="param groups"):
        gather_optimizer_state(optimizers[:1] * 2, lambda n, _t: shard_shape[n], cfg, 1, 2)


def test_bad_inputs_leave_nothing_behind(tmp_path: Path) -> None:
    cfg = CONFIGS["neox"]
    full = random_state(cfg)
    with pytest.raises(CheckpointError, match="tp=3 does not divide"):
        write_checkpoint(full, cfg, tmp_path / "bad", TargetLayout(3, 0))
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))
    write_checkpoint(full, cfg, tmp_path / "ok", TargetLayout(2, 2))
    with pytest.raises(CheckpointError, match="already exists"):
        write_checkpoint(full, cfg, tmp_path / "ok", TargetLayout(1, 0))
    (tmp_path / "ok" / "global_step0" / "layer_03-model_01-model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"layer 03 lacks TP shard\(s\) \[1\]"):
        read_checkpoint(tmp_path / "ok", model=cfg)
    write_checkpoint(full, cfg, tmp_path / "seq", TargetLayout(2, 0))
    with pytest.raises(CheckpointError, match="saved with hidden_size=32 but the config says 64"):
        read_checkpoint(tmp_path / "seq", model=cfg.replace(hidden_size=64))
    with pytest.raises(CheckpointError, match=r"does not match the model config: shape mismatch .*mlp\.linear1"):
        read_checkpoint(tmp_path / "seq", model=cfg.replace(intermediate_size=256))
    (tmp_path / "seq" / "global_step0" / "mp_rank_01_model_states.pt").unlink()
    (tmp_path / "seq" / "global_step0" / "mp_rank_02_model_states.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=r"mp_rank shard.* 01 missing"):
        read_checkpoint(tmp_path / "seq", model=cfg)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        read_checkpoint(tmp_path, model=cfg)


def test_plan_load_reshards_for_another_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from megatron.checkpoint.autoreshard import plan_load

    cfg = CONFIGS["llama"]
    full = random_state(cfg, seed=4)
    write_checkpoint(full, cfg, tmp_path / "ck", TargetLayout(2, 2), iteration=3)
    calls = []
    same = plan_load(tmp_path / "ck", "global_step3", tp=2, pp=2, model=cfg,
                     is_writer=True, barrier=lambda: calls.append(1))  # fmt: skip
    assert (same.root, same.resharded, calls) == (str(tmp_path / "ck"), False, [])
    with caplog.at_level("WARNING"):
        plan = plan_load(tmp_path / "ck", "global_step3", tp=1, pp=0, model=cfg,
                         is_writer=True, barrier=lambda: calls.append(1))  # fmt: skip
    assert "was saved with tp=2 pp=2 but this run uses tp=1 pp=0: resharding" in caplog.text
    assert plan.resharded and plan.weights_only and calls == [1]  # no optimizer state in the source
    assert plan.root == str(tmp_path / "ck" / ".resharded" / "global_step3-tp1-pp0")
    back = read_checkpoint(Path(plan.root), model=cfg)
    assert back.layout.tp == 1 and not back.layout.is_pipe and back.iteration == 3
    assert all(torch.equal(back.state_dict[k], v) for k, v in full.items())


def test_reads_a_gpt_neox_written_pipe_checkpoint(tmp_path: Path) -> None:
    """GPT-NeoX's own files: legacy MLP names, persisted rotary ``inv_freq``, per-rank row biases, no marker."""
    cfg = CONFIGS["neox"]
    full = random_state(cfg, seed=5)
    directory = gpt_neox_checkpoint(full, cfg, tmp_path / "neox", TargetLayout(2, 2), iteration=9)
    for path in directory.glob("layer_0[23]-*"):
        sd = torch.load(path, weights_only=True)
        legacy = {k.replace("mlp.linear1.", "mlp.dense_h_to_4h.").replace("mlp.linear2.", "mlp.dense_4h_to_h."): v
                  for k, v in sd.items()}  # fmt: skip
        legacy["attention.rotary_emb.inv_freq"] = torch.ones(cfg.rotary_ndims // 2)
        torch.save(legacy, path)
    back = read_checkpoint(tmp_path / "neox", model=cfg)
    assert set(back.state_dict) == set(full) and back.iteration == 9
    for key, value in full.items():
        assert torch.allclose(back.state_dict[key], value, atol=1e-6), key


def test_plan_load_converts_gpt_neox_row_biases(tmp_path: Path) -> None:
    from megatron.checkpoint.autoreshard import plan_load

    cfg = CONFIGS["neox"]
    full = random_state(cfg, seed=6)
    gpt_neox_checkpoint(full, cfg, tmp_path / "ck")
    plan = plan_load(tmp_path / "ck", "global_step1", tp=2, pp=0, model=cfg,
                     is_writer=True, barrier=lambda: None)  # fmt: skip
    assert plan.resharded
    back = read_checkpoint(Path(plan.root), model=cfg)
    assert back.layout.tp == 2
    for key, value in full.items():
        assert torch.allclose(back.state_dict[key], value, atol=1e-6), key


def test_plan_load_reuses_a_fresh_copy_only(tmp_path: Path) -> None:
    import os
    import shutil

    from megatron.checkpoint.autoreshard import plan_load

    cfg = CONFIGS["neox"]
    write_checkpoint(random_state(cfg, seed=7), cfg, tmp_path / "ck", TargetLayout(2, 0), iteration=1)
    kw = dict(tp=1, pp=0, model=cfg, is_writer=True, barrier=lambda: None)
    plan = plan_load(tmp_path / "ck", "global_step1", **kw)
    manifest = Path(plan.root) / "global_step1" / "manifest.json"
    first = manifest.stat().st_mtime_ns
    plan_load(tmp_path / "ck", "global_step1", **kw)
    assert manifest.stat().st_mtime_ns == first  # reused
    newer = random_state(cfg, seed=8)
    write_checkpoint(newer, cfg, tmp_path / "other", TargetLayout(2, 0), iteration=1)  # the tag is saved again
    future = manifest.stat().st_mtime + 5
    for path in (tmp_path / "other" / "global_step1").glob("mp_rank_*"):
        shutil.copy(path, tmp_path / "ck" / "global_step1" / path.name)
        os.utime(tmp_path / "ck" / "global_step1" / path.name, (future, future))
    plan = plan_load(tmp_path / "ck", "global_step1", **kw)
    back = read_checkpoint(Path(plan.root), model=cfg)
    assert all(torch.equal(back.state_dict[k], v) for k, v in newer.items())
    # a failing reshard still reaches the barrier (other ranks must not hang), then raises everywhere
    calls: list[int] = []
    (tmp_path / "ck" / "global_step1" / "mp_rank_01_model_states.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=r"automatic resharding .* failed: cannot read"):
        plan_load(tmp_path / "ck", "global_step1", **{**kw, "tp": 2, "pp": 2, "barrier": lambda: calls.append(1)})
    assert calls == [1]


def test_plan_load_optimizer_state_only_for_zero0_runs(tmp_path: Path) -> None:
    from megatron.checkpoint.autoreshard import plan_load

    cfg = CONFIGS["neox"]
    full = FullOptimizerState(group_hparams={"decay": {"lr": 0.1, "weight_decay": 0.1}, "no_decay": {"lr": 0.1}})
    for name, value in random_state(cfg).items():
        full.per_param[name] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(value)}
    write_checkpoint(random_state(cfg), cfg, tmp_path / "ck", TargetLayout(2, 0), iteration=1,
                     optimizer_state=scatter_optimizer_state(full, cfg, 2, 0))  # fmt: skip
    kw = dict(tp=1, pp=1, model=cfg, is_writer=True, barrier=lambda: None)
    plan = plan_load(tmp_path / "ck", "global_step1", **kw)
    assert plan.resharded and not plan.weights_only  # ZeRO-0 state came along
