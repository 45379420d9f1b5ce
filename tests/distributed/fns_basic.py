"""Functions run on spawned ranks by the harness tests (must be importable by the child processes)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def collectives() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank), float(rank * rank)]))
    return {
        "rank": rank,
        "world": world,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "sum": t.item(),
        "gathered": [g.tolist() for g in gathered],
    }


def fail_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def deepspeed_toy_training(zero_stage: int, steps: int) -> list[float]:
    """Train a 3-layer MLP on a fixed regression problem with the DeepSpeed engine; return the losses."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    x_all = torch.randn(8, 8, generator=gen)  # one fixed batch per rank: the loss must fall steadily
    y_all = x_all.sum(dim=1, keepdim=True).sin()
    losses = []
    for _step in range(steps):
        step_loss = 0.0
        for micro in range(2):
            i = micro * 4
            loss = torch.nn.functional.mse_loss(engine(x_all[i : i + 4]), y_all[i : i + 4])
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / 2
        t = torch.tensor([step_loss])
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def return_tensors() -> dict:
    rank = dist.get_rank()
    return {"t": torch.full((3, 4), float(rank)), "nested": [torch.arange(5) * rank]}
