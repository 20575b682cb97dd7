"""A person's request stops a decode that carries only a batch's lines (engine/interruption.py), on FakeBackend:
the chat's prompt is the next decode, the line's rows are computed again after it, and both answers are the
ones each gets alone; a decode that carries a foreground row is never stopped."""

import threading

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.engine.interruption import BackgroundInterruption
from tests.fakes.backend import FakeBackend, default_rule
from tests.waiting import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LINE = "Ticket: the printer is on fire #" * 3
CHAT = "In two sentences, what should a support team do first?"


def alone(prompt: str) -> str:
    with Engine(FakeBackend(n_ctx=2048, n_seq_max=2)) as engine:
        return engine.generate(GenerationRequest(prompt, GREEDY)).text


def arriving_during(rows_of: str, background_chat: bool = False) -> tuple[Engine, FakeBackend, dict]:
    """A batch line answered by an engine whose first decode of `rows_of` ("line prompt" or "line decode")
    submits a chat from inside the decode, as a request arriving on another thread while ggml computes; both
    answers are checked against each one's answer alone."""
    submitted: dict = {}
    line_tokens = len(FakeBackend().tokenize(LINE))

    def rule(history):
        in_prompt = len(history) == line_tokens
        if "engine" in submitted and "chat" not in submitted and history[:line_tokens] == LINE_IDS and (
                in_prompt == (rows_of == "line prompt")):
            submitted["at"] = len(backend.decode_calls)  # the decodes done before the one this stops
            submitted["chat"] = submitted["engine"].submit(GenerationRequest(CHAT, GREEDY,
                                                                             background=background_chat))
        return default_rule(history)

    LINE_IDS = FakeBackend().tokenize(LINE)
    backend = FakeBackend(n_ctx=2048, n_seq_max=2, rule=rule)
    with Engine(backend) as engine:
        submitted["engine"] = engine
        line = engine.submit(GenerationRequest(LINE, GREEDY, background=True))
        assert line.result(10).text == alone(LINE)
        assert submitted["chat"].result(10).text == alone(CHAT)
        wait_until(lambda: engine.status.running == 0, what="the engine to be idle")
    return engine, backend, submitted


def test_a_chat_arriving_during_a_lines_prompt_stops_that_decode_and_is_prefilled_first():
    engine, backend, submitted = arriving_during("line prompt")
    assert engine.status.kv.decodes_interrupted == 1
    [stopped] = backend.interrupted_calls
    assert stopped[-1][0] == backend.tokenize(LINE)[-1]  # the decode of the line's last prompt token
    # The next decodes carry the chat's prompt alone (the plan keeps background rows out of them); the stopped
    # rows come once it is in, all again (beside the chat's next token).
    after = backend.decode_calls[submitted["at"]:]
    again = next(index for index, call in enumerate(after) if set(stopped) <= set(call))
    chat_rows = [row for call in after[:again] for row in call]
    assert {seq_id for _, _, seq_id, _ in chat_rows} == {1 - stopped[0][2]}
    assert [token for token, *_ in chat_rows] == backend.tokenize(CHAT)[-len(chat_rows):]


def test_a_chat_arriving_during_a_lines_decode_step_stops_it_too():
    engine, backend, submitted = arriving_during("line decode")
    assert len(backend.interrupted_calls) == 1 and len(backend.interrupted_calls[0]) == 1  # the line's one row
    assert engine.status.kv.decodes_interrupted == 1


def test_another_batch_line_arriving_stops_nothing():
    engine, backend, submitted = arriving_during("line prompt", background_chat=True)
    assert backend.interrupted_calls == [] and engine.status.kv.decodes_interrupted == 0


def test_the_stop_flag_is_set_only_around_a_background_decode():
    backend = FakeBackend()
    interruption = BackgroundInterruption(backend)
    interruption.arrived(1)  # a chat waits in the inbox: nothing runs yet, nothing to stop
    assert backend.stop is False
    with interruption.background_decode():
        assert backend.stop is True  # it stops at once: the engine takes the chat first
    assert backend.stop is False
    interruption.taken(1)
    with interruption.background_decode():
        assert backend.stop is False
        arrival = threading.Thread(target=interruption.arrived, args=(2,))
        arrival.start()
        arrival.join()
        assert backend.stop is True
    assert backend.stop is False
