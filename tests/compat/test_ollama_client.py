"""The `ollama` Python client against Reame serving the default model (SmolLM2) and, for tool calls,
Qwen2.5-Coder-1.5B (whose template lays tools out): list, show, ps, generate, chat streamed and not, logprobs,
a JSON schema format, embeddings, pull, a tool call and its round trip, and Ollama's errors."""

import json

import ollama
import pytest

from tests.live_server import model_server as serve

GREEDY = {"temperature": 0, "num_predict": 24}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(native_libraries, smollm2_path):
    with serve(smollm2_path, env={"REAME_SERVER_ALLOW_PULL": "true"}) as live:
        yield ollama.Client(host=live.base)


def test_the_model_is_listed_shown_and_running(client):
    (model,) = client.list().models
    assert model.model == "smollm2-135m"  # the catalog's name for the file
    assert model.details.format == "gguf" and model.details.family == "llama"
    assert model.details.quantization_level == "Q4_1" and model.size == 98_362_432
    shown = client.show(model.model)
    assert shown.modelinfo["llama.context_length"] == 8192 and "completion" in shown.capabilities
    assert client.ps().models[0].context_length == 2048


def test_generate_and_chat_streamed_and_not_say_the_same(client):
    whole = client.chat(model="smollm2", messages=[{"role": "user", "content": "Name a colour."}], options=GREEDY)
    parts = list(client.chat(model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
                             options=GREEDY, stream=True))
    assert "".join(part.message.content for part in parts) == whole.message.content and whole.message.content
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length") and parts[-1].eval_count > 0
    generated = client.generate(model="smollm2", prompt="Name a colour.", options=GREEDY)
    assert generated.response == whole.message.content and generated.eval_count == whole.eval_count
    assert generated.total_duration > 0 and generated.prompt_eval_count > 0


def test_logprobs_reach_the_client_token_by_token(client):
    """`logprobs` and `top_logprobs`, as the client asks for them: one entry per generated token, its text
    the answer's, streamed with the pieces they scored."""
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a fruit."}], "logprobs": True,
           "top_logprobs": 3, "options": {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}}
    whole = client.chat(**ask)
    assert len(whole.logprobs) == whole.eval_count
    assert "".join(entry.token for entry in whole.logprobs) == whole.message.content
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token and
               entry.logprob <= 0 for entry in whole.logprobs)
    parts = list(client.chat(**ask, stream=True))
    assert [entry.token for part in parts for entry in part.logprobs or []] == \
        [entry.token for entry in whole.logprobs]
    generated = client.generate(model="smollm2", prompt="Name a fruit.", logprobs=True,
                                options={"temperature": 0, "num_predict": 6})
    assert len(generated.logprobs) == generated.eval_count and generated.logprobs[0].top_logprobs == []


def test_a_json_schema_format_is_followed(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    answer = client.chat(model="smollm2", messages=[{"role": "user", "content": "Bob is 30. Reply in JSON."}],
                         format=schema, options={"temperature": 0, "num_predict": 80})
    parsed = json.loads(answer.message.content)
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)


def test_embeddings_and_pull(client):
    vectors = client.embed(model="smollm2", input=["a cat", "a dog"]).embeddings
    assert len(vectors) == 2 and len(vectors[0]) == 576
    assert client.embeddings(model="smollm2", prompt="a cat").embedding == pytest.approx(vectors[0])
    assert client.pull("smollm2-135m").status == "success"
    with pytest.raises(ollama.ResponseError) as raised:
        client.pull("no-such-model")
    assert raised.value.status_code == 404


def test_ollamas_errors_reach_the_client_as_response_errors(client):
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="smollm2", messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}])
    assert raised.value.status_code == 400 and "text only" in raised.value.error


def test_a_tool_call_and_its_round_trip_on_qwen(native_libraries, model_path):
    with serve(model_path("qwen2.5-coder-1.5b")) as live:
        client = ollama.Client(host=live.base)
        question = [{"role": "user", "content": "What is the weather in Paris? Use the tool, then answer in one "
                                                "sentence."}]
        answer = client.chat(model="qwen", messages=question, tools=[WEATHER], options={"temperature": 0})
        (call,) = answer.message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments["city"] == "Paris"
        streamed = [part for part in client.chat(model="qwen", messages=question, tools=[WEATHER],
                                                 options={"temperature": 0}, stream=True) if part.message.tool_calls]
        assert streamed[0].message.tool_calls[0].function.arguments == call.function.arguments
        final = client.chat(model="qwen", messages=question + [
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"temperature_c": 21})}],
            tools=[WEATHER], options={"temperature": 0, "num_predict": 60})
        assert not final.message.tool_calls and "21" in final.message.content


def test_thinking_sent_back_is_taken(client):
    history = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "Blue.", "thinking": "Blue is calm."},
               {"role": "user", "content": "Another one?"}]
    answer = client.chat(model="smollm2-135m", messages=history, options=GREEDY)
    assert answer.message.content and answer.done
