"""Hostfiles (``hostname slots=N``) and DeepSpeed's include/exclude resource filters, parsed without DeepSpeed."""

from __future__ import annotations

import re

_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\d+))?\s*$")


def parse_hostfile(text: str, path: str = "hostfile") -> dict[str, int]:
    """Hosts and their slot counts, in file order. Raises ValueError naming the line on a malformed entry."""
    hosts: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"{path}: line {lineno}: expected 'hostname slots=N', got {raw.strip()!r}")
        host = m.group("host")
        if host in hosts:
            raise ValueError(f"{path}: line {lineno}: host {host!r} is listed twice")
        hosts[host] = int(m.group("slots")) if m.group("slots") else 1
    return hosts


def read_hostfile(path: str) -> dict[str, int]:
    """Parse the hostfile at ``path``."""
    with open(path, encoding="utf-8") as f:
        return parse_hostfile(f.read(), path)


def parse_filter(spec: str, what: str) -> dict[str, list[int] | None]:
    """``worker-0@worker-1:0,2`` -> {"worker-0": None (all slots), "worker-1": [0, 2]}."""
    out: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            continue
        host, _, slots = part.partition(":")
        try:
            out[host] = [int(s) for s in slots.split(",")] if slots else None
        except ValueError:
            raise ValueError(f"{what}: bad slot list in {part!r}; expected NODE[:SLOT,SLOT]") from None
    return out


def filter_resources(
    hosts: dict[str, int], include: str | None = None, exclude: str | None = None
) -> dict[str, list[int]]:
    """Apply DeepSpeed's include/exclude rules to ``hosts``; returns host -> slot ids."""
    pool = {h: list(range(n)) for h, n in hosts.items()}
    if include and exclude:
        raise ValueError("include and exclude cannot both be set")
    if include:
        chosen: dict[str, list[int]] = {}
        for host, slots in parse_filter(include, "include").items():
            if host not in pool:
                raise ValueError(f"include: host {host!r} is not in the hostfile (hosts: {', '.join(pool)})")
            bad = [s for s in slots or [] if s not in pool[host]]
            if bad:
                raise ValueError(f"include: host {host!r} has no slot(s) {bad}")
            chosen[host] = slots if slots is not None else pool[host]
        return chosen
    if exclude:
        for host, slots in parse_filter(exclude, "exclude").items():
            if host not in pool:
                raise ValueError(f"exclude: host {host!r} is not in the hostfile (hosts: {', '.join(pool)})")
            if slots is None:
                del pool[host]
            else:
                pool[host] = [s for s in pool[host] if s not in slots]
        return {h: s for h, s in pool.items() if s}
    return pool


def active_resources(
    hosts: dict[str, int],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = -1,
    num_gpus: int | None = None,
) -> dict[str, list[int]]:
    """Host -> slot ids DeepSpeed's runner would use: include/exclude, then the first ``num_nodes`` hosts and
    the first ``num_gpus`` slots of each."""
    active = filter_resources(hosts, include, exclude)
    names = list(active)
    if num_nodes is not None and num_nodes > 0:
        names = names[:num_nodes]
    if num_gpus is not None and num_gpus > 0:
        return {n: list(range(num_gpus)) for n in names}
    return {n: active[n] for n in names}


def count_ranks(
    hosts: dict[str, int],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int = -1,
    num_gpus: int | None = None,
) -> int:
    """Total ranks DeepSpeed's runner would start for this hostfile and filters."""
    return sum(len(s) for s in active_resources(hosts, include, exclude, num_nodes, num_gpus).values())
