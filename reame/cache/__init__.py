"""The persistent shared-prefix KV cache: snapshots in RAM and on disk, found by prefix."""

from reame.cache.prefix import PrefixCache, common_prefix
from reame.cache.store import Snapshot

__all__ = ["PrefixCache", "Snapshot", "common_prefix"]
