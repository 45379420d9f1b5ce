"""The config keys the launcher reads (``deepy.py``): where the ranks start and how."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron.config_utils import NeoXValues, from_schema, neox_values, schema_defaults


@dataclass(frozen=True, kw_only=True)  # global_num_gpus (derived) has no default
@schema_defaults
class LauncherConfig:
    """GPT-NeoX's launcher keys of a resolved config (values as set, ``None`` included)."""

    hostfile: str | None = from_schema()
    include: str | None = from_schema()
    exclude: str | None = from_schema()
    num_nodes: int = from_schema()
    num_gpus: int | None = from_schema()
    global_num_gpus: int
    master_port: int = from_schema()
    master_addr: str | None = from_schema()
    launcher: Literal["pdsh", "openmpi", "mvapich", "slurm"] = from_schema()
    force_multi: bool = from_schema()
    deepspeed_slurm: bool = from_schema()
    deepspeed_mpi: bool = from_schema()
    user_script: str | None = from_schema()
    comment: str | None = from_schema()
    account: str | None = from_schema()
    preemption_signals: list = from_schema()  # the signal deepy relays through srun/mpirun must be one of them
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
