"""Mamba training step: our all-Mamba model vs Hugging Face ``MambaForCausalLM`` (its pure-PyTorch path), fp32 CPU.

    python benchmarks/bench_mamba_train.py [--layers 2] [--hidden 256] [--seq 256] [--batch 2] [--vocab 8192]
        [--rounds 5] [--warmup 1] [--save]

Both models are built from the same config (no download): ours with ``build_sequential_model`` (GPT-NeoX's
``attention_config`` ``[[["mamba"], L]]``, RMSNorm, ``pos_emb: none``, untied head), HF's from the
``MambaConfig`` that :func:`megatron.model.hf_mapping.neox_to_hf_config` writes for it, with our initial weights
copied in by :func:`megatron.model.hf_mapping.neox_to_hf_state_dict` (the exporter's mapping). One step = forward,
loss, backward, optimizer step, ``zero_grad`` on the same random batch. Ours: the model's fused output+loss
(``loss_targets``) and ``torch.optim.AdamW(fused=True)``, what ``optimizer: adam`` builds for CPU parameters; HF:
``model(input_ids, labels=...)`` (HF shifts the labels itself, so it gets the batch one token longer) and a default
``torch.optim.AdamW``. HF runs its slow path (no ``mamba_ssm`` / ``causal_conv1d`` on a CPU), a Python loop over
tokens; ours the chunked selective scan of ``megatron/model/mamba/scan.py``.

Gate: the first-step losses are equal (fp32, rel 1e-5) before any timing. Rounds alternate (ours, then HF); the
ratio is the median of the per-round ratios of HF time / our time (= ours tokens/s / HF tokens/s; > 1: ours faster).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, median, median_ratio, now

from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.hf_mapping import neox_to_hf_config, neox_to_hf_state_dict


def build_pair(layers: int, hidden: int, vocab: int, seed: int = 1234) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours, HF) with the same fp32 weights; HF's from our state dict through the exporter's mapping."""
    import transformers

    cfg = GPTModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=hidden // 64 if hidden % 64 == 0 else 1,
        padded_vocab_size=vocab,
        max_position_embeddings=4096,
        attention_config=[[["mamba"], layers]],
        norm="rmsnorm",
        rms_norm_epsilon=1e-5,
        pos_emb="none",
        no_weight_tying=True,
        seed=seed,
    )
    ours = build_sequential_model(cfg).train()
    hf = transformers.MambaForCausalLM(neox_to_hf_config(cfg, "mamba")).float().train()
    sd = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(neox_to_hf_state_dict(sd, cfg, "mamba"), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weight transfer to HF failed: missing {missing}, unexpected {unexpected}")
    return ours, hf


class Side:
    """One model, its optimizer and its step on a fixed batch ``text`` ``[b, s + 1]``."""

    def __init__(self, model: torch.nn.Module, hf: bool, text: torch.Tensor) -> None:
        self.model, self.hf, self.text = model, hf, text
        opt = {} if hf else {"fused": True}
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **opt)

    def step(self) -> float:
        if self.hf:
            loss = self.model(input_ids=self.text, labels=self.text).loss
        else:
            tokens, labels = self.text[:, :-1], self.text[:, 1:]
            loss = self.model(tokens, loss_targets=(labels, torch.ones(labels.shape)))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--save", action="store_true")
    a = p.parse_args()
    report = Report(
        "mamba_train",
        " ".join(["python", *sys.argv]),
        layers=a.layers,
        hidden=a.hidden,
        seq=a.seq,
        micro_batch=a.batch,
        vocab=a.vocab,
        precision="fp32",
        rounds=a.rounds,
        warmup=a.warmup,
    )
    ours_model, hf_model = build_pair(a.layers, a.hidden, a.vocab)
    text = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    ours, hf = Side(ours_model, False, text), Side(hf_model, True, text)
    first_ours, first_hf = ours.step(), hf.step()  # the gate: same model, same batch, same loss
    if abs(first_ours - first_hf) > 1e-5 * abs(first_hf):
        raise SystemExit(f"gate failed: first losses differ: ours {first_ours:.7f} vs HF {first_hf:.7f}")
    for _ in range(a.warmup):
        ours.step()
        hf.step()
    t_ours, t_hf = [], []
    for _ in range(a.rounds):
        start = now()
        ours.step()
        mid = now()
        hf.step()
        t_ours.append(mid - start)
        t_hf.append(now() - mid)
        print(f"round: ours {t_ours[-1]:.3f} s, HF {t_hf[-1]:.3f} s", flush=True)
    tokens = a.batch * a.seq
    report.finish(
        median_ratio(t_hf, t_ours),
        "ours tokens/s / HF MambaForCausalLM tokens/s, forward + backward + AdamW step (median of per-round ratios)",
        save=a.save,
        first_loss_ours=round(first_ours, 7),
        first_loss_hf=round(first_hf, 7),
        gate="first losses equal (fp32 rel 1e-5)",
        median_ours_s=round(median(t_ours), 4),
        median_hf_s=round(median(t_hf), 4),
        ours_tokens_per_s=round(tokens / median(t_ours), 1),
        hf_tokens_per_s=round(tokens / median(t_hf), 1),
        per_round_ratios=[round(h / o, 3) for o, h in zip(t_ours, t_hf, strict=True)],
        tokens_per_step=tokens,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
