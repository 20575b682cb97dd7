"""`arca.remote` as a node reads it: one store (ARCA, Redis, Valkey) or a Redis Cluster, and a client for it."""

from __future__ import annotations

import urllib.parse

from reame.arca.client import REDIS_PORT, TIMEOUT_S, StoreAddress, StoreClient, StoreCommands
from reame.arca.cluster import ClusterAddress, ClusterClient
from reame.errors import ConfigError

CLUSTER_SCHEME = "redis+cluster://"


def parse_remote(text: str) -> StoreAddress | ClusterAddress:
    """`redis+cluster://[:password@]host1:port1,host2:port2` (any nodes of the cluster; port 6379 when
    omitted), else what StoreAddress.parse takes."""
    if not text.startswith(CLUSTER_SCHEME):
        return StoreAddress.parse(text)
    rest = text[len(CLUSTER_SCHEME):].rstrip("/")
    credentials, _, hosts = rest.rpartition("@")
    password = urllib.parse.unquote(credentials.partition(":")[2]) if credentials else ""
    seeds = []
    for part in hosts.split(","):
        try:
            parsed = urllib.parse.urlsplit("redis://" + part.strip())
            if not parsed.hostname or parsed.path or parsed.username or parsed.password:
                raise ValueError(part)
            seeds.append((parsed.hostname, parsed.port or REDIS_PORT))
        except ValueError:
            raise ConfigError(f"arca.remote: a cluster is redis+cluster://[:password@]host:port,host:port, "
                              f"got {text!r}") from None
    return ClusterAddress(tuple(seeds), password)


def connect(address: StoreAddress | ClusterAddress, timeout_s: float = TIMEOUT_S) -> StoreCommands:
    if isinstance(address, ClusterAddress):
        return ClusterClient(address, timeout_s)
    return StoreClient(address, timeout_s)


def describe(address: StoreAddress | ClusterAddress) -> str:
    if isinstance(address, ClusterAddress):
        return "the Redis Cluster at " + ",".join(f"{host}:{port}" for host, port in address.seeds)
    return f"the store at {address.host}:{address.port}"


def shared_store(remote: str, secret: str) -> StoreCommands:
    """A new client of the store `remote` (arca.remote) names (each user of the store has its own connection),
    its values sealed with `secret` (arca.secret) when there is one."""
    store = connect(parse_remote(remote))
    if not secret:
        return store
    from reame.arca.sealed import SealedStore
    return SealedStore(store, secret.encode())


def store_description(remote: str, secret: str) -> str:
    sealed = "sealed with arca.secret" if secret else \
        "unsealed: whoever can write to it decides what this node serves from it (arca.secret)"
    return f"{describe(parse_remote(remote))}, {sealed}"
