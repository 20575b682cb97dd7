"""Anthropic's Messages API on a FakeBackend server: the OpenAI route's answer in Anthropic's shapes (content
blocks, stop reasons, usage), the event stream's order, messages and tools as the templates read them,
x-api-key, count_tokens, errors. (The real `anthropic` SDK: tests/compat/test_anthropic_client.py.)"""

import json

import pytest

from reame.server.apis import anthropic
from tests.unit.test_server import Live

MESSAGE = {"model": "claude-anything", "max_tokens": 12, "temperature": 0,
           "messages": [{"role": "user", "content": "hello there"}]}


def events(live, body: dict) -> list[tuple[str, dict]]:
    response, data = live.request("POST", "/v1/messages", dict(body, stream=True))
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    frames = [frame for frame in data.decode().split("\n\n") if frame.strip()]
    parsed = []
    for frame in frames:
        name_line, data_line = frame.split("\n")
        parsed.append((name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return parsed


def test_a_message_is_the_openai_routes_answer_in_anthropics_shape(live):
    status, body = live.json("POST", "/v1/messages", MESSAGE)
    _, openai = live.json("POST", "/v1/chat/completions", {"messages": MESSAGE["messages"], "temperature": 0,
                                                           "max_tokens": 12})
    assert status == 200 and body["type"] == "message" and body["role"] == "assistant"
    assert body["id"].startswith("msg_") and body["model"] == "claude-anything"
    assert body["content"] == [{"type": "text", "text": openai["choices"][0]["message"]["content"]}]
    assert body["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[openai["choices"][0]["finish_reason"]]
    assert body["usage"]["output_tokens"] == openai["usage"]["completion_tokens"]
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] == openai["usage"]["prompt_tokens"]


def test_a_stop_sequence_is_named(live):
    _, whole = live.json("POST", "/v1/messages", dict(MESSAGE, max_tokens=30))
    text = whole["content"][0]["text"]
    stop = text[4:6]
    _, stopped = live.json("POST", "/v1/messages", dict(MESSAGE, max_tokens=30, stop_sequences=[stop]))
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == stop
    assert stopped["content"][0]["text"] == text[:text.index(stop)]


def test_the_stream_is_anthropics_event_sequence(live):
    streamed = events(live, MESSAGE)
    names = [name for name, _ in streamed]
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[-3] == "content_block_stop" and set(names[2:-3]) == {"content_block_delta"}
    assert all(name == data["type"] for name, data in streamed)
    _, whole = live.json("POST", "/v1/messages", MESSAGE)
    text = "".join(data["delta"]["text"] for name, data in streamed if name == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert streamed[-2][1]["delta"]["stop_reason"] == whole["stop_reason"]
    assert streamed[-2][1]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_messages_become_the_chat_the_templates_read():
    body = {"system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                                     {"type": "text", "text": "And so?"}]}]}
    assert anthropic.conversation(body) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "toolu_1"}, {"role": "user", "content": "And so?"}]


def test_tools_and_tool_choice_become_the_tool_layers():
    tools = [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}]
    request = anthropic.tools_of({"tools": tools, "tool_choice": {"type": "tool", "name": "weather",
                                                                  "disable_parallel_tool_use": True}})
    assert request.forced == "weather" and request.parallel is False
    assert request.tools[0]["function"] == {"name": "weather", "description": "d", "parameters": {"type": "object"}}
    assert anthropic.tools_of({"tools": tools, "tool_choice": {"type": "any"}}).forced == ""
    assert anthropic.tools_of({"tools": tools, "tool_choice": {"type": "none"}}) is None


@pytest.mark.parametrize("body", [
    {**MESSAGE, "max_tokens": None}, {**MESSAGE, "model": None},
    {**MESSAGE, "messages": [{"role": "system", "content": "x"}]},
    {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {**MESSAGE, "tool_choice": {"type": "sometimes"}, "tools": [{"name": "t", "input_schema": {}}]},
    {**MESSAGE, "output_config": {"format": {"type": "xml"}}}, {**MESSAGE, "temperature": 3},
])
def test_a_bad_request_is_a_400_in_anthropics_error_shape(live, body):
    status, answer = live.json("POST", "/v1/messages", body)
    assert status == 400 and answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]


def test_output_config_format_makes_the_answer_follow_a_schema(structured_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    _, body = structured_server.json("POST", "/v1/messages", dict(MESSAGE, max_tokens=300, temperature=1.0,
                                                                  output_config={"format": {"type": "json_schema",
                                                                                            "schema": schema}}))
    assert isinstance(json.loads(body["content"][0]["text"])["n"], int)


def test_count_tokens_counts_what_a_message_would_prefill(live):
    _, counted = live.json("POST", "/v1/messages/count_tokens", {"model": "m", "messages": MESSAGE["messages"]})
    _, body = live.json("POST", "/v1/messages", MESSAGE)
    assert counted["input_tokens"] == body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]


def test_x_api_key_authenticates_as_a_bearer_key_does(engine):
    server = Live(engine, api_keys=("sk-right",))
    try:
        assert server.json("POST", "/v1/messages", MESSAGE, {"x-api-key": "sk-right"})[0] == 200
        status, body = server.json("POST", "/v1/messages", MESSAGE, {"x-api-key": "sk-wrong"})
        assert status == 401 and body["error"]["type"] == "authentication_error"
    finally:
        server.close()
