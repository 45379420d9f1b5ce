"""The config keys the launcher reads (``deepy.py``): where the ranks start and how."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from megatron.config_utils import NeoXValues, neox_values
from megatron.neox_arguments.sections.deepspeed import DeepspeedRunnerArgs
from megatron.neox_arguments.sections.other import LaunchKeys
from megatron.neox_arguments.sections.training import PreemptionKeys


@dataclass(kw_only=True)
class LauncherConfig(DeepspeedRunnerArgs, LaunchKeys, PreemptionKeys):
    """GPT-NeoX's launcher keys of a resolved config (values as set, ``None`` included)."""

    explicit_keys: frozenset[str] = field(default_factory=frozenset)
    """The keys the user set (a CPU launch picks a free port unless ``master_port`` is one of them)."""

    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("explicit_keys",)

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> LauncherConfig:
        """Read every field strictly under its NeoX key, and the keys the user set."""
        return cls(**neox_values(cls, args), explicit_keys=frozenset(args.explicit_keys))

    @property
    def hostfile_path(self) -> str | None:
        """``hostfile`` (else ``$DLTS_HOSTFILE``) when that file exists."""
        path = self.hostfile or os.environ.get("DLTS_HOSTFILE")
        return path if path and os.path.isfile(path) else None


def ranks_on_cpu() -> bool:
    """True when the ranks will run on the CPU: ``DS_ACCELERATOR=cpu``, or no CUDA device (only then is torch
    imported: deepy and the config layer do not load it otherwise)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return True
    from megatron.distributed import on_cpu

    return on_cpu()
