"""llama-server's extensions of the routes every family shares, on FakeBackend servers: a prompt's prefill
progress (`return_progress`) and running `timings` (`timings_per_token`) on /completion, OpenAI's chat and
the Responses API; `verbose`; a last assistant message continued (llama-server's prefill and
`continue_final_message`); model aliases and tags in /v1/models; several listen addresses; a chat format
named instead of the model's own template."""

import http.client
import json
import socket

import pytest

from reame.config import LLAMA_CHAT_TEMPLATES, load
from reame.errors import ConfigError, ModelError
from reame.settings import from_values
from reame.engine import Engine
from reame.model.backend import ModelSettings
from reame.server.forgery import allowed_hosts
from reame.server.listener import listen_addresses
from tests.fakes.backend import FakeBackend
from tests.fakes.client import run_route
from tests.unit.test_server import Live, read_sse

LONG = "the quick brown fox jumps over the lazy dog " * 4  # 177 characters: tokens over several 64-token steps
GREEDY = {"temperature": 0, "n_predict": 6}


def records(app, body: dict) -> list[dict]:
    client = run_route(app, "/completion", dict(body, stream=True))
    return [payload for _, payload in client.frames]


def check_progress(progress: list[dict], n_batch: int = 64) -> None:
    """What llama-server's clients read of a prompt's progress: the first says what was found cached (nothing
    computed yet), then `processed` grows by at most a batch per record to `total`, the cache unchanged."""
    first, last = progress[0], progress[-1]
    assert first["cache"] == first["processed"] and last["processed"] == last["total"] > 0
    assert all(later["total"] == first["total"] and later["cache"] == first["cache"] for later in progress)
    steps = [b["processed"] - a["processed"] for a, b in zip(progress, progress[1:])]
    assert steps and all(0 < step <= n_batch for step in steps)
    assert [p["time_ms"] for p in progress] == sorted(p["time_ms"] for p in progress)


def test_a_completion_streams_its_prompts_progress_then_its_pieces_with_running_timings(live):
    streamed = records(live.app, {"prompt": LONG, **GREEDY, "return_progress": True, "timings_per_token": True})
    progress = [record for record in streamed if "prompt_progress" in record]
    pieces = [record for record in streamed if "prompt_progress" not in record and not record["stop"]]
    check_progress([record["prompt_progress"] for record in progress])
    assert progress[0]["timings"]["prompt_n"] == progress[0]["timings"]["predicted_n"] == 0
    assert progress[0]["timings"]["prompt_ms"] == 0.0 and all(record["content"] == "" for record in progress)
    assert streamed.index(progress[-1]) < streamed.index(pieces[0])  # the prompt's progress comes first
    assert [piece["timings"]["predicted_n"] for piece in pieces] == [piece["tokens_predicted"] for piece in pieces]
    assert all(piece["timings"]["prompt_n"] == len(LONG) + 1 for piece in pieces)  # (with BOS)
    again = records(live.app, {"prompt": LONG, **GREEDY, "return_progress": True})
    cached = [record["prompt_progress"] for record in again if "prompt_progress" in record]
    check_progress(cached)
    assert cached[0]["cache"] == len(LONG)  # the slot held it all: the last token is computed again
    assert all("timings" not in record for record in again if not record["stop"])


def test_without_asking_a_stream_carries_neither(live):
    streamed = records(live.app, {"prompt": LONG, **GREEDY})
    assert all("prompt_progress" not in record for record in streamed)
    assert all("timings" not in record for record in streamed if not record["stop"])


def test_a_chat_stream_says_its_progress_with_the_role_and_its_timings_per_piece(live):
    chunks = read_sse(live, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": LONG}], "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "return_progress": True, "timings_per_token": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    progress = [chunk for chunk in chunks if "prompt_progress" in chunk]
    check_progress([chunk["prompt_progress"] for chunk in progress])
    assert all(chunk["choices"][0]["delta"] == {"role": "assistant", "content": None} for chunk in progress)
    texts = [chunk for chunk in chunks[1:] if chunk["choices"] and chunk["choices"][0]["delta"].get("content")
             and "prompt_progress" not in chunk]
    assert texts and all("timings" in chunk for chunk in texts)
    counts = [chunk["timings"]["predicted_n"] for chunk in texts]
    assert counts == sorted(counts) and counts[0] >= 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["timings"]["predicted_n"] == usage["usage"]["completion_tokens"]


def test_a_responses_stream_says_its_progress_in_progress_events_and_its_timings(live):
    response, data = live.request("POST", "/v1/responses", {
        "input": LONG, "max_output_tokens": 6, "temperature": 0, "stream": True, "return_progress": True,
        "timings_per_token": True})
    streamed = [json.loads(frame.split("\ndata: ")[1]) for frame in data.decode().split("\n\n") if frame.strip()]
    progress = [event for event in streamed if "prompt_progress" in event]
    assert progress and all(event["type"] == "response.in_progress" for event in progress)
    check_progress([event["prompt_progress"] for event in progress])
    deltas = [event for event in streamed if event["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in event["timings"] for event in deltas)
    assert streamed[-1]["timings"]["predicted_n"] == streamed[-1]["response"]["usage"]["output_tokens"]
    assert [event["sequence_number"] for event in streamed] == list(range(len(streamed)))


def test_verbose_gives_the_prompt_as_the_model_read_it(live):
    ask = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "best?"}],
           "max_tokens": 2, "temperature": 0}
    status, body = live.json("POST", "/v1/chat/completions", dict(ask, verbose=True))
    verbose = body["__verbose"]
    assert status == 200 and verbose["prompt"].startswith("<s><|im_start|>system\nBook")
    assert verbose["prompt"].endswith("<|im_start|>assistant\n") and verbose["content"] == \
        body["choices"][0]["message"]["content"]
    assert verbose["tokens_evaluated"] == body["usage"]["prompt_tokens"]
    assert "__verbose" not in live.json("POST", "/v1/chat/completions", ask)[1]


def prompt_tokens(live, text: str) -> int:
    return live.json("POST", "/v1/completions", {"prompt": text, "max_tokens": 1})[1]["usage"]["prompt_tokens"]


def test_a_last_assistant_message_is_continued_not_answered(live):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Whi"}]
    prompt = live.json("POST", "/apply-template", {"messages": chat})[1]["prompt"]
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nWhi")
    explicit = live.json("POST", "/apply-template", {"messages": chat, "continue_final_message": True,
                                                     "add_generation_prompt": False})[1]["prompt"]
    assert explicit == prompt
    status, answer = live.json("POST", "/v1/chat/completions", {"messages": chat, "max_tokens": 4,
                                                                "temperature": 0})
    assert status == 200 and answer["usage"]["prompt_tokens"] == prompt_tokens(live, prompt)
    assert not answer["choices"][0]["message"]["content"].startswith("Whi")  # the continuation only


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
     "continue_final_message": True},  # add_generation_prompt defaults to true
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                  {"role": "assistant", "content": "c"}]},
    {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
     "continue_final_message": 3, "add_generation_prompt": False},
])
def test_what_llama_server_refuses_of_a_continuation_is_a_400(live, body):
    for path in ("/v1/chat/completions", "/apply-template"):
        status, answer = live.json("POST", path, dict(body, max_tokens=2))
        assert status == 400 and answer["error"]["message"], (path, answer)


def test_an_anthropic_prefill_is_continued(live):
    status, body = live.json("POST", "/v1/messages", {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Whi"}]})
    prompt = live.json("POST", "/apply-template", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Whi"}]})[1]["prompt"]
    assert status == 200 and body["usage"]["input_tokens"] == prompt_tokens(live, prompt)


def test_models_list_the_names_and_tags_the_configuration_gave(live):
    model = live.model
    model.name, model.aliases = "code", ("fim", "tinyllama-2", "model.gguf")
    model.given_names, model.tags = ("code", "fim", "tinyllama-2"), ("chat", "fim")
    (card,) = live.json("GET", "/v1/models")[1]["data"]
    assert card["id"] == "code" and card["aliases"] == ["code", "fim", "tinyllama-2"]
    assert card["tags"] == ["chat", "fim"] and "model.gguf" in card["reame"]["aliases"]
    assert live.json("POST", "/v1/chat/completions", {"model": "fim", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}]})[0] == 200


def load_config(env: dict[str, str]):
    return from_values(load(None, env))


def test_model_id_and_tags_are_read_from_the_config():
    settings = load_config({"REAME_SERVER_MODEL_ID": "code|fim", "REAME_SERVER_MODEL_TAGS": "chat, fim,"})
    assert settings.server.model_id == "code|fim" and settings.server.model_tags == ("chat", "fim")


def loopback_v6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_listen_addresses_and_the_host_names_they_answer_to():
    assert listen_addresses("127.0.0.1, [::1]") == ["127.0.0.1", "::1"] and listen_addresses("") == ["127.0.0.1"]
    assert allowed_hosts("127.0.0.1,::1", ()) == frozenset({"localhost", "127.0.0.1", "::1"})
    assert allowed_hosts("127.0.0.1,0.0.0.0", ()) is None  # bound beyond loopback: its keys protect it
    assert allowed_hosts("127.0.0.1,10.0.0.1", ("example.org",)) == frozenset({"example.org", "127.0.0.1"})


@pytest.mark.skipif(not loopback_v6(), reason="no IPv6 loopback here")
def test_a_server_listens_on_every_address_it_is_given(engine):
    server = Live(engine, host="127.0.0.1,::1", api_keys=("k",))
    try:
        for host in ("127.0.0.1", "::1"):
            connection = http.client.HTTPConnection(host, server.port, timeout=10)
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            connection.request("POST", "/v1/completions", body=b"{}", headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            assert response.status == 401
            connection.close()
    finally:
        server.close()
    with pytest.raises(ConnectionRefusedError):  # shut down on every address
        socket.create_connection(("::1", server.port), timeout=2).close()


def test_a_chat_format_may_be_named_instead_of_the_models_template(tmp_path):
    assert {"chatml", "llama3", "command-r"} <= set(LLAMA_CHAT_TEMPLATES)
    assert load_config({"REAME_MODEL_CHAT_TEMPLATE": "command-r"}).model.chat_template == "command-r"
    with pytest.raises(ConfigError):
        load_config({"REAME_MODEL_CHAT_TEMPLATE": "no-such-format"})
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ModelSettings(str(model), chat_template="llama3").validated()  # a name the model settings take
    with pytest.raises(ModelError, match="chat_template"):
        ModelSettings(str(model), chat_template="no-such-format").validated()


def test_a_continuation_and_a_forced_tool_call_are_a_400(live):
    status, body = live.json("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "messages"


def test_a_progress_is_said_only_to_a_request_that_asked():
    with Engine(FakeBackend(n_ctx=1024)) as engine:
        from reame.engine import GenerationRequest, ProgressEvent, SamplingParams
        params = SamplingParams(temperature=0, max_tokens=2)
        quiet = list(engine.submit(GenerationRequest(LONG, params)).events())
        told = list(engine.submit(GenerationRequest(LONG, params, progress=True)).events())
    assert not any(isinstance(event, ProgressEvent) for event in quiet)
    progress = [event for event in told if isinstance(event, ProgressEvent)]
    assert progress[-1].processed == progress[-1].total == len(LONG) + 1
    assert [e.text for e in told if not isinstance(e, ProgressEvent)] == [e.text for e in quiet]


def test_pooling_none_gives_a_vector_per_token_on_llama_servers_route_only():
    with Engine(FakeBackend(n_ctx=512, pooled_embeddings=False)) as engine:
        server = Live(engine)
        try:
            status, answer = server.json("POST", "/embeddings", {"input": ["hey", "a"]})
            assert status == 200 and [item["index"] for item in answer] == [0, 1]
            assert [len(item["embedding"]) for item in answer] == [4, 2]  # BOS and each byte
            vector = answer[0]["embedding"][1]  # "h" (104): as the model gave it, not made unit length
            assert vector[104 % len(vector)] == 1.0 and sum(value * value for value in vector) == 1.25
            status, error = server.json("POST", "/v1/embeddings", {"input": "hey"})
            assert status == 400 and "Pooling type 'none'" in error["error"]["message"]
        finally:
            server.close()


def test_pooled_embeddings_on_llama_servers_route_are_openais_shape(live):
    by_route = [live.json("POST", path, {"input": "hey"})[1] for path in ("/embeddings", "/v1/embeddings")]
    assert by_route[0]["data"] == by_route[1]["data"] and by_route[0]["object"] == "list"
