"""The engine thread on FakeBackend: exact behaviour, no model needed."""

import threading
import time

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams, TokenEvent
from tests.fakes.backend import EOS, N_VOCAB, FakeBackend, default_rule, gated_rule
from reame.errors import ContextExceeded, EngineUnavailable, ModelError, RequestError
from tests.waiting import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=60)
PROMPTS = ["hello world", "abc", "the quick brown fox", "x", "zzz top", "one two three"]


def run_alone(prompt: str, params: SamplingParams = GREEDY, **backend_args) -> list[int]:
    with Engine(FakeBackend(**backend_args)) as engine:
        return engine.generate(GenerationRequest(prompt, params)).tokens


def test_greedy_generation_is_deterministic():
    assert run_alone("hello world") == run_alone("hello world")


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    params = SamplingParams(temperature=0.9, max_tokens=40, seed=11, ignore_eos=True)
    first = run_alone("hello", params)
    assert first == run_alone("hello", params)
    other = run_alone("hello", SamplingParams(temperature=0.9, max_tokens=40, seed=12, ignore_eos=True))
    assert first != other


def test_many_sequences_in_one_step_give_the_same_tokens_as_each_alone():
    alone = {prompt: run_alone(prompt, n_seq_max=4) for prompt in PROMPTS}
    backend = FakeBackend(n_seq_max=4, n_ctx=2048)
    engine = Engine(backend)
    handles = [engine.submit(GenerationRequest(prompt, GREEDY)) for prompt in PROMPTS]
    engine.start()
    try:
        together = {prompt: handle.result(timeout_s=10).tokens for prompt, handle in zip(PROMPTS, handles)}
    finally:
        engine.close()
    assert together == alone
    widest = max(len({seq for _, _, seq, _ in call}) for call in backend.decode_calls)
    assert widest == 4, "sequences were not decoded in one batch"


def test_long_prompt_is_prefilled_in_chunks_with_the_same_output():
    prompt = "a long prompt that does not fit in one batch " * 4
    backend = FakeBackend(n_batch=16)
    with Engine(backend) as engine:
        chunked = engine.generate(GenerationRequest(prompt, GREEDY)).tokens
    assert all(len(call) <= 16 for call in backend.decode_calls)
    assert chunked == run_alone(prompt, n_batch=512)


def test_end_of_generation_token_ends_the_sequence_and_is_not_emitted():
    with Engine(FakeBackend()) as engine:
        result = engine.generate(GenerationRequest("abc", SamplingParams(temperature=0, max_tokens=200)))
    assert result.finish.reason == "stop"
    assert EOS not in result.tokens
    assert result.finish.usage.completion_tokens == len(result.tokens)


def test_ignore_eos_generates_exactly_max_tokens():
    with Engine(FakeBackend()) as engine:
        result = engine.generate(GenerationRequest("abc", SamplingParams(temperature=0, max_tokens=100,
                                                                         ignore_eos=True)))
    assert len(result.tokens) == 100
    assert result.finish.reason == "length"


def test_stop_string_spanning_tokens_ends_generation_and_never_leaks():
    free = run_alone("hello world", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    text = bytes(t for t in free if t < 256).decode("utf-8", "replace")
    stop = text[10:13]  # three bytes, so three tokens
    with Engine(FakeBackend()) as engine:
        handle = engine.submit(GenerationRequest("hello world", SamplingParams(
            temperature=0, max_tokens=60, ignore_eos=True, stop=(stop,))))
        events = list(handle)
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent)) + handle.finish.text
    assert streamed == text[:text.index(stop)]
    assert handle.finish.reason == "stop"


def test_split_utf8_characters_stream_whole():
    def rule(history):
        logits = [-1e9] * N_VOCAB
        cycle = "aé🙂".encode()
        logits[cycle[(len(history) - 2) % len(cycle)]] = 1.0  # history starts as [BOS, "q"]
        return logits
    with Engine(FakeBackend(rule=rule)) as engine:
        handle = engine.submit(GenerationRequest("q", SamplingParams(temperature=0, max_tokens=21)))
        texts = [event.text for event in handle if isinstance(event, TokenEvent)]
    joined = "".join(texts)
    assert "\ufffd" not in joined
    assert set(joined) <= set("aé🙂")
    assert all(len(text) <= 1 for text in texts)


def test_a_prompt_the_context_cannot_hold_is_refused_before_any_work():
    backend = FakeBackend(n_ctx=64)
    with Engine(backend) as engine:
        with pytest.raises(RequestError) as raised:
            engine.submit(GenerationRequest("x" * 80))
        assert raised.value.code == "context_length_exceeded" and raised.value.param == "prompt"
        assert "maximum context length is 64 tokens" in str(raised.value)
    assert backend.decode_calls == []


def test_max_tokens_beyond_what_the_context_leaves_is_clamped_and_ends_with_length():
    with Engine(FakeBackend(n_ctx=64)) as engine:
        result = engine.generate(GenerationRequest("x" * 40, SamplingParams(temperature=0, max_tokens=30,
                                                                            ignore_eos=True)))
    assert result.finish.reason == "length"
    assert len(result.tokens) == 64 - 41  # the prompt is 40 characters and a BOS


def test_a_request_fills_at_most_its_context_per_request_of_a_larger_kv():
    backend = FakeBackend(n_ctx=128, n_seq_max=2)
    with Engine(backend, context_per_request=48) as engine:
        with pytest.raises(ContextExceeded) as raised:
            engine.submit(GenerationRequest("x" * 47))  # 48 tokens with the BOS
        assert (raised.value.n_prompt_tokens, raised.value.n_ctx) == (48, 48)
        assert raised.value.code == "context_length_exceeded" and "maximum context length is 48" in str(raised.value)
        result = engine.generate(GenerationRequest("x" * 20, SamplingParams(temperature=0, max_tokens=100,
                                                                            ignore_eos=True)))
    assert result.finish.reason == "length" and len(result.tokens) == 48 - 21
    assert backend.decode_calls  # the refused one cost nothing, the other ran


def test_a_context_per_request_beyond_what_a_sequence_holds_is_what_it_holds():
    with Engine(FakeBackend(n_ctx=64), context_per_request=1000) as engine:
        assert engine.context_per_request == 64


def test_token_prompt_outside_vocabulary_is_refused():
    with Engine(FakeBackend()) as engine:
        with pytest.raises(RequestError):
            engine.submit(GenerationRequest([1, N_VOCAB]))
        with pytest.raises(RequestError):
            engine.submit(GenerationRequest([1, 2], SamplingParams(logit_bias={N_VOCAB: 1.0})))


def test_without_max_tokens_generation_stops_when_the_context_is_full():
    with Engine(FakeBackend(n_ctx=48)) as engine:
        result = engine.generate(GenerationRequest("abcd", SamplingParams(temperature=0, ignore_eos=True)))
    assert result.finish.reason == "length"
    assert len(result.tokens) == 48 - 5


@pytest.mark.parametrize("reuse", [0, 64])
def test_cancel_stops_generation_and_keeps_the_kv_for_the_next_request_where_the_cache_is_reused(reuse):
    """An editor plugin cuts its completion short (a time limit, the next keystroke): its next request shares
    the whole prompt, so the slot keeps what was decoded, as after a completed answer, where the request
    reuses the cache (llama-server's routes); elsewhere a cancelled request frees its cells."""
    gate = threading.Event()
    backend = FakeBackend(rule=gated_rule(gate))
    prompt = "a question that is long enough to be worth keeping"
    with Engine(backend) as engine:
        handle = engine.submit(GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=400),
                                                 cache_reuse=reuse))
        events = handle.events(timeout_s=5)
        gate.set()
        said = [next(events).token]
        handle.cancel()
        said += [event.token for event in events if isinstance(event, TokenEvent)]
        held = backend.kv_tokens(0)
        again = engine.generate(GenerationRequest(prompt + " again", SamplingParams(temperature=0, max_tokens=2)))
    assert handle.finish.reason == "cancelled"
    assert handle.finish.usage.completion_tokens < 400
    if not reuse:
        assert held == [] and again.finish.usage.cached_tokens == 0
        return
    assert held == (backend.tokenize(prompt) + said)[:len(held)] and len(held) >= len(backend.tokenize(prompt))
    assert again.finish.usage.cached_tokens == len(backend.tokenize(prompt))


def test_cancelled_before_admission_never_runs():
    backend = FakeBackend()
    engine = Engine(backend)
    handle = engine.submit(GenerationRequest("abc", GREEDY))
    handle.cancel()
    engine.start()
    try:
        result = handle.result(timeout_s=5)
    finally:
        engine.close()
    assert result.finish.reason == "cancelled"
    assert backend.decode_calls == []


def test_requests_that_do_not_fit_the_kv_together_wait_their_turn():
    backend = FakeBackend(n_ctx=100, n_seq_max=2)
    engine = Engine(backend)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    first = engine.submit(GenerationRequest("first", params))
    second = engine.submit(GenerationRequest("second", params))
    engine.start()
    try:
        results = [first.result(timeout_s=5), second.result(timeout_s=5)]
    finally:
        engine.close()
    assert all(len(r.tokens) == 60 and r.finish.message == "" for r in results)
    assert max(len({seq for _, _, seq, _ in call}) for call in backend.decode_calls) == 1


def test_a_sequence_that_outgrows_its_reservation_ends_alone():
    backend = FakeBackend(n_ctx=100, n_seq_max=2)
    engine = Engine(backend, reserve_tokens=10)
    params = SamplingParams(temperature=0, ignore_eos=True)  # no max_tokens: until the context is full
    older = engine.submit(GenerationRequest("first", params))
    newer = engine.submit(GenerationRequest("second", params))
    engine.start()
    try:
        newer_result, older_result = newer.result(timeout_s=5), older.result(timeout_s=5)
    finally:
        engine.close()
    assert newer_result.finish.reason == "length" and newer_result.finish.message == "the context is full"
    assert len(older_result.tokens) > len(newer_result.tokens)


def test_a_long_prompt_is_fed_in_chunks_beside_running_streams():
    def slow(history):
        time.sleep(0.002)
        return default_rule(history)

    backend = FakeBackend(n_ctx=2048, n_seq_max=2, n_batch=512, rule=slow)
    engine = Engine(backend, prefill_chunk_tokens=16)
    running = engine.submit(GenerationRequest("short", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    engine.start()
    try:
        next(running.events(timeout_s=5))
        late = engine.submit(GenerationRequest("x" * 200, SamplingParams(temperature=0, max_tokens=5)))
        running.result(timeout_s=5), late.result(timeout_s=5)
    finally:
        engine.close()
    mixed = [call for call in backend.decode_calls if len({seq for _, _, seq, _ in call}) == 2]
    assert mixed and all(len(call) <= 17 for call in mixed)  # one decode token + at most one chunk


def test_close_cancels_running_and_waiting_requests():
    gate = threading.Event()
    engine = Engine(FakeBackend(rule=gated_rule(gate))).start()
    running = engine.submit(GenerationRequest("a", GREEDY))
    waiting = engine.submit(GenerationRequest("b", GREEDY))
    gate.set()
    engine.close()
    assert running.result(timeout_s=5).finish.reason in ("cancelled", "length", "stop")
    assert waiting.result(timeout_s=5).finish.reason == "cancelled"
    with pytest.raises(EngineUnavailable):
        engine.submit(GenerationRequest("c", GREEDY))


def test_a_request_that_fails_to_start_fails_alone_and_the_engine_goes_on():
    class BrokenSamplerBackend(FakeBackend):
        def new_sampler(self, steps, seq_id=None):
            if any(step.kind == "penalties" for step in steps):
                raise ValueError("boom")
            return super().new_sampler(steps, seq_id)

    with Engine(BrokenSamplerBackend()) as engine:
        failed = engine.generate(GenerationRequest("abc", SamplingParams(repeat_penalty=1.2)), timeout_s=5)
        fine = engine.generate(GenerationRequest("abc", GREEDY), timeout_s=5)
    assert failed.finish.reason == "error" and "boom" in failed.finish.message
    assert fine.finish.reason in ("stop", "length") and fine.tokens


def test_a_failing_decode_ends_the_requests_it_carried_and_the_engine_goes_on():
    class FlakyBackend(FakeBackend):
        fail_next = True

        def decode(self, *args):
            if self.fail_next:
                self.fail_next = False
                raise ModelError("decode exploded")
            return super().decode(*args)

    with Engine(FlakyBackend()) as engine:
        failed = engine.generate(GenerationRequest("abc", GREEDY), timeout_s=5)
        fine = engine.generate(GenerationRequest("abc", GREEDY), timeout_s=5)
    assert failed.finish.reason == "error" and failed.finish.message == "decode exploded"
    assert fine.tokens == run_alone("abc")


def test_logprobs_are_the_log_softmax_of_the_model_and_do_not_change_the_tokens():
    import math

    plain = run_alone("hello world")
    backend = FakeBackend()
    with Engine(backend) as engine:
        result = engine.generate(GenerationRequest("hello world", GREEDY, logprobs=3))
        handle = engine.submit(GenerationRequest("hello world", GREEDY, logprobs=3))
        events = [e for e in handle if isinstance(e, TokenEvent)]
    assert result.tokens == plain
    history = backend.tokenize("hello world")
    for event in events:
        logits = backend.rule(history)
        finite = [v for v in logits if v != -math.inf]
        norm = max(finite) + math.log(sum(math.exp(v - max(finite)) for v in finite))
        assert math.isclose(event.logprob, logits[event.token] - norm, abs_tol=1e-9)
        assert len(event.top) == 3 and event.top[0][1] >= event.top[1][1] >= event.top[2][1]
        assert event.top[0][0] == event.token  # greedy picks the most likely token
        history.append(event.token)


def test_logprobs_request_is_validated():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(RequestError):
            GenerationRequest("x", GREEDY, logprobs=bad)


def test_a_session_prefills_only_what_the_next_turn_adds_with_identical_output():
    from reame.engine import Session
    backend = FakeBackend()
    session = Session()
    turn_one = "<|im_start|>user\nfirst question<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with Engine(backend) as engine:
        first = engine.generate(GenerationRequest(turn_one, params, session=session))
        # the last token is not in KV
        assert list(session.state.tokens) == backend.tokenize(turn_one) + first.tokens[:-1]
    turn_two = turn_one + first.text + "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
    backend = FakeBackend()  # a restart: the slots forget; only the session remembers
    with Engine(backend) as engine:
        second = engine.generate(GenerationRequest(turn_two, params, session=session))
        fed = sum(len(call) for call in backend.decode_calls)
    prompt_two = backend.tokenize(turn_two)
    cached = second.finish.usage.cached_tokens
    assert cached == len(backend.tokenize(turn_one)) + len(first.tokens) - 1
    assert fed == len(prompt_two) - cached + len(second.tokens) - 1
    assert second.tokens == run_alone(turn_two, params)


def test_a_session_blob_that_does_not_restore_falls_back_to_a_full_prefill():
    from reame.engine import Session, SessionState
    backend = FakeBackend()
    session = Session(SessionState(tokens=tuple(backend.tokenize("hello world")), blob=b"garbage"))
    with Engine(backend) as engine:
        result = engine.generate(GenerationRequest("hello world again", GREEDY, session=session))
    assert result.finish.usage.cached_tokens == 0
    assert result.tokens == run_alone("hello world again")


def test_a_new_request_reuses_the_idle_slot_with_the_longest_shared_prefix():
    backend = FakeBackend(n_seq_max=3, n_ctx=2048)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = "a long shared system prompt that many requests start with. "
    with Engine(backend) as engine:
        for prompt in ("unrelated text", shared + "first", "other unrelated"):
            engine.generate(GenerationRequest(prompt, params))
        calls_before = len(backend.decode_calls)
        result = engine.generate(GenerationRequest(shared + "second", params))
        fed = backend.decode_calls[calls_before:]
    prompt = backend.tokenize(shared + "second")
    common = len(backend.tokenize(shared)) + 0  # "first"/"second" differ from their first byte
    assert result.finish.usage.cached_tokens == common
    assert sum(len(call) for call in fed) == len(prompt) - common + len(result.tokens) - 1
    assert {seq for call in fed for _, _, seq, _ in call} == {1}  # the slot that held the shared prefix
    assert result.tokens == run_alone(shared + "second", params)


def test_a_repeated_prompt_decodes_only_its_last_token_again():
    backend = FakeBackend()
    with Engine(backend) as engine:
        first = engine.generate(GenerationRequest("same prompt", GREEDY))
        second = engine.generate(GenerationRequest("same prompt", GREEDY))
    assert second.tokens == first.tokens
    assert second.finish.usage.cached_tokens == len(backend.tokenize("same prompt")) - 1


def test_idle_cached_kv_is_given_up_before_any_running_request():
    backend = FakeBackend(n_ctx=120, n_seq_max=2)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with Engine(backend) as engine:
        engine.generate(GenerationRequest("cached in an idle slot", params))
        result = engine.generate(GenerationRequest("x" * 60, params))
    assert result.finish.reason == "length" and result.finish.message == ""
    assert len(result.tokens) == 50


def test_a_full_queue_is_refused_and_a_long_wait_times_out():
    from reame.errors import OverloadedError
    gate = threading.Event()
    engine = Engine(FakeBackend(rule=gated_rule(gate)), max_queue=1, queue_timeout_s=0.2).start()
    try:
        running = engine.submit(GenerationRequest("a", SamplingParams(temperature=0, max_tokens=3)))
        wait_until(lambda: engine.load() == (0, 1), what="the first request to be admitted (blocked in decode)")
        waiting = engine.submit(GenerationRequest("b", GREEDY))
        with pytest.raises(OverloadedError):
            engine.submit(GenerationRequest("c", GREEDY))
        wait_until(lambda: time.monotonic() - waiting.submitted_at > engine.queue_timeout_s,
                   what="the waiting request to outlive the queue timeout")
        gate.set()
        assert waiting.result(timeout_s=5).finish.reason == "timeout"
        assert running.result(timeout_s=5).finish.reason == "length"
    finally:
        gate.set()
        engine.close()


def test_the_sequence_beyond_its_reservation_is_the_one_that_ends():
    backend = FakeBackend(n_ctx=80, n_seq_max=2)  # both fit their reservations, not their growth
    engine = Engine(backend, reserve_tokens=10)
    greedy_forever = SamplingParams(temperature=0, ignore_eos=True)  # reserves 10 answer tokens, wants more
    bounded = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # reserves what it uses
    runaway = engine.submit(GenerationRequest("runaway", greedy_forever))
    polite = engine.submit(GenerationRequest("polite", bounded))  # admitted after the runaway
    engine.start()
    try:
        runaway_result, polite_result = runaway.result(timeout_s=5), polite.result(timeout_s=5)
    finally:
        engine.close()
    assert len(polite_result.tokens) == 40 and polite_result.finish.message == ""
    assert runaway_result.finish.message == "the context is full"


def test_a_streamed_first_token_is_sent_before_the_next_step_takes_the_cores():
    backend = FakeBackend(n_ctx=512)
    sent = threading.Event()
    sent_before_each_decode: list[bool] = []
    decode = backend.decode

    def watched(tokens, positions, seq_ids, outputs, rowwise=False):
        sent_before_each_decode.append(sent.is_set())
        return decode(tokens, positions, seq_ids, outputs, rowwise)
    backend.decode = watched
    with Engine(backend, first_token_handoff_s=60) as engine:
        handle = engine.submit(GenerationRequest("hello there", SamplingParams(temperature=0, max_tokens=3),
                                                 streamed=True))
        for event in handle:
            if isinstance(event, TokenEvent):
                sent.set()  # the caller has written the token out
            handle.delivered()
    assert sent_before_each_decode == [False, True, True]


@pytest.mark.parametrize("streamed", [False, True])
def test_the_engine_goes_on_without_a_delivery_it_was_not_promised_or_from_a_cancelled_request(streamed):
    with Engine(FakeBackend(n_ctx=512), first_token_handoff_s=600) as engine:
        handle = engine.submit(GenerationRequest("hello there", SamplingParams(temperature=0, max_tokens=4),
                                                 streamed=streamed))
        if streamed:
            next(iter(handle))
            handle.cancel()  # a client that went away delivers nothing
        assert handle.result(timeout_s=30).finish.reason == ("cancelled" if streamed else "length")
        assert engine.generate(GenerationRequest("next one", SamplingParams(temperature=0, max_tokens=2)),
                               timeout_s=30).text
