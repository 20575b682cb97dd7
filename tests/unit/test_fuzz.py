"""Fuzzing every parser of outside input with hypothesis: HTTP request lines and headers, JSON bodies
(type confusion in every field, huge numbers, deep nesting, invalid UTF-8), the config file, cache
snapshot and session files, GGUF headers. Bad input gets its error: never a crash, never a 500."""

import json
import os
import socket
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reame import config, gguf
from reame.arca.client import StoreAddress
from reame.cache.store import Snapshot, decode, encode
from reame.engine import Engine
from tests.cpu import cpu_clock
from tests.fakes.backend import FakeBackend
from reame.errors import CacheError, ConfigError, ModelFileError
from reame.server.sessions import SessionError, Sessions

from .test_gguf import GOOD as GOOD_GGUF
from .test_server import Live

# 150 examples per test in CI; REAME_FUZZ_EXAMPLES=100000 for a long run.
FUZZ = settings(max_examples=int(os.environ.get("REAME_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server():
    with Engine(FakeBackend(n_ctx=512, n_seq_max=2)) as engine:
        live = Live(engine, idle_timeout_s=2, request_timeout_s=2, max_body_bytes=64 << 10)
        yield live
        live.close()


def exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes, half-close, read everything the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def statuses(reply: bytes) -> list[int]:
    return [int(line.split(b" ")[1]) for line in reply.split(b"\r\n") if line.startswith(b"HTTP/1.") and
            len(line.split(b" ")) > 1 and line.split(b" ")[1].isdigit()]


TOKENS = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"HEAD", b"BREW", b"/v1/completions",
                          b"/v1/chat/completions", b"/v1/embeddings", b"/health", b"/v1/sessions/x/save", b"/%00",
                          b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b" ", b"\r\n", b"\n", b":", b"Content-Length",
                          b"Transfer-Encoding", b"chunked", b"-1", b"99999999999999999999", b"0", b"5", b"{",
                          b"\xff\xfe", b"\x00", b"Host", b"Authorization: Bearer x"])
REQUESTS = st.lists(st.one_of(TOKENS, st.binary(max_size=40)), max_size=40).map(b"".join)


@FUZZ
@given(request=REQUESTS)
def test_any_bytes_get_an_http_answer_or_a_clean_close_never_a_500(server, request):
    for status in statuses(exchange(server.port, request)):
        # 501 an unknown method or transfer coding, 503 busy, 505 an HTTP version other than 1.x
        assert status < 500 or status in (501, 503, 505), status
    assert server.json("GET", "/health")[0] == 200


JSON = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) |
                    st.floats(allow_nan=False) | st.text(max_size=30),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children,
                                                                                       max_size=4),
                    max_leaves=12)
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs",
                        "echo", "stream", "stream_options", "logit_bias", "suffix", "best_of", "presence_penalty",
                        "frequency_penalty", "min_p", "repeat_penalty", "ignore_eos", "model", "session",
                        "return_progress", "timings_per_token"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature", "n", "stop", "tools",
                             "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs", "response_format",
                             "stream", "seed", "model", "session", "return_progress", "timings_per_token",
                             "verbose", "continue_final_message", "add_generation_prompt"],
    "/v1/embeddings": ["input", "encoding_format", "dimensions", "model"],
    "/v1/warm": ["prompt", "messages"],
    "/tokenize": ["content", "add_special", "parse_special", "with_pieces"],
    "/completion": ["prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "stop", "seed", "n_probs",
                    "samplers", "grammar", "json_schema", "response_fields", "n_cmpl", "return_tokens",
                    "repeat_penalty", "repeat_last_n", "ignore_eos", "n_indent", "t_max_predict_ms",
                    "post_sampling_probs", "cache_prompt", "id_slot", "model", "return_progress",
                    "timings_per_token"],
    "/infill": ["input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "n_indent", "samplers",
                "top_k", "top_p", "t_max_predict_ms"],
    "/apply-template": ["messages", "continue_final_message", "add_generation_prompt"],
    "/embeddings": ["input", "encoding_format", "model"],
    "/v1/chat/completions/input_tokens": ["messages", "tools", "model"],
    "/detokenize": ["tokens"],
    "/api/chat": ["messages", "model", "options", "format", "tools", "keep_alive", "think", "logprobs",
                  "top_logprobs"],
    "/api/generate": ["prompt", "model", "system", "suffix", "raw", "options", "format", "keep_alive", "logprobs",
                      "top_logprobs"],
    "/api/embed": ["input", "model", "keep_alive", "truncate"],
    "/api/embeddings": ["prompt", "model", "keep_alive"],
    "/api/show": ["model", "name", "verbose"],
    "/api/pull": ["model", "stream", "insecure"],
    "/v1/messages": ["messages", "model", "max_tokens", "system", "stop_sequences", "tools", "tool_choice",
                     "temperature", "top_k", "output_config", "metadata", "thinking"],
    "/v1/messages/count_tokens": ["messages", "system", "tools", "model"],
    "/v1/responses": ["input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
                      "previous_response_id", "store", "temperature", "parallel_tool_calls", "metadata", "user",
                      "reasoning", "model", "return_progress", "timings_per_token"],
}
VALID = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         "/v1/embeddings": {"input": "hi"}, "/embeddings": {"input": "hi"}, "/v1/warm": {"prompt": "hi"}, "/tokenize": {"content": "hi"},
         "/detokenize": {"tokens": [104, 105]}, "/completion": {"prompt": "hi", "n_predict": 2},
         "/infill": {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 2},
         "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
         "/v1/chat/completions/input_tokens": {"messages": [{"role": "user", "content": "hi"}]},
         "/api/chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                       "options": {"num_predict": 2}},
         "/api/generate": {"model": "m", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
         "/api/embed": {"model": "m", "input": "hi"}, "/api/embeddings": {"model": "m", "prompt": "hi"},
         "/api/show": {"model": "m"}, "/api/pull": {"model": "m", "stream": False},
         "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
         "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
         "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 2}}


def error_message(path: str, answer: dict) -> str:
    """A 400's message in the shape of the path's API family (Ollama's, Anthropic's, else OpenAI's)."""
    if path.startswith("/api/"):
        return answer["error"]
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        return answer["error"]["message"]
    # a prompt over the context: llama-server's type, which OpenAI's clients read as a 400 too
    assert answer["error"]["type"] in ("invalid_request_error", "exceed_context_size_error")
    return answer["error"]["message"]


@FUZZ
@given(path=st.sampled_from(sorted(FIELDS)), data=st.data())
def test_type_confusion_in_any_field_is_a_400_naming_it_never_a_500(server, path, data):
    """Every API family's fields (OpenAI's, Ollama's, Anthropic's, Responses, embeddings; model names and
    keep_alive among them), each answered within a second and 16 MiB of the server's allocations."""
    field = data.draw(st.sampled_from(FIELDS[path]))
    body = dict(VALID[path], **{field: data.draw(JSON)})
    if field in ("n", "max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict", "n_cmpl") and \
            isinstance(body[field], int):
        # Valid and huge (or n_predict -1, until the context is full): a long but correct generation, not what
        # this test is about.
        assume(body[field] < 64 and (field != "n_predict" or body[field] != -1))
    assume(not (field == "stream" and body[field] is True))  # valid: an SSE stream, answered as one elsewhere
    tracemalloc.start()
    started = time.perf_counter()
    status, answer = server.json("POST", path, body)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    allowed = (200, 400, 404, 413) + ((403,) if path == "/api/pull" else ())  # pulling is off here
    assert status in allowed, (status, answer)
    assert seconds < 1.0 and peak < 16 << 20, (path, field, seconds, peak)
    if status == 400:
        assert error_message(path, answer)


def history_with_thinking(path: str, thought, turns: int) -> dict:
    """A conversation of `turns` assistant answers, each carrying `thought` where `path`'s family sends the
    thinking it was given back (OpenAI's reasoning_content, Ollama's thinking, Anthropic's thinking and
    redacted_thinking blocks, the Responses API's reasoning items), then a user's question."""
    question = {"role": "user", "content": "hi"}
    if path == "/v1/responses":
        reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": thought}],
                     "content": [{"type": "reasoning_text", "text": thought}]}
        answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
        return dict(VALID[path], input=[question, reasoning, answer] * turns + [question])
    if path == "/v1/messages":
        answer = {"role": "assistant", "content": [{"type": "thinking", "thinking": thought, "signature": "s"},
                                                   {"type": "redacted_thinking", "data": thought},
                                                   {"type": "text", "text": "a"}]}
    else:
        answer = {"role": "assistant", "content": "a",
                  ("thinking" if path == "/api/chat" else "reasoning_content"): thought}
    return dict(VALID[path], messages=[question, answer] * turns + [question])


@FUZZ
@given(path=st.sampled_from(["/v1/chat/completions", "/api/chat", "/v1/messages", "/v1/responses"]), data=st.data())
def test_thinking_sent_back_in_any_shape_is_read_or_refused_in_bounds(server, path, data):
    """The thinking a client returns with its history is input like the rest: any value, long, in many turns,
    gets an answer or a 400 (a 413 past the body limit) within a second and 16 MiB, never a 500. (Bodies stay
    under ~250 KB: past that, the server's early 413 meets a client still sending.)"""
    turns = data.draw(st.integers(1, 300))
    thought = data.draw(st.one_of(JSON, st.text(max_size=200),
                                  st.integers(1, 20_000 // turns).map(lambda n: "think " * n)))
    tracemalloc.start()
    started = time.perf_counter()
    status, answer = server.json("POST", path, history_with_thinking(path, thought, turns))
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert status in (200, 400, 413), (status, answer)
    assert seconds < 1.0 and peak < 16 << 20, (path, seconds, peak)
    if status == 400:
        assert error_message(path, answer)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
                     st.integers(1, 400).map(lambda n: b'{"prompt": ' * n + b"1" + b"}" * n),
                     st.text(max_size=50).map(lambda t: b'{"prompt": "' + t.encode("utf-8") + b'\xff\xfe"}')))
def test_malformed_and_deep_json_bodies_are_400(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/api/chat", "/v1/messages",
                 "/v1/responses"):
        response, data = server.request("POST", path, raw=raw, headers={"Content-Type": "application/json"})
        if response.status != 200:
            assert response.status == 400 and error_message(path, json.loads(data)), data


@FUZZ
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=300) |
       st.lists(st.sampled_from(["[model]", "[server]", "threads = ", "port = 99999", "= x", "[", "x", "# c",
                                 " ; ", '"', "cache.directory = ", "[speculative]\nmode = lookup", "\n", "a=b",
                                 "context_length = -1", "kv_cache_type = q8_0", "[a.b]\nc = d"]),
                max_size=30).map("".join))
def test_the_config_parser_fails_only_with_a_config_error(text):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.conf"
        path.write_text(text, encoding="utf-8")
        try:
            config.load(path, env={})
        except ConfigError as error:
            assert "\n" not in str(error)


@FUZZ
@given(text=st.text(max_size=200) | st.lists(st.sampled_from(["redis://", ":", "[", "]", "@", "/", "host", "::1",
                                                               "6420", "99999", "%", " ", "x"]),
                                             max_size=20).map("".join))
def test_a_store_address_parses_or_fails_with_a_config_error_in_bounded_time(text):
    address = None
    with cpu_clock() as clock:
        try:
            address = StoreAddress.parse(text)
        except ConfigError as error:
            assert "\n" not in str(error)
    if address is not None:
        assert address.host and 0 < address.port < 65536
    assert clock.seconds < 0.05


VALID_SNAPSHOT = encode(b"f" * 32, Snapshot((1, 2, 3), b"\x07" * 5000), compress=True)


def mutated(valid: bytes):
    return st.one_of(
        st.binary(max_size=300),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
            lambda change: valid[:change[0]] + bytes([change[1]]) + valid[change[0] + 1:]),
        st.integers(0, len(valid)).map(lambda end: valid[:end]),
        st.binary(min_size=1, max_size=50).map(lambda extra: valid + extra))


@FUZZ
@given(data=mutated(VALID_SNAPSHOT))
def test_a_damaged_snapshot_fails_only_with_a_cache_error(data):
    try:
        decode(data, b"f" * 32)
    except CacheError:
        pass


@FUZZ
@given(data=mutated(VALID_SNAPSHOT))
def test_a_damaged_session_file_fails_only_with_a_session_error(data):
    with tempfile.TemporaryDirectory() as directory:
        sessions = Sessions(Path(directory), b"model")
        path = sessions.path("", "fuzzed")
        path.write_bytes(data)
        try:
            sessions.load("", "fuzzed")
        except SessionError as error:
            assert error.status in (404, 409)


@FUZZ
@given(data=mutated(GOOD_GGUF))
def test_a_damaged_gguf_header_fails_only_with_a_model_file_error(data):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.gguf"
        path.write_bytes(data)
        try:
            gguf.read_metadata(path)
        except ModelFileError as error:
            assert "\n" not in str(error)
