"""The peers ``bench_train.py --peer NAME`` knows: one row each (add a row to add a peer).

A row names the runner script (``benchmarks/peers/<runner>``), the virtualenv it runs in
(``benchmarks/peers/.venv-<venv>``, made by ``benchmarks/peers/setup.sh <venv>``), extra runner flags, and whether
its model is ours exactly (then the first-step losses must match, fp32 rel 1e-4, or the ratio is refused).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

PEERS_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Peer:
    runner: str  # file name under benchmarks/peers/
    venv: str  # benchmarks/peers/.venv-<venv>; "" = the running interpreter (tests, in-repo runners)
    flags: tuple[str, ...] = ()  # extra runner flags, e.g. ("--compile",)
    same_model: bool = True  # same weights and math as ours: the first losses gate the ratio
    compile: bool = False  # our side runs with torch_compile: true as well (compiled vs compiled)
    notes: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # our config keys set to the peer's default work per step (e.g. its clipping), so both sides do the same work
    ours: dict[str, Any] = field(default_factory=dict)

    def python(self) -> str:
        return os.path.join(PEERS_DIR, f".venv-{self.venv}", "bin", "python") if self.venv else sys.executable

    def runner_path(self) -> str:
        return os.path.join(PEERS_DIR, self.runner)

    def setup_hint(self) -> str:
        return f"peer venv missing: {self.python()}; create it with: bash benchmarks/peers/setup.sh {self.venv}"


# litgpt pretrain's defaults that change the work of a step: clip_grad_norm_(max_norm=1.0), AdamW weight decay 0.01
_LITGPT_OURS = {"gradient_clipping": 1.0, "weight_decay": 0.01}

PEERS: dict[str, Peer] = {
    "litgpt": Peer(
        "litgpt_runner.py", "litgpt", notes="litgpt GPT + its pretrain recipe's step, eager", ours=_LITGPT_OURS
    ),
    "litgpt-compiled": Peer(
        "litgpt_runner.py",
        "litgpt",
        ("--compile",),
        compile=True,
        ours=_LITGPT_OURS,
        notes="litgpt pretrain's torch.compile(model)",
    ),
    # an in-repo runner on our .venv's transformers GPTNeoX: what the CI test drives (no peer venv needed)
    "hf-loop": Peer("loop_runner.py", "", notes="transformers GPTNeoX + torch AdamW, a plain loop"),
}
