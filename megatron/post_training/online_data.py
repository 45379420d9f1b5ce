"""Rollouts from GPT-NeoX's online data servers (``dataset_impl: online``), the client side of its protocol.

The protocol: the trainer connects over TCP to its data server (``online_dataserver_ips``/``_ports``, one per
data-parallel rank when lists), sends the split name (``train``, ``valid`` or ``test``, UTF-8, no terminator) and
reads until the server closes the connection: one pickle of a list of prompt groups
``{"prefix": [ids], "completions": [[ids], ...], "rewards": [float, ...]}``.

Beyond GPT-NeoX, which connects once and unpickles whatever arrives: the connection is retried until
``online_dataserver_timeout`` seconds have passed (the server may still be loading), a server silent for that long
is an error, the pickle may hold only lists, dicts, strings and numbers (no class is ever loaded: a pickle can run
code), and the groups are checked (shapes, token ids within the vocabulary); every failure is one
:class:`OnlineDataError` line naming host and port.

Each completion becomes one sample (GPT-NeoX's ``OnlineDataset``, golden-tested): ``text = prefix + completion``,
``label = [-100] * len(prefix) + completion``, padded to ``seq_length + 1`` with 0 / -100, and its reward minus a
baseline: the mean reward of the other completions of its prompt (``reinforce_leave_one_out``), else the mean of the
last 100 prompts' mean rewards before this one. ``raw_reward`` keeps the server's reward for the metrics.
"""

from __future__ import annotations

import io
import logging
import pickle
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from megatron.errors import UserError

logger = logging.getLogger(__name__)

MOVING_AVERAGE_WINDOW = 100  # prompts whose mean rewards form the baseline without leave-one-out (GPT-NeoX's)
_SAFE_GLOBALS = {  # numpy scalars (a reward computed with numpy pickles as one): built from bytes, run no code
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "dtype"),
}


class OnlineDataError(UserError):
    """An online data server that cannot be reached or sent something that is not rollouts."""


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name} (only lists, dicts, strings and numbers are read)")


def loads_data(payload: bytes) -> Any:
    """Unpickle rollouts without loading any class (numpy scalars excepted)."""
    return _DataUnpickler(io.BytesIO(payload)).load()


def server_address(
    ips: str | list[str], ports: int | list[int], dp_rank: int, dp_size: int
) -> tuple[str, int]:  # fmt: skip
    """The data server of a data-parallel rank: the one value, or the rank's entry of a list."""
    for key, value in (("online_dataserver_ips", ips), ("online_dataserver_ports", ports)):
        if isinstance(value, list) and len(value) < dp_size:
            raise OnlineDataError(f"{key} has {len(value)} entries for {dp_size} data-parallel ranks (one per rank)")
    host = ips[dp_rank] if isinstance(ips, list) else ips
    port = ports[dp_rank] if isinstance(ports, list) else ports
    return str(host), int(port)


def fetch_rollouts(host: str, port: int, split: str, timeout: float) -> list[dict[str, Any]]:
    """One request to the data server: the split's prompt groups (raises :class:`OnlineDataError`)."""
    where = f"online data server {host}:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise OnlineDataError(
                    f"{where} unreachable for {timeout:g} s ({e.strerror or e}; online_dataserver_ips/ports, "
                    "online_dataserver_timeout): is the rollout server running?"
                ) from None
            time.sleep(0.2)
    chunks = []
    with sock:
        sock.settimeout(timeout)
        try:
            sock.sendall(split.encode())
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
        except TimeoutError:
            raise OnlineDataError(f"{where} sent nothing for {timeout:g} s (online_dataserver_timeout)") from None
        except OSError as e:
            raise OnlineDataError(f"{where}: connection failed while reading ({e.strerror or e})") from None
    payload = b"".join(chunks)
    if not payload:
        raise OnlineDataError(f"{where} closed the connection without sending rollouts")
    try:
        groups = loads_data(payload)
    except Exception as e:  # any malformed pickle: one line
        raise OnlineDataError(f"{where} sent {len(payload)} bytes that are not a rollout pickle: {e}") from None
    return groups


def check_groups(groups: Any, where: str, vocab_size: int) -> list[dict[str, Any]]:
    """The prompt groups as lists of ints / floats, or :class:`OnlineDataError` naming what is wrong."""

    def ids(x: Any, what: str) -> list[int]:
        if not isinstance(x, list | tuple) or not all(isinstance(t, int | np.integer) for t in x):
            raise OnlineDataError(f"{where}: {what} is not a list of token ids")
        bad = [int(t) for t in x if not 0 <= int(t) < vocab_size]
        if bad:
            raise OnlineDataError(f"{where}: {what} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        return [int(t) for t in x]

    if not isinstance(groups, list) or not groups:
        raise OnlineDataError(f"{where} sent {type(groups).__name__} {groups!r:.60}, not a non-empty list of groups")
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not {"prefix", "completions", "rewards"} <= set(g):
            raise OnlineDataError(f"{where}: group {i} is not a dict with prefix, completions and rewards")
        comps, rewards = g["completions"], g["rewards"]
        if not isinstance(comps, list | tuple) or not comps:
            raise OnlineDataError(f"{where}: group {i} has no completions")
        if not isinstance(rewards, list | tuple) or len(rewards) != len(comps):
            raise OnlineDataError(f"{where}: group {i} has {len(comps)} completions but not one reward per completion")
        if not all(isinstance(r, int | float | np.number) and np.isfinite(r) for r in rewards):
            raise OnlineDataError(f"{where}: group {i} has a reward that is not a finite number")
        out.append(
            {
                "prefix": ids(g["prefix"], f"group {i} prefix"),
                "completions": [ids(c, f"group {i} completion {j}") for j, c in enumerate(comps)],
                "rewards": [float(r) for r in rewards],
            }
        )
    return out


class RewardBaseline:
    """GPT-NeoX's reward baselines: leave-one-out per prompt, or a moving average over prompts."""

    def __init__(self, leave_one_out: bool) -> None:
        self.leave_one_out = leave_one_out
        self.buffer: deque[float] = deque(maxlen=MOVING_AVERAGE_WINDOW)

    def advantages(self, rewards: list[float], where: str) -> list[float]:
        """Each reward minus its baseline (the buffer advances by one prompt without leave-one-out)."""
        if self.leave_one_out:
            if len(rewards) < 2:
                raise OnlineDataError(
                    f"{where}: a prompt with {len(rewards)} completion; reinforce_leave_one_out needs at least 2"
                )
            return [r - float(np.mean(rewards[:i] + rewards[i + 1 :])) for i, r in enumerate(rewards)]
        baseline = float(np.mean(self.buffer)) if self.buffer else 0.0
        self.buffer.append(float(np.mean(rewards)))
        return [r - baseline for r in rewards]


def completion_sample(
    prefix: list[int], completion: list[int], advantage: float, raw: float, seq_length: int
) -> dict[str, np.ndarray]:  # fmt: skip
    """One training sample (GPT-NeoX's layout; longer ones are cut to ``seq_length + 1``, GPT-NeoX leaves them)."""
    n = seq_length + 1
    text = (prefix + completion)[:n]
    label = ([-100] * len(prefix) + completion)[:n]
    return {
        "text": np.array(text + [0] * (n - len(text)), dtype=np.int64),
        "label": np.array(label + [-100] * (n - len(label)), dtype=np.int64),
        "reward": np.array([advantage], dtype=np.float32),
        "raw_reward": np.array([raw], dtype=np.float32),
    }


class OnlineRollouts:
    """Endless samples of one split from one data server: fetched a server answer at a time, in the order sent."""

    def __init__(
        self, host: str, port: int, split: str, *, seq_length: int, vocab_size: int, leave_one_out: bool,
        timeout: float, window: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:  # fmt: skip
        self.host, self.port, self.split = host, port, split
        self.window = window or nullcontext
        self.seq_length, self.vocab_size, self.timeout = seq_length, vocab_size, timeout
        self.baseline = RewardBaseline(leave_one_out)
        self.pending: deque[dict[str, np.ndarray]] = deque()
        self.fetches = 0

    def refill(self) -> None:
        """Ask the server for the next groups and queue their samples."""
        where = f"online data server {self.host}:{self.port}"
        with self.window():  # the weight server answers while the trainer waits here
            raw_groups = fetch_rollouts(self.host, self.port, self.split, self.timeout)
        groups = check_groups(raw_groups, where, self.vocab_size)
        self.fetches += 1
        n = 0
        for g in groups:
            for comp, adv, raw in zip(
                g["completions"], self.baseline.advantages(g["rewards"], where), g["rewards"], strict=True
            ):
                self.pending.append(completion_sample(g["prefix"], comp, adv, raw, self.seq_length))
                n += 1
        logger.debug("%s: %d samples for %s", where, n, self.split)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            if not self.pending:
                self.refill()
            yield self.pending.popleft()


def micro_batches(samples: Iterator[dict[str, np.ndarray]], micro_batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Stack consecutive samples into micro-batches ``{key: [b, ...]}``."""
    while True:
        rows = [next(samples) for _ in range(micro_batch_size)]
        yield {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}


SPLITS = ("train", "valid", "test")


def build_online_iterators(
    cfg: Any, *, seq_length: int, micro_batch_size: int, vocab_size: int, dp_rank: int, dp_size: int,
    fetches: bool, window: Callable[[], AbstractContextManager[Any]] | None = None,
) -> tuple[Iterator[dict[str, torch.Tensor]] | None, ...]:  # fmt: skip
    """Train/valid/test micro-batch iterators of this rank (``cfg``: a ``PostTrainingConfig``). Only the first
    tensor-parallel rank of a group talks to the server (``fetches``); the others get ``None`` and receive the
    batch by broadcast. ``window``: entered around each request (the weight server answers inside it)."""
    if not fetches:
        return None, None, None
    host, port = server_address(cfg.online_dataserver_ips, cfg.online_dataserver_ports, dp_rank, dp_size)
    out = []
    for split in SPLITS:
        rollouts = OnlineRollouts(
            host, port, split, seq_length=seq_length, vocab_size=vocab_size,
            leave_one_out=cfg.reinforce_leave_one_out, timeout=cfg.online_dataserver_timeout, window=window,
        )  # fmt: skip
        out.append(micro_batches(iter(rollouts), micro_batch_size))
    return tuple(out)
