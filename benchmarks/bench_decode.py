"""Greedy decode throughput: neox-forge's generation API vs transformers ``generate`` on the same weights.

    python benchmarks/bench_decode.py [--layers 4] [--hidden 256] [--new-tokens 64] [--repeats 5] [--threads 1]

A random GPT-NeoX model is saved as a Hugging Face folder and imported with ``megatron.checkpoint.hf_io`` (the
code path of ``convert_hf_to_neox.py``), so both sides run identical fp32 weights. Gate: the greedy tokens must be
identical at batch 1 and batch 8 (same-length prompts). Both decode the whole batch at once over a KV cache
(neox-forge: ``generate_tokens_batch``, what ``generate_samples_from_prompt(batch_size=8)`` runs). Prints tokens/s, the median ratio (neox-forge / HF) per batch size and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))


def build(args: argparse.Namespace, folder: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    from megatron.checkpoint.hf_io import import_hf
    from megatron.model import build_sequential_model

    config = transformers.GPTNeoXConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden, max_position_embeddings=1024,
        rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(folder)
    sd, cfg, _, _ = import_hf(folder, "fp32")
    ours = build_sequential_model(cfg.replace(params_dtype=torch.float32)).eval()
    ours.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    return ours, hf


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from megatron.generation.sampling import SamplingConfig, generate_tokens_batch, kv_cache_forward

    with tempfile.TemporaryDirectory() as folder:
        ours, hf = build(args, folder)
    cfg = SamplingConfig(maximum_tokens=args.new_tokens, seq_length=1024)
    forward = kv_cache_forward(ours)
    results = {}
    for batch in (1, 8):
        prompts = torch.randint(1, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))

        def run_ours(prompts: torch.Tensor = prompts) -> list[list[int]]:
            with torch.no_grad():
                return [new for new, _ in generate_tokens_batch(forward, prompts.tolist(), cfg, eod_token=0)]

        def run_hf(prompts: torch.Tensor = prompts) -> list[list[int]]:
            with torch.no_grad():
                out = hf.generate(
                    prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                    do_sample=False, eos_token_id=0, pad_token_id=0,
                )  # fmt: skip
            rows = [r[args.prompt_len :].tolist() for r in out]
            return [r[: r.index(0)] if 0 in r else r for r in rows]

        a, b = run_ours(), run_hf()
        if a != b:
            print(f"batch {batch}: tokens differ, no timing reported", file=sys.stderr)
            return 1
        tokens = sum(len(r) for r in a)
        times = {"neox_forge": [], "hf": []}
        for _ in range(args.repeats):
            for name, fn in (("neox_forge", run_ours), ("hf", run_hf)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        ours_tps = tokens / statistics.median(times["neox_forge"])
        hf_tps = tokens / statistics.median(times["hf"])
        # the median of the per-repeat ratios (A and B run back to back, so load changes hit both alike)
        ratio = statistics.median(h / o for o, h in zip(times["neox_forge"], times["hf"], strict=True))
        results[f"batch{batch}"] = {"neox_forge_tok_s": ours_tps, "hf_tok_s": hf_tps, "ratio": ratio}
        print(f"batch {batch}: neox-forge {ours_tps:8.1f} tok/s | HF generate {hf_tps:8.1f} tok/s | "
              f"median ratio {ratio:.2f}x ({tokens} tokens, identical)")  # fmt: skip
    print(json.dumps({"benchmark": "decode", **vars(args), **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
