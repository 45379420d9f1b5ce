"""Rows for peerlit's peer table (``benchmarks/peers/registry.py``'s ``PEERS``): the Hugging Face Trainer and
torchtitan peers. Plain keyword dicts (this module needs no registry import), merged there as
``PEERS.update({name: Peer(**row) for name, row in PEERS_HF.items()})``.

``ours`` sets our config keys to the peer's default per-step work, so both sides do the same work: the Trainer clips
at ``max_grad_norm`` 1.0 with weight decay 0; torchtitan's recipe clips at 1.0 with AdamW weight decay 0.1.
"""

from __future__ import annotations

from typing import Any

_TRAINER_OURS = {"gradient_clipping": 1.0, "weight_decay": 0.0}
_TORCHTITAN_OURS = {"gradient_clipping": 1.0, "weight_decay": 0.1}

PEERS_HF: dict[str, dict[str, Any]] = {
    "hf-fused": {
        "runner": "hf_runner.py",
        "venv": "hf",
        "ours": _TRAINER_OURS,
        "notes": "transformers.Trainer.train() with its defaults (adamw_torch_fused, linear lr, clip 1.0), eager",
    },
    "hf-compiled": {
        "runner": "hf_runner.py",
        "venv": "hf",
        "flags": ("--compile",),
        "compile": True,
        "ours": _TRAINER_OURS,
        "notes": "the same with TrainingArguments(torch_compile=True): accelerate compiles the model",
    },
    "torchtitan": {
        "runner": "torchtitan_runner.py",
        "venv": "torchtitan",
        "same_model": False,
        "ours": _TORCHTITAN_OURS,
        "notes": "torchtitan 0.3.0 Trainer.train(), llama3 debugmodel recipe shaped like ours (not GPT-NeoX)",
    },
    "torchtitan-compiled": {
        "runner": "torchtitan_runner.py",
        "venv": "torchtitan",
        "flags": ("--compile",),
        "same_model": False,
        "compile": True,
        "ours": _TORCHTITAN_OURS,
        "notes": "the same with compile.enable (torchtitan compiles each block and the loss)",
    },
}
