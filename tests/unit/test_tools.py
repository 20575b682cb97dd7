"""Function calling: the parser's exact output, the prompt a template without tools gets, and round
trips through the server on FakeBackend (the model's reply scripted), streamed and not."""

import json

import pytest

from reame.engine import Engine
from tests.fakes.backend import FakeBackend, reply_rule
from reame.structured.tools import ToolCallParser, ToolRequest, template_messages, tool_parser

from .test_server import Live, read_sse

NAMES = frozenset({"get_weather", "add"})
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def parse(chunks, parallel=True, prefill=""):
    parser = ToolCallParser(NAMES, parallel, prefill)
    said = [item for chunk in chunks for item in parser.feed(chunk)] + parser.finish()
    return [(kind, item if kind == "content" else (item.name, json.loads(item.arguments))) for kind, item in said]


@pytest.mark.parametrize("chunks, expected", [
    (["It is sunny."], [("content", "It is sunny.")]),
    (['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'],
     [("call", ("get_weather", {"city": "Rome"}))]),
    (["<tool", "_call>", '{"name": "add", "argu', 'ments": {"a": 1}}', "</tool_call>"],
     [("call", ("add", {"a": 1}))]),
    (["\n", '<tool_call>{"name": "add", "arguments": {}}</tool_call>\n<tool_call>',
      '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'],
     [("call", ("add", {})), ("call", ("get_weather", {"city": "Oslo"}))]),
    (['Let me check. <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'],
     [("content", "Let me check. "), ("call", ("add", {"a": 2}))]),
    (['<tool_call>{"name": "add", "arguments": {"a": 3}}'], [("call", ("add", {"a": 3}))]),  # cut before the close
    (['<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'],
     [("content", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')]),
    (["<tool_call>not json</tool_call> after"],
     [("content", "<tool_call>not json</tool_call>"), ("content", " after")]),
    (['{"name": "get_weather", "parameters": {"city": "Paris"}}'], [("call", ("get_weather", {"city": "Paris"}))]),
    (["<|python", '_tag|>{"name": "add", "arguments": {"b": 1}}'], [("call", ("add", {"b": 1}))]),
    (['{"answer": 42}'], [("content", '{"answer": 42}')]),
    (["``", '`json\n{"name": "add", "arguments": {"c": 2}}\n```'], [("call", ("add", {"c": 2}))]),
    (["```python\nprint(1)\n```"], [("content", "```python\nprint(1)\n```")]),
    (["```\n", "x = 1\n```"], [("content", "```\nx = 1\n```")]),
    (["`code` here"], [("content", "`code` here")]),
    (['{{"name": "add", "arguments": {"d": 4}}}'], [("call", ("add", {"d": 4}))]),
    (['<tool_call>\n{{"name": "add", "arguments": {}}}\n</tool_call>'], [("call", ("add", {}))]),
    (["{{not json}}"], [("content", "{{not json}}")]),
    (["a < b and x<tool", " is a word"], [("content", "a < b and x"), ("content", "<tool is a word")]),
])
def test_the_parser_splits_content_and_calls_exactly(chunks, expected):
    assert parse(chunks) == expected


def test_one_call_only_when_parallel_calls_are_off():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": {"x": 1}}'
    assert parse([text], parallel=False) == [("call", ("add", {}))]


def test_a_forced_call_continues_the_prefill():
    forced = ToolRequest((WEATHER,), forced="get_weather")
    assert forced.prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert parse(['{"city": "Rome"}}\n</tool_call>'], prefill=forced.prefill) == [
        ("call", ("get_weather", {"city": "Rome"}))]
    assert ToolRequest((WEATHER,), forced="").prefill == '<tool_call>\n{"name": "'
    assert tool_parser(None) is None


def test_a_template_without_tools_gets_instructions_and_the_history_as_text():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    shaped = template_messages(history, ToolRequest((WEATHER,)), template_has_tools=False)
    assert shaped[0]["role"] == "system" and shaped[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in shaped[0]["content"]
    assert shaped[2] == {"role": "assistant", "content":
                         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'}
    assert shaped[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert template_messages(history, ToolRequest((WEATHER,)), template_has_tools=True) == history


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture(params=[True, False], ids=["template-with-tools", "template-without"])
def scripted(request):
    """A server whose model always answers with CALL (or, given a reply, that)."""
    servers = []

    def make(reply=CALL):
        engine = Engine(FakeBackend(n_ctx=2048, rule=reply_rule(reply), template_tools=request.param)).start()
        server = Live(engine)
        servers.append((server, engine))
        return server
    yield make
    for server, engine in servers:
        server.close()
        engine.close()


def ask(**extra):
    return {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER, ADD],
            "temperature": 0, "max_tokens": 200, **extra}


def test_a_tool_call_comes_back_as_tool_calls(scripted):
    status, body = scripted().json("POST", "/v1/chat/completions", ask())
    assert status == 200
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Rome"})


def test_a_streamed_tool_call_arrives_as_a_tool_call_delta(scripted):
    events = read_sse(scripted(), "/v1/chat/completions", ask(stream=True))
    deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
    calls = [delta["tool_calls"] for delta in deltas if "tool_calls" in delta]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "get_weather"
    assert not "".join(delta.get("content") or "" for delta in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_text_answers_stay_content_when_tools_are_offered(scripted):
    server = scripted("It is sunny in <b>Rome</b>.")
    body = server.json("POST", "/v1/chat/completions", ask())[1]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny in <b>Rome</b>."}
    assert body["choices"][0]["finish_reason"] == "stop"
    events = read_sse(server, "/v1/chat/completions", ask(stream=True))
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == "It is sunny in <b>Rome</b>."


def test_a_named_tool_choice_prefills_the_call(scripted):
    server = scripted(CALL)
    body = server.json("POST", "/v1/chat/completions",
                       ask(tool_choice={"type": "function", "function": {"name": "get_weather"}}))[1]
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Rome"}


def test_the_tool_result_round_trip_reaches_the_prompt(scripted):
    server = scripted("It is sunny.")
    first_call = {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [first_call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    status, body = server.json("POST", "/v1/chat/completions", ask(messages=messages))
    assert status == 200 and body["choices"][0]["message"]["content"] == "It is sunny."
    tokens = server.json("POST", "/tokenize", {"content": server.model.engine.chat_prompt(
        template_messages(messages, None, server.model.engine.backend.template_supports_tools))})[1]["tokens"]
    assert len(tokens) > 20


def test_tool_choice_none_sends_no_tools_and_parses_nothing(scripted):
    body = scripted(CALL).json("POST", "/v1/chat/completions", ask(tool_choice="none"))[1]
    assert body["choices"][0]["message"]["content"] == CALL and body["choices"][0]["finish_reason"] == "stop"
