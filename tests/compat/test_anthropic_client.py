"""The `anthropic` SDK against Reame serving the default model (SmolLM2) behind an API key, and, for tool use,
Qwen2.5-Coder-1.5B: messages, a streamed message, count_tokens, a JSON schema output, stop sequences, the
key sent as x-api-key, and a tool_use / tool_result round trip, streamed and not."""

import json

import anthropic
import pytest

from tests.live_server import model_server as serve

KEY = "sk-anthropic-test"
GREEDY = {"temperature": 0}  # today's SDK has no sampling arguments: sent as extra fields
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def base(native_libraries, smollm2_path):
    with serve(smollm2_path, KEY) as live:
        yield live.base


def client(base: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def test_a_message_and_the_same_message_streamed(base):
    question = [{"role": "user", "content": "Name a colour."}]
    whole = client(base).messages.create(model="smollm2", max_tokens=24, system="Be brief.", messages=question,
                                         extra_body=GREEDY)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    with client(base).messages.stream(model="smollm2", max_tokens=24, system="Be brief.", messages=question,
                                      extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens
    counted = client(base).messages.count_tokens(model="smollm2", system="Be brief.", messages=question)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_a_json_schema_output_and_a_stop_sequence(base):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    answer = client(base).messages.create(model="smollm2", max_tokens=80, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": "Bob is 30. Reply in JSON."}],
                                          output_config={"format": {"type": "json_schema", "schema": schema}})
    parsed = json.loads(answer.content[0].text)
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)
    counting = [{"role": "user", "content": "Count from 1 to 9, separated by commas."}]
    full = client(base).messages.create(model="smollm2", max_tokens=40, messages=counting, extra_body=GREEDY)
    stop = full.content[0].text.strip()[2:4]
    cut = client(base).messages.create(model="smollm2", max_tokens=40, messages=counting, extra_body=GREEDY,
                                       stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop


def test_the_key_goes_as_x_api_key(base):
    with pytest.raises(anthropic.AuthenticationError):
        client(base, "sk-wrong").messages.create(model="smollm2", max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])


def test_a_tool_use_round_trip_on_qwen(native_libraries, model_path):
    with serve(model_path("qwen2.5-coder-1.5b")) as live:
        qwen = client(live.base, "unused")
        question = [{"role": "user", "content": "What is the weather in Paris? Use the tool, then answer in one "
                                                "sentence."}]
        answer = qwen.messages.create(model="qwen", max_tokens=80, messages=question, tools=[WEATHER],
                                      extra_body=GREEDY)
        assert answer.stop_reason == "tool_use"
        (use,) = [block for block in answer.content if block.type == "tool_use"]
        assert use.name == "get_weather" and use.input == {"city": "Paris"}
        with qwen.messages.stream(model="qwen", max_tokens=80, messages=question, tools=[WEATHER],
                                  extra_body=GREEDY) as stream:
            streamed = stream.get_final_message()
        assert [block.input for block in streamed.content if block.type == "tool_use"] == [{"city": "Paris"}]
        final = qwen.messages.create(model="qwen", max_tokens=80, tools=[WEATHER], extra_body=GREEDY, messages=[
            *question, {"role": "assistant", "content": answer.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]}])
        assert final.stop_reason == "end_turn" and "21" in final.content[0].text


def test_thinking_blocks_sent_back_are_taken(base):
    # What a client holds after a thinking model's answer goes back in the history: its thinking block (and a
    # redacted one, which no model here reads); SmolLM2's template renders no thinking, so the counts are alike.
    said = [{"type": "thinking", "thinking": "Blue is calm.", "signature": ""},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}, {"type": "text", "text": "Blue."}]
    history = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": said},
               {"role": "user", "content": "Another one?"}]
    plain = [history[0], {"role": "assistant", "content": "Blue."}, history[2]]
    answer = client(base).messages.create(model="smollm2", max_tokens=8, messages=history, extra_body=GREEDY)
    assert answer.content[0].type == "text"
    assert client(base).messages.count_tokens(model="smollm2", messages=history).input_tokens == \
        client(base).messages.count_tokens(model="smollm2", messages=plain).input_tokens
