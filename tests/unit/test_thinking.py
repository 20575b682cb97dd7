"""A thinking model's text split into thinking and content, whatever pieces it arrives in; and said apart by
each API (OpenAI's reasoning_content, Ollama's thinking, Anthropic's thinking block), with each API's switch."""

import json
import random
import time

import pytest

from reame.structured.thinking import ThinkingSplitter

ANSWER = "<think>\nThe user wants a colour.\n</think>\n\nBlue."


def split(pieces, splitter=None):
    splitter = splitter or ThinkingSplitter()
    said = [item for piece in pieces for item in splitter.feed(piece)] + splitter.finish()
    joined = {"thinking": "", "content": ""}
    for kind, text in said:
        joined[kind] += text
    return joined


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 100])
def test_the_parts_are_the_same_whatever_the_pieces(size):
    pieces = [ANSWER[i:i + size] for i in range(0, len(ANSWER), size)]
    assert split(pieces) == {"thinking": "The user wants a colour.\n", "content": "Blue."}


def test_a_prompt_that_opened_the_thinking_starts_inside_it():
    splitter = ThinkingSplitter.for_prompt("<|im_start|>assistant\n<think>\n")
    assert split(["Hmm, blue.</think>", "\n\nBlue."], splitter) == {"thinking": "Hmm, blue.", "content": "Blue."}
    closed = ThinkingSplitter.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert split(["Blue."], closed) == {"thinking": "", "content": "Blue."}


def test_a_tag_after_the_answer_began_is_the_answers_text():
    assert split(["Use <think> tags like <think>this</think>."]) == {
        "thinking": "", "content": "Use <think> tags like <think>this</think>."}
    assert split(["<thi"]) == {"thinking": "", "content": "<thi"}  # an unfinished tag is text after all


def test_random_text_splits_alike_in_any_pieces_in_bounded_time():
    generator = random.Random(9)
    alphabet = ["<", "/", "t", "h", "i", "n", "k", ">", " ", "\n", "x", "<think>", "</think>"]
    started = time.perf_counter()
    for _ in range(300):
        text = "".join(generator.choice(alphabet) for _ in range(200))
        pieces, at = [], 0
        while at < len(text):
            size = generator.randrange(1, 9)
            pieces.append(text[at:at + size])
            at += size
        parts = split(pieces)
        assert parts == split([text])
        assert len(parts["thinking"]) + len(parts["content"]) <= len(text)
    assert time.perf_counter() - started < 5


# --- a thinking model behind each API (a template shaped like Qwen3's: the model opens <think> itself, and
# enable_thinking=false closes an empty one in the prompt) ---

THINKING_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
THOUGHT = "<think>\nThe user wants a colour. Blue is calm.\n</think>\n\nBlue."
ASK = [{"role": "user", "content": "A colour?"}]


@pytest.fixture
def thinker():
    from reame.engine import Engine
    from tests.fakes.backend import FakeBackend, reply_rule
    from tests.unit.test_server import Live
    with Engine(FakeBackend(n_ctx=1024, rule=reply_rule(THOUGHT), template=THINKING_TEMPLATE)) as engine:
        server = Live(engine)
        yield server
        server.close()


def test_openai_chat_says_the_thinking_as_reasoning_content(thinker):
    _, body = thinker.json("POST", "/v1/chat/completions", {"messages": ASK, "temperature": 0, "max_tokens": 80})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"].strip() == "The user wants a colour. Blue is calm." and \
        message["content"] == "Blue."
    response, data = thinker.request("POST", "/v1/chat/completions", {"messages": ASK, "temperature": 0,
                                                                      "max_tokens": 80, "stream": True})
    chunks = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Blue."
    _, off = thinker.json("POST", "/v1/chat/completions", {"messages": ASK, "temperature": 0, "max_tokens": 80,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning_content" not in off["choices"][0]["message"]


def test_ollama_says_the_thinking_as_thinking(thinker):
    body = {"model": "m", "messages": ASK, "stream": False, "options": {"temperature": 0, "num_predict": 80}}
    _, whole = thinker.json("POST", "/api/chat", body)
    assert whole["message"]["thinking"].strip() == "The user wants a colour. Blue is calm."
    assert whole["message"]["content"] == "Blue."
    _, data = thinker.request("POST", "/api/chat", dict(body, stream=True))
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert "".join(line["message"].get("thinking", "") for line in lines) == whole["message"]["thinking"]
    _, off = thinker.json("POST", "/api/chat", dict(body, think=False))
    assert "thinking" not in off["message"]


def test_anthropic_says_the_thinking_in_a_thinking_block(thinker):
    body = {"model": "m", "max_tokens": 80, "temperature": 0, "messages": ASK}
    _, whole = thinker.json("POST", "/v1/messages", body)
    assert [block["type"] for block in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"].strip() == "The user wants a colour. Blue is calm."
    assert whole["content"][1]["text"] == "Blue."
    _, data = thinker.request("POST", "/v1/messages", dict(body, stream=True))
    frames = [json.loads(frame.split("\ndata: ")[1]) for frame in data.decode().split("\n\n") if frame.strip()]
    starts = [frame["content_block"]["type"] for frame in frames if frame["type"] == "content_block_start"]
    thought = "".join(frame["delta"]["thinking"] for frame in frames if frame["type"] == "content_block_delta"
                      and frame["delta"]["type"] == "thinking_delta")
    assert starts == ["thinking", "text"] and thought == whole["content"][0]["thinking"]
    _, off = thinker.json("POST", "/v1/messages", dict(body, thinking={"type": "disabled"}))
    assert all(block["type"] != "thinking" for block in off["content"])


def test_the_responses_api_says_the_thinking_in_a_reasoning_item(thinker):
    body = {"model": "m", "input": "A colour?", "temperature": 0, "max_output_tokens": 80}
    _, whole = thinker.json("POST", "/v1/responses", body)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"].strip() == "The user wants a colour. Blue is calm."
    assert whole["output"][1]["content"][0]["text"] == "Blue."
    _, off = thinker.json("POST", "/v1/responses", dict(body, reasoning={"effort": "none"}))
    assert [item["type"] for item in off["output"]] == ["message"]


# --- the thinking sent back: each API's history shape reaches the template as `reasoning_content` ---

HISTORY_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EARLIER = "Blue is calm."
RENDERED = (f"<|im_start|>user\nA colour?<|im_end|>\n<|im_start|>assistant\n<think>\n{EARLIER}\n</think>\n\n"
            "Blue.<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture
def recorder():
    """A thinking model whose template renders an assistant's `reasoning_content`; `.prompts` are the prompts
    its rule saw first in each request."""
    from reame.engine import Engine
    from tests.fakes.backend import FakeBackend, reply_rule
    from tests.unit.test_server import Live
    answer = reply_rule(THOUGHT)
    histories = []

    def rule(history):
        histories.append(list(history))
        return answer(history)
    backend = FakeBackend(n_ctx=1024, rule=rule, template=HISTORY_TEMPLATE)
    with Engine(backend) as engine:
        server = Live(engine)
        server.prompt = lambda: backend.detokenize(min(histories, key=len)).removeprefix("<s>")
        server.forget = histories.clear
        yield server
        server.close()


def asked(server, path, body):
    server.forget()
    response, data = server.request("POST", path, body)
    assert response.status == 200, data
    return server.prompt()


def test_openai_chat_takes_reasoning_content_back(recorder):
    messages = [ASK[0], {"role": "assistant", "content": "Blue.", "reasoning_content": EARLIER},
                {"role": "user", "content": "Another?"}]
    assert asked(recorder, "/v1/chat/completions", {"messages": messages, "max_tokens": 4}) == RENDERED
    response, data = recorder.request("POST", "/v1/chat/completions", {
        "messages": [ASK[0], dict(messages[1], reasoning_content=7), messages[2]]})
    assert response.status == 400 and b"messages[1].reasoning_content" in data


def test_anthropic_takes_thinking_blocks_back_and_drops_redacted_ones(recorder):
    assistant = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": EARLIER, "signature": ""},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT"},
        {"type": "text", "text": "Blue."}]}
    body = {"model": "m", "max_tokens": 4, "messages": [ASK[0], assistant, {"role": "user", "content": "Another?"}]}
    assert asked(recorder, "/v1/messages", body) == RENDERED
    _, counted = recorder.json("POST", "/v1/messages/count_tokens", body)
    _, without = recorder.json("POST", "/v1/messages/count_tokens", dict(body, messages=[
        ASK[0], {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]))
    assert counted["input_tokens"] - without["input_tokens"] == len(f"<think>\n{EARLIER}\n</think>\n\n")
    response, _ = recorder.request("POST", "/v1/messages", dict(body, messages=[
        {"role": "user", "content": [{"type": "thinking", "thinking": "mine"}]}]))
    assert response.status == 400


def test_ollama_takes_thinking_back(recorder):
    messages = [ASK[0], {"role": "assistant", "content": "Blue.", "thinking": EARLIER},
                {"role": "user", "content": "Another?"}]
    body = {"model": "m", "messages": messages, "stream": False, "options": {"num_predict": 4}}
    assert asked(recorder, "/api/chat", body) == RENDERED
    response, _ = recorder.request("POST", "/api/chat", dict(body, messages=[ASK[0], dict(messages[1], thinking=[])]))
    assert response.status == 400


def test_the_responses_api_takes_its_output_back_as_input(recorder):
    _, first = recorder.json("POST", "/v1/responses", {"model": "m", "input": "A colour?", "max_output_tokens": 80,
                                                       "temperature": 0})
    assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
    thought = first["output"][0]["content"][0]["text"]
    again = [{"role": "user", "content": "A colour?"}, *first["output"], {"role": "user", "content": "Another?"}]
    expected = RENDERED.replace(EARLIER, thought)
    assert asked(recorder, "/v1/responses", {"model": "m", "input": again, "max_output_tokens": 4}) == expected
    # A summary stands in for the text; through previous_response_id the stored answer keeps its thinking.
    summarised = [again[0], {"type": "reasoning", "summary": [{"type": "summary_text", "text": EARLIER}]},
                  again[2], again[3]]
    assert asked(recorder, "/v1/responses", {"model": "m", "input": summarised, "max_output_tokens": 4}) == RENDERED
    assert asked(recorder, "/v1/responses", {"model": "m", "input": "Another?", "max_output_tokens": 4,
                                             "previous_response_id": first["id"]}) == expected
    response, _ = recorder.request("POST", "/v1/responses", {"model": "m", "input": [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": 3}]}]})
    assert response.status == 400
