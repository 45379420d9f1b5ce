"""Host reads of tensors made by neox-forge's own code during a real training run (one gloo rank).

Every ``Tensor.item / tolist / cpu / numpy / __float__ / __int__ / __bool__`` call whose caller is a file under
megatron/ is counted (on a GPU each is a device-to-host synchronisation; DeepSpeed's and torch's own calls are
theirs, not counted). The counts are split per training iteration by ``pretrain``'s ``on_step`` callback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

MEGATRON = str(Path(__file__).resolve().parents[2] / "megatron")
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def host_reads_per_iteration(config: dict[str, Any]) -> dict[str, Any]:
    """Run ``pretrain(config)``; returns the host reads between consecutive iterations' ``on_step`` calls, with
    where they were made."""
    from tests.distributed.fns_train import run_pretrain

    windows: list[list[str]] = [[]]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str) -> Any:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(MEGATRON):
                windows[-1].append(f"{name} {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(self, *args, **kwargs)

        return read

    steps: list[tuple[int, float]] = []

    def next_iteration(iteration: int, result: Any) -> None:
        windows.append([])
        steps.append((iteration, result.lm_loss))

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        result = run_pretrain(config, on_step=next_iteration)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    # windows[i] (i >= 1): after iteration i's on_step up to iteration i+1's: i's logging, then step i+1
    return {"windows": windows, "losses": result["train_losses"], "on_step": steps}
