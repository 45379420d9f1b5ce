"""The launchers' rank variables, parsed and range-checked before anything uses them.

torchrun, DeepSpeed, srun and mpirun hand each rank its place in environment variables. A value that is not a
plain decimal integer in range (``WORLD_SIZE=abc``, ``LOCAL_RANK=1e9``, ``RANK=-1``, which would make the rendezvous
wait forever, ``MASTER_PORT=99999999``) is a :class:`LaunchEnvError` naming the variable, its value and what is
valid, before torch.distributed sees it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from megatron.errors import UserError

MAX_WORLD_SIZE = 1 << 20  # far beyond any cluster; keeps every count a small integer
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's and torchrun's default
_DIGITS = re.compile(r"[0-9]{1,9}")
# a host name, an IPv4 address or an IPv6 address (bracketed or not, with an optional %zone)
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")


class LaunchEnvError(UserError):
    """A launcher's environment variable that cannot be used as given."""


def _shown(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def env_int(env: Mapping[str, str], name: str, lo: int, hi: int, default: int | None = None, why: str = "") -> int:
    """``env[name]`` as an integer in ``[lo, hi]`` (``default`` when unset; unset and no default is an error too).
    ``why`` explains a bound that comes from another variable."""
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise LaunchEnvError(f"environment variable {name} is not set: the launcher must set it")
        return default
    if _DIGITS.fullmatch(raw) and lo <= int(raw) <= hi:
        return int(raw)
    valid = f"an integer from {lo} to {hi}" if hi > lo else f"{lo}"
    raise LaunchEnvError(f"environment variable {name}={_shown(raw)} is not valid: it must be {valid}{why}")


def master_addr(env: Mapping[str, str]) -> str | None:
    """``MASTER_ADDR`` (None when unset), checked to look like a host name or an address."""
    raw = env.get("MASTER_ADDR")
    if raw is None or _HOST.fullmatch(raw):
        return raw
    raise LaunchEnvError(
        f"environment variable MASTER_ADDR={_shown(raw)} is not valid: it must be the host name or IP address of "
        "the node running rank 0"
    )


def master_port(env: Mapping[str, str], default: int = DEFAULT_MASTER_PORT) -> int:
    """``MASTER_PORT`` (``default`` when unset), a TCP port from 1 to 65535."""
    return env_int(env, "MASTER_PORT", 1, 65535, default)


def world_size(env: Mapping[str, str]) -> int:
    """``WORLD_SIZE`` (1 when unset)."""
    return env_int(env, "WORLD_SIZE", 1, MAX_WORLD_SIZE, 1)


def check_launch_env(env: Mapping[str, str]) -> None:
    """Check every torch.distributed variable that is set: counts, ranks below their counts, port, address."""
    world = world_size(env)
    of_world = f" (WORLD_SIZE is {world})"
    env_int(env, "RANK", 0, world - 1, 0, of_world)
    local_world = world
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):  # DeepSpeed's name, then torchrun's (which wins when both are set)
        local_world = env_int(env, name, 1, world, local_world, of_world)
    env_int(env, "LOCAL_RANK", 0, local_world - 1, 0, f" (the local world size is {local_world})")
    master_port(env)
    master_addr(env)
