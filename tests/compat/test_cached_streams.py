"""A greedy request asked twice, the second answered from the exact answer cache, streamed to the real clients
of each API family (`openai` chat and Responses, `ollama`, `anthropic`): the repeat arrives in the same
pieces as the computed answer, not as one record, with the same usage."""

import urllib.request

import anthropic
import ollama
import openai
import pytest

from tests.live_server import model_server as serve



@pytest.fixture(scope="module")
def base(native_libraries, smollm2_path, tmp_path_factory):
    answers = tmp_path_factory.mktemp("answers")
    with serve(smollm2_path, env={"REAME_CACHE_ANSWERS": "1", "REAME_CACHE_ANSWERS_DIR": str(answers)}) as live:
        yield live.base


def hits(base: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("reame_answers_hits_total"))


def openai_chat(base: str, question: str) -> tuple[list[str], int]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24,
        stream=True, stream_options={"include_usage": True}))
    pieces = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    return pieces, chunks[-1].usage.completion_tokens


def openai_responses(base: str, question: str) -> tuple[list[str], int]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    with client.responses.stream(model="smollm2", input=question, temperature=0, max_output_tokens=200) as stream:
        pieces = [event.delta for event in stream if event.type == "response.output_text.delta"]
        return pieces, stream.get_final_response().usage.output_tokens


def ollama_chat(base: str, question: str) -> tuple[list[str], int]:
    parts = list(ollama.Client(host=base).chat(model="smollm2", messages=[{"role": "user", "content": question}],
                                               options={"temperature": 0, "num_predict": 24}, stream=True))
    return [part.message.content for part in parts if part.message.content], parts[-1].eval_count


def anthropic_messages(base: str, question: str) -> tuple[list[str], int]:
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    with client.messages.stream(model="smollm2", max_tokens=24, messages=[{"role": "user", "content": question}],
                                extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        return pieces, stream.get_final_message().usage.output_tokens


# Each family its own question: chat-shaped families share the cache's keys, so the first asking must be new.
@pytest.mark.parametrize("ask,question", [
    (openai_chat, "Name three colours of the rainbow."), (openai_responses, "Name three kinds of tree."),
    (ollama_chat, "Name three rivers of Europe."), (anthropic_messages, "Name three planets.")])
def test_a_repeated_greedy_stream_arrives_in_the_pieces_it_was_computed_in(base, ask, question):
    before = hits(base)
    computed, computed_tokens = ask(base, question)
    assert hits(base) == before  # the first one decoded
    kept, kept_tokens = ask(base, question)
    assert hits(base) == before + 1  # the repeat came from the cache
    assert len(computed) > 1 and kept == computed and kept_tokens == computed_tokens
