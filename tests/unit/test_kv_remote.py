"""The fleet's KV tier on FakeBackend engines sharing an ARCA on a thread: a document one node prefilled is
restored by another with the same output; the store's keys and chunks; a store that is down, dies mid-fetch
or mid-publish, sends damaged or foreign data, or is too slow is a miss and a prefill, never an error;
`reame warm` publishes; Redis Cluster's slots and redirections."""

import random
import sys
import threading
import time
import tracemalloc

import pytest

from reame.arca import cluster
from reame.arca.client import StoreAddress, StoreClient
from reame.arca.stores import parse_remote
from reame.cache import PrefixCache, remote
from reame.cache.remote import RemoteKV, chunk_key, decode_meta, encode_meta, index_key, meta_key
from reame.errors import ConfigError
from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.arca_thread import arca_thread
from tests.fakes.backend import FakeBackend
from tests.live_server import free_port
from tests.waiting import wait_until

FINGERPRINT = b"m" * 32
GREEDY = SamplingParams(temperature=0, max_tokens=24)
DOCUMENT = "the fleet manual: " + "a document is prefilled once per fleet, not once per machine. " * 8


def client(port: int) -> StoreClient:
    return StoreClient(StoreAddress("127.0.0.1", port, "", 0))


def node_cache(directory, port, fingerprint=FINGERPRINT, **options) -> PrefixCache:
    options.setdefault("publish_budget_bytes", 64 << 20)
    shared = RemoteKV(lambda: client(port), fingerprint, 2.0, options.pop("publish_budget_bytes"))
    return PrefixCache(fingerprint, directory, block_tokens=4, min_new_tokens=8, remote=shared, **options)


def run(prompts, prefix_cache=None):
    backend = FakeBackend(n_ctx=2048)
    with Engine(backend, cache=prefix_cache) as engine:  # closing it publishes what is queued
        results = [engine.generate(GenerationRequest(prompt, GREEDY)) for prompt in prompts]
    return backend, results


@pytest.fixture
def store(tmp_path):
    with arca_thread(tmp_path / "arca") as port:
        yield port


def prompt_tokens(text: str) -> int:
    return len(FakeBackend().tokenize(text))


def test_a_document_one_node_prefilled_is_restored_by_another_with_the_same_output(store, tmp_path):
    first_cache = node_cache(tmp_path / "a", store)
    _, (first,) = run([DOCUMENT + "who reads it?"], first_cache)
    assert first_cache.remote is None  # closed with the engine, after publishing
    second_cache = node_cache(tmp_path / "b", store)
    backend, (second,) = run([DOCUMENT + "who pays for it?"], second_cache)
    _, (plain,) = run([DOCUMENT + "who pays for it?"])
    assert second.tokens == plain.tokens
    assert second.finish.usage.cached_tokens >= prompt_tokens(DOCUMENT)
    assert len(backend.decode_calls[0]) == prompt_tokens(DOCUMENT + "who pays for it?") - \
        second.finish.usage.cached_tokens  # only the question was prefilled
    third_cache = node_cache(tmp_path / "b", store)  # B kept it on its own disk: no fetch needed now
    _, (third,) = run([DOCUMENT + "who pays for it?"], third_cache)
    assert third.tokens == plain.tokens


def test_the_store_holds_chunks_a_meta_and_one_key_per_block(store, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    cache = node_cache(tmp_path / "a", store)
    run([DOCUMENT + "how big?"], cache)
    keys = client(store).call(b"KEYS", b"reame:kv:*")
    metas = [key for key in keys if key.endswith(b"}:m")]
    assert len(metas) == 1
    name = metas[0].split(b"{")[1].split(b"}")[0].decode()
    chunks, size, tokens = decode_meta(client(store).get(meta_key(name)))
    assert chunks > 1 and size > 1000 and len(tokens) >= prompt_tokens(DOCUMENT)
    assert all(len(client(store).get(chunk_key(name, i))) <= 1000 for i in range(chunks))
    blocks = [key for key in keys if b"}:b:" in key]
    assert len(blocks) == len(tokens) // 4 and all(client(store).get(key) == name.encode() for key in blocks)
    assert len({cluster.key_slot(key) for key in blocks}) == 1  # one MGET finds them, in a cluster too
    assert len({cluster.key_slot(key) for key in keys if name.encode() in key and b"}:b:" not in key}) == 1


def test_another_models_snapshot_is_never_restored(store, tmp_path):
    run([DOCUMENT + "which model?"], node_cache(tmp_path / "a", store))
    other = node_cache(tmp_path / "b", store, fingerprint=b"o" * 32)
    _, (result,) = run([DOCUMENT + "which model?"], other)
    assert result.finish.usage.cached_tokens == 0


def test_a_damaged_chunk_is_a_miss_and_a_prefill_with_the_same_output(store, tmp_path):
    run([DOCUMENT + "is it whole?"], node_cache(tmp_path / "a", store))
    chunk = next(key for key in client(store).call(b"KEYS", b"reame:kv:*") if b"}:c:0" in key)
    data = bytearray(client(store).get(chunk))
    data[-10] ^= 0xFF
    client(store).set(chunk, bytes(data))
    cache = node_cache(tmp_path / "b", store)
    shared = cache.remote
    _, (result,) = run([DOCUMENT + "is it whole?"], cache)
    _, (plain,) = run([DOCUMENT + "is it whole?"])
    assert result.tokens == plain.tokens and result.finish.usage.cached_tokens == 0
    assert shared.stats()["damaged"] == 1 and shared.stats()["hits"] == 0


def test_without_a_store_a_node_prefills_as_if_it_had_none(tmp_path):
    cache = node_cache(tmp_path / "a", free_port())  # nothing listens there
    started = time.monotonic()
    _, (result,) = run([DOCUMENT + "anyone there?"], cache)
    _, (plain,) = run([DOCUMENT + "anyone there?"])
    assert result.tokens == plain.tokens and time.monotonic() - started < 5


class Dying:
    """A store client that answers its first `calls` calls through `real`, then is down (None)."""

    def __init__(self, real: StoreClient, calls: int) -> None:
        self.real, self.left, self.timeout_s = real, calls, real.timeout_s

    def call(self, *words, timeout_s=None):
        self.left -= 1
        return self.real.call(*words, timeout_s=timeout_s) if self.left >= 0 else None

    def mget(self, keys):
        self.left -= 1
        return self.real.mget(keys) if self.left >= 0 else [None] * len(keys)

    def close(self):
        self.real.close()


def test_a_store_that_dies_mid_fetch_or_mid_publish_loses_only_the_snapshot(store, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    dying_publisher = PrefixCache(FINGERPRINT, tmp_path / "a", block_tokens=4, min_new_tokens=8,
                                  remote=RemoteKV(lambda: Dying(client(store), 3), FINGERPRINT, 2.0, 64 << 20))
    shared = dying_publisher.remote
    run([DOCUMENT + "half sent?"], dying_publisher)
    assert shared.stats()["publish_failed"] == 1 and shared.stats()["published"] == 0
    assert client(store).call(b"KEYS", b"reame:kv:*}:m") == []  # no meta, no block key: nobody finds it
    run([DOCUMENT + "half sent?"], node_cache(tmp_path / "b", store))  # published whole this time
    dying_reader = PrefixCache(FINGERPRINT, tmp_path / "c", block_tokens=4, min_new_tokens=8,
                               remote=RemoteKV(lambda: Dying(client(store), 3), FINGERPRINT, 2.0, 64 << 20))
    shared = dying_reader.remote
    _, (result,) = run([DOCUMENT + "half sent?"], dying_reader)
    _, (plain,) = run([DOCUMENT + "half sent?"])
    assert result.tokens == plain.tokens and result.finish.usage.cached_tokens == 0
    assert shared.stats()["misses"] == 1 and shared.stats()["hits"] == 0


def test_a_fetch_past_its_deadline_is_abandoned(store, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    run([DOCUMENT + "too slow?"], node_cache(tmp_path / "a", store))

    class Slow(StoreClient):
        def call(self, *words, timeout_s=None):
            if b"}:c:" in words[1]:
                time.sleep(0.2)
            return super().call(*words, timeout_s=timeout_s)
    slow = PrefixCache(FINGERPRINT, tmp_path / "b", block_tokens=4, min_new_tokens=8,
                       remote=RemoteKV(lambda: Slow(StoreAddress("127.0.0.1", store, "", 0)), FINGERPRINT, 0.3,
                                       64 << 20))
    shared = slow.remote
    _, (result,) = run([DOCUMENT + "too slow?"], slow)
    assert result.finish.usage.cached_tokens == 0 and shared.stats()["timeouts"] == 1


class Gated(StoreClient):
    """A store client whose reads of the first snapshot's chunks it meets hold its connection until `gate`
    opens (a large transfer in progress); every chunk read is counted in `reads`."""

    def __init__(self, address, gate: threading.Event, reads: list) -> None:
        super().__init__(address)
        self.gate, self.reads = gate, reads

    def _request(self, words, timeout_s):
        key = words[-1]
        if b"}:c:" in key:
            self.reads.append(key)
            if key.split(b"}:c:")[0] == self.reads[0].split(b"}:c:")[0] and not self.gate.wait(10):
                raise AssertionError("the gate stayed shut")
        return super()._request(words, timeout_s)


def gated_node(store, tmp_path, gate, reads) -> PrefixCache:
    shared = RemoteKV(lambda: Gated(StoreAddress("127.0.0.1", store, "", 0), gate, reads), FINGERPRINT, 10.0, 64 << 20)
    return PrefixCache(FINGERPRINT, tmp_path, block_tokens=4, min_new_tokens=8, remote=shared)


def looking_up(cache: PrefixCache, text: str, found: dict) -> threading.Thread:
    """A lookup on a thread of its own (a request's), its snapshot put in `found[text]`."""
    thread = threading.Thread(target=lambda: found.update({text: cache.lookup(FakeBackend().tokenize(text)[:-1])}))
    thread.start()
    return thread


def test_requests_for_one_document_arriving_together_fetch_it_once(store, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    run([DOCUMENT + "who fetches?"], node_cache(tmp_path / "a", store))
    gate, reads, found = threading.Event(), [], {}
    cache = gated_node(store, tmp_path / "b", gate, reads)
    first = looking_up(cache, DOCUMENT + "who fetches?", found)
    wait_until(lambda: reads, what="the first fetch to read a chunk")
    second = looking_up(cache, DOCUMENT + "who else?", found)
    wait_until(lambda: inside(second, "_share") or len(reads) > 1, what="the second to wait or fetch")
    gate.set()
    first.join(10)
    second.join(10)
    snapshot = found[DOCUMENT + "who fetches?"]
    assert snapshot is not None and found[DOCUMENT + "who else?"] is snapshot
    assert len(reads) == len(set(reads)), "each chunk was read once"
    assert cache.remote.stats()["hits"] == 2 and cache.remote.stats()["fetches_shared"] == 1
    cache.close()


def inside(thread: threading.Thread, function: str) -> bool:
    """Whether `thread` is running `function` now (somewhere on its stack)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_a_large_fetch_under_way_holds_up_no_other_documents_lookup(store, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    other = "another manual: " + "a lookup never waits behind someone else's fetch. " * 8
    run([DOCUMENT + "slow?", other + "fast?"], node_cache(tmp_path / "a", store))
    gate, reads, found = threading.Event(), [], {}
    cache = gated_node(store, tmp_path / "b", gate, reads)
    slow = looking_up(cache, DOCUMENT + "slow?", found)
    wait_until(lambda: reads, what="the slow fetch to read a chunk")
    try:
        assert cache.lookup(FakeBackend().tokenize(other + "fast?")[:-1]) is not None
        assert slow.is_alive() and inside(slow, "_request"), "found while the slow fetch still holds its connection"
    finally:
        gate.set()
    slow.join(10)
    assert found[DOCUMENT + "slow?"] is not None and cache.remote.stats()["hits"] == 2
    cache.close()


def test_publishing_is_bounded_by_its_byte_budget(store, tmp_path):
    cache = node_cache(tmp_path / "a", store, publish_budget_bytes=10)
    shared = cache.remote
    run([DOCUMENT + "room?"], cache)
    assert shared.stats()["publish_skipped"] == 1 and shared.stats()["published"] == 0


def test_warm_publishes_what_this_node_already_had_on_its_disk(store, tmp_path):
    backend = FakeBackend(n_ctx=2048)
    with Engine(backend, cache=PrefixCache(FINGERPRINT, tmp_path / "a", block_tokens=4, min_new_tokens=8)) as engine:
        engine.generate(GenerationRequest(DOCUMENT, GREEDY, warm=True))  # warmed before the fleet had a store
    cache = node_cache(tmp_path / "a", store)
    with Engine(FakeBackend(n_ctx=2048), cache=cache) as engine:
        request = GenerationRequest(DOCUMENT, GREEDY, warm=True)
        assert engine.generate(request).finish.usage.cached_tokens > 0
        assert cache.share(engine.prompt_tokens(request))
    _, (result,) = run([DOCUMENT + "from the warm node"], node_cache(tmp_path / "b", store))
    assert result.finish.usage.cached_tokens >= prompt_tokens(DOCUMENT) - 1


@pytest.mark.parametrize("value", [b"", b"REAMEKVM", encode_meta(1, 10, [1, 2])[:-1],
                                   encode_meta(2, 10, [1, 2]), encode_meta(1, 0, [1, 2]), encode_meta(1, 10, []),
                                   b"XXXXXXXX" + encode_meta(1, 10, [1, 2])[8:]])
def test_a_meta_that_is_not_whole_and_ours_is_none(value):
    assert decode_meta(value) is None
    assert decode_meta(encode_meta(1, 10, [1, 2])) == (1, 10, (1, 2))


def test_random_meta_values_are_decoded_fast_and_bounded():
    generator = random.Random(3)
    tracemalloc.start()
    started = time.perf_counter()
    for _ in range(5000):
        value = generator.randbytes(generator.randrange(0, 64))
        if generator.random() < 0.5:
            value = b"REAMEKVM" + value
        decode_meta(value)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - started < 5 and peak < 4 << 20


def test_index_keys_name_the_model_so_other_models_never_meet():
    assert index_key(b"a" * 32, b"k" * 16) != index_key(b"b" * 32, b"k" * 16)


# --- Redis Cluster ---

@pytest.mark.parametrize("key,slot", [(b"foo", 12182), (b"123456789", 12739), (b"{user1000}.following", 3443),
                                      (b"{user1000}.followers", 3443), (b"foo{}{bar}", 8363), (b"{}", 15257)])
def test_key_slots_are_redis_clusters(key, slot):
    assert cluster.key_slot(key) == slot


def test_a_redirection_names_its_node_and_anything_else_is_none():
    assert cluster._redirection("MOVED 3999 127.0.0.1:6381") == ("MOVED", ("127.0.0.1", 6381))
    assert cluster._redirection("ASK 3999 [::1]:7000") == ("ASK", ("::1", 7000))
    for message in ("ERR unknown", "MOVED 3999", "MOVED 1 host:x", "ASK 1 :80", "MOVED 1 h:0"):
        assert cluster._redirection(message) is None


def test_a_slot_map_reply_that_is_not_one_is_none():
    good = [[0, 8191, [b"10.0.0.1", 7000, b"id"]], [8192, 16383, [b"", 7001, b"id"]]]
    slots = cluster._slot_map(good, "10.0.0.9")
    assert slots[0] == ("10.0.0.1", 7000) and slots[16383] == ("10.0.0.9", 7001)
    for bad in (b"x", [[0, 16384, [b"h", 1]]], [[5, 1, [b"h", 1]]], [[0, 1, [b"h", 0]]], [[0, 1]],
                [[0, 1, [b"a b", 1]]], [["0", 1, [b"h", 1]]]):
        assert cluster._slot_map(bad, "h") is None


def test_commands_are_routed_by_their_key():
    assert cluster.command_key((b"GET", b"k")) == b"k"
    assert cluster.command_key((b"XREAD", b"COUNT", b"1", b"STREAMS", b"s", b"0")) == b"s"
    assert cluster.command_key((b"XREAD", b"STREAMS")) is None and cluster.command_key((b"PING",)) is None


def test_a_cluster_address_lists_its_nodes():
    address = parse_remote("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert address.seeds == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002)) and address.password == "pw"
    for bad in ("redis+cluster://", "redis+cluster://h:x", "redis+cluster://h/0", "redis+cluster://a,,b"):
        with pytest.raises(ConfigError):
            parse_remote(bad)
