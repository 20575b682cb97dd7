"""Fuzzing what a batch's user sends: multipart/form-data uploads and the JSONL lines of a batch's input. Any
bytes get a part list or a 4xx (never another exception), in time linear in the body and memory bounded by
it; any input file gets its lines or an error entry per bad line."""

import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reame.server import multipart
from reame.server.batches import parse_lines
from reame.server.client import HttpError
from reame.server.settings import BatchLimits
from tests.cpu import cpu_clock

from .test_batches import chat_line, form, jsonl
from .test_fuzz import FUZZ

GOOD_BODY, GOOD_TYPE = form({"purpose": "batch"}, "in.jsonl", jsonl([chat_line("a", "hi")]))
PIECES = st.sampled_from([b"--", b"\r\n", b"\r\n\r\n", b"Content-Disposition: form-data; name=", b'"file"',
                          b'"purpose"', b'; filename="x"', b"Content-Type: x", b":", b";", b'"', b"\\", b"batch",
                          GOOD_BODY[:40], b"\x00", b"\xff", b" "])


def mutated_body():
    return st.one_of(
        st.binary(max_size=400),
        st.lists(PIECES, max_size=40).map(b"".join),
        st.tuples(st.integers(0, len(GOOD_BODY) - 1), st.integers(0, 255)).map(
            lambda change: GOOD_BODY[:change[0]] + bytes([change[1]]) + GOOD_BODY[change[0] + 1:]),
        st.integers(0, len(GOOD_BODY)).map(lambda end: GOOD_BODY[:end]))


@FUZZ
@given(body=mutated_body(), content_type=st.one_of(st.just(GOOD_TYPE), st.text(max_size=80)))
def test_any_upload_body_parses_or_is_a_4xx(body, content_type):
    parts = None
    with cpu_clock() as clock:
        try:
            parts = multipart.parse(body, content_type)
        except HttpError as error:
            assert 400 <= error.status < 500 and "\n" not in error.message
    if parts is not None:
        assert len(parts) <= multipart.MAX_PARTS
        assert sum(len(part.data) for part in parts.values()) <= len(body)
    assert clock.seconds < 0.05


@pytest.mark.parametrize("body", [
    GOOD_BODY[:GOOD_BODY.index(b"\r\n")] + b"\r\n" + b"X: y\r\n" * 200_000,  # headers that never end
    b"--" + GOOD_TYPE.split("=")[1].encode() + b"\r\n" * 500_000,  # boundaries and breaks
    b"x" * (8 << 20),  # no boundary at all, 8 MiB
], ids=["endless headers", "empty lines", "no boundary"])
def test_an_adversarial_upload_is_refused_in_linear_time_and_bounded_memory(body):
    tracemalloc.start()
    with cpu_clock(pause_collector=False) as clock, pytest.raises(HttpError) as refused:
        multipart.parse(body, GOOD_TYPE)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert refused.value.status == 400
    assert clock.seconds < 0.5 and peak < 2 * len(body) + (1 << 20)


def test_many_parts_are_refused():
    boundary = GOOD_TYPE.split("=")[1]
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="f{{}}"\r\n\r\nx\r\n'
    body = "".join(part.format(n) for n in range(multipart.MAX_PARTS + 1)) + f"--{boundary}--\r\n"
    with pytest.raises(HttpError) as refused:
        multipart.parse(body.encode(), GOOD_TYPE)
    assert "more than" in refused.value.message


LINE_PIECES = st.sampled_from([b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}',
                               b"{", b"}", b"[", b'"custom_id"', b":", b"null", b"1e999", b"\n", b"\xff", b'"',
                               b'"body": {"stream": true}', b","])


@FUZZ
@given(data=st.lists(LINE_PIECES, min_size=1, max_size=60).map(b"".join) | st.binary(min_size=1, max_size=300))
def test_any_input_file_gives_lines_and_error_entries_or_a_400(data):
    parsed = None
    with cpu_clock() as clock:
        try:
            parsed = parse_lines(data, "/v1/chat/completions", BatchLimits(max_lines=50, max_line_bytes=200))
        except HttpError as error:
            assert error.status == 400
    if parsed is not None:
        lines, errors = parsed
        assert len(lines) + len(errors) <= data.count(b"\n") + 1
        assert all(entry["record"]["error"]["code"] == "invalid_request" for entry in errors)
        assert len({line.custom_id for line in lines}) == len(lines)
    assert clock.seconds < 0.1
