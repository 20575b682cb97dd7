"""The exact answer cache on FakeBackend servers: one node alone (RAM, then its disk, which a restarted
or sibling process reads), and nodes sharing an ARCA on a thread: hits without the engine, what is never
cached, the opt-out, a store that goes away."""

import json

import pytest

from reame.arca.client import StoreAddress, StoreClient
from reame.engine import Engine, FinishEvent, Usage
from reame.errors import ConfigError
from tests.fakes.backend import FakeBackend
from reame.cache.answers import DiskAnswers, RamAnswers
from reame.answers import AnswerCache, SharedAnswers
from reame.server.exchange import REPLAY_MAX_CHARS, replayed
from tests.arca_thread import arca_thread
from tests.live_server import free_port
from tests.unit.test_server import Live

FINGERPRINT = b"fake-model"
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12, "temperature": 0}


@pytest.mark.parametrize("text,address", [
    ("arca.lan", StoreAddress("arca.lan", 6420, "", 0)),  # the original's form names an ARCA: its port
    ("10.0.0.5:6421", StoreAddress("10.0.0.5", 6421, "", 0)),
    ("[::1]", StoreAddress("::1", 6420, "", 0)),
    ("[fd00::5]:7000", StoreAddress("fd00::5", 7000, "", 0)),
    ("fd00::5", StoreAddress("fd00::5", 6420, "", 0)),
    ("redis://cache.lan", StoreAddress("cache.lan", 6379, "", 0)),  # a URL reads as Redis's clients read it
    ("redis://:s%40cret@10.0.0.5:6380/2", StoreAddress("10.0.0.5", 6380, "s@cret", 2)),
])
def test_a_store_is_named_by_host_host_port_or_a_redis_url(text, address):
    assert StoreAddress.parse(text) == address


@pytest.mark.parametrize("text", ["", "host:", "host:0", "host:65536", "host:x", "host:\u0663", "[::1]:", "[::1]x",
                                  "a b", "user@host:1", "http://host:1", "redis://", "redis://h:x", "redis://h/db",
                                  "host:1/0"])
def test_a_bad_store_address_is_one_config_error_line(text):
    with pytest.raises(ConfigError) as raised:
        StoreAddress.parse(text)
    assert "\n" not in str(raised.value) and repr(text) in str(raised.value)


@pytest.fixture
def store(tmp_path):
    with arca_thread(tmp_path) as port:
        yield port


def shared(port: int, ttl_ms: int = 60_000) -> SharedAnswers:
    return SharedAnswers(StoreClient(StoreAddress("127.0.0.1", port, "", 0)), ttl_ms)


def node(*tiers) -> tuple[Live, Engine, FakeBackend]:
    backend = FakeBackend(n_ctx=1024, n_seq_max=2)
    engine = Engine(backend).start()
    live = Live(engine)
    live.model.answers = AnswerCache(list(tiers), FINGERPRINT)
    return live, engine, backend


@pytest.fixture
def nodes(store):
    made = [node(RamAnswers(1 << 20), shared(store)) for _ in range(2)]
    yield made
    for live, engine, _ in made:
        live.close()
        engine.close()


def metric(live: Live, name: str, **labels: str) -> float:
    samples = live.json("GET", "/stats")[1]["samples"]
    return sum(s["value"] for s in samples if s["name"] == name and all(s["labels"].get(k) == v
                                                                         for k, v in labels.items()))


def stream_text(live: Live, body: dict) -> tuple[str, dict]:
    response, data = live.request("POST", "/v1/chat/completions", dict(body, stream=True,
                                                                      stream_options={"include_usage": True}))
    chunks = [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def test_an_answer_from_one_node_is_a_hit_on_the_other_without_its_engine(nodes):
    (first, _, _), (second, _, second_backend) = nodes
    status, answered = first.json("POST", "/v1/chat/completions", CHAT)
    assert status == 200 and metric(first, "reame_answers_misses_total") == 1
    assert metric(first, "reame_answers_stored_total") == 1
    status, hit = second.json("POST", "/v1/chat/completions", CHAT)
    assert status == 200 and second_backend.decode_calls == []  # the engine never ran
    assert hit["choices"][0]["message"] == answered["choices"][0]["message"]
    assert hit["choices"][0]["finish_reason"] == answered["choices"][0]["finish_reason"]
    assert hit["usage"]["completion_tokens"] == answered["usage"]["completion_tokens"]
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == hit["usage"]["prompt_tokens"]
    assert metric(second, "reame_answers_hits_total") == 1
    text, usage = stream_text(second, CHAT)  # streamed too
    assert text == answered["choices"][0]["message"]["content"] and second_backend.decode_calls == []
    assert usage["completion_tokens"] == answered["usage"]["completion_tokens"]


@pytest.mark.parametrize("change", [
    {"max_tokens": 11}, {"temperature": 0.5, "seed": 1}, {"stop": ["x"]}, {"logit_bias": {"97": 5}},
    {"messages": [{"role": "user", "content": "hello there!"}]}, {"grammar": "root ::= [a-z ]+"},
])
def test_anything_that_can_change_the_answer_changes_the_key(nodes, change):
    (first, _, _), (second, _, second_backend) = nodes
    first.json("POST", "/v1/chat/completions", CHAT)
    assert second.json("POST", "/v1/chat/completions", dict(CHAT, **change))[0] == 200
    assert second_backend.decode_calls != []


def test_a_seeded_sampled_answer_is_shared_but_an_unseeded_one_never_is(nodes):
    (first, _, _), (second, _, second_backend) = nodes
    seeded = dict(CHAT, temperature=0.9, seed=7)
    first.json("POST", "/v1/chat/completions", seeded)
    second.json("POST", "/v1/chat/completions", seeded)
    assert second_backend.decode_calls == []
    unseeded = dict(CHAT, temperature=0.9)
    first.json("POST", "/v1/chat/completions", unseeded)
    assert metric(first, "reame_answers_stored_total") == 1  # only the seeded one
    second.json("POST", "/v1/chat/completions", unseeded)
    assert second_backend.decode_calls != []


def test_a_cut_answer_is_never_kept(store):
    cache = AnswerCache([shared(store, 0)], FINGERPRINT)
    from reame.engine import FinishEvent, Usage
    usage = Usage(5, 3, 0.1, 0.1)
    assert cache.put(b"k1", "abc", FinishEvent("cancelled", usage)) is False
    assert cache.put(b"k2", "abc", FinishEvent("length", usage, "the context is full")) is False
    assert cache.put(b"k3", "abc", FinishEvent("error", usage, "boom")) is False
    assert cache.put(b"k4", "abc", FinishEvent("length", usage)) is True  # its max_tokens is in the key
    assert cache.get(b"k1") is None and cache.get(b"k4").text == "abc"
    assert cache.get(b"k4").finish(5).usage.cached_tokens == 5


def test_without_its_store_a_node_answers_as_if_it_had_none(tmp_path):
    live, engine, backend = node(shared(free_port()))  # nothing listens there
    try:
        for _ in range(2):
            status, body = live.json("POST", "/v1/chat/completions", CHAT)
            assert status == 200 and body["choices"][0]["message"]["content"] is not None
        assert live.model.answers.tiers[0].store.failures == 1  # then it waits a backoff instead of trying each time
    finally:
        live.close()
        engine.close()


@pytest.fixture
def alone(tmp_path):
    """One node with the default tiers (RAM, then disk), and a way to make it again as a restart would."""
    made = []

    def start(ram_bytes: int = 1 << 20, disk_bytes: int = 1 << 20):
        made.append(node(RamAnswers(ram_bytes), DiskAnswers(tmp_path / "answers", disk_bytes)))
        return made[-1]
    yield start
    for live, engine, _ in made:
        live.close()
        engine.close()


def test_one_node_alone_answers_a_repeat_from_ram_and_says_so(alone):
    live, _, backend = alone()
    response, first = live.request("POST", "/v1/chat/completions", CHAT)
    assert response.status == 200 and response.getheader("X-Reame-Cache") == "miss"
    calls = len(backend.decode_calls)
    response, again = live.request("POST", "/v1/chat/completions", CHAT)
    assert response.getheader("X-Reame-Cache") == "hit" and len(backend.decode_calls) == calls
    assert json.loads(again)["choices"] == json.loads(first)["choices"]
    assert metric(live, "reame_answers_hits_total") == 1 and metric(live, "reame_answers_misses_total") == 1
    text, usage = stream_text(live, CHAT)
    assert text == json.loads(first)["choices"][0]["message"]["content"] and len(backend.decode_calls) == calls
    assert usage["completion_tokens"] == json.loads(first)["usage"]["completion_tokens"]


def test_a_restarted_node_finds_the_answer_on_disk_and_keeps_it_in_ram(alone):
    first, _, _ = alone()
    _, answered = first.json("POST", "/v1/chat/completions", CHAT)
    restarted, _, backend = alone()
    status, hit = restarted.json("POST", "/v1/chat/completions", CHAT)
    assert status == 200 and backend.decode_calls == [] and hit["choices"] == answered["choices"]
    assert len(restarted.model.answers.tiers[0]) == 1  # copied into RAM


def test_a_request_that_opts_out_is_computed_and_not_kept(alone):
    live, _, backend = alone()
    opted_out = dict(CHAT, reame={"cache": False})
    for _ in range(2):
        response, _ = live.request("POST", "/v1/chat/completions", opted_out)
        assert response.status == 200 and response.getheader("X-Reame-Cache") == "bypass"
    calls = len(backend.decode_calls)
    assert calls and metric(live, "reame_answers_stored_total") == 0
    response, _ = live.request("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                           "reame": {"cache": False}})
    assert response.status == 200 and response.getheader("X-Reame-Cache") == "bypass"
    status, body = live.json("POST", "/v1/chat/completions", dict(CHAT, reame={"cache": "no"}))
    assert status == 400 and body["error"]["param"] == "cache"
    status, body = live.json("POST", "/v1/chat/completions", dict(CHAT, reame={"caches": False}))
    assert status == 400 and "best_of, cache" in body["error"]["message"]


def test_sampled_without_a_seed_is_never_looked_up(alone):
    live, _, _ = alone()
    response, _ = live.request("POST", "/v1/chat/completions", dict(CHAT, temperature=0.8))
    assert response.getheader("X-Reame-Cache") == "bypass" and metric(live, "reame_answers_misses_total") == 0


def test_without_the_cache_the_header_says_off():
    live, engine, _ = node()
    live.model.answers = None
    try:
        response, _ = live.request("POST", "/v1/chat/completions", CHAT)
        assert response.status == 200 and response.getheader("X-Reame-Cache") == "off"
    finally:
        live.close()
        engine.close()


ASKED = [{"role": "user", "content": "hello there"}]


def sse_data(data: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: {")]


# Each family's streamed greedy request, and the text pieces its stream carries (in order).
STREAMED = {
    "openai chat": ("/v1/chat/completions", dict(CHAT, stream=True), lambda data: [
        chunk["choices"][0]["delta"]["content"] for chunk in sse_data(data)
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content")]),
    "openai completions": ("/v1/completions", {"prompt": "hello there", "max_tokens": 12, "temperature": 0,
                                               "stream": True}, lambda data: [
        chunk["choices"][0]["text"] for chunk in sse_data(data) if chunk["choices"][0]["text"]]),
    "ollama": ("/api/chat", {"model": "reame", "messages": ASKED, "options": {"temperature": 0, "num_predict": 12}},
               lambda data: [line["message"]["content"] for line in map(json.loads, data.decode().splitlines())
                             if not line["done"] and line["message"]["content"]]),
    "anthropic": ("/v1/messages", {"model": "reame", "max_tokens": 12, "temperature": 0, "messages": ASKED,
                                   "stream": True}, lambda data: [
        event["delta"]["text"] for event in sse_data(data) if event.get("type") == "content_block_delta"]),
    "responses": ("/v1/responses", {"model": "reame", "input": "hello there", "max_output_tokens": 16,
                                    "temperature": 0, "stream": True}, lambda data: [
        event["delta"] for event in sse_data(data) if event.get("type") == "response.output_text.delta"]),
}


@pytest.mark.parametrize("family", STREAMED)
def test_a_streamed_hit_arrives_in_the_pieces_a_generation_sends(alone, family):
    """A client's stream handling (its UI, a parser fed per chunk) sees a kept answer as it saw it computed."""
    live, _, backend = alone()
    path, body, pieces = STREAMED[family]
    response, computed = live.request("POST", path, body)
    assert response.getheader("X-Reame-Cache") == "miss"
    calls = len(backend.decode_calls)
    response, kept = live.request("POST", path, body)
    assert response.getheader("X-Reame-Cache") == "hit" and len(backend.decode_calls) == calls
    assert len(pieces(computed)) > 1 and pieces(kept) == pieces(computed)


def test_a_kept_answer_replays_a_character_split_across_tokens_whole():
    pieces = [event.text for event in replayed("pé ✓", FakeBackend())]  # bytes: p, é as 2, space, ✓ as 3
    assert pieces == ["p", "é", " ", "✓"]


def test_a_kept_answer_that_does_not_tokenize_back_to_itself_arrives_whole():
    class LeadingSpace(FakeBackend):
        def token_piece(self, token: int) -> bytes:
            return b" " + super().token_piece(token) if token == ord("h") else super().token_piece(token)
    assert [event.text for event in replayed("hi", LeadingSpace())] == ["hi"]


class RecordingTier(RamAnswers):
    """A RAM tier that remembers the last key it kept: where a test plants another value."""

    key = b""

    def put(self, key: bytes, value: bytes) -> bool:
        self.key = key
        return super().put(key, value)


@pytest.mark.parametrize("planted,completion_tokens", [
    ("x" * 200, 5),  # far more tokens than the generation it claims to be sent
    ("word " * (REPLAY_MAX_CHARS // 5 + 1), 1_000_000),  # past the replay's size bound, whatever it claims
], ids=["more-tokens-than-recorded", "over-the-size-bound"])
def test_a_kept_answer_unlike_any_generation_streams_whole_without_being_cut(planted, completion_tokens):
    """A kept answer comes from a file or a shared store that another writer may fill: cutting a planted
    megabyte into tokens took seconds on the HTTP thread, so such a text is sent as one piece."""
    tier = RecordingTier(1 << 22)
    live, engine, backend = node(tier)
    try:
        body = {"prompt": "hello there", "max_tokens": 12, "temperature": 0, "stream": True}
        live.request("POST", "/v1/completions", body)
        live.model.answers.put(tier.key, planted, FinishEvent("stop", Usage(3, completion_tokens, 0.0, 0.0)))
        tokenized = []
        original = backend.tokenize
        backend.tokenize = lambda text, *args, **kwargs: tokenized.append(len(text)) or original(text, *args, **kwargs)
        response, data = live.request("POST", "/v1/completions", body)
        pieces = [chunk["choices"][0]["text"] for chunk in sse_data(data) if chunk["choices"][0]["text"]]
        assert response.getheader("X-Reame-Cache") == "hit" and pieces == [planted]
        assert max(tokenized, default=0) <= REPLAY_MAX_CHARS  # the bound is checked before any tokenizing
    finally:
        live.close()
        engine.close()
