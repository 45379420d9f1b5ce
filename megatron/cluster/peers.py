"""Which host each rank runs on, so that a lost connection can be reported by host and rank, not by address.

At start-up every rank contributes (hostname, the address it reaches the master from); when a collective later
fails because a peer vanished (gloo: ``Connection reset by peer [10.0.0.2]:port``, ``Connection closed by peer``;
a timeout), :func:`lost_peer_message` turns the error into one line naming the host and its ranks.
"""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass

# gloo's and NCCL's words for "the other side is gone" (a timeout: it stopped answering)
_LOST = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|Read error|Write error|Timed out waiting|Socket Timeout"
    r"|remote process exited|Watchdog caught collective operation timeout|NCCL communicator was aborted",
    re.IGNORECASE,
)
_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


@dataclass(frozen=True)
class RankHost:
    rank: int
    host: str
    addr: str


_table: list[RankHost] = []
_me: RankHost | None = None
_timeout_minutes: list[float] = []  # the collective timeout this process group was made with


def local_address(master_addr: str, master_port: int) -> str:
    """The address this host uses to reach ``master_addr`` (no packet is sent: a UDP socket only picks a route)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, master_port))
        return str(s.getsockname()[0])
    return "127.0.0.1"


def record(table: list[RankHost], me: RankHost, timeout_minutes: float | None = None) -> None:
    """Remember every rank's host (the result of an all-gather at start-up), this rank's own entry and the collective
    timeout."""
    global _me
    _table[:] = table
    _me = me
    _timeout_minutes[:] = [] if timeout_minutes is None else [timeout_minutes]


def hosts_of(addr: str) -> tuple[str, list[int]] | None:
    """(host, its ranks) for a peer address, or None when no rank reported it."""
    ranks = [r for r in _table if r.addr == addr]
    if not ranks:
        return None
    return ranks[0].host, sorted(r.rank for r in ranks)


def lost_peer_message(error: BaseException, timeout_minutes: float | None = None) -> str | None:
    """One line for a collective that failed because a peer died or stopped answering; None for other errors."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not _LOST.search(text):
        return None
    me = f"rank {_me.rank} on {_me.host}" if _me else "this rank"
    m = _PEER.search(text)
    if m:
        known = hosts_of(m.group(1))
        peer = (
            f"host {known[0]} ({m.group(1)}, rank{'s' if len(known[1]) > 1 else ''} {', '.join(map(str, known[1]))})"
            if known
            else f"the peer at {m.group(1)}"
        )
        what = f"lost the connection to {peer}"
    else:
        timeout_minutes = timeout_minutes or (_timeout_minutes[0] if _timeout_minutes else None)
        limit = f" after distributed_timeout_minutes={timeout_minutes:g}" if timeout_minutes else ""
        what = f"a collective timed out{limit}: a peer rank stopped answering"
    return (
        f"{me}: {what} ({text.splitlines()[0][:200]}); that node died or became unreachable, or its rank stopped on an error printed above. Training stops here; "
        "resume from the last committed checkpoint (on fewer nodes if need be)"
    )
