"""Issue 32's findings on the real library and SmolLM2: what llama.cpp's own grammar parser and matcher would
have been made to do, and a request asking for the whole context beside ordinary ones."""

import dataclasses

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.structured.grammar import GrammarError
from reame.structured.gbnf import parse_gbnf
from reame.model.sampling import chain_steps
from reame.errors import ModelError

pytestmark = pytest.mark.integration

AMBIGUOUS = 'root ::= a\na ::= "x" a "y"? | "x"'


@pytest.mark.parametrize("gbnf", [
    'root ::= "a"{0,2000}', 'root ::= "a"{2000}', 'root ::= "a"{2001}', 'root ::= "a"{0,2001}',
    'root ::= (("a" | "b") "c"){1000}', 'root ::= (("a" | "b") "c"){1001}', 'root ::= ("a" | "b"){2000}',
    'root ::= ("a"{0,50}){0,40}', 'root ::= ("a"{0,50}){0,41}', 'root ::= x{3}\nx ::= ("q"){600}',
])
def test_every_grammar_we_accept_llama_cpp_accepts_too(backend, gbnf):
    """Our checks run before llama.cpp sees a grammar: what passes them must never fail later on the engine
    thread. (We refuse some llama.cpp accepts: a {0,n} past 2000 it silently makes unbounded.)"""
    try:
        parse_gbnf(gbnf)
    except GrammarError:
        return
    sampler = backend.new_sampler(chain_steps(SamplingParams(temperature=0, grammar=gbnf)))
    backend.free_sampler(sampler)


def test_llama_cpp_refuses_what_we_refuse_at_its_own_limit(backend):
    with pytest.raises(GrammarError):
        parse_gbnf('root ::= "a"{2001}')
    with pytest.raises(ModelError):
        backend.new_sampler(chain_steps(SamplingParams(temperature=0, grammar='root ::= "a"{2001}')))


def test_an_ambiguous_grammar_ends_its_request_and_the_engine_goes_on(backend):
    """On today's main before the bound, llama.cpp's matcher took 413 s for 600 such tokens on the engine
    thread here, everyone else stalled; now the request ends within a few hundred tokens, with its reason."""
    x = backend.tokenize("x", add_special=False, parse_special=False)[0]
    with Engine(backend) as engine:
        ambiguous = engine.submit(GenerationRequest("Write x many times: xxxxxxxx", SamplingParams(
            temperature=0, max_tokens=1500, grammar=AMBIGUOUS, logit_bias={x: 100.0})))
        other = engine.submit(GenerationRequest("Hello", SamplingParams(temperature=0, max_tokens=8)))
        result = ambiguous.result(300)
        assert result.finish.reason == "error" and result.finish.code == "grammar_too_ambiguous"
        assert len(result.tokens) < 300 and set(result.text) == {"x"}
        assert other.result(60).finish.reason in ("stop", "length")


def test_a_request_asking_the_whole_context_leaves_room_for_the_others(backend):
    """Before, one max_tokens of 2^31 reserved the whole context: the next request waited for its minutes."""
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    with Engine(backend) as engine:
        huge = engine.submit(GenerationRequest("Count to a million:", dataclasses.replace(greedy, max_tokens=2**31)))
        small = engine.submit(GenerationRequest("Hello", dataclasses.replace(greedy, max_tokens=4)))
        assert small.result(120).finish.reason == "length"
        huge.cancel()
        assert huge.result(60).finish.reason == "cancelled"  # it was still running when the small one ended
