"""The `openai` SDK's Responses API (`client.responses.create`) against Reame serving the default model
(SmolLM2) and, for function tools, Qwen2.5-Coder-1.5B: text, a stream, a JSON schema, previous_response_id,
retrieve and delete, and a function call with its output, streamed and not."""

import json

import openai
import pytest

from tests.live_server import model_server as serve

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(native_libraries, smollm2_path):
    with serve(smollm2_path) as live:
        yield openai.OpenAI(base_url=live.base + "/v1", api_key="none", max_retries=0)


def test_text_and_the_same_text_streamed(client):
    whole = client.responses.create(model="smollm2", instructions="Be brief.", input="Name a colour.",
                                    temperature=0, max_output_tokens=24)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    with client.responses.stream(model="smollm2", instructions="Be brief.", input="Name a colour.", temperature=0,
                                 max_output_tokens=24) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_json_schema_a_continued_conversation_retrieve_and_delete(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = client.responses.create(model="smollm2", input="Bob is 30. Reply in JSON.", temperature=0,
                                     max_output_tokens=80, text={"format": {"type": "json_schema", "name": "person",
                                                                            "schema": schema, "strict": True}})
    parsed = json.loads(answer.output_text)
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)
    follow = client.responses.create(model="smollm2", input="How old is he?", previous_response_id=answer.id,
                                     temperature=0, max_output_tokens=24)
    assert follow.previous_response_id == answer.id and follow.output_text
    assert client.responses.retrieve(answer.id).output_text == answer.output_text
    client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)
    unstored = client.responses.create(model="smollm2", input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", input="Again", previous_response_id=unstored.id)


def test_a_function_call_and_its_output_on_qwen(native_libraries, model_path):
    with serve(model_path("qwen2.5-coder-1.5b")) as live:
        qwen = openai.OpenAI(base_url=live.base + "/v1", api_key="none", max_retries=0)
        question = "What is the weather in Paris? Use the tool, then answer in one sentence."
        answer = qwen.responses.create(model="qwen", input=question, tools=[WEATHER], temperature=0,
                                       max_output_tokens=80)
        (call,) = [item for item in answer.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        with qwen.responses.stream(model="qwen", input=question, tools=[WEATHER], temperature=0,
                                   max_output_tokens=80) as stream:
            final = stream.get_final_response()
        assert [json.loads(item.arguments) for item in final.output if item.type == "function_call"] == \
            [{"city": "Paris"}]
        done = qwen.responses.create(model="qwen", previous_response_id=answer.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=80, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id,
                                                                   "output": json.dumps({"temperature_c": 21})}])
        assert not [item for item in done.output if item.type == "function_call"] and "21" in done.output_text


def test_a_responses_output_with_reasoning_goes_back_as_input(client):
    # The Responses way of keeping a conversation without storing it: the output items, a reasoning item
    # among them when the model thinks (SmolLM2 does not: its item is written here as the SDK types it).
    first = client.responses.create(model="smollm2", input="Name a colour.", temperature=0, max_output_tokens=8,
                                    store=False)
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "A short name."}],
                 "content": [{"type": "reasoning_text", "text": "Blue is calm."}]}
    again = client.responses.create(model="smollm2", temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "Name a colour."}, reasoning, *[item.model_dump() for item in first.output],
        {"role": "user", "content": "Another one?"}])
    assert again.status in ("completed", "incomplete") and again.output_text
