"""A rollout server for REINFORCE tests, speaking GPT-NeoX's two protocols (test helper, run as a program).

``python -m tests.rollout_server CONFIG.json --data-port P --weight-port W`` listens on ``127.0.0.1:P`` for the
trainer (GPT-NeoX's online data protocol: the split name in, one pickled list of prompt groups out, then close). For
each request it fetches the policy's current weights from the trainer's weight server on ``127.0.0.1:W`` (GPT-NeoX's
weight protocol, CPU form: one pickled dict per tensor with its bytes, acknowledged one by one), loads them into a
model built from the same config with neox-forge's builder, samples completions with neox-forge's generation
(``generate_tokens_batch``) and scores them with a verifiable reward: the fraction of a completion's characters
that are digits ("answer with a number"). Each answer's mean reward is appended to ``--log`` (one JSON per line).

Faults for the fault tests: ``--fault slow:SECONDS`` (answers after a delay), ``--fault garbage`` (bytes that are not
a pickle), ``--max-answers N`` (exits after N answers), ``--fault wrong`` (a pickle of the wrong shape), ``--fault classes`` (a pickle that names a class).
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import socket
import sys
import time
from typing import Any

import numpy as np
import torch

PROMPTS = ["3+4=", "10-7=", "2*6=", "9+9=", "5*5=", "8-2=", "1+1=", "7*3="]


class WeightUnpickler(pickle.Unpickler):
    """Reads the weight messages: torch dtypes and sizes only, no other class."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch", "Size"):
            return torch.Size
        raise pickle.UnpicklingError(f"refused class {module}.{name}")


def fetch_weights(port: int) -> dict[str, torch.Tensor]:
    """The trainer's current state dict over GPT-NeoX's weight protocol (CPU messages carry the bytes)."""
    out: dict[str, torch.Tensor] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock, sock.makefile("rb") as stream:
        while True:
            msg = WeightUnpickler(stream).load()
            assert msg["storage_device"] == "cpu", msg["storage_device"]
            flat = torch.frombuffer(bytearray(msg["data"]), dtype=torch.uint8).view(msg["dtype"])
            out[msg["state_dict_key"]] = flat.view(msg["tensor_size"]).clone()
            sock.sendall(b"ok")
            if msg["end"]:
                return out


def digit_reward(text: str) -> float:
    """The verifiable reward: the share of the completion's characters that are digits (0 for an empty one)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class Sampler:
    """neox-forge's model and generation for the trainer's config."""

    def __init__(self, config: dict[str, Any], completions: int, max_tokens: int) -> None:
        from megatron.generation.sampling import SamplingConfig
        from megatron.model import GPTModelConfig
        from megatron.model.gpt2_model import build_sequential_model
        from megatron.neox_arguments import NeoXArgs
        from megatron.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size

        args = NeoXArgs.from_dict(config)
        self.tokenizer = build_tokenizer(TokenizerConfig.from_neox_args(args))
        vocab = padded_vocab_size(self.tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
        args = args.derived(tokenizer=self.tokenizer, padded_vocab_size=vocab)
        self.model = build_sequential_model(GPTModelConfig.from_neox_args(args)).eval()
        self.sampling = SamplingConfig(
            seq_length=args.seq_length, maximum_tokens=max_tokens, temperature=1.0, top_k=0, top_p=0.0
        )
        self.completions = completions
        self.generator = torch.Generator().manual_seed(args.seed)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        mine = self.model.state_dict()
        weights = {k.removeprefix("module."): v for k, v in state.items()}
        missing = [k for k in mine if k not in weights and not k.endswith("inv_freq")]
        assert not missing, f"served weights lack {missing[:3]}"
        self.model.load_state_dict({k: weights[k] for k in mine if k in weights}, strict=False)

    def groups(self, prompts: list[str]) -> list[dict[str, Any]]:
        from megatron.generation.sampling import generate_tokens_batch
        from megatron.model.gpt2_model import GPTSequential

        assert isinstance(self.model, GPTSequential)
        model = self.model
        rows = [self.tokenizer.tokenize(p) for p in prompts for _ in range(self.completions)]
        outs = generate_tokens_batch(
            lambda tokens, cache: model(tokens, kv_cache=cache), rows, self.sampling,
            eod_token=self.tokenizer.eod, vocab_size=self.tokenizer.vocab_size, generator=self.generator,
        )  # fmt: skip
        groups = []
        for i, p in enumerate(prompts):
            comps = [new for new, _ in outs[i * self.completions : (i + 1) * self.completions]]
            rewards = [digit_reward(self.tokenizer.detokenize(c)) for c in comps]
            groups.append({"prefix": self.tokenizer.tokenize(p), "completions": comps, "rewards": rewards})
        return groups


def answer(args: argparse.Namespace, sampler: Sampler | None, split: str, k: int) -> bytes:
    if args.fault == "garbage":
        return b"this is not a pickle"
    if args.fault == "wrong":
        return pickle.dumps([{"prefix": [1, 2], "completions": [[3], [4]], "rewards": [1.0]}])
    if args.fault == "classes":
        return pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": [np.float64(1.0)], "x": io.BytesIO}])
    assert sampler is not None
    sampler.load(fetch_weights(args.weight_port))
    start = (k * args.prompts) % len(PROMPTS)
    groups = sampler.groups([PROMPTS[(start + j) % len(PROMPTS)] for j in range(args.prompts)])
    mean = float(np.mean([r for g in groups for r in g["rewards"]]))
    if args.log:
        with open(args.log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"split": split, "mean_reward": mean}) + "\n")
    return pickle.dumps(groups)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--data-port", type=int, required=True)
    parser.add_argument("--weight-port", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--completions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--fault", default="")
    parser.add_argument("--log", default="")
    parser.add_argument("--max-answers", type=int, default=0, help="exit after this many answers (0: never)")
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    torch.set_num_threads(1)
    sampler = (
        None if args.fault in ("garbage", "wrong", "classes") else Sampler(config, args.completions, args.max_tokens)
    )
    srv = socket.create_server(("127.0.0.1", args.data_port))
    print("rollout server ready", flush=True)
    k = 0
    while True:
        conn, _ = srv.accept()
        with conn:
            split = conn.recv(4096).decode()
            if args.fault.startswith("slow:"):
                time.sleep(float(args.fault.split(":")[1]))
            payload = answer(args, sampler, split, k)
            conn.sendall(payload)
        k += 1
        print(f"answered {split} request {k}", file=sys.stderr, flush=True)
        if k == args.max_answers:
            return  # the server goes away


if __name__ == "__main__":
    main()
