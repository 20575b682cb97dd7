"""Reame's Redis Cluster client against a real 3-node cluster (redis-cli --cluster create): its slots are
Redis's, a stale slot map is corrected by MOVED, a migrating slot is reached through ASK, and a node that
dies costs only its own slots."""

import sys
from pathlib import Path

import pytest
import redis

from reame.arca import cluster
from reame.arca.cluster import ClusterAddress, ClusterClient
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from redis_servers import redis_cluster  # noqa: E402


@pytest.fixture
def ports(tmp_path):
    with redis_cluster(tmp_path / "cluster") as running:
        yield running


def client(ports) -> ClusterClient:
    return ClusterClient(ClusterAddress((("127.0.0.1", ports[0]),), ""), timeout_s=2.0)


def owner(ports, key: bytes) -> int:
    """The port of the node serving `key`'s slot, as the cluster says."""
    slot = redis.Redis(port=ports[0]).execute_command("CLUSTER", "KEYSLOT", key)
    for start, end, primary, *_ in redis.Redis(port=ports[0]).execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return primary[1]
    raise AssertionError("no node serves the slot")


def test_slots_are_the_clusters_and_every_key_reaches_its_node(ports):
    store = client(ports)
    for n in range(40):
        key = f"reame:test:{n}".encode()
        assert cluster.key_slot(key) == redis.Redis(port=ports[0]).execute_command("CLUSTER", "KEYSLOT", key)
        assert store.set(key, str(n).encode()) and store.get(key) == str(n).encode()
        assert redis.Redis(port=owner(ports, key)).get(key) == str(n).encode()
    assert store.mget([b"{tag}a", b"{tag}b"]) == [None, None]  # one slot: one MGET
    store.close()


def test_a_stale_slot_map_is_corrected_by_moved(ports):
    store = client(ports)
    store._learn_slots()
    store._slots = [("127.0.0.1", ports[0])] * cluster.SLOTS  # as if every slot had moved since
    keys = [f"moved:{n}".encode() for n in range(12)]
    assert any(owner(ports, key) != ports[0] for key in keys)
    for key in keys:
        assert store.set(key, b"v") and store.get(key) == b"v"
    assert store._slots[cluster.key_slot(keys[0])] == ("127.0.0.1", owner(ports, keys[0]))
    store.close()


def test_a_migrating_slot_is_reached_through_ask(ports):
    key = b"asked:1"
    source_port = owner(ports, key)
    target_port = next(port for port in ports if port != source_port)
    source, target = redis.Redis(port=source_port), redis.Redis(port=target_port)
    slot = source.execute_command("CLUSTER", "KEYSLOT", key)
    target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.execute_command("CLUSTER", "MYID"))
    source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.execute_command("CLUSTER", "MYID"))
    store = client(ports)
    assert store.set(key, b"moving") and store.get(key) == b"moving"  # a new key goes where the slot is going
    assert source.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0  # it is on the target only
    assert target.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
    store.close()


def test_a_dead_node_costs_only_its_own_slots(ports, tmp_path):
    store = client(ports)
    keys = {port: next(f"k{n}".encode() for n in range(1000) if owner(ports, f"k{n}".encode()) == port)
            for port in ports}
    for key in keys.values():
        assert store.set(key, b"v")
    redis.Redis(port=ports[2]).shutdown(nosave=True)
    wait_until(lambda: store.get(keys[ports[2]]) is None, 10, "the dead node's key to miss")
    assert store.get(keys[ports[0]]) == b"v" and store.get(keys[ports[1]]) == b"v"
    store.close()
