"""OpenAI's Responses API on a FakeBackend server: the chat route's answer as a response object, its event
stream, input items as the templates read them, previous_response_id over stored responses (per key, with
`store: false` storing none), errors. (The real `openai` SDK: tests/compat/test_openai_responses.py.)"""

import json
import time

import pytest

from reame.server.apis import responses
from reame.server.conversations import Conversations
from tests.unit.test_server import Live

ASK = {"model": "m", "input": "hello there", "temperature": 0, "max_output_tokens": 12}


def events(live, body: dict) -> list[dict]:
    response, data = live.request("POST", "/v1/responses", dict(body, stream=True))
    assert response.status == 200
    return [json.loads(frame.split("\ndata: ")[1]) for frame in data.decode().split("\n\n") if frame.strip()]


def test_a_response_is_the_chat_routes_answer_as_a_response_object(live):
    status, body = live.json("POST", "/v1/responses", dict(ASK, instructions="Be brief."))
    _, chat = live.json("POST", "/v1/chat/completions", {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        "temperature": 0, "max_tokens": 12})
    (item,) = body["output"]
    assert status == 200 and body["object"] == "response" and body["id"].startswith("resp_")
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"] == [{"type": "output_text", "text": chat["choices"][0]["message"]["content"],
                                "annotations": []}]
    assert body["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    finished = chat["choices"][0]["finish_reason"]
    assert body["status"] == {"stop": "completed", "length": "incomplete"}[finished]


def test_the_stream_is_the_responses_event_sequence(live):
    streamed = events(live, ASK)
    kinds = [event["type"] for event in streamed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          streamed[-1]["type"]] and streamed[-1]["type"] in ("response.completed",
                                                                            "response.incomplete")
    assert [event["sequence_number"] for event in streamed] == list(range(len(streamed)))
    text = "".join(event["delta"] for event in streamed if event["type"] == "response.output_text.delta")
    assert text == streamed[-1]["response"]["output"][0]["content"][0]["text"]


def test_input_items_become_the_chat_the_templates_read():
    assert responses.item_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}]) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


def test_previous_response_id_continues_the_conversation_for_its_key_only(live):
    _, first = live.json("POST", "/v1/responses", ASK)
    _, second = live.json("POST", "/v1/responses", dict(ASK, input="and then?", previous_response_id=first["id"]))
    _, chat = live.json("POST", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first["output"][0]["content"][0]["text"]},
        {"role": "user", "content": "and then?"}], "temperature": 0, "max_tokens": 12})
    assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert second["previous_response_id"] == first["id"]
    assert live.json("GET", f"/v1/responses/{first['id']}")[1]["id"] == first["id"]
    _, unstored = live.json("POST", "/v1/responses", dict(ASK, store=False))
    status, body = live.json("POST", "/v1/responses", dict(ASK, previous_response_id=unstored["id"]))
    assert status == 404 and body["error"]["code"] == "previous_response_not_found"
    assert live.json("DELETE", f"/v1/responses/{first['id']}")[1]["deleted"] is True
    assert live.json("GET", f"/v1/responses/{first['id']}")[0] == 404


def test_another_keys_responses_are_not_found(engine):
    server = Live(engine, api_keys=("key-a", "key-b"))
    try:
        _, first = server.json("POST", "/v1/responses", ASK, {"Authorization": "Bearer key-a"})
        status, _ = server.json("POST", "/v1/responses", dict(ASK, previous_response_id=first["id"]),
                                {"Authorization": "Bearer key-b"})
        assert status == 404
    finally:
        server.close()


def test_one_key_storing_in_a_loop_keeps_another_keys_response(engine):
    """Issue 49, finding 2 as sent: key A's cached store:true requests in a loop evicted key B's stored response
    (its GET and previous_response_id then 404)."""
    server = Live(engine, api_keys=("key-a", "key-b"))
    server.app.conversations = Conversations(max_kept=20)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    try:
        _, kept = server.json("POST", "/v1/responses", ASK, b)
        for n in range(60):
            assert server.json("POST", "/v1/responses", dict(ASK, input=f"hello {n % 3}"), a)[0] == 200
        assert server.json("GET", f"/v1/responses/{kept['id']}", headers=b)[0] == 200
        status, _ = server.json("POST", "/v1/responses", dict(ASK, previous_response_id=kept["id"]), b)
        assert status == 200
    finally:
        server.close()


def test_stored_responses_are_bounded_in_number_size_and_time():
    kept = Conversations(keep_seconds=60, max_kept=2, max_bytes=100)
    for n in range(3):
        kept.keep("", f"r{n}", [{"role": "user", "content": "x" * 10}], {})
    assert kept.find("", "r0") is None and kept.find("", "r2") is not None
    assert kept.find("", "r2").messages == [{"role": "user", "content": "x" * 10}]
    kept.keep("", "big", [{"role": "user", "content": "x" * 101}], {})
    assert kept.find("", "big") is None
    kept.keep("", "echo", [], {"metadata": [{}] * 60})  # what the response echoes counts too
    assert kept.find("", "echo") is None
    old = Conversations(keep_seconds=0.001)  # (waits on the clock: expiry is the behaviour under test)
    old.keep("", "r", [{"role": "user", "content": "x"}], {})
    time.sleep(0.01)
    assert old.find("", "r") is None


@pytest.mark.parametrize("body", [
    dict(ASK, input=[]), dict(ASK, input=[{"type": "image", "url": "x"}]),
    dict(ASK, input=[{"role": "user", "content": [{"type": "input_image"}]}]),
    dict(ASK, tools=[{"type": "web_search"}]), dict(ASK, text={"format": {"type": "xml"}}), dict(ASK, temperature=9),
    dict(ASK, previous_response_id=5),
])
def test_a_bad_request_is_a_400_or_404_naming_its_field(live, body):
    status, answer = live.json("POST", "/v1/responses", body)
    assert status in (400, 404) and answer["error"]["message"]


def test_text_format_makes_the_answer_follow_a_schema(structured_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    _, body = structured_server.json("POST", "/v1/responses", dict(
        ASK, temperature=1.0, max_output_tokens=300, text={"format": {"type": "json_schema", "name": "n",
                                                                      "schema": schema}}))
    assert isinstance(json.loads(body["output"][0]["content"][0]["text"])["n"], int)


def test_a_key_storing_in_a_loop_evicts_its_own_responses_not_another_keys():
    """Issue 49, finding 2: key A's 1,000 stored responses evicted key B's (GET and previous_response_id 404)."""
    kept = Conversations(keep_seconds=60, max_kept=10, max_bytes=10_000)
    kept.keep("b", "b0", [{"role": "user", "content": "mine"}], {"id": "b0"})
    for n in range(1000):
        kept.keep("a", f"a{n}", [{"role": "user", "content": "x" * 50}], {"id": f"a{n}"})
    assert kept.find("b", "b0") is not None and kept.find("a", "a999") is not None and kept.find("a", "a0") is None
    for n in range(50):
        kept.keep("a", f"big{n}", [{"role": "user", "content": "y" * 2000}], {})
    assert kept.find("b", "b0") is not None  # by bytes too


@pytest.mark.parametrize("field, value", [
    ("metadata", [{}] * 10), ("metadata", {f"k{n}": "v" for n in range(17)}), ("metadata", {"k" * 65: "v"}),
    ("metadata", {"k": "v" * 513}), ("metadata", {"k": {}}), ("user", "u" * 513), ("user", 5)])
def test_request_fields_a_stored_response_echoes_are_bounded(live, field, value):
    status, answer = live.json("POST", "/v1/responses", dict(ASK, **{field: value}))
    assert status == 400 and answer["error"]["param"] == field
