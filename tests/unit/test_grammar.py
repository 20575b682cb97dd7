"""GBNF and JSON Schema -> GBNF: what each grammar accepts and rejects (tables), clear errors, the text a
grammar forces, and constrained generation on FakeBackend that always parses and validates."""

import json
import random

import jsonschema
import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import FakeBackend, printable_rule
from reame.structured.grammar import GrammarError, GrammarState
from reame.structured.gbnf import parse_gbnf
from reame.structured.json_schema import JSON_OBJECT_GBNF, integer_range, schema_to_gbnf


@pytest.mark.parametrize("gbnf, accepted, rejected", [
    ('root ::= "yes" | "no"', ["yes", "no"], ["", "y", "yess", "No"]),
    ('root ::= [a-c]+ "!"', ["a!", "cab!"], ["!", "d!", "ab"]),
    ('root ::= [^0-9]* "."', [".", "ab ."], ["1.", "a"]),
    ('root ::= "x"{2,3}', ["xx", "xxx"], ["x", "xxxx"]),
    ('root ::= "x"{2} ("y"{1,})', ["xxy", "xxyyy"], ["xx", "xy"]),
    ('root ::= ("a" | "b")? "c"', ["c", "ac", "bc"], ["abc", ""]),
    ('root ::= item ("," item)*\nitem ::= [0-9]+', ["1", "1,22,333"], ["1,", ",1", ""]),
    ('# a comment\nroot ::= "\\x41\\u00e9\\n" . # any char\n', ["Aé\n!", "Aé\né"], ["Aé\n", "Ae\n!"]),
    ('root ::= (\n  "a"\n  | "b"\n)', ["a", "b"], ["ab"]),
    ('root ::= "a" |\n  "b"', ["a", "b"], [""]),
    ('root ::= "\\"" [^"\\\\]* "\\""', ['"hi"', '""'], ['"a"b"', '"']),
])
def test_a_gbnf_grammar_accepts_exactly_its_sentences(gbnf, accepted, rejected):
    grammar = parse_gbnf(gbnf)
    assert [text for text in accepted if not grammar.accepts(text)] == []
    assert [text for text in rejected if grammar.accepts(text)] == []


@pytest.mark.parametrize("gbnf, message", [
    ("", "no 'root' rule"),
    ("root ::= other", "line 1, column 10: rule 'other' is used but never defined"),
    ('root ::= "a', "unterminated string literal"),
    ("root ::= [a-", "unterminated character class"),
    ("root := x", "expected '::=' after 'root'"),
    ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule 'root' is defined twice"),
    ("root ::= root \"a\"", "left recursion"),
    ('root ::= ("a"', "expected ')'"),
    ('root ::= "a"{3,1}', "the most is below the least"),
    ("root ::= * \"a\"", "repeats nothing"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\x4"', "needs 2 hexadecimal digits"),
    ("root ::= [z-a]", "runs backwards"),
])
def test_a_broken_grammar_is_one_error_naming_where(gbnf, message):
    with pytest.raises(GrammarError) as raised:
        parse_gbnf(gbnf)
    assert message in str(raised.value) and "\n" not in str(raised.value)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email"} if False else {"type": "string"},
    "role": {"enum": ["admin", "user"]},
}, "required": ["name", "age"]}


SCHEMA_CASES = [
    (PERSON, ['{"name": "Ann", "age": 30}', '{"name":"Ann","age":30,"role":"admin"}',
              '{\n  "name": "A",\n  "age": 0,\n  "email": "a@b",\n  "role": "user"\n}'],
     ['{"age": 30}', '{"name": "", "age": 30}', '{"name": "Ann", "age": 121}', '{"name": "Ann", "age": 30, '
      '"role": "guest"}', '{"age": 30, "name": "Ann"}', '{"name": "Ann", "age": 30, "x": 1}', '[]']),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
     ["[true]", "[true, false]"], ["[]", "[true, true, true]", "[1]"]),
    ({"type": "string", "format": "date"}, ['"2026-12-01"'], ['"2026-13-01"', '"26-12-01"']),
    ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'], ['"123"']),
    ({"type": "string", "format": "date-time"}, ['"2026-12-01T10:20:30Z"', '"2026-12-01T10:20:30.5+01:00"'],
     ['"2026-12-01 10:20:30"']),
    ({"type": ["integer", "null"]}, ["3", "-4", "null"], ["3.5", '"3"']),
    ({"type": "number"}, ["0", "-1.5", "2e10", "3.25E-2"], ["01", "1.", ".5", "+1"]),
    ({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}, ["-2", "0", "2"], ["-3", "3"]),
    ({"const": {"a": [1, "x"]}}, ['{"a": [1, "x"]}'], ['{"a": [1, "y"]}']),
    ({"anyOf": [{"type": "string"}, {"type": "object", "properties": {"k": {"type": "null"}}, "required": ["k"]}]},
     ['"s"', '{"k": null}'], ["null", "{}"]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ['{}', '{"a": 1, "b": 2}'], ['{"a": "x"}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a": 1, "b": [null]}', '{"z": 1}', "{}"], ['{"a": "x"}']),
    ({"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                              {"type": "null"}]}},
                         "required": ["next"]}}, "$ref": "#/$defs/node"},
     ['{"next": null}', '{"next": {"next": {"next": null}}}'], ['{"next": {}}']),
    (True, ['{"x": [1, 2.5, "s", true, null]}', "3"], ["{", "tru"]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "integer"}]},  # a tuple, as drafts 4-7
     ["[3]", "[ -3000 ]"], ["[]", "[1, 2]", '["a"]', "{}"]),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}], "items": {"type": "null"}},
     ['["a", true]', '[\n  "a",\n  false\n]'], ['["a"]', '["a", true, null]', '[true, "a"]']),
]


@pytest.mark.parametrize("schema, accepted, rejected", SCHEMA_CASES)
def test_a_schemas_grammar_accepts_what_the_schema_does(schema, accepted, rejected):
    grammar = parse_gbnf(schema_to_gbnf(schema))
    assert [text for text in accepted if not grammar.accepts(text)] == []
    assert [text for text in rejected if grammar.accepts(text)] == []
    for text in accepted:  # and what the grammar accepts, the schema does
        jsonschema.validate(json.loads(text), schema if isinstance(schema, dict) else {})


def test_integer_ranges_are_exact():
    for low, high in [(0, 100), (5, 1234), (-20, 20), (None, -3), (7, None), (-999, None), (0, 0), (99, 100)]:
        grammar = parse_gbnf("root ::= " + integer_range(low, high))
        wrong = [n for n in range(-1500, 1500)
                 if grammar.accepts(str(n)) != ((low is None or n >= low) and (high is None or n <= high))]
        assert wrong == [], (low, high, wrong[:5])
        assert not grammar.accepts("007") and not grammar.accepts("-0")


@pytest.mark.parametrize("low, high", [(0, None), (None, 5), (None, None)])
def test_an_open_integer_bound_stops_at_sixteen_digits_as_unbounded_integers_do(low, high):
    grammar = parse_gbnf("root ::= " + integer_range(low, high))
    assert grammar.accepts("9" * 16) is (high is None)
    assert grammar.accepts("-" + "9" * 16) is (low is None)
    assert not grammar.accepts("9" * 17) and not grammar.accepts("-" + "9" * 17)


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "^a$"}, "'pattern' is not supported at $"),
    ({"type": "object", "properties": {"x": {"type": "string", "format": "email"}}}, "format 'email' is not "
                                                                                     "supported"),
    ({"type": "object", "properties": {"x": {"not": {}}}}, "'not' is not supported at $.properties.x"),
    ({"allOf": [{"type": "string"}]}, "'allOf' is not supported"),
    ({"type": "number", "minimum": 1.5}, "bounds on a non-integer number"),
    ({"type": "object", "required": ["a"]}, "required property 'a' is not in 'properties'"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"$ref": "http://x/schema"}, "is not supported (only #/$defs/NAME"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "no integer lies between the bounds"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "'maxItems' is below 'minItems'"),
    ({"type": "date"}, "type 'date' is not a JSON type"),
    ({"enum": []}, "'enum' must be a non-empty array"),
    ({"prefixItems": {"type": "string"}}, "'prefixItems' must be a non-empty array of schemas"),
    ({"type": "array", "items": []}, "'items' must be a non-empty array of schemas"),
    ({"type": "array", "prefixItems": [{}], "minItems": 2}, "a tuple of 1 items is outside 'minItems'..'maxItems'"),
    ({"prefixItems": [{}], "items": {"pattern": "x"}}, "'pattern' is not supported at $.items"),
    ([1], "a JSON schema must be an object"),
])
def test_an_unsupported_schema_part_is_named(schema, message):
    with pytest.raises(GrammarError) as raised:
        schema_to_gbnf(schema)
    assert message in str(raised.value)


def test_the_text_a_schema_forces_is_drafted_up_to_where_the_model_chooses():
    state = GrammarState(parse_gbnf(schema_to_gbnf(PERSON)))
    assert state.forced_text(50) == "{"  # then whitespace may follow: that is where the model chooses
    assert state.feed('{"name": "Al')
    assert state.forced_text(50) == ""  # the name goes on, or ends
    assert state.feed('"')
    assert state.forced_text(50) == ""  # whitespace may follow
    assert state.feed(", ")
    assert state.forced_text(50) == '"age":'
    assert state.feed('"age": 7')
    assert not state.feed("x")


def test_optional_whitespace_is_drafted_as_the_writer_laid_it_out_before():
    three = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"},
                                              "c": {"type": "string"}}, "required": ["a", "b", "c"]}
    state = GrammarState(parse_gbnf(schema_to_gbnf(three)))
    assert state.feed('{\n  "a": "x"')
    assert state.habits == {'{"': "\n  ", ':"': " "}
    assert state.forced_text(50) == ""  # nothing learnt yet about what follows the closing '"'
    assert state.feed(',\n  "b": "y"')
    assert state.habits == {'{"': "\n  ", ':"': " ", '",': "", ',"': "\n  "}
    assert state.forced_text(50) == ',\n  "c": "'
    assert state.forced_text(4) == ',\n  '
    state.feed(",\n")  # half way through the whitespace written after ',' before
    assert state.forced_text(50) == '  "c": "'
    state = GrammarState(parse_gbnf(schema_to_gbnf(three)))
    state.feed('{"a":"x","b":')
    assert state.forced_text(50) == '"'  # no whitespace after ':' last time
    state.feed("\n")  # whitespace never written here: nothing to go on
    assert state.forced_text(50) == ""


def test_an_enum_forces_its_only_possible_rest():
    state = GrammarState(parse_gbnf(schema_to_gbnf({"enum": ["administrator", "user"]})))
    assert state.feed('"a')
    assert state.forced_text(50) == 'dministrator"'


@pytest.mark.parametrize("schema", [PERSON, {"type": "array", "items": {"type": "integer", "minimum": -5,
                                                                                "maximum": 5}, "maxItems": 4},
                                    {"enum": ["red", "green", "blue"]}, True])
def test_sampled_generation_under_a_schema_always_parses_and_validates(schema):
    grammar = schema_to_gbnf(schema)
    rng = random.Random(7)
    with Engine(FakeBackend(n_ctx=1024, rule=printable_rule)) as engine:
        for _ in range(20):
            params = SamplingParams(temperature=1.5, seed=rng.randrange(10**6), max_tokens=400, grammar=grammar)
            result = engine.generate(GenerationRequest("answer: ", params))
            assert result.finish.reason == "stop", result.text
            jsonschema.validate(json.loads(result.text), schema if isinstance(schema, dict) else {})


def test_an_answer_cut_by_max_tokens_says_length():
    with Engine(FakeBackend(n_ctx=1024, rule=printable_rule)) as engine:
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, grammar=JSON_OBJECT_GBNF)
        result = engine.generate(GenerationRequest("answer: ", params))
    assert result.finish.reason == "length" and len(result.tokens) == 3 and result.text.startswith("{")



@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_through_the_api_always_validates(structured_server, stream):
    from .test_server import read_sse
    request = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 300, "temperature": 1.2,
               "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    for seed in range(5):
        body = dict(request, seed=seed, stream=stream)
        if stream:
            events = read_sse(structured_server, "/v1/chat/completions", body)
            text = "".join(event["choices"][0]["delta"].get("content") or "" for event in events if event["choices"])
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            answer = structured_server.json("POST", "/v1/chat/completions", body)[1]
            text, finish = answer["choices"][0]["message"]["content"], answer["choices"][0]["finish_reason"]
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_a_schema_beside_json_object_holds_the_answer_to_it_as_llama_server_does(structured_server):
    request = {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 40, "temperature": 1.2}
    digits = {"type": "json_object", "schema": {"items": [{"type": "integer", "minimum": 0, "maximum": 9}]}}
    for seed in range(3):
        answer = structured_server.json("POST", "/v1/chat/completions", dict(request, seed=seed,
                                                                             response_format=digits))[1]
        value = json.loads(answer["choices"][0]["message"]["content"])
        assert isinstance(value, list) and len(value) == 1 and 0 <= value[0] <= 9
    answer = structured_server.json("POST", "/v1/chat/completions", dict(
        request, seed=5, max_tokens=300, response_format={"type": "json_object", "schema": {}}))[1]
    assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict)
    status, error = structured_server.json("POST", "/v1/chat/completions", dict(
        request, response_format={"type": "json_object", "schema": {"type": "hiccup"}}))
    assert status == 400 and error["error"]["param"] == "response_format.schema"
    assert "type 'hiccup' is not a JSON type" in error["error"]["message"]


def test_json_object_and_a_grammar_on_completions(structured_server):
    answer = structured_server.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 200, "seed": 1,
                                                                "response_format": {"type": "json_object"}})[1]
    assert isinstance(json.loads(answer["choices"][0]["text"]), dict)
    answer = structured_server.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 20, "seed": 2,
                                                                "grammar": 'root ::= ("yes" | "no") "."'})[1]
    assert answer["choices"][0]["text"] in ("yes.", "no.")
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    answer = structured_server.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 50, "seed": 3,
                                                                "json_schema": digit})[1]
    assert 0 <= json.loads(answer["choices"][0]["text"]) <= 9
