"""multipart/form-data bodies (RFC 7578), as the openai SDK's `files.create` and `curl -F` send them: a file
part and a few text fields.

The body is already in memory, bounded by server.max_request_size_mb, so the parse only has to stay linear in
it and refuse what no client sends: every search starts where the last one ended (no quadratic rescans),
parts and their header blocks are counted and bounded, and anything malformed is a 400 naming what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reame.server.client import HttpError

MAX_PARTS = 16  # a file and its fields; the SDK sends two
MAX_PART_HEADER_BYTES = 8192
# RFC 2046 §5.1.1: 1-70 characters from this set, not ending in a space.
BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
PARAMETER = re.compile(r';\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')


@dataclass(frozen=True)
class Part:
    """One part: its field name, its file name if it is a file, its declared type and its bytes."""

    name: str
    filename: str | None
    content_type: str
    data: bytes


def parameters(value: str) -> tuple[str, dict[str, str]]:
    """A header value's first token and its `; name=value` parameters (quoted or not), names lower-cased."""
    head, _, rest = value.partition(";")
    found = {}
    for match in PARAMETER.finditer(";" + rest):
        raw = match.group(2)
        found[match.group(1).lower()] = re.sub(r"\\(.)", r"\1", raw[1:-1]) if raw.startswith('"') else raw
    return head.strip().lower(), found


def boundary_of(content_type: str) -> bytes:
    """The boundary a multipart/form-data Content-Type declares; 400 without a valid one."""
    media_type, params = parameters(content_type)
    if media_type != "multipart/form-data":
        raise HttpError(415, f"send the file as multipart/form-data (got {media_type[:100]!r})",
                        code="unsupported_media_type")
    boundary = params.get("boundary", "")
    if not BOUNDARY.fullmatch(boundary):
        raise HttpError(400, "the multipart/form-data Content-Type has no valid boundary parameter",
                        code="invalid_multipart")
    return boundary.encode("ascii")


def parse(body: bytes, content_type: str) -> dict[str, Part]:
    """The body's parts by field name. 400 for a body that is not well-formed multipart, or with a field twice."""
    delimiter = b"--" + boundary_of(content_type)
    if body.startswith(delimiter):
        position = len(delimiter)
    else:  # a preamble before the first delimiter is allowed, and ignored
        start = body.find(b"\r\n" + delimiter)
        if start < 0:
            raise _malformed("no part starts with the boundary")
        position = start + 2 + len(delimiter)
    separator = b"\r\n" + delimiter
    parts: dict[str, Part] = {}
    while True:
        if body.startswith(b"--", position):
            return parts  # the close delimiter; an epilogue after it is ignored
        line_end = body.find(b"\r\n", position)
        if line_end < 0 or body[position:line_end].strip(b" \t"):
            raise _malformed("a boundary line is not followed by a line break")
        headers_end = body.find(b"\r\n\r\n", line_end, line_end + MAX_PART_HEADER_BYTES + 4)
        if headers_end < 0:
            raise _malformed(f"a part's headers do not end within {MAX_PART_HEADER_BYTES} bytes")
        data_end = body.find(separator, headers_end + 4)
        if data_end < 0:
            raise _malformed("the body ends inside a part (no closing boundary)")
        part = _part(body[line_end + 2:headers_end], body[headers_end + 4:data_end])
        if part.name in parts:
            raise _malformed(f"the field {part.name[:100]!r} is sent twice")
        if len(parts) == MAX_PARTS:
            raise _malformed(f"more than {MAX_PARTS} parts")
        parts[part.name] = part
        position = data_end + len(separator)


def _part(header_block: bytes, data: bytes) -> Part:
    headers: dict[str, str] = {}
    for line in header_block.split(b"\r\n") if header_block else []:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise _malformed("a part has a malformed header line")
        headers[name.decode("latin-1").lower()] = value.decode("utf-8", "replace").strip()
    disposition, params = parameters(headers.get("content-disposition", ""))
    if disposition != "form-data" or not params.get("name"):
        raise _malformed("a part lacks 'Content-Disposition: form-data; name=...'")
    return Part(params["name"], params.get("filename"), headers.get("content-type", "text/plain"), data)


def _malformed(why: str) -> HttpError:
    return HttpError(400, f"malformed multipart/form-data body: {why}", code="invalid_multipart")
