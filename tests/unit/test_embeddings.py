"""/v1/embeddings on FakeBackend: shapes, batching on the engine thread between steps, bad input."""

import array
import base64
import json
import math
import socket
import threading

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.errors import ModelError, OverloadedError, RequestError
from tests.fakes.backend import EMBEDDING_SIZE, FakeBackend, gated_rule
from tests.waiting import wait_until

from .test_server import Live


@pytest.fixture
def server():
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=2)) as engine:
        live = Live(engine)
        yield live
        live.close()


def test_one_unit_vector_per_input_in_order_with_usage(server):
    status, body = server.json("POST", "/v1/embeddings", {"model": "m", "input": ["cat on a mat", "the cat", "xyz"]})
    assert status == 200 and body["object"] == "list" and body["model"] == server.model.name
    vectors = [item["embedding"] for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1, 2] and all(len(v) == EMBEDDING_SIZE for v in vectors)
    assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-9 for v in vectors)
    cosine = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    tokens = sum(len(t) + 1 for t in ("cat on a mat", "the cat", "xyz"))  # bytes and a BOS each
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    alone = server.json("POST", "/v1/embeddings", {"input": "the cat"})[1]["data"][0]["embedding"]
    assert alone == vectors[1]


def test_base64_is_little_endian_float32_of_the_same_vector(server):
    floats = server.json("POST", "/v1/embeddings", {"input": [1, 2, 3]})[1]["data"][0]["embedding"]
    packed = server.json("POST", "/v1/embeddings", {"input": [[1, 2, 3]], "encoding_format": "base64"})[1]
    decoded = array.array("f", base64.b64decode(packed["data"][0]["embedding"]))
    assert list(decoded) == pytest.approx(floats, rel=1e-6)


def test_inputs_are_embedded_in_batches_the_backend_takes(server):
    backend = server.model.engine.backend
    backend.embed_calls.clear()
    body = server.json("POST", "/v1/embeddings", {"input": [f"text {i}" for i in range(10)]})[1]
    assert len(body["data"]) == 10 and backend.embed_calls == [4, 4, 2]


def test_embeddings_are_computed_between_the_steps_of_a_running_generation():
    gate = threading.Event()
    with Engine(FakeBackend(n_ctx=1024, rule=gated_rule(gate))) as engine:
        handle = engine.submit(GenerationRequest("hello", SamplingParams(max_tokens=50, ignore_eos=True)))
        job = engine.embed([[1, 2, 3]] * 9)
        gate.set()
        assert len(job.result(10)) == 9
        assert len(handle.result(10).tokens) == 50


@pytest.mark.parametrize("body, param", [
    # ("" and ["a", 1] are llama-server's shapes: tests/unit/test_llamacpp_api.py)
    ({}, "input"), ({"input": []}, "input"),
    ({"input": [[1], []]}, "input"), ({"input": {"a": 1}}, "input"), ({"input": [300]}, "input"),
    ({"input": "a", "encoding_format": "binary"}, "encoding_format"),
    ({"input": "a", "dimensions": 8}, "dimensions"), ({"input": "a", "dimensions": "16"}, "dimensions"),
    ({"input": "x" * 2000}, "input"), ({"input": "a", "model": 5}, "model"),
])
def test_bad_embedding_requests_are_400_naming_the_field(server, body, param):
    status, answer = server.json("POST", "/v1/embeddings", body)
    assert status == 400 and answer["error"]["param"] == param


def test_an_input_over_the_context_is_context_length_exceeded(server):
    answer = server.json("POST", "/v1/embeddings", {"input": "x" * 2000})[1]
    assert answer["error"]["code"] == "context_length_exceeded"


def test_the_full_dimension_count_is_accepted(server):
    assert server.json("POST", "/v1/embeddings", {"input": "a", "dimensions": EMBEDDING_SIZE})[0] == 200


def test_every_route_caps_the_inputs_before_tokenizing_them(server):
    """Issue 49, finding 1: /api/embed took 5,000 one-letter inputs (67 s of CPU) and would take millions."""
    many = ["a"] * 2049
    for path, body in (("/api/embed", {"model": "m", "input": many}), ("/v1/embeddings", {"input": many})):
        status, answer = server.json("POST", path, body)
        assert status == 400 and "at most 2048 inputs" in json.dumps(answer), path
    assert server.model.engine.backend.embed_calls == []
    with pytest.raises(RequestError):  # and the engine itself, whoever calls it
        server.model.engine.embed([[1]] * 2049)


def test_an_embedding_job_counts_against_the_queue_and_ends_when_its_client_leaves():
    """Finding 1: embedding jobs were never counted or cancelled (one kept computing 35 s after its client left,
    slowing every chat beside it)."""
    backend = FakeBackend(n_ctx=1024, n_seq_max=2)
    entered, release = threading.Event(), threading.Event()
    original = backend.embed

    def slow(inputs):
        entered.set()
        assert release.wait(10)
        return original(inputs)
    backend.embed = slow
    with Engine(backend, max_queue=1) as engine:
        job = engine.embed([[1, 2]] * 40)  # 10 batches of 4
        assert entered.wait(10)
        assert engine.load()[0] == 1
        with pytest.raises(OverloadedError):  # the queue's one place is the job's
            engine.submit(GenerationRequest("hello", SamplingParams(max_tokens=2)))
        with pytest.raises(OverloadedError):
            engine.embed([[3]])
        job.cancel()
        release.set()
        with pytest.raises(ModelError, match="cancelled"):
            job.result(10)
        assert backend.embed_calls == [4]  # the batch under way, and none after the cancel
        assert engine.load()[0] == 0
        assert engine.generate(GenerationRequest("hello", SamplingParams(max_tokens=2)), timeout_s=10).tokens


def test_a_client_that_leaves_cancels_its_embeddings():
    backend = FakeBackend(n_ctx=1024, n_seq_max=2)
    entered, release = threading.Event(), threading.Event()
    original = backend.embed

    def slow(inputs):
        entered.set()
        release.wait(0.05)
        return original(inputs)
    backend.embed = slow
    with Engine(backend) as engine:
        live = Live(engine)
        try:
            sock = socket.create_connection(("127.0.0.1", live.port), timeout=5)
            body = json.dumps({"model": "m", "input": [f"text {i}" for i in range(400)]}).encode()
            sock.sendall(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert entered.wait(10)
            sock.close()
            wait_until(lambda: engine.load()[0] == 0, timeout_s=10)
            assert len(backend.embed_calls) < 100  # of the 100 batches the job had
        finally:
            live.close()
