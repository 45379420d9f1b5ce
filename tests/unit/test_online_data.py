"""The online data client and the weight server against real sockets on 127.0.0.1 (servers in threads): a server
that is down, slow, or answers with something that is not rollouts gives one ``OnlineDataError`` line naming host
and port after a bounded wait; the weight server speaks GPT-NeoX's protocol and answers only while the trainer waits
for rollouts."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from megatron.post_training.online_data import OnlineDataError, OnlineRollouts, fetch_rollouts, server_address
from megatron.post_training.weight_server import WeightServer, weight_server_port_of
from tests.harness import free_port
from tests.rollout_server import fetch_weights

GOOD = [{"prefix": [5, 6], "completions": [[7, 8], [9]], "rewards": [1.0, 0.0]}]


def serve_once(payload: bytes, delay: float = 0.0) -> int:
    srv = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(4096)
                time.sleep(delay)
                conn.sendall(payload)

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


def test_server_down_is_one_line_after_the_bounded_wait() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(OnlineDataError) as e:
        fetch_rollouts("127.0.0.1", port, "train", timeout=1.0)
    assert 1.0 <= time.monotonic() - start < 5
    assert f"online data server 127.0.0.1:{port} unreachable for 1 s" in str(e.value) and "\n" not in str(e.value)


def test_server_starting_late_is_waited_for() -> None:
    port = free_port()

    def late() -> None:
        time.sleep(0.6)
        srv = socket.create_server(("127.0.0.1", port))
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(pickle.dumps(GOOD))

    threading.Thread(target=late, daemon=True).start()
    assert fetch_rollouts("127.0.0.1", port, "train", timeout=10) == GOOD


def test_slow_server_within_the_timeout_is_fine_beyond_it_an_error() -> None:
    assert fetch_rollouts("127.0.0.1", serve_once(pickle.dumps(GOOD), delay=0.5), "train", timeout=5) == GOOD
    port = serve_once(pickle.dumps(GOOD), delay=3)
    with pytest.raises(OnlineDataError, match=rf"^online data server 127.0.0.1:{port} sent nothing for 0.5 s"):
        fetch_rollouts("127.0.0.1", port, "train", timeout=0.5)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "closed the connection without sending rollouts"),
        (b"not a pickle", "bytes that are not a rollout pickle"),
        (pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": [1.0], "x": socket.socket}]), "socket.socket"),
        (pickle.dumps({"prefix": [1]}), "not a non-empty list of groups"),
        (pickle.dumps([{"prefix": [1], "completions": [[2], [3]], "rewards": [1.0]}]), "not one reward per completion"),
        (pickle.dumps([{"prefix": [1], "completions": [[2, 999]], "rewards": [1.0]}]), "token id 999 outside"),
        (pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": [float("nan")]}]), "not a finite number"),
        (pickle.dumps([{"prefix": "abc", "completions": [[2]], "rewards": [1.0]}]), "prefix is not a list of token"),
    ],
    ids=["empty", "garbage", "class", "not_list", "rewards", "vocab", "nan", "prefix"],
)
def test_wrong_answers_are_one_line(payload: bytes, message: str) -> None:
    port = serve_once(payload)
    rollouts = OnlineRollouts("127.0.0.1", port, "train", seq_length=8, vocab_size=64, leave_one_out=False, timeout=5)
    with pytest.raises(OnlineDataError) as e:
        next(iter(rollouts))
    assert str(e.value).startswith(f"online data server 127.0.0.1:{port}") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_numpy_rewards_are_read_and_leave_one_out_needs_two_completions() -> None:
    groups = [{"prefix": [1], "completions": [[2], [3]], "rewards": [np.float64(1.0), np.float32(0.0)]}]
    port = serve_once(pickle.dumps(groups))
    it = iter(OnlineRollouts("127.0.0.1", port, "train", seq_length=4, vocab_size=8, leave_one_out=True, timeout=5))
    assert [float(next(it)["reward"][0]) for _ in range(2)] == [1.0, -1.0]
    port = serve_once(pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": [1.0]}]))
    it = iter(OnlineRollouts("127.0.0.1", port, "train", seq_length=4, vocab_size=8, leave_one_out=True, timeout=5))
    with pytest.raises(OnlineDataError, match="reinforce_leave_one_out needs at least 2"):
        next(it)


def test_long_samples_are_cut_to_seq_length_plus_one() -> None:
    port = serve_once(pickle.dumps([{"prefix": [1, 2, 3], "completions": [[4] * 10, [5]], "rewards": [1.0, 0.0]}]))
    it = iter(OnlineRollouts("127.0.0.1", port, "train", seq_length=6, vocab_size=8, leave_one_out=False, timeout=5))
    sample = next(it)
    assert sample["text"].tolist() == [1, 2, 3, 4, 4, 4, 4] and sample["label"].tolist() == [-100] * 3 + [4] * 4


def test_server_address_per_data_parallel_rank() -> None:
    assert server_address("h", [10, 11], 1, 2) == ("h", 11)
    assert server_address(["a", "b"], 7, 1, 2) == ("b", 7)
    with pytest.raises(OnlineDataError, match="online_dataserver_ports has 1 entries for 2 data-parallel ranks"):
        server_address("h", [10], 0, 2)
    assert weight_server_port_of(6000, 3) == 6003 and weight_server_port_of([7, 8], 1) == 8


def test_weight_server_protocol_and_window() -> None:
    weights = {
        "a.weight": torch.arange(6, dtype=torch.float32).view(2, 3).t(),
        "b": torch.ones(2, dtype=torch.bfloat16),
    }
    port = free_port()
    server = WeightServer(lambda: weights, port)
    got: dict[str, Any] = {}
    try:
        client = threading.Thread(target=lambda: got.update(fetch_weights(port)), daemon=True)
        client.start()
        client.join(timeout=0.5)
        assert client.is_alive() and server.served == 0  # the trainer is not waiting for rollouts: no answer yet
        with server.serving():
            client.join(timeout=10)
        assert not client.is_alive() and server.served == 1
        assert list(got) == ["a.weight", "b"]
        assert torch.equal(got["a.weight"], weights["a.weight"]) and got["b"].dtype == torch.bfloat16
        weights["b"] = torch.full((2,), 3.0, dtype=torch.bfloat16)  # an update: the next request sees it
        with server.serving():
            assert torch.equal(fetch_weights(port)["b"], weights["b"])
    finally:
        server.close()
    with pytest.raises(OSError, match=f"weight server: cannot listen on localhost:{port}"):
        taken = socket.create_server(("localhost", port))
        try:
            WeightServer(lambda: weights, port)
        finally:
            taken.close()
