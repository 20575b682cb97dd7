"""The chat REPL on FakeBackend: history, trimming, commands, multi-line input."""

import io

from reame.chat import Conversation, read_message, repl
from reame.engine import Engine, SamplingParams
from tests.fakes.backend import FakeBackend

PARAMS = SamplingParams(temperature=0, max_tokens=8)


def lines(*items):
    queue = list(items)

    def read(_prompt):
        if not queue:
            raise EOFError
        return queue.pop(0)
    return read


def test_backslash_and_triple_quotes_make_multi_line_messages():
    assert read_message(lines("first \\", "second")) == "first \nsecond"
    assert read_message(lines('"""', "a", "", "b", '"""')) == "a\n\nb"
    assert read_message(lines()) is None


def test_history_goes_through_the_chat_template():
    with Engine(FakeBackend()) as engine:
        conversation = Conversation(engine, PARAMS, system="be brief")
        prompt, dropped = conversation.prompt_for("hi")
        conversation.answered("hello")
        prompt2, _ = conversation.prompt_for("again")
    assert dropped == 0
    assert prompt.startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>" in prompt2
    assert prompt2.endswith("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")


def test_oldest_exchanges_are_dropped_when_the_context_would_overflow():
    with Engine(FakeBackend(n_ctx=200)) as engine:
        conversation = Conversation(engine, PARAMS)
        for n in range(5):
            conversation.prompt_for(f"question number {n} " + "x" * 20)
            conversation.answered("an answer " + "y" * 20)
        prompt, dropped = conversation.prompt_for("last question")
    assert dropped > 0
    assert "last question" in prompt and "question number 0" not in prompt
    assert len(FakeBackend().tokenize(prompt)) < 200 - PARAMS.max_tokens


def test_repl_answers_with_history_resets_and_exits():
    out, err = io.StringIO(), io.StringIO()
    backend = FakeBackend()
    with Engine(backend) as engine:
        conversation = Conversation(engine, PARAMS)
        code = repl(conversation, lines("hello", "/help", "", "second", "/reset", "/exit", "never read"),
                    out=out, err=err, title="fake")
    assert code == 0
    assert "/reset" in err.getvalue() and "(conversation forgotten)" in err.getvalue()
    assert len(out.getvalue().splitlines()) == 2  # two answers
    assert conversation.turns == []


def test_end_of_input_leaves_the_repl():
    with Engine(FakeBackend()) as engine:
        assert repl(Conversation(engine, PARAMS), lines("hi"), out=io.StringIO(), err=io.StringIO()) == 0
