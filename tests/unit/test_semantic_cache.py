"""The semantic answer cache: its index (the numbers-and-negation check, the threshold, scopes, bounds, a
hostile store's entries) and FakeBackend servers using it, alone and two sharing an ARCA on a thread:
a retyped question gets the kept answer, marked; anything else about the request must match."""

import array
import json
import math
import random
import time
import tracemalloc
import zlib

import pytest

from reame.answers import AnswerCache, SharedAnswers
from reame.arca.client import StoreAddress, StoreClient
from reame.cache.answers import RamAnswers
from reame.engine import Engine, SamplingParams
from reame.errors import ModelError
from reame import semantic
from reame.semantic import (KeptQuestion, SemanticCache, SemanticIndex, canonical, decode, details, little_endian,
                            nearest, unit_float32)
from tests.arca_thread import arca_thread
from tests.fakes.backend import FakeBackend
from tests.unit.test_answer_cache import metric, stream_text
from tests.unit.test_server import Live

FINGERPRINT = b"fake-model"
DOCUMENT = "Harbourside Cycles closes at 16:00 on Saturdays and is closed on Sundays."
QUESTION = "What time does the shop close on Saturdays?"


def chat(question: str, document: str = DOCUMENT, **more) -> dict:
    return {"messages": [{"role": "system", "content": document}, {"role": "user", "content": question}],
            "max_tokens": 12, "temperature": 0, **more}


class WordsEmbedder:
    """Each lower-case word adds to one hashed dimension: questions sharing words point alike."""

    identity = "words"

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.closed = False

    def embed(self, text: str) -> list[float]:
        self.texts.append(text)
        vector = [0.0] * 64
        for word in text.lower().replace("?", " ").split():
            vector[zlib.crc32(word.encode()) % 64] += 1
        norm = math.sqrt(sum(v * v for v in vector)) or 1
        return [v / norm for v in vector]

    def close(self) -> None:
        self.closed = True


def vector_of(text: str) -> list[float]:
    return WordsEmbedder().embed(text)


# --- the index ---

@pytest.mark.parametrize("question,numbers,negated", [
    ("How much for 2 days?", ("2",), False), ("How much for two days?", ("2",), False),
    ("Quanto costano 3 chili?", ("3",), False), ("Quanto costano tre chili?", ("3",), False),
    ("Is it 4.60 or 4,60 euros?", ("4.60", "4.60"), False), ("A cake for ten people", ("10",), False),
    ("Is the shop not open?", (), True), ("Why can't I book?", (), True), ("Why can\u2019t I book?", (), True),
    ("Il forno non è aperto?", (), True), ("Senza acconto?", (), True), ("Is the shop open on Sundays?", (), False),
    ("One bike, una torta", (), False),  # articles, not counts
])
def test_details_are_the_numbers_said_and_whether_the_question_negates(question, numbers, negated):
    assert details(question) == semantic.Details(numbers, negated)


def test_canonical_drops_spacing_and_end_punctuation_only():
    assert canonical("  what time do   you close ?! ") == "what time do you close"
    assert canonical("What time do you close?") == "What time do you close"
    assert canonical("Is 4.5 right?") == "Is 4.5 right"


def kept(text: str, key: bytes = b"reame:answer:1") -> KeptQuestion:
    return KeptQuestion(text, unit_float32(vector_of(text)), key, details(text))


def test_nearest_skips_kept_questions_that_say_other_numbers_or_negate_otherwise():
    questions = [kept("How much is a rental for 2 days", b"reame:answer:2"),
                 kept("Is the shop not open on Sundays", b"reame:answer:not"),
                 kept("How much is a rental for 3 days", b"reame:answer:3")]
    match = nearest(questions, vector_of("How much is a rental for 3 days"), "How much is a rental for 3 days")
    assert match is not None and match.question.answer_key == b"reame:answer:3" and match.similarity > 0.999
    assert nearest(questions, vector_of("How much is a rental for 5 days"), "How much is a rental for 5 days") is None
    match = nearest(questions, vector_of("Is the shop open on Sundays"), "Is the shop open on Sundays")
    assert match is None  # the only kept question about Sundays negates


def index(threshold: float = 0.8, **more) -> SemanticIndex:
    return SemanticIndex(FINGERPRINT, "words", threshold, **more)


def test_a_question_finds_the_kept_one_at_or_above_the_threshold_only():
    cache = index(0.95)
    scope = cache.scope("ctx", SamplingParams(temperature=0), "chat")
    cache.add(scope, QUESTION, vector_of(QUESTION), b"reame:answer:a")
    retyped = "what time does the shop close on saturdays"
    assert cache.find(scope, retyped, vector_of(retyped)).question.text == QUESTION
    other = "What time does the shop open on Saturdays?"
    assert 0.7 < semantic.similarity(vector_of(QUESTION), vector_of(other)) < 0.95
    assert cache.find(scope, other, vector_of(other)) is None
    assert index(0.7).find(scope, other, vector_of(other)) is None  # another index: nothing kept


@pytest.mark.parametrize("change", [
    dict(context="other ctx"), dict(params=SamplingParams(temperature=0, max_tokens=5)), dict(shape="chat+tools"),
    dict(params=SamplingParams(temperature=0.5, seed=3)),
])
def test_the_scope_is_the_conversation_around_the_question_the_settings_and_the_shape(change):
    cache = index()
    base = dict(context="ctx", params=SamplingParams(temperature=0), shape="chat")
    assert cache.scope(**base) != cache.scope(**{**base, **change})
    assert cache.scope(**base) != SemanticIndex(FINGERPRINT, "another embedder", 0.8).scope(**base)
    assert cache.scope(**base) != SemanticIndex(b"another model", "words", 0.8).scope(**base)
    greedy = SamplingParams(temperature=0, seed=1)
    assert cache.scope("ctx", greedy, "chat") == cache.scope("ctx", SamplingParams(temperature=0, seed=2), "chat")


def test_scopes_and_their_questions_are_bounded(monkeypatch):
    monkeypatch.setattr(semantic, "QUESTIONS_PER_SCOPE", 3)
    monkeypatch.setattr(semantic, "MAX_SCOPES", 2)
    cache = index(0.99)
    scopes = [cache.scope(f"ctx {n}", SamplingParams(), "chat") for n in range(3)]
    for n in range(5):
        text = f"question number {'x' * n}"
        cache.add(scopes[0], text, vector_of(text), f"reame:answer:{n}".encode())
    assert cache.find(scopes[0], "question number", vector_of("question number")) is None  # the oldest went
    assert cache.find(scopes[0], "question number xxxx", vector_of("question number xxxx")) is not None
    cache.add(scopes[1], QUESTION, vector_of(QUESTION), b"reame:answer:q")
    cache.add(scopes[2], QUESTION, vector_of(QUESTION), b"reame:answer:q")
    assert cache.find(scopes[0], "question number xxxx", vector_of("question number xxxx")) is None
    assert cache.find(scopes[2], QUESTION, vector_of(QUESTION)) is not None


def test_the_index_stays_within_its_byte_budget_whatever_the_questions(monkeypatch):
    """Issue 49 (suspected): 1,024 scopes of 256 long questions took the index to 1.2-1.6 GiB."""
    import tracemalloc
    monkeypatch.setattr(semantic, "MAX_INDEX_BYTES", 4 << 20)
    cache = index(0.99)
    long_question = "How many of 1 2 3 4 5 6 7 8 9 10 " * 55  # near MAX_QUESTION_CHARS, full of numbers
    vector = vector_of(QUESTION)
    tracemalloc.start()
    for scope_number in range(16):
        scope = cache.scope(f"ctx {scope_number}", SamplingParams(), "chat")
        for n in range(64):
            cache.add(scope, f"{n} {long_question}", vector, f"reame:answer:{scope_number}:{n}".encode())
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert cache._bytes <= semantic.MAX_INDEX_BYTES and held < semantic.MAX_INDEX_BYTES * 1.25
    assert cache.find(scope, f"63 {long_question}", vector) is not None  # the newest scope is kept


def entry(text: bytes = QUESTION.encode(), vector: bytes | None = None, key: bytes = b"reame:answer:ab") -> dict:
    packed = little_endian(unit_float32(vector_of(QUESTION))) if vector is None else vector
    return {b"q": text, b"v": packed, b"a": key}


@pytest.mark.parametrize("fields", [
    {}, {b"q": b"x"}, entry(vector=b"\0" * 12), entry(vector=b"\0" * 256),  # wrong size; all zeros
    entry(vector=array.array("f", [float("nan")] * 64).tobytes()), entry(vector=array.array("f", [1.0] * 64).tobytes()),
    entry(key=b"some:other:key"), entry(key=b"reame:answer:" + b"f" * 200), entry(text=b"\xff\xfe"),
    entry(text=b"q" * (4 * semantic.MAX_QUESTION_CHARS + 1)),
])
def test_what_the_store_sends_is_a_question_only_if_it_is_whole_and_ours(fields):
    assert decode(fields, 64) is None
    assert decode(entry(), 64) is not None


def test_decoding_random_store_entries_is_fast_bounded_and_never_raises():
    generator = random.Random(5)
    tracemalloc.start()
    started = time.perf_counter()
    for _ in range(3000):
        fields = {generator.choice([b"q", b"v", b"a", b"x"]): generator.randbytes(generator.randrange(0, 300))
                  for _ in range(generator.randrange(0, 5))}
        assert decode(fields, 64) is None or isinstance(decode(fields, 64), KeptQuestion)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - started < 5 and peak < 8 << 20


@pytest.mark.parametrize("text", ["a'" * 5000, "9," * 5000, "n't " * 2000, "\u0663" * 10000, "x" * 100_000])
def test_details_of_a_hostile_question_take_linear_time(text):
    started = time.perf_counter()
    details(text)
    canonical(text)
    assert time.perf_counter() - started < 1


# --- servers ---

def node(*, store: int | None = None, threshold: float = 0.8, embedder=None) -> tuple[Live, Engine, FakeBackend]:
    backend = FakeBackend(n_ctx=1024, n_seq_max=2)
    engine = Engine(backend).start()
    live = Live(engine)
    client = StoreClient(StoreAddress("127.0.0.1", store, "", 0)) if store else None
    tiers = [RamAnswers(1 << 20)] + ([SharedAnswers(client, 60_000)] if client else [])
    live.model.answers = AnswerCache(tiers, FINGERPRINT)
    live.model.semantic = SemanticCache(SemanticIndex(FINGERPRINT, "words", threshold, client),
                                      embedder or WordsEmbedder())
    return live, engine, backend


@pytest.fixture
def alone():
    made = node()
    yield made
    made[0].close()
    made[1].close()


def ask(live: Live, body: dict) -> tuple[int, dict, str]:
    response, data = live.request("POST", "/v1/chat/completions", body)
    return response.status, json.loads(data), response.getheader("X-Reame-Cache")


def test_a_retyped_question_gets_the_kept_answer_marked_semantic(alone):
    live, _, backend = alone
    status, first, header = ask(live, chat(QUESTION))
    assert status == 200 and header == "miss" and "reame" not in first
    calls = len(backend.decode_calls)
    status, again, header = ask(live, chat("what time does the shop close on saturdays"))
    assert status == 200 and header == "semantic" and len(backend.decode_calls) == calls
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert again["reame"] == {"cache": "semantic", "similarity": 1.0, "question": QUESTION}
    assert metric(live, "reame_semantic_hits_total") == 1 and metric(live, "reame_semantic_misses_total") == 1
    assert ask(live, chat(QUESTION))[2] == "hit"  # the exact cache answers the very same question first
    text, _ = stream_text(live, chat("What time does the shop close on Saturdays"))
    assert text == first["choices"][0]["message"]["content"] and len(backend.decode_calls) == calls


@pytest.mark.parametrize("variant", [
    chat("What time does the shop close on 2 Saturdays?"),  # a number the kept question does not say
    chat("What time does the shop not close on Saturdays?"),  # a negation
    chat(QUESTION, document=DOCUMENT + " It opens at 9."),  # another document
    chat(QUESTION, max_tokens=11), chat(QUESTION, temperature=0.4, seed=1), chat(QUESTION, stop=["x"]),
    chat(QUESTION, reame={"semantic": False}),
    {"messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": "At four."}, {"role": "user", "content": QUESTION}],
     "max_tokens": 12, "temperature": 0},  # another conversation around it
])
def test_anything_else_about_the_request_must_match(alone, variant):
    live, _, backend = alone
    ask(live, chat(QUESTION + "  "))
    calls = len(backend.decode_calls)
    status, _, header = ask(live, variant)
    assert status == 200 and header == "miss" and len(backend.decode_calls) > calls


def test_an_opted_out_question_is_not_kept_and_a_sampled_one_never_looked_up(alone):
    live, _, _ = alone
    ask(live, chat(QUESTION, reame={"semantic": False}))
    assert ask(live, chat(QUESTION.lower()))[2] == "miss"
    assert ask(live, chat(QUESTION, temperature=0.8))[2] == "bypass"
    assert live.model.semantic.embedder.texts == [canonical(QUESTION.lower())]


def test_a_question_that_cannot_be_embedded_is_computed():
    class Failing(WordsEmbedder):
        def embed(self, text):
            raise ModelError("the embedding model failed")
    live, engine, _ = node(embedder=Failing())
    try:
        status, body, header = ask(live, chat(QUESTION))
        assert status == 200 and header == "miss" and body["choices"][0]["message"]["content"]
    finally:
        live.close()
        engine.close()


def test_the_served_models_own_embeddings_work_through_its_engine():
    live, engine, backend = node(threshold=0.95)
    live.model.semantic = SemanticCache(live.model.semantic.index, None)
    try:
        first = ask(live, chat(QUESTION))[1]
        status, again, header = ask(live, chat(QUESTION + "  ?"))
        assert backend.embed_calls == [1, 1] and header == "semantic"
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
    finally:
        live.close()
        engine.close()


def test_nodes_sharing_a_store_find_each_others_questions(tmp_path):
    with arca_thread(tmp_path) as port:
        (first, first_engine, _), (second, second_engine, second_backend) = node(store=port), node(store=port)
        try:
            answered = ask(first, chat(QUESTION))[1]
            status, hit, header = ask(second, chat("what time does the shop close on saturdays"))
            assert header == "semantic" and second_backend.decode_calls == []
            assert hit["choices"][0]["message"] == answered["choices"][0]["message"]
        finally:
            for live, engine in ((first, first_engine), (second, second_engine)):
                live.close()
                engine.close()
