"""A tiny tensor-parallel LM trained through ``deepspeed.initialize(mpu=mpu)`` (run on spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron import mpu

VOCAB, HIDDEN, FFN, SEQ, MBS, GAS = 64, 32, 64, 8, 2, 2
CLIP = 0.05


def _init(t: torch.Tensor) -> None:
    nn.init.normal_(t, std=0.2)


class TinyTPModel(nn.Module):
    """Embedding -> norm -> gated TP MLP (column stride 2 + row) -> norm -> vocab-parallel head."""

    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        self.embed = mpu.VocabParallelEmbedding(VOCAB, HIDDEN, init_method=_init)
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.fc1 = mpu.ColumnParallelLinear(HIDDEN, 2 * FFN, gather_output=False, init_method=_init, stride=2)
        self.fc2 = mpu.RowParallelLinear(FFN, HIDDEN, input_is_parallel=True, init_method=_init)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.head = mpu.ColumnParallelLinear(HIDDEN, VOCAB, bias=False, gather_output=False, init_method=_init)
        with torch.no_grad():  # non-zero biases so that their TP handling matters
            self.fc1.bias.fill_(0.01)
            self.fc2.bias.fill_(-0.02)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        a, _ = self.fc1(self.norm1(h))  # [b, s, 2*ffn/tp]
        x, gate = a.chunk(2, dim=-1)
        m, _ = self.fc2(x * F.silu(gate))  # [b, s, h]
        return h + m

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # [b, s, h]
        h = mpu.checkpoint(self._mlp, h) if self.activation_checkpointing else self._mlp(h)
        logits, _ = self.head(self.norm2(h))  # [b, s, V/tp]
        return logits


def _batch(step: int, micro: int) -> dict[str, torch.Tensor] | None:
    if mpu.get_model_parallel_rank() != 0:
        return None  # only TP rank 0 "owns a data loader"
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + mpu.get_data_parallel_rank())
    return {"text": torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)}


def train(
    model_parallel_size: int, steps: int, zero_stage: int = 1, activation_checkpointing: bool = False
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; return losses, global grad norms and replicated-parameter copies."""
    import deepspeed

    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(model_parallel_size)
    torch.manual_seed(1234)
    model = TinyTPModel(activation_checkpointing)
    config = {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    losses, norms = [], []
    for step in range(steps):
        step_loss = 0.0
        for micro in range(GAS):
            text = mpu.broadcast_data(["text"], _batch(step, micro), torch.int64)["text"]
            tokens, labels = text[:, :-1], text[:, 1:]
            logits = engine(tokens)
            loss = mpu.vocab_parallel_cross_entropy(logits.float(), labels).mean()
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / GAS
        t = torch.tensor([step_loss])
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
        norms.append(float(engine.get_global_grad_norm()))
    module = engine.module
    replicated = [module.fc2.bias, module.norm1.weight]
    with deepspeed.zero.GatheredParameters(replicated, enabled=zero_stage == 3):
        result = {
            "dp_world_size": engine.dp_world_size,
            "losses": losses,
            "grad_norms": norms,
            "fc2_bias": module.fc2.bias.detach().tolist(),
            "norm1_weight": module.norm1.weight.detach().tolist(),
        }
    mpu.destroy_model_parallel()
    return result
