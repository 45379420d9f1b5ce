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

_TRAINER_OURS = {"gradient_clipping": 1.0, "weight_decay": 0.0}
_TORCHTITAN_OURS = {"gradient_clipping": 1.0, "weight_decay": 0.1}

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
    # transformers.Trainer clips at max_grad_norm 1.0 with weight decay 0; torchtitan's recipe clips at 1.0 with
    # AdamW weight decay 0.1
    "hf-fused": Peer(
        "hf_runner.py",
        "hf",
        ours=_TRAINER_OURS,
        notes="transformers.Trainer.train() with its defaults (adamw_torch_fused, linear lr, clip 1.0), eager",
    ),
    "hf-compiled": Peer(
        "hf_runner.py",
        "hf",
        ("--compile",),
        compile=True,
        ours=_TRAINER_OURS,
        notes="the same with TrainingArguments(torch_compile=True): accelerate compiles the model",
    ),
    "torchtitan": Peer(
        "torchtitan_runner.py",
        "torchtitan",
        same_model=False,
        ours=_TORCHTITAN_OURS,
        notes="torchtitan 0.3.0 Trainer.train(), llama3 debugmodel recipe shaped like ours (not GPT-NeoX)",
    ),
    "torchtitan-compiled": Peer(
        "torchtitan_runner.py",
        "torchtitan",
        ("--compile",),
        same_model=False,
        compile=True,
        ours=_TORCHTITAN_OURS,
        notes="the same with compile.enable (torchtitan compiles each block and the loss)",
    ),
}
