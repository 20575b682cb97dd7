"""What a hostile grammar or JSON schema may cost: every limit of structured/grammar.py and json_schema.py is a
GrammarError naming the rule or the schema's place, and any input, valid or not, is compiled and read within
a bound of CPU time and memory (hypothesis fuzz with both measured, not only "no exception")."""

import gc
import os
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.cpu import cpu_clock
from tests.fakes.backend import EOS, N_VOCAB, FakeBackend
from reame.structured.grammar import GrammarError, GrammarState, GrammarTooAmbiguous
from reame.structured.gbnf import CACHE_BYTES, MAX_ELEMENTS, MAX_REPETITION, compiled, parse_gbnf
from reame.structured.json_schema import schema_to_gbnf

FUZZ = settings(max_examples=int(os.environ.get("REAME_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
CPU_SECONDS = 2.0  # per input, compiled and read, with tracemalloc slowing Python down ~2x
PEAK_BYTES = 64 << 20

AMBIGUOUS = 'root ::= a\na ::= "x" a "y"? | "x"'  # a state per "x" read, each as deep as the x's so far


def measured(work):
    """Run `work()`; return (its result or the GrammarError it raised, CPU seconds, peak bytes allocated)."""
    tracemalloc.start()
    try:
        with cpu_clock(pause_collector=False) as clock:
            try:
                outcome = work()
            except GrammarError as error:
                outcome = error
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return outcome, clock.seconds, peak


def assert_bounded(work):
    outcome, seconds, peak = measured(work)
    assert seconds < CPU_SECONDS and peak < PEAK_BYTES, (seconds, peak >> 20)
    return outcome


@pytest.mark.parametrize("gbnf, message", [
    ('root ::= "a"{0,200000}', "rule 'root': {0,200000} repeats more than 2000 times"),
    ('root ::= "a"{2001}', "rule 'root': {2001} repeats more than 2000"),
    ('root ::= x\nx ::= "a"{99999999999999999999,}', "rule 'x': {99999999999999999999,} repeats more than 2000"),
    ('root ::= (("a" | "b") "c"){1500}', "rule 'root': repeating a group of 2 rules 1500 times writes more than 2000"),
    ('root ::= "' + "x" * 1000 + '"{1000}', f"the grammar grows past {MAX_ELEMENTS} elements"),
    ("root ::= " + "(" * 100 + '"a"' + ")" * 100, "rule 'root': groups nested more than 64 deep"),
])
def test_a_grammar_past_a_limit_is_refused_naming_its_rule(gbnf, message):
    error = assert_bounded(lambda: parse_gbnf(gbnf))
    assert isinstance(error, GrammarError) and message in str(error), error


def test_grammars_at_the_limits_are_accepted():
    assert parse_gbnf(f'root ::= "a"{{0,{MAX_REPETITION}}}').accepts("a" * MAX_REPETITION)
    assert parse_gbnf('root ::= ("a" | "b"){2000}').accepts("ab" * 1000)
    assert parse_gbnf("root ::= " + "(" * 64 + '"a"' + ")" * 64).accepts("a")


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "maxLength": 100000}, "'maxLength' of 100000 is over the 2000"),
    ({"type": "array", "minItems": 2001}, "'minItems' of 2001 is over the 2000"),
    ({"type": "integer", "minimum": float("inf")}, "'minimum' must be a number within ±10^18"),
    ({"type": "integer", "maximum": -10**40}, "'maximum' must be a number within ±10^18"),
])
def test_a_schema_past_a_limit_is_refused_naming_the_keyword(schema, message):
    error = assert_bounded(lambda: schema_to_gbnf(schema))
    assert isinstance(error, GrammarError) and message in str(error) and "at $" in str(error), error


def test_a_schema_nested_too_deep_is_refused_naming_where():
    schema = {"type": "string"}
    for _ in range(600):
        schema = {"type": "array", "items": schema}
    error = assert_bounded(lambda: schema_to_gbnf(schema))
    assert isinstance(error, GrammarError) and "schemas nested more than 64 deep at $.items.items" in str(error)


def test_a_tuple_nested_too_deep_is_refused_naming_where():
    schema: dict = {"type": "string"}
    for _ in range(600):
        schema = {"prefixItems": [schema]}
    error = assert_bounded(lambda: schema_to_gbnf(schema))
    assert isinstance(error, GrammarError) and "schemas nested more than 64 deep at $.prefixItems[0]" in str(error)


def test_an_ambiguous_grammar_is_cut_off_while_its_text_is_read_at_a_bounded_cost():
    state = GrammarState(parse_gbnf(AMBIGUOUS))

    def read():
        for _ in range(2000):
            state.feed("x")
    error = assert_bounded(read)
    assert isinstance(error, GrammarTooAmbiguous) and "the grammar is too ambiguous: after" in str(error)
    assert state.read < 2000


def test_a_grammar_whose_start_fans_out_too_far_is_refused_when_it_is_parsed():
    letters = " | ".join(f'"{chr(65 + i % 26)}{i}"' for i in range(40))
    endings = " | ".join(f'c "{i}"' for i in range(40))  # 40 ways to begin, each with 40 ways to go on
    error = assert_bounded(lambda: parse_gbnf(f"root ::= b\nb ::= {endings}\nc ::= {letters}\n"))
    assert isinstance(error, GrammarTooAmbiguous) and "too ambiguous: in rule 'b' it could be in" in str(error), error


def test_the_compiled_grammar_cache_is_bounded_by_the_memory_its_grammars_hold():
    """Five heavy schemas once held 446 MB for good; now what the cache keeps, memo tables included, is
    bounded by CACHE_BYTES (and the estimate it counts is within reach of what tracemalloc measures)."""
    compiled.clear()
    gc.collect()
    tracemalloc.start()
    for n in range(800):  # about twice what fits
        grammar = compiled(f'root ::= "a{n}" [a-z]{{0,50}} ("x" | "y"){{0,30}}')
        GrammarState(grammar).feed(f"a{n}" + "b" * 50)
    for n in range(20):
        grammar = compiled(f'root ::= "q{n}" ("ab" | "cd"){{0,1000}}')
        GrammarState(grammar).feed(f"q{n}" + "ab" * 900)
    compiled('root ::= "a0" [a-z]{0,50} ("x" | "y"){0,30}')  # each use looks at what the cache holds now
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert compiled.bytes <= CACHE_BYTES
    assert held < 2 * CACHE_BYTES, held >> 20
    compiled.clear()


def x_lover(history):
    """A model that writes "x" whenever it may (and ends the text otherwise)."""
    logits = [float("-inf")] * N_VOCAB
    logits[ord("x")], logits[ord("y")], logits[EOS] = 5.0, 1.0, 0.0
    return logits


def test_a_request_whose_grammar_grows_too_ambiguous_ends_with_a_clear_error_and_others_go_on():
    with Engine(FakeBackend(n_ctx=4096, n_seq_max=2, rule=x_lover)) as engine:
        ambiguous = engine.submit(GenerationRequest("go", SamplingParams(temperature=0, max_tokens=3000,
                                                                         grammar=AMBIGUOUS)))
        plain = engine.submit(GenerationRequest("go", SamplingParams(temperature=0, max_tokens=50)))
        result = ambiguous.result(30)
        assert result.finish.reason == "error" and result.finish.code == "grammar_too_ambiguous"
        assert "too ambiguous" in result.finish.message
        assert 100 < len(result.tokens) < 3000
        assert plain.result(30).finish.reason == "length"


# --- fuzz ---------------------------------------------------------------------------------------------------

SYMBOLS = st.sampled_from(['"a"', '"xyz"', "[a-c]", "[^\\n]", ".", "x", "y", "root", '""', "(", ")", "|", "*", "+",
                           "?", "{2}", "{0,5}", "{3,}", "{2000}", "{0,2000}", "{1999,2000}", "{2001}",
                           "{99999999}", "\n", " ", "::=", "x ::=", "\ny ::= ", "\nx ::= ", "#c\n", '"\\x41"'])
GRAMMARS = st.lists(SYMBOLS, min_size=1, max_size=30).map(lambda parts: "root ::= " + " ".join(parts))


@FUZZ
@given(gbnf=GRAMMARS, text=st.text(alphabet="axyzbc\n", max_size=300))
def test_any_grammar_is_parsed_and_read_within_a_bound_of_time_and_memory(gbnf, text):
    def work():
        grammar = parse_gbnf(gbnf)
        state = GrammarState(grammar)
        state.feed(text)
        state.forced_text(64)
        return grammar
    assert_bounded(work)


SCHEMA_LEAVES = st.sampled_from([
    {"type": "string"}, {"type": "string", "maxLength": 2000}, {"type": "string", "minLength": 1999},
    {"type": "string", "maxLength": 10**6}, {"type": "integer", "minimum": -10**17, "maximum": 10**17},
    {"type": "integer", "minimum": 1e300}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
    {"enum": ["a", "b", 3]}, {"const": {"k": [1, 2]}}, {"type": "string", "format": "date-time"},
    {"type": "string", "pattern": "x"}, True, {}, {"$ref": "#/$defs/node"},
])
SCHEMAS = st.recursive(SCHEMA_LEAVES, lambda inner: st.one_of(
    st.builds(lambda items, low, high: {"type": "array", "items": items, "minItems": low, "maxItems": high},
              inner, st.integers(0, 3), st.sampled_from([None, 5, 2000, 50000])).map(
        lambda s: {k: v for k, v in s.items() if v is not None}),
    st.dictionaries(st.text(alphabet="abcd", min_size=1, max_size=4), inner, max_size=5).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]}),
    st.lists(inner, min_size=1, max_size=4).map(lambda options: {"anyOf": options}),
    st.lists(inner, min_size=0, max_size=4).map(lambda items: {"prefixItems": items}),
    st.lists(inner, min_size=1, max_size=4).map(lambda items: {"type": "array", "items": items, "maxItems": 2}),
), max_leaves=25)


@FUZZ
@given(schema=SCHEMAS, text=st.text(alphabet='{}[]":, abc0123\n', max_size=200))
def test_any_schema_is_compiled_and_read_within_a_bound_of_time_and_memory(schema, text):
    def work():
        document = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
                    **(schema if isinstance(schema, dict) else {"anyOf": [schema]})}
        grammar = parse_gbnf(schema_to_gbnf(document))
        GrammarState(grammar).feed(text)
        return grammar
    assert_bounded(work)
