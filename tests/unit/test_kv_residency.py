"""Reuse with the KV already full, on FakeBackend (whose restores, as llama.cpp's, need free cells): idle slots
give up what they keep, least recently used first, so that a prefix-cache snapshot (from RAM, from disk, from
the fleet's store), a session, a warmed document or the Conclave's shared prompt is restored instead of
prefilled, beside running sequences that nothing touches; each gives exactly the output of a cold prefill."""

import json
import threading

import pytest

from reame.cache import PrefixCache, Snapshot
from reame.cache.remote import RemoteKV
from reame.arca.client import StoreAddress, StoreClient
from reame.conclave import convene
from reame.engine import Engine, GenerationRequest, SamplingParams, Session
from tests.arca_thread import arca_thread
from tests.fakes.backend import FakeBackend, default_rule
from tests.waiting import wait_until

FINGERPRINT = b"r" * 32
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def document(name: str, tokens: int) -> str:
    """A document of about `tokens` FakeBackend tokens (one per byte)."""
    line = f"{name} says that each step reads all the weights once. "
    return (line * (tokens // len(line) + 1))[:tokens]


A, B, C = document("alpha", 200), document("bravo", 200), document("charlie", 200)


def ask(text: str, question: str = "what does it say?") -> str:
    return f"<|im_start|>user\n{text}\n{question}<|im_end|>\n<|im_start|>assistant\n"


def cold(prompt: str, params: SamplingParams = GREEDY) -> list[int]:
    """The answer computed from nothing (the fake model's output depends only on the tokens)."""
    with Engine(FakeBackend(n_ctx=4096)) as engine:
        return engine.generate(GenerationRequest(prompt, params)).tokens


def prefix_cache(directory=None, **options) -> PrefixCache:
    return PrefixCache(FINGERPRINT, directory, block_tokens=4, min_new_tokens=8, **options)


def tokens(text: str) -> int:
    return len(FakeBackend().tokenize(text))


def idle(engine: Engine) -> list[str]:
    """What the idle slots hold, as text, once the engine is idle."""
    wait_until(lambda: engine.status.running == 0 and engine.status.waiting == 0, what="the engine to be idle")
    return [FakeBackend().detokenize(list(prefix)) for prefix in engine.status.idle_prefixes if prefix]


def restores(engine: Engine) -> dict[tuple[str, str], int]:
    wait_until(lambda: engine.status.running == 0, what="the engine to be idle")
    return {(source, outcome): count for source, outcome, count in engine.status.kv.restores}


def test_a_document_read_again_is_restored_whatever_other_documents_the_idle_slots_keep():
    backend = FakeBackend(n_ctx=320, n_seq_max=4)
    assert tokens(ask(A)) + tokens(ask(B)) > backend.n_ctx  # the two cannot both stay resident
    with Engine(backend, cache=prefix_cache()) as engine:
        first = [engine.generate(GenerationRequest(ask(text), GREEDY)) for text in (A, B)]
        again = [engine.generate(GenerationRequest(ask(text, "who wrote it?"), GREEDY)) for text in (A, B)]
        assert [result.tokens for result in first] == [cold(ask(A)), cold(ask(B))]
        assert [result.tokens for result in again] == [cold(ask(A, "who wrote it?")), cold(ask(B, "who wrote it?"))]
        assert all(result.finish.usage.cached_tokens >= tokens(A) for result in again)
        assert backend.refused_restores == 0
        assert restores(engine) == {("snapshot", "restored"): 2}
        assert engine.status.kv.cells_given_up > 0


def test_behind_a_prefix_cache_a_start_leaves_no_other_idle_cache_in_the_kv():
    backend = FakeBackend(n_ctx=1024, n_seq_max=4)
    with Engine(backend, cache=prefix_cache()) as engine:
        for text in (A, B):
            engine.generate(GenerationRequest(ask(text), GREEDY))
        kept = idle(engine)
        assert len(kept) == 1 and B in kept[0]
        assert engine.status.kv.cells_used == len(engine.status.idle_prefixes[engine.status.idle_prefixes.index(
            next(prefix for prefix in engine.status.idle_prefixes if prefix))])
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=4)) as engine:  # no cache behind them: the slots keep theirs
        for text in (A, B):
            engine.generate(GenerationRequest(ask(text), GREEDY))
        assert len(idle(engine)) == 2


def test_idle_caches_give_way_least_recently_used_first_and_only_as_many_as_needed():
    backend = FakeBackend(n_ctx=560, n_seq_max=4)
    long_document, shorts = document("lima", 200), [document(name, 90) for name in ("one", "two", "three")]
    with Engine(backend) as engine:  # no prefix cache: idle slots keep their KV until cells are needed
        engine.generate(GenerationRequest(ask(long_document), GREEDY))
        for text in shorts:  # the third one's prefill needs the long document's cells: its slot gives them up
            engine.generate(GenerationRequest(ask(text), GREEDY))
        assert not any(long_document in held for held in idle(engine))
        engine.generate(GenerationRequest(ask(shorts[0], "and then?"), GREEDY))  # "one" is used again
        result = engine.generate(GenerationRequest(ask(document("mike", 200)), GREEDY))
        assert result.tokens == cold(ask(document("mike", 200)))
        kept = idle(engine)
        assert [any(text in held for held in kept) for text in shorts] == [True, False, True], \
            "only the least recently used ('two') gave its cells to the new document"


def test_a_restore_beside_a_running_sequence_touches_nothing_of_it():
    backend = FakeBackend(n_ctx=400, n_seq_max=4)
    runner = GenerationRequest("count on: ", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    with Engine(backend, cache=prefix_cache()) as engine:
        for text in (A, B):
            engine.generate(GenerationRequest(ask(text), GREEDY))
        running, revisit = engine.submit_together([runner, GenerationRequest(ask(A, "again?"), GREEDY)])
        assert running.result(10).tokens == cold("count on: ", runner.params)
        result = revisit.result(10)
        assert result.tokens == cold(ask(A, "again?")) and result.finish.usage.cached_tokens >= tokens(A)
        assert restores(engine) == {("snapshot", "restored"): 1} and backend.refused_restores == 0


def pausing_at(tokens: int):
    """(reached, gate, rule): the rule stops a runner at `tokens` tokens, inside a step, setting `reached`,
    until `gate` is set (the revisit queued)."""
    reached, gate = threading.Event(), threading.Event()

    def rule(history):
        if len(history) >= tokens and not gate.is_set():
            reached.set()
            gate.wait(5)
        return default_rule(history)
    return reached, gate, rule


def test_a_restore_whose_cells_running_sequences_hold_is_prefilled_and_its_snapshot_kept():
    short = document("sierra", 150)
    reached, gate, rule = pausing_at(300)
    backend = FakeBackend(n_ctx=400, n_seq_max=2, rule=rule)
    runner = GenerationRequest("go on: ", SamplingParams(temperature=0, ignore_eos=True))  # past its reservation
    cache = prefix_cache()
    with Engine(backend, cache=cache) as engine:
        engine.generate(GenerationRequest(ask(short), GREEDY))
        running = engine.submit(runner)
        assert reached.wait(10)
        revisit = engine.submit(GenerationRequest(ask(short, "again?"), GREEDY))
        gate.set()
        result = revisit.result(10)
        assert result.tokens == cold(ask(short, "again?"))
        assert running.result(10).finish.message == "the context is full"  # it ran past its share
        assert restores(engine) == {("snapshot", "no_room"): 1}
        assert cache.stats()["restore_failed"] == 0 and backend.refused_restores == 0
        later = engine.generate(GenerationRequest(ask(short, "once more?"), GREEDY))
        assert later.finish.usage.cached_tokens >= tokens(short), "the snapshot was kept"


def test_a_damaged_snapshot_in_a_full_kv_is_prefilled_with_the_same_output_and_forgotten():
    backend = FakeBackend(n_ctx=320, n_seq_max=4)
    cache = prefix_cache()
    prompt = ask(A, "damaged?")
    cache.offer(Snapshot(tuple(FakeBackend().tokenize(prompt)[:-1]), b"not a state"))
    with Engine(backend, cache=cache) as engine:
        engine.generate(GenerationRequest(ask(B), GREEDY))
        result = engine.generate(GenerationRequest(prompt, GREEDY))
        assert result.tokens == cold(prompt) and result.finish.usage.cached_tokens == 0
        assert restores(engine) == {("snapshot", "rejected"): 1}
        assert cache.stats()["restore_failed"] == 1
        revisit = engine.generate(GenerationRequest(ask(B, "still there?"), GREEDY))
        assert revisit.tokens == cold(ask(B, "still there?")) and revisit.finish.usage.cached_tokens >= tokens(B)


def test_a_snapshot_from_disk_is_restored_into_a_full_kv(tmp_path):
    with Engine(FakeBackend(n_ctx=320, n_seq_max=4), cache=prefix_cache(tmp_path)) as engine:
        engine.generate(GenerationRequest(ask(A), GREEDY))  # written to disk when the engine closes
    backend = FakeBackend(n_ctx=320, n_seq_max=4)
    cache = prefix_cache(tmp_path, ram_budget_bytes=0)  # a restart: what it restores comes from the disk
    with Engine(backend, cache=cache) as engine:
        engine.generate(GenerationRequest(ask(B), GREEDY))
        result = engine.generate(GenerationRequest(ask(A, "after a restart?"), GREEDY))
        assert result.tokens == cold(ask(A, "after a restart?")) and result.finish.usage.cached_tokens >= tokens(A)
        assert cache.stats()["bytes_read"] > 0 and backend.refused_restores == 0


def test_a_snapshot_from_the_fleets_store_is_restored_into_a_full_kv(tmp_path):
    with arca_thread(tmp_path / "arca") as port:
        def node(name: str) -> PrefixCache:
            shared = RemoteKV(lambda: StoreClient(StoreAddress("127.0.0.1", port, "", 0)), FINGERPRINT, 2.0, 64 << 20)
            return prefix_cache(tmp_path / name, remote=shared)
        with Engine(FakeBackend(n_ctx=320, n_seq_max=4), cache=node("a")) as engine:
            engine.generate(GenerationRequest(ask(A), GREEDY))  # published before the engine closes
        backend, cache = FakeBackend(n_ctx=320, n_seq_max=4), node("b")
        with Engine(backend, cache=cache) as engine:
            engine.generate(GenerationRequest(ask(B), GREEDY))  # node B has served other work
            result = engine.generate(GenerationRequest(ask(A, "from the fleet?"), GREEDY))
            assert result.tokens == cold(ask(A, "from the fleet?"))
            assert result.finish.usage.cached_tokens >= tokens(A)
            assert cache.remote_stats()["hits"] == 1 and backend.refused_restores == 0


def test_a_session_is_restored_into_a_full_kv():
    backend = FakeBackend(n_ctx=320, n_seq_max=2)
    session = Session()
    cache = prefix_cache()
    with Engine(backend, cache=cache) as engine:
        first = engine.generate(GenerationRequest(ask(A), GREEDY, session=session))
        for text in (B, C):  # two other documents take both slots: the conversation's KV is gone from them
            engine.generate(GenerationRequest(ask(text), GREEDY))
        assert not any(A in held for held in idle(engine))
        follow_up = ask(A) + backend.detokenize(first.tokens) + "<|im_end|>\n" + ask("", "and then?")
        result = engine.generate(GenerationRequest(follow_up, GREEDY, session=session))
        assert result.tokens == cold(follow_up) and result.finish.usage.cached_tokens >= tokens(A)
        assert restores(engine) == {("session", "restored"): 1} and backend.refused_restores == 0
        assert engine.status.kv.idle_snapshots == 0, "a conversation's KV is its session's, never snapshotted"


def test_a_warmed_document_is_restored_into_a_full_kv():
    backend = FakeBackend(n_ctx=320, n_seq_max=4)
    with Engine(backend, cache=prefix_cache()) as engine:
        engine.generate(GenerationRequest(ask(A, ""), warm=True))
        engine.generate(GenerationRequest(ask(B), GREEDY))
        result = engine.generate(GenerationRequest(ask(A, "warm?"), GREEDY))
        assert result.tokens == cold(ask(A, "warm?")) and result.finish.usage.cached_tokens >= tokens(A)
        assert restores(engine) == {("snapshot", "restored"): 1} and backend.refused_restores == 0


def test_the_conclaves_attempts_share_one_restore_in_a_full_kv():
    backend = FakeBackend(n_ctx=420, n_seq_max=5)
    request = GenerationRequest(ask(A, "best of three?"), SamplingParams(temperature=0.8, max_tokens=6, seed=5))
    with Engine(backend, cache=prefix_cache()) as engine:
        engine.generate(GenerationRequest(ask(A), GREEDY))
        engine.generate(GenerationRequest(ask(B), GREEDY))
        outcome = convene(engine, request, 3, timeout_s=10)
        assert restores(engine) == {("snapshot", "restored"): 1}, "the leader restores, the others share its cells"
    with Engine(FakeBackend(n_ctx=4096, n_seq_max=5)) as engine:
        expected = convene(engine, request, 3, timeout_s=10)
    assert [c.tokens for c in outcome.completions] == [c.tokens for c in expected.completions]
    assert backend.refused_restores == 0


def test_an_idle_slot_giving_up_a_long_answer_keeps_it_as_a_snapshot():
    backend = FakeBackend(n_ctx=320, n_seq_max=2)
    cache = prefix_cache()
    long_answer = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with Engine(backend, cache=cache) as engine:
        first = engine.generate(GenerationRequest(ask(A), long_answer))
        engine.generate(GenerationRequest(ask(B), GREEDY))  # A's slot gives its cells to B
        assert engine.status.kv.idle_snapshots == 1
        follow_up = ask(A) + backend.detokenize(first.tokens) + ask("", "and then?")
        result = engine.generate(GenerationRequest(follow_up, GREEDY))
        assert result.finish.usage.cached_tokens >= tokens(ask(A)) + 39, "the answer's KV came back too"
        assert result.tokens == cold(follow_up)


class WindowedBackend(FakeBackend):
    """A model with a sliding window: its restores need cells the engine's ledger does not count."""

    sliding_window = 8
    window_cells = 200

    def seq_state_set(self, seq_id, blob):
        self.seq_rm(seq_id)
        if self.cells_in_use() + len(json.loads(bytes(blob))["tokens"]) + self.window_cells > self.n_ctx:
            self.refused_restores += 1
            return False
        return super().seq_state_set(seq_id, blob)


def test_with_a_sliding_window_a_state_refused_beside_a_running_sequence_is_prefilled_and_kept():
    reached, gate, rule = pausing_at(70)
    backend = WindowedBackend(n_ctx=480, n_seq_max=2, rule=rule)
    runner = GenerationRequest("count on: ", SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    cache = prefix_cache()
    with Engine(backend, cache=cache) as engine:
        gate.set()
        engine.generate(GenerationRequest(ask(A), GREEDY))
        gate.clear()
        running = engine.submit(runner)
        assert reached.wait(10)
        revisit = engine.submit(GenerationRequest(ask(A, "window?"), GREEDY))
        gate.set()
        assert revisit.result(10).tokens == cold(ask(A, "window?"))
        assert running.result(10).tokens == cold("count on: ", runner.params)
        assert restores(engine) == {("snapshot", "no_room"): 1} and backend.refused_restores == 1
        assert cache.stats()["restore_failed"] == 0 and cache.has(FakeBackend().tokenize(ask(A))[:-1])


@pytest.mark.parametrize("slots", [2, 4, 8])
def test_documents_taken_in_turns_are_each_prefilled_once(slots):
    backend = FakeBackend(n_ctx=600, n_seq_max=slots)
    documents = [document(name, 180) for name in ("a1", "b2", "c3", "d4", "e5")]
    order = [0, 1, 2, 3, 4, 2, 0, 4, 1, 3, 0, 1]
    with Engine(backend, cache=prefix_cache()) as engine:
        results = [engine.generate(GenerationRequest(ask(documents[i], f"question {n}?"), GREEDY))
                   for n, i in enumerate(order)]
    for n, (i, result) in enumerate(zip(order, results)):
        assert result.tokens == cold(ask(documents[i], f"question {n}?"))
        if order.index(i) < n:
            assert result.finish.usage.cached_tokens >= tokens(documents[i]), f"request {n} prefilled again"
    assert backend.refused_restores == 0


SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def chat(question: str) -> str:
    return f"{SYSTEM}{question}<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_whose_slot_gave_its_kv_to_another_start_restores_the_template_head():
    backend = FakeBackend(n_ctx=1024, n_seq_max=4)
    # The defaults: the 26-token opening is below what the prefix cache indexes and snapshots.
    cache = PrefixCache(FINGERPRINT, None, block_tokens=32, min_new_tokens=64)
    opening = tokens(SYSTEM)
    head = opening // 8 * 8
    assert head == 24
    line = "<|im_start|>system\nTriage.<|im_end|>\n<|im_start|>user\nticket {}<|im_end|>\n<|im_start|>assistant\n"
    with Engine(backend, cache=cache) as engine:
        found = []
        for question, ticket in (("hello?", line.format(1)), ("what is KV?", line.format(2))):
            found.append(engine.generate(GenerationRequest(chat(question), GREEDY)).finish.usage.cached_tokens)
            engine.generate(GenerationRequest(ticket, GREEDY))  # its start makes the chat's slot give up its KV
        # The ticket's slot shares 9 tokens with the second chat, whose head (24) is not kept yet: it is prefilled
        # from its start instead, so that its head's KV is a cold prefill's, which its slot then keeps.
        assert found == [0, 0]
        result = engine.generate(GenerationRequest(chat("why so slow?"), GREEDY))
        assert result.finish.usage.cached_tokens == head
        assert result.tokens == cold(chat("why so slow?"))
        assert restores(engine) == {("head", "restored"): 1}
        assert cache.stats()["snapshots"] == 0, "nothing was long enough for the prefix cache"


def test_a_head_is_restored_only_where_the_answer_stays_that_of_a_whole_prefill():
    backend = FakeBackend(n_ctx=1024, n_seq_max=4)
    cache = PrefixCache(FINGERPRINT, None, block_tokens=32, min_new_tokens=64)
    with Engine(backend, cache=cache) as engine:
        for question, ticket in (("hello?", "ticket 1"), ("what is KV?", "ticket 2")):
            engine.generate(GenerationRequest(chat(question), GREEDY))
            engine.generate(GenerationRequest(ticket, GREEDY))
        # A 24-token head leaves 16 of chat("?")'s 40 tokens to prefill: restored. SYSTEM + "hi" has 28 tokens: it
        # would leave 4, fewer than 8, where the rows' numerics change; it is prefilled whole.
        short = engine.generate(GenerationRequest(chat("?"), GREEDY))
        engine.generate(GenerationRequest("ticket 3", GREEDY))
        shorter = engine.generate(GenerationRequest(SYSTEM + "hi", GREEDY))
        assert (short.finish.usage.cached_tokens, shorter.finish.usage.cached_tokens) == (24, 0)
        assert (short.tokens, shorter.tokens) == (cold(chat("?")), cold(SYSTEM + "hi"))
        assert restores(engine) == {("head", "restored"): 1}
