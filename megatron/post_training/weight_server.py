"""The policy's weight server (``serve_model_weights``), GPT-NeoX's protocol.

Rank ``r`` listens on ``localhost:weight_server_port + r`` (or ``weight_server_port[r]``). On each connection it sends
its ``state_dict`` (the engine's: keys ``module.<name>``; under tensor parallelism this rank's shard), one pickled
dict per tensor — ``state_dict_key``, ``dtype``, ``tensor_size``, ``tensor_stride``, ``tensor_offset``,
``requires_grad`` (False), ``end`` (True on the last) and the storage — and waits for any acknowledgement (up to 4096
bytes) after each. On CUDA the storage fields are GPT-NeoX's CUDA IPC handles (``storage_cls``,
``storage_device``, ``storage_handle``, ``storage_size_bytes``, ``storage_offset_bytes``, ``ref_counter_handle``,
``ref_counter_offset``, ``event_handle``, ``event_sync_required``): the client maps the live weights. A CPU tensor
has no such handle: its message carries ``storage_device: "cpu"`` and ``data``, the tensor's bytes (contiguous,
row-major) at the time of the request.

Beyond GPT-NeoX, which serves one connection before training and blocks until it comes: the server runs in a
thread and answers every connection, so a rollout server gets the current weights whenever it asks; and it answers
only while the training thread waits for rollouts (:meth:`WeightServer.serving`), so a copy never mixes two steps.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

logger = logging.getLogger(__name__)


def weight_server_port_of(ports: int | list[int], rank: int) -> int:
    """GPT-NeoX's port of a rank: ``ports + rank``, or ``ports[rank]`` from a list."""
    if isinstance(ports, list):
        if rank >= len(ports):
            raise ValueError(f"weight_server_port has {len(ports)} entries; rank {rank} needs one")
        return int(ports[rank])
    return int(ports) + rank


def tensor_message(key: str, tensor: torch.Tensor, end: bool) -> dict[str, Any]:
    """One message of the protocol (CUDA IPC handles on CUDA, the bytes on the CPU)."""
    data = tensor.detach()
    msg: dict[str, Any] = {
        "state_dict_key": key,
        "dtype": data.dtype,
        "tensor_size": data.shape,
        "tensor_stride": data.stride(),
        "tensor_offset": data.storage_offset(),
        "requires_grad": False,
        "end": end,
    }
    if data.is_cuda:
        with warnings.catch_warnings():  # GPT-NeoX shares the TypedStorage
            warnings.simplefilter("ignore", UserWarning)
            storage = data.storage()
        fields = (
            "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle",
            "ref_counter_offset", "event_handle", "event_sync_required",
        )  # fmt: skip
        msg.update(storage_cls=type(storage), **dict(zip(fields, storage._share_cuda_(), strict=True)))
    else:
        flat = data.contiguous()
        msg.update(
            tensor_stride=flat.stride(),
            tensor_offset=0,
            storage_device="cpu",
            data=flat.view(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b"",
        )
    return msg


def send_state_dict(state_dict: dict[str, torch.Tensor], conn: socket.socket) -> None:
    """Send every tensor, each followed by the client's acknowledgement."""
    keys = list(state_dict)
    for i, key in enumerate(keys):
        conn.sendall(pickle.dumps(tensor_message(key, state_dict[key], i == len(keys) - 1)))
        if not conn.recv(4096):
            raise ConnectionError(f"the client closed the connection after {key}")


class WeightServer:
    """A thread serving ``state_dict()`` to each connection while the trainer waits for rollouts."""

    def __init__(self, state_dict: Callable[[], dict[str, torch.Tensor]], port: int, host: str = "localhost") -> None:
        self.state_dict, self.port = state_dict, port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise OSError(f"weight server: cannot listen on {host}:{port} ({e.strerror}; weight_server_port)") from None
        self.sock.listen(8)
        self.window = threading.Condition()
        self.open = False
        self.closed = False
        self.served = 0
        self.thread = threading.Thread(target=self._run, name=f"weight-server-{port}", daemon=True)
        self.thread.start()
        logger.info("serving the model's weights on %s:%d", host, port)

    @contextmanager
    def serving(self) -> Iterator[None]:
        """While inside, connections get the weights (the trainer waits for rollouts then)."""
        with self.window:
            self.open = True
            self.window.notify_all()
        try:
            yield
        finally:
            with self.window:  # waits for a copy in progress to end before training moves on
                self.open = False

    def _run(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn, self.window:
                self.window.wait_for(lambda: self.open or self.closed)
                if self.closed:
                    return
                try:
                    send_state_dict(self.state_dict(), conn)
                    self.served += 1
                except OSError as e:
                    logger.warning("weight server: a client left mid-transfer (%s)", e)

    def close(self) -> None:
        """Stop serving (a client being served is cut off)."""
        with self.window:
            self.closed = True
            self.window.notify_all()
        with contextlib.suppress(OSError):  # not connected
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=5)
