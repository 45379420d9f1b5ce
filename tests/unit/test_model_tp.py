"""Tensor/sequence/pipeline parallel runs of the model on gloo ranks compared with a single-process tp=1 model.

Layout-invariant init means a seed gives the same FULL model under any TP size, so the merged shards must equal
the tp=1 weights exactly, and logits, loss and (merged) gradients must agree to 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron import mpu
from megatron.model import (
    GPT2ModelPipe,
    GPTModelConfig,
    KVCache,
    build_sequential_model,
    cross_entropy,
    get_ltor_masks_and_position_ids,
)
from megatron.model.tp_sharding import merge_state_dicts, partition_spec, shard_state_dict
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

V = 128
TP_CASES = {
    "gptj-mha-gelu-untied": dict(gpt_j_residual=True, rotary_pct=0.25, no_weight_tying=True),
    "gqa-swiglu-rmsnorm-tied": dict(num_kv_heads=2, activation="swiglu", norm="rmsnorm", mlp_multiple_of=4),
    "sp-gptj-gqa-geglu": dict(
        sequence_parallel=True, gpt_j_residual=True, num_kv_heads=2, activation="geglu", mlp_multiple_of=4
    ),
    "sp-sequential-learned-untied": dict(sequence_parallel=True, pos_emb="learned", no_weight_tying=True),
    "alibi": dict(pos_emb="alibi"),
    # hidden dropout draws from the TP-replicated stream: same masks as tp=1 (GPT-J: one reduction, bias once)
    "gptj-hidden-dropout": dict(gpt_j_residual=True, hidden_dropout=0.3),
    "sequential-hidden-dropout-gqa": dict(hidden_dropout=0.3, num_kv_heads=2),
    "rpe-qknorm-gqa": dict(pos_emb="rpe", use_qk_layernorm=True, num_kv_heads=2),
    # the qk norm holds this rank's heads: a TP shard the sequence-parallel norm sync must not sum
    "sp-qknorm-rmsnorm": dict(sequence_parallel=True, use_qk_layernorm=True, norm="rmsnorm"),
    # Mamba: the inner dimension split (in_proj per [x | z] half), x_proj's partial sums reduced
    "mamba-attention-linear-biases": dict(attention_config=[[["mamba", "global"], 1]], mamba_use_bias_in_linears=True),
    "sp-mamba-rmsnorm": dict(sequence_parallel=True, attention_config=[[["mamba"], 2]], norm="rmsnorm"),
}


def _cfg(**kw) -> GPTModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=V,
        max_position_embeddings=32,
        pos_emb="rotary",
        init_method_std=0.2,
        output_layer_init_method="normal",
        seed=99,
    )
    base.update(kw)
    return GPTModelConfig(**base)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3))
    return ids, torch.roll(ids, -1, 1), torch.ones(ids.shape)


def _portable(obj: object) -> object:
    """Tensors → numpy (the harness queue must not pass shared-memory tensors from exiting ranks) and back."""
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    return obj


def _step(cfg: GPTModelConfig) -> dict:
    model = build_sequential_model(cfg)
    if cfg.sequence_parallel:
        mpu.mark_norms_for_sequence_parallel_grad_sync(model)
    ids, labels, mask = _batch()
    torch.manual_seed(1234)  # dropout masks (default stream, identical on every TP rank)
    logits = model(ids)  # [b, s, V/tp]
    loss = cross_entropy(logits, (labels, mask))
    loss.backward()
    return {
        "logits": mpu.gather_from_model_parallel_region(logits.detach()),
        "loss": loss.detach(),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {k: p.grad.detach().clone() for k, p in model.named_parameters()},
    }


def _greedy(cfg: GPTModelConfig, steps: int = 6, cached: bool = True) -> torch.Tensor:
    """Greedy decode from a fixed prompt (with or without the KV cache); returns all tokens."""
    model = build_sequential_model(cfg).eval()
    tokens = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(8))
    cache = KVCache() if cached else None
    with torch.no_grad():
        new = tokens
        for _ in range(steps):
            logits = mpu.gather_from_model_parallel_region(model(new if cached else tokens, kv_cache=cache))
            nxt = logits[:, -1:].argmax(-1)
            tokens = torch.cat((tokens, nxt), dim=1)
            new = nxt
    return tokens


DECODE_CFG = dict(num_kv_heads=2, activation="swiglu", norm="rmsnorm", mlp_multiple_of=4)
MAMBA_DECODE_CFG = dict(attention_config=[[["mamba", "global"], 1]], mamba_use_bias_in_linears=True)


def tp_rank_fn(tp: int, cases: dict) -> dict:
    """Runs on every rank: one forward/backward per case under TP ``tp``, and a cached greedy decode."""
    mpu.initialize_model_parallel(tp)
    out = {name: _step(_cfg(**kw)) for name, kw in cases.items()}
    out["decode"] = _greedy(_cfg(**DECODE_CFG))
    out["mamba_decode"] = _greedy(_cfg(**MAMBA_DECODE_CFG))  # the conv and SSM states of this rank's channels
    try:
        build_sequential_model(_cfg(num_kv_heads=1))
        out["mqa_error"] = None
    except ValueError as exc:
        out["mqa_error"] = str(exc)
    try:
        build_sequential_model(_cfg(use_qk_layernorm=True, norm="scalenorm"))
        out["qk_scalenorm_error"] = None
    except ValueError as exc:
        out["qk_scalenorm_error"] = str(exc)
    return _portable(out)


def test_tensor_and_sequence_parallel_match_tp1() -> None:
    ranks = _portable(run_distributed(tp_rank_fn, 2, 2, TP_CASES, timeout=300))
    for name, kw in TP_CASES.items():
        cfg = _cfg(**kw)
        ref = _step(cfg.replace(sequence_parallel=False))
        got = [r[name] for r in ranks]
        merged = merge_state_dicts([g["state"] for g in got], cfg)
        assert set(merged) == set(ref["state"]), name
        for key, value in ref["state"].items():
            assert torch.equal(merged[key], value), f"{name}: init differs for {key}"
        for g in got:
            assert (g["logits"] - ref["logits"]).abs().max() <= 1e-5, name
            assert abs(g["loss"].item() - ref["loss"].item()) <= 1e-5, name
        grads = merge_state_dicts([g["grads"] for g in got], cfg)
        for key, grad in ref["grads"].items():
            assert (grads[key] - grad).abs().max() <= 1e-5, f"{name}: grad differs for {key}"
            if partition_spec(key, cfg)[0] is None:  # replicated params: every rank holds the full gradient
                assert (got[1]["grads"][key] - grad).abs().max() <= 1e-5, f"{name}: replicated grad {key}"
        shards = [shard_state_dict(ref["state"], cfg, r, 2) for r in range(2)]
        for r in range(2):
            for key, value in shards[r].items():
                assert torch.equal(value, got[r]["state"][key]), f"{name}: shard {r} of {key}"
    expected = _greedy(_cfg(**DECODE_CFG), cached=False)
    mamba_expected = _greedy(_cfg(**MAMBA_DECODE_CFG), cached=False)
    for r in ranks:
        assert torch.equal(r["decode"], expected)
        assert torch.equal(r["mamba_decode"], mamba_expected)
        assert r["mqa_error"] == "num_kv_heads=1 must be divisible by model_parallel_size=2"
        assert "scalenorm is not supported with model_parallel_size > 1" in r["qk_scalenorm_error"]


# ----------------------------------------------------------------------------------------------------------------
# pipeline


def _pipe_batches(n: int) -> list:
    out = []
    g = torch.Generator().manual_seed(12)
    for _ in range(n):
        ids = torch.randint(0, V, (2, 9), generator=g)
        tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        mask, loss_mask, pos = get_ltor_masks_and_position_ids(tokens, eod_token=0)
        out.append(((tokens, pos, mask), (labels, loss_mask)))
    return out


PIPE_CFG = dict(num_layers=4, no_weight_tying=False, checkpoint_activations=True, hidden_dropout=0.0)


def pipe_rank_fn(pp: int, cfg_kwargs: dict) -> dict:
    """Train two steps with DeepSpeed's pipeline engine on ``pp`` stages; return losses and the stage weights."""
    import deepspeed

    mpu.initialize_model_parallel(1, pipe_parallel_size=pp)
    cfg = _cfg(**cfg_kwargs)
    model = GPT2ModelPipe(cfg, mpu.get_topology())  # default partition method "type:transformerlayer|mlp"
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ds_config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    batches = _pipe_batches(4)
    losses = [engine.train_batch(iter(batches[2 * i : 2 * i + 2])).item() for i in range(2)]
    return _portable({"losses": losses, "weights": weights, "stage": mpu.get_pipe_parallel_rank()})


def test_pipeline_engine_matches_sequential_model() -> None:
    ranks = _portable(run_distributed(pipe_rank_fn, 2, 2, PIPE_CFG, timeout=300))
    cfg = _cfg(**PIPE_CFG)
    model = build_sequential_model(cfg)
    reference = model.state_dict()
    # per-spec seeding: each stage's layers equal the sequential model's, whatever the partition
    for r in ranks:
        for key, value in r["weights"].items():
            parts = key.split(".")
            idx = 0 if parts[0] == "tied_modules" else int(parts[0])
            name = ".".join(parts[2:] if parts[0] == "tied_modules" else parts[1:])
            assert torch.equal(value, reference[f"sequential.{idx}.{name}"]), key
    assert {r["stage"] for r in ranks} == {0, 1}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _pipe_batches(4)
    expected = []
    for i in range(2):
        opt.zero_grad()
        total = 0.0
        for inputs, labels in batches[2 * i : 2 * i + 2]:
            loss = cross_entropy(model(*inputs), labels) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        expected.append(total)
    last = next(r for r in ranks if r["stage"] == 1)["losses"]
    assert last == pytest.approx(expected, abs=1e-5)
