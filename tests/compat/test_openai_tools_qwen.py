"""Function calling through the official `openai` SDK on Qwen2.5-Coder-1.5B, whose own chat template lays
tools out: a call, the tool's result, then the final answer, streamed and not."""

import json
import os
import sys
from pathlib import Path

import openai
import pytest

from tests.live_server import live_server

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen2.5-coder-1.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris? Use the tool, then answer in one sentence."}]


@pytest.fixture(scope="module")
def client(native_libraries, model_path):
    command = [sys.executable, "-m", "reame", "run", str(model_path(MODEL)), "--serve", "--port", "0",
               "--parallel", "1", "--ctx", "2048", "--threads", "2"]
    with live_server(command, env=dict(os.environ, PYTHONPATH=str(ROOT))) as live:
        yield openai.OpenAI(base_url=live.base + "/v1", api_key="none", max_retries=0)


def finish_the_round_trip(client, call_id, name, arguments):
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=60)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    assert "21" in final.choices[0].message.content


def test_a_tool_call_round_trip(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], temperature=0,
                                              max_tokens=60)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    finish_the_round_trip(client, call.id, call.function.name, call.function.arguments)


def test_a_streamed_tool_call_round_trip(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], temperature=0,
                                            max_tokens=60, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] == "Paris"
    finish_the_round_trip(client, call["id"], call["name"], call["arguments"])


def test_a_named_tool_choice_forces_the_call(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a joke about Rome."}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=60)
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
