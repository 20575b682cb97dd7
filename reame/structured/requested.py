"""Structured output: what a request asks its answer to match, as one GBNF grammar.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and, as
llama-server takes them, a `grammar` (GBNF) or a bare `json_schema` field. The
grammar is checked here, in the caller's thread (structured/grammar.py), so a
mistake is a 400 naming it before any work; llama.cpp's grammar sampler then
constrains every token, and the answer always parses (or ends with
`finish_reason: "length"` when max_tokens cut it). Mistakes are RequestErrors
(GrammarError for the grammar itself) naming the field: the HTTP edge makes
them 400s.
"""

from __future__ import annotations

from typing import Any

from reame.structured.gbnf import compiled
from reame.structured.json_schema import JSON_OBJECT_GBNF, schema_to_gbnf
from reame.errors import RequestError
from reame.structured.tools import ToolRequest, forced_call_grammar

MAX_GRAMMAR_BYTES = 256 << 10


def forced_tool_grammar(tools: ToolRequest) -> str | None:
    """The grammar of a forced tool call (tool_choice `required` or a named function), checked here like
    any other: a parameter schema it cannot express is a GrammarError naming it."""
    grammar = forced_call_grammar(tools)
    return checked(grammar) if grammar is not None else None


def requested_grammar(body: dict[str, Any]) -> str | None:
    """The GBNF the answer must match, or None; a RequestError (GrammarError) for anything malformed or
    unsupported, naming the field."""
    asked = [name for name in ("response_format", "grammar", "json_schema") if body.get(name) is not None]
    if len(asked) > 1:
        raise RequestError(f"give one of 'response_format', 'grammar' and 'json_schema', not {' and '.join(asked)}",
                           param=asked[1])
    if "grammar" in asked:
        grammar = body["grammar"]
        if not isinstance(grammar, str) or not grammar.strip():
            raise RequestError("'grammar' must be a GBNF text", param="grammar", code="invalid_type")
        if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise RequestError(f"'grammar' is over {MAX_GRAMMAR_BYTES} bytes", param="grammar")
        return checked(grammar)
    if "json_schema" in asked:
        return checked(schema_to_gbnf(body["json_schema"], param="json_schema"))
    if "response_format" in asked:
        return response_format_grammar(body["response_format"])
    return None


def response_format_grammar(value: Any) -> str | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": …, \"schema\": {…}}}",
                           param="response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        # llama-server's extension: a `schema` beside json_object holds the answer to it; none (or {}), any object.
        schema = value.get("schema")
        if schema is None or schema == {}:
            return JSON_OBJECT_GBNF
        return checked(schema_to_gbnf(schema, param="response_format.schema"))
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise RequestError("'response_format.json_schema' must be an object with a 'schema'",
                           param="response_format.json_schema")
    return checked(schema_to_gbnf(spec["schema"], param="response_format.json_schema.schema"))


def checked(gbnf: str) -> str:
    """The grammar, once it parsed within the grammar limits (compiled() keeps it for the engine)."""
    compiled(gbnf).start()  # its start may already be too ambiguous
    return gbnf
