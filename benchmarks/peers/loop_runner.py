"""The in-repo peer: transformers' ``GPTNeoXForCausalLM`` + ``torch.optim.AdamW`` in a plain loop, in our .venv.

What bench_train.py's built-in HF baseline does, behind the peer protocol: it needs no peer virtualenv, so the CI
test drives the whole protocol (export, start, interleaved steps, loss gate, ratio) with a real model step.
``--perturb-init`` adds noise to the embedding after loading, a deliberately different model for the gate test.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from protocol import runner_arguments, serve


def build(args: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    import transformers

    torch.set_num_threads(args.threads)
    model = transformers.GPTNeoXForCausalLM.from_pretrained(args.init_hf, dtype=torch.float32, trust_remote_code=False)
    if args.perturb_init:
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    model.train()
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step(rows: list[list[int]]) -> float:
        batch = torch.tensor(rows, dtype=torch.int64)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    params = sum(p.numel() for p in model.parameters())
    facts = {"peer": "hf-loop", "version": transformers.__version__, "torch": torch.__version__, "params": params}
    return step, facts


def main() -> int:
    p = runner_arguments(__doc__.splitlines()[0])
    p.add_argument("--perturb-init", action="store_true", help="noise on the embedding: a different model")
    args = p.parse_args()
    return serve(lambda: build(args))


if __name__ == "__main__":
    sys.exit(main())
