"""ARCA: the Redis-protocol daemon (exact answer cache, shared corpus) and the client Reame nodes use."""
