"""A Redis Cluster as one store (`arca.remote = redis+cluster://host1:port1,host2:port2`).

Each key lives in one of 16,384 hash slots (CRC16 of the key, or of its `{hash tag}`), each slot on one
node. The client learns which node serves which slot from CLUSTER SLOTS (asked of any node it knows),
sends each command to its key's node over that node's own StoreClient, and follows the cluster's
redirections: MOVED (the slot lives elsewhere now: remember it, and relearn the map) and ASK (the slot
is migrating: ask the other node once, after ASKING). A user who outgrows one Redis adds nodes, not
code. Like every store, a cluster that is down or confused is a miss, never a failed request.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from reame.arca.client import TIMEOUT_S, ReplyError, StoreAddress, StoreClient, StoreCommands

log = logging.getLogger("reame.arca")

SLOTS = 16384
MAX_REDIRECTIONS = 3
MAX_MAPPED_RANGES = 1024  # slot ranges in a CLUSTER SLOTS reply (Redis advises at most 1,000 nodes)


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


CRC16 = _crc16_table()  # CRC16-CCITT (XMODEM), as Redis Cluster hashes keys


def key_slot(key: bytes) -> int:
    """The hash slot of `key`: of the text between its first `{` and the next `}` when that is not empty."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    crc = 0
    for byte in key:
        crc = ((crc << 8) & 0xFFFF) ^ CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc % SLOTS


def command_key(words: tuple[bytes, ...]) -> bytes | None:
    """The key a command is routed by (the first one: a multi-key command keeps its keys in one slot)."""
    name = words[0].upper()
    if name in (b"XREAD", b"XREADGROUP"):
        upper = [word.upper() for word in words]
        return words[upper.index(b"STREAMS") + 1] if b"STREAMS" in upper[:-1] else None
    return words[1] if len(words) > 1 else None


@dataclass(frozen=True)
class ClusterAddress:
    seeds: tuple[tuple[str, int], ...]
    password: str


class ClusterClient(StoreCommands):
    def __init__(self, address: ClusterAddress, timeout_s: float = TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._nodes: dict[tuple[str, int], StoreClient] = {}
        self._slots: list[tuple[str, int] | None] = [None] * SLOTS
        self._mapped: set[tuple[str, int]] = set()  # the nodes the slot map names
        self._stale = True  # the slot map must be (re)learned before the next command

    @property
    def failures(self) -> int:
        with self._lock:
            return sum(node.failures for node in self._nodes.values())

    def call(self, *words: bytes, timeout_s: float | None = None) -> object:
        key = command_key(words)
        if key is None:
            return None
        slot = key_slot(key)
        target, asking = self._owner(slot), False
        for _ in range(MAX_REDIRECTIONS + 1):
            if target is None:
                return None
            reply = self._node(target).request(words, timeout_s, asking=asking)
            if not isinstance(reply, ReplyError):
                return reply
            redirection = _redirection(str(reply))
            if redirection is None:
                log.warning("the cluster refused %s: %s", words[0].decode(), reply)
                return None
            kind, node = redirection
            if not self._named(node):  # a store can name any host: the password goes to mapped nodes only
                log.warning("the cluster redirected %s to %s:%d, which its slot map does not name: not followed "
                            "(the map is read again)", words[0].decode(), node[0][:64], node[1])
                with self._lock:
                    self._stale = True
                return None
            if kind == "MOVED":
                with self._lock:
                    self._slots[slot] = node
                    self._stale = True
            target, asking = node, kind == "ASK"
        log.warning("the cluster redirected %s more than %d times", words[0].decode(), MAX_REDIRECTIONS)
        return None

    def close(self) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

    def _named(self, node: tuple[str, int]) -> bool:
        """Whether the slot map or the configured seeds name `node`."""
        with self._lock:
            return node in self.address.seeds or node in self._mapped

    def _node(self, where: tuple[str, int]) -> StoreClient:
        with self._lock:
            node = self._nodes.get(where)
            if node is None:
                node = self._nodes[where] = StoreClient(StoreAddress(where[0], where[1], self.address.password, 0),
                                                        self.timeout_s)
            return node

    def _owner(self, slot: int) -> tuple[str, int] | None:
        with self._lock:
            stale = self._stale
        if stale:
            self._learn_slots()
        with self._lock:
            return self._slots[slot]

    def _learn_slots(self) -> None:
        """Ask the known nodes, then the seeds, for the slot map; the first whole answer wins."""
        with self._lock:
            candidates = list(dict.fromkeys([*self._nodes, *self.address.seeds]))
        for where in candidates:
            slots = _slot_map(self._node(where).request((b"CLUSTER", b"SLOTS")), where[0])
            if slots is not None:
                with self._lock:
                    self._slots = slots
                    self._mapped = {node for node in slots if node is not None}
                    self._stale = False
                return


def _slot_map(reply: object, asked_host: str) -> list[tuple[str, int] | None] | None:
    """CLUSTER SLOTS' reply as slot -> primary node, or None for a reply that is not one."""
    if not isinstance(reply, list) or len(reply) > MAX_MAPPED_RANGES:
        return None
    slots: list[tuple[str, int] | None] = [None] * SLOTS
    try:
        for item in reply:
            start, end, primary = item[0], item[1], item[2]
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end < SLOTS):
                return None
            host = primary[0].decode() if isinstance(primary[0], bytes) and primary[0] else asked_host
            port = primary[1]
            if not (isinstance(port, int) and 0 < port < 65536) or any(c.isspace() for c in host):
                return None
            slots[start:end + 1] = [(host, port)] * (end - start + 1)
    except (TypeError, IndexError, UnicodeDecodeError):
        return None
    return slots


def _redirection(message: str) -> tuple[str, tuple[str, int]] | None:
    """("MOVED" or "ASK", node) of a redirection error (`MOVED 3999 127.0.0.1:6381`), else None."""
    words = message.split()
    if len(words) != 3 or words[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = words[2].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return words[0], (host.strip("[]"), int(port))
