"""The checks behind ``scripts/gpu_check.sh`` (see there). One summary table; exit code 1 on any FAIL.

Checks (CUDA half / CPU half when no GPU):
1. logits: fp32 CUDA logits equal fp32 CPU logits of the same weights (TF32 off; atol 1e-4, rtol 1e-4).
2. attention: flash-attn/SDPA on CUDA in bf16 equals the explicit fp32-softmax reference (atol 2e-2 relative to
   max |out|); on CPU, SDPA equals the explicit path in fp32 (atol 1e-5).
3. train: ``pretrain()`` of a 1.3B-parameter GPT (24 layers, d=2048, 16 heads, seq 2048) in bf16 for 30 steps,
   tokens/s and MFU against the GPU's peak (``megatron.logging.peak_flops``); on CPU a tiny fp32 run of 2 steps
   through the same code (its loss must be finite and its MFU positive).
4. generate: greedy tokens on CUDA equal those on CPU; on CPU, KV-cache decoding equals full recomputation.
5. bnb: bitsandbytes' 8-bit Adam (``use_bnb_optimizer``) trains a small model on the device (CPU: its CPU backend).
6. te: on CUDA with transformer_engine, ``te.Linear`` equals torch's linear in bf16; the ``te_*`` keys are refused
   in one line naming what the machine lacks (on CPU only that line is checked).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
CUDA = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
if not CUDA:
    os.environ["DS_ACCELERATOR"] = "cpu"


def small_model(dtype: torch.dtype = torch.float32, **kw: object) -> torch.nn.Module:
    from megatron.model import GPTModelConfig, build_sequential_model

    cfg = GPTModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, padded_vocab_size=512,
                         max_position_embeddings=128, pos_emb="rotary", rotary_pct=0.25, gpt_j_residual=True,
                         no_weight_tying=True, params_dtype=dtype, **kw)  # fmt: skip
    torch.manual_seed(0)
    return build_sequential_model(cfg).eval()


def check_logits() -> str:
    model = small_model()
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cpu = model(tokens)
        if not CUDA:
            assert torch.isfinite(cpu).all()
            return "SKIP (no CUDA): CPU reference logits computed"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        gpu = model.cuda()(tokens.cuda()).cpu()
    diff = (gpu - cpu).abs().max().item()
    torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=1e-4)
    return f"PASS max |diff| {diff:.2e} (atol 1e-4, rtol 1e-4)"


def check_attention() -> str:
    model = small_model()
    attn = model.sequential[2].attention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g) for _ in range(3))
    ref = attn._math_attention(q, k, v, None, None, 0.0, 0)  # fp32 softmax reference (plain causal, no cache)
    if not CUDA:
        out = attn._attend(q, k, v, None, 0)  # SDPA (causal)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return f"PASS (CPU fp32 SDPA == reference, max |diff| {(out - ref).abs().max().item():.1e}); CUDA part skipped"
    attn.attention_type = "flash"
    qc, kc, vc = (t.cuda().bfloat16() for t in (q, k, v))
    out = attn._attend(qc, kc, vc, None, 0).float().cpu()
    rel = (out - ref).abs().max().item() / ref.abs().max().item()
    assert rel < 2e-2, f"bf16 attention differs from the reference: {rel:.3e} relative"
    return f"PASS bf16 flash/SDPA vs fp32 reference: {rel:.2e} relative (tolerance 2e-2)"


def check_train(steps: int, tiny: bool) -> str:
    from bench_train import CORPUS, TOKENIZER, prepare_data

    import megatron.training.step as step_mod
    from megatron.logging.flops import FlopsConfig, flops_per_iteration
    from megatron.logging.peak_flops import resolve_peak
    from megatron.neox_arguments import NeoXArgs
    from megatron.training.pretraining import pretrain

    big = CUDA and not tiny
    shape = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048) if big else dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)  # fmt: skip
    steps = steps if CUDA else 2
    times: list[float] = []
    original = step_mod.SequentialStep.train

    def timed(self: object, data_iter: object) -> object:
        if CUDA:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = original(self, data_iter)
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return out

    step_mod.SequentialStep.train = timed
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(tmp, CORPUS, TOKENIZER)
        config = {
            **shape, "max_position_embeddings": shape["seq_length"], "pos_emb": "rotary", "rotary_pct": 0.25,
            "gpt_j_residual": True, "no_weight_tying": True, "norm": "layernorm", "pipe_parallel_size": 0,
            "model_parallel_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4}},
            "zero_optimization": {"stage": 1}, "bf16": {"enabled": bool(CUDA)},
            "precision": "bfloat16" if CUDA else "fp32", "train_micro_batch_size_per_gpu": 4 if big else 2,
            "train_iters": steps, "eval_iters": 0, "eval_interval": 10**6, "log_interval": 10, "split": "100,0,0",
            "data_path": data, "vocab_file": TOKENIZER, "tokenizer_type": "HFTokenizer",
            "make_vocab_size_divisible_by": 128, "global_num_gpus": 1, "num_workers": 0, "seed": 1234,
            "attention_config": [[["flash"], shape["num_layers"]]] if CUDA else [[["global"], shape["num_layers"]]],
        }  # fmt: skip
        args = NeoXArgs.from_dict(config)
        args.build_tokenizer()  # as GPT-NeoX's train.py does first: sets padded_vocab_size (pretrain uses a copy)
        result = pretrain(args)
    step_mod.SequentialStep.train = original
    assert result.iteration == steps and all(math.isfinite(x) for x in result.train_losses), result.train_losses
    flops_cfg = FlopsConfig.from_neox_args(args)
    t = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    peak, source = resolve_peak(getattr(args, "peak_theoretical_tflops", None), args.params_dtype, not CUDA)
    mfu = 100.0 * flops_per_iteration(flops_cfg, 3) / t / (peak * 1e12) if peak else float("nan")
    tokens_s = args.train_batch_size * args.seq_length / t
    assert mfu > 0, "MFU must be positive"
    what = "1.3B bf16" if big else "tiny fp32 (CPU half)"
    return f"PASS {what}: {steps} steps, {tokens_s:,.0f} tokens/s, MFU {mfu:.1f}% of {peak:.4g} TFLOP/s ({source})"


def check_generate() -> str:
    from megatron.generation.sampling import SamplingConfig, generate_tokens_batch, kv_cache_forward

    model = small_model()
    prompts = torch.randint(1, 512, (2, 8), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = SamplingConfig(maximum_tokens=16, seq_length=128)
    with torch.no_grad():
        cpu = generate_tokens_batch(kv_cache_forward(model), prompts, cfg, eod_token=0)
        if not CUDA:
            again = generate_tokens_batch(kv_cache_forward(model), prompts, SamplingConfig(
                maximum_tokens=16, seq_length=128, recompute=True), eod_token=0)  # fmt: skip
            assert [t for t, _ in cpu] == [t for t, _ in again], "KV-cache decoding differs from recomputation"
            return "PASS (CPU: KV cache == recomputation, 2x16 greedy tokens); CUDA part skipped"
        gpu = generate_tokens_batch(kv_cache_forward(model.cuda()), prompts, cfg, eod_token=0, device="cuda")
    assert [t for t, _ in cpu] == [t for t, _ in gpu], "greedy tokens differ between CUDA and CPU"
    return "PASS greedy tokens identical on CUDA and CPU (2x16)"


def check_bnb() -> str:
    """use_bnb_optimizer's optimizer on the device: bitsandbytes' 8-bit Adam trains a small model (loss falls, both
    moments uint8); on CPU through bitsandbytes' CPU backend."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        return f"SKIP bitsandbytes not installed ({e}); pip install -r requirements/requirements-bnb.txt"
    from megatron.training.bnb_optimizer import adam8bit

    device = "cuda" if CUDA else "cpu"
    model = small_model().train().to(device)
    opt = adam8bit([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(3)).to(device)
    losses = []
    for _ in range(12):
        logits = model(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    quantized = [st for st in opt.state.values() if "state1" in st and st["state1"].dtype == torch.uint8]
    assert quantized and losses[-1] < losses[0] - 0.5, f"losses {losses[0]:.3f} -> {losses[-1]:.3f}"
    where = "CUDA" if CUDA else "CPU backend"
    return f"PASS ({where}) 8-bit Adam: loss {losses[0]:.2f} -> {losses[-1]:.2f} in 12 steps, {len(quantized)} uint8 states"


def check_te() -> str:
    """Transformer Engine: where CUDA and transformer_engine are present, te.Linear equals torch's linear in bf16;
    the te_* keys are refused in one line naming what this machine lacks."""
    from megatron.neox_arguments import ConfigError, NeoXArgs

    try:
        NeoXArgs.from_dict({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "te_mha": True})
        raise AssertionError("te_mha was accepted")
    except ConfigError as e:
        line = str(e)
    assert "\n" not in line and "Transformer Engine needs a CUDA GPU" in line, line
    missing = line.split("here: ")[1].split(";")[0]
    if not CUDA or importlib.util.find_spec("transformer_engine") is None:
        return f"SKIP (te_* refused in one line; here: {missing})"
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layer = te.Linear(256, 256, bias=True, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    rel = ((layer(x).float() - ref).abs().max() / ref.abs().max()).item()
    assert rel < 2e-2, f"te.Linear differs from torch: {rel:.3e} relative"
    return f"PASS te.Linear bf16 == torch ({rel:.1e} relative); te_* keys still refused ({missing})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tiny", action="store_true", help="on CUDA too, train the tiny model instead of 1.3B")
    p.add_argument("--only", default=None, help="comma-separated subset: logits,attention,train,generate,bnb,te")
    args = p.parse_args()
    checks: dict[str, Callable[[], str]] = {
        "logits": check_logits,
        "attention": check_attention,
        "train": lambda: check_train(args.steps, args.tiny),
        "generate": check_generate,
        "bnb": check_bnb,
        "te": check_te,
    }
    wanted = args.only.split(",") if args.only else list(checks)
    rows, failed = [], False
    device = torch.cuda.get_device_name() if CUDA else "no CUDA (CPU halves only)"
    for name in wanted:
        start = time.perf_counter()
        try:
            status = checks[name]()
        except Exception as e:  # every check reports, the script fails at the end
            traceback.print_exc()
            status, failed = f"FAIL {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", True
        rows.append((name, f"{time.perf_counter() - start:6.1f}s", status))
    print(f"\n==== gpu_check summary ({device}) ====")
    for name, secs, status in rows:
        print(f"{name:<10} {secs}  {status}")
    print("RESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
