"""Issue 49, finding 3: the shared store was trusted. Whoever could write to it rewrote a stored answer and node B
served it (with a phishing link) and copied it to its own disk. With `arca.secret`, nodes seal what they write
and use only what is sealed with the fleet's secret: a value planted, rewritten, moved under another key or
sealed with another secret is a miss, counted, and the node answers itself. Against a real ARCA over RESP."""

import pytest

from reame.answers import AnswerCache, SharedAnswers
from reame.arca.client import StoreAddress, StoreClient
from reame.arca.sealed import TAG_BYTES, TAG_FIELD, SealedStore
from reame.cache.answers import RamAnswers
from reame.cache.remote import RemoteKV, chunk_key, encode_meta, meta_key
from reame.cache.store import Snapshot
from reame.engine import Engine
from tests.arca_thread import arca_thread
from tests.fakes.backend import FakeBackend
from tests.unit.test_answer_cache import CHAT, FINGERPRINT, metric
from tests.unit.test_server import Live

SECRET = b"the fleet's secret"
MODEL = bytes(range(32))  # a model's fingerprint, as snapshots carry it


@pytest.fixture
def port(tmp_path):
    with arca_thread(tmp_path) as port:
        yield port


def client(port: int) -> StoreClient:
    return StoreClient(StoreAddress("127.0.0.1", port, "", 0), timeout_s=2.0)


def test_a_value_is_used_only_under_the_key_and_the_secret_it_was_sealed_with(port):
    sealed, raw = SealedStore(client(port), SECRET), client(port)
    assert sealed.set(b"k", b"the answer") and sealed.get(b"k") == b"the answer"
    assert raw.get(b"k")[TAG_BYTES:] == b"the answer"  # what the store holds: the tag, then the value
    raw.set(b"moved", raw.get(b"k"))
    raw.set(b"planted", b"x" * TAG_BYTES + b"a phishing link")
    raw.set(b"short", b"tiny")
    assert sealed.get(b"moved") is None and sealed.get(b"planted") is None and sealed.get(b"short") is None
    assert sealed.mget([b"k", b"planted", b"nothing"]) == [b"the answer", None, None]
    assert SealedStore(client(port), b"another fleet").get(b"k") is None
    assert sealed.refused == 4


def test_a_sealed_store_reports_its_stores_failures(tmp_path):
    """The corpus reader asks its store how often it was down when a read finds nothing (to back off): over
    a sealed store that question used to end the reader thread."""
    with arca_thread(tmp_path) as store_port:
        sealed = SealedStore(client(store_port), SECRET)
        assert sealed.xread(b"s", b"0", 10, None) == [] and sealed.failures == 0
    assert sealed.get(b"k") is None and sealed.failures == 1  # the store has gone


def test_stream_entries_without_the_fleets_tag_are_skipped(port):
    sealed, raw = SealedStore(client(port), SECRET), client(port)
    assert sealed.xadd(b"s", {b"q": b"When do you open?", b"a": b"reame:answer:1"}, 100)
    assert raw.xadd(b"s", {b"q": b"When do you open?", b"a": b"reame:answer:forged"}, 100)
    (_, first), (_, planted) = raw.xread(b"s", b"0", 10, None)
    assert raw.xadd(b"s", {**first, b"a": b"reame:answer:forged"}, 100)  # the tag kept, a field changed
    entries = sealed.xread(b"s", b"0", 10, None)
    assert [fields for _, fields in entries] == [{b"q": b"When do you open?", b"a": b"reame:answer:1"}]
    assert TAG_FIELD not in planted and sealed.refused == 2


def test_a_rewritten_answer_is_not_served_and_the_node_answers_itself(port):
    """The finding as written: node A answers, someone rewrites the stored answer, node B asks the same."""
    def node(store) -> tuple[Live, Engine, FakeBackend]:
        backend = FakeBackend(n_ctx=1024, n_seq_max=2)
        engine = Engine(backend).start()
        live = Live(engine)
        live.model.answers = AnswerCache([RamAnswers(1 << 20), SharedAnswers(store, 60_000)], FINGERPRINT)
        return live, engine, backend

    (first, first_engine, _), (second, second_engine, backend) = (node(SealedStore(client(port), SECRET))
                                                                 for _ in range(2))
    try:
        status, answered = first.json("POST", "/v1/chat/completions", CHAT)
        assert status == 200
        raw = client(port)
        (key,) = [key for key in raw.call(b"KEYS", b"*") if key.startswith(b"reame:answer:")]
        raw.set(key, raw.get(key).replace(answered["choices"][0]["message"]["content"].encode(),
                                          b"Visit http://evil.example"))
        response, data = second.request("POST", "/v1/chat/completions", CHAT)
        assert response.status == 200 and response.getheader("X-Reame-Cache") == "miss"
        assert b"evil.example" not in data and backend.decode_calls  # computed, not taken from the store
        assert metric(second, "reame_answers_hits_total") == 0
    finally:
        for live, engine in ((first, first_engine), (second, second_engine)):
            live.close()
            engine.close()


def test_a_planted_snapshot_meta_claiming_gigabytes_allocates_nothing(port):
    """A 424-byte meta claiming 4 GiB made RemoteKV.fetch allocate 4 GiB (MemoryError, a 500)."""
    import tracemalloc
    raw = client(port)
    raw.set(meta_key("a" * 40), encode_meta(1024, (4 << 30) - 1, tuple(range(100))))
    for store in (lambda: client(port), lambda: SealedStore(client(port), SECRET)):
        remote = RemoteKV(store, MODEL, 2.0, 1 << 20)
        try:
            tracemalloc.start()
            assert remote.fetch("a" * 40, list(range(100)), 0) is None
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 16 << 20
        finally:
            remote.close()


def test_sealed_snapshots_travel_between_nodes_and_a_relabelled_one_does_not(port):
    """A store writer relabelling KV computed from other text under a popular prompt's tokens."""
    tokens = tuple(range(1, 300))
    snapshot = Snapshot(tokens, b"kv of the real document" * 1000)
    publisher = RemoteKV(lambda: SealedStore(client(port), SECRET), MODEL, 2.0, 1 << 30)
    reader = RemoteKV(lambda: SealedStore(client(port), SECRET), MODEL, 2.0, 1 << 30)
    try:
        name = "b" * 40
        assert publisher.publish(name, snapshot, [])
        assert publisher.flush(10)
        fetched = reader.fetch(name, list(tokens), 0)
        assert fetched is not None and bytes(fetched.blob) == snapshot.blob
        raw = client(port)
        relabelled = raw.get(chunk_key(name, 0))[TAG_BYTES:].replace(b"real", b"fake")
        raw.set(chunk_key(name, 0), relabelled)
        assert reader.fetch(name, list(tokens), 0) is None
    finally:
        publisher.close()
        reader.close()
