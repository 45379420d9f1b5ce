"""Lost peers are reported by host and rank (megatron/cluster/peers.py), other errors are left alone."""

from __future__ import annotations

from megatron.cluster import peers

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.12]:54996: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)


def test_a_reset_names_the_host_and_its_ranks():
    table = [peers.RankHost(r, f"node{r // 2 + 1}", f"10.0.0.{11 + r // 2}") for r in range(4)]
    peers.record(table, table[1])
    msg = peers.lost_peer_message(RuntimeError(GLOO_RESET))
    assert msg is not None
    assert msg.startswith("rank 1 on node1: lost the connection to host node2 (10.0.0.12, ranks 2, 3)")
    unknown = peers.lost_peer_message(RuntimeError(GLOO_RESET.replace("10.0.0.12", "10.9.9.9")))
    assert unknown is not None and "the peer at 10.9.9.9" in unknown


def test_a_timeout_names_the_configured_limit_and_other_errors_are_not_touched():
    peers.record([], peers.RankHost(0, "node1", "10.0.0.11"), timeout_minutes=0.5)
    msg = peers.lost_peer_message(RuntimeError("[gloo] Timed out waiting 30000ms for recv operation"))
    assert msg is not None and "distributed_timeout_minutes=0.5" in msg
    assert peers.lost_peer_message(RuntimeError("shape mismatch")) is None
    assert peers.lost_peer_message(ValueError("Connection reset by peer")) is None


def test_local_address_of_loopback():
    assert peers.local_address("127.0.0.1", 29500) == "127.0.0.1"
