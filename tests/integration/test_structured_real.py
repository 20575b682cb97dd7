"""Structured output on the real model: llama.cpp takes every grammar the converter writes, answers always
validate, and Il Suggeritore leaves greedy answers unchanged while its drafts are accepted."""

import ctypes
import json

import jsonschema
import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.llama import LlamaBackend
from reame.model.sampler_chain import RANKED_CANDIDATES
from reame.structured.json_schema import schema_to_gbnf
from reame.model.sampling import chain_steps
from reame.speculative import Speculation
from reame.speculative.suggeritore import Suggeritore

from ..unit.test_grammar import PERSON, SCHEMA_CASES
from .conftest import settings_for
from .test_speculative_real import FreeDrafts

SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
                                      "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
     "required": ["city", "temperature_c", "sky"]},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["ok"]},
]


def test_llama_cpp_takes_every_grammar_the_converter_writes(backend):
    for schema in [case[0] for case in SCHEMA_CASES] + SCHEMAS:
        sampler = backend.new_sampler(chain_steps(SamplingParams(temperature=0, grammar=schema_to_gbnf(schema))))
        backend.free_sampler(sampler)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_answers_under_a_schema_validate_on_the_real_model(native_libraries, smollm2_path, schema):
    with LlamaBackend(settings_for(smollm2_path, n_seq_max=1)) as backend, Engine(backend) as engine:
        prompt = backend.apply_chat_template([{"role": "user", "content": "Describe the weather in Rome as JSON."}])
        for seed in (1, 2):
            params = SamplingParams(temperature=0.8, seed=seed, max_tokens=250, grammar=schema_to_gbnf(schema))
            result = engine.generate(GenerationRequest(prompt, params))
            assert result.finish.reason == "stop", result.text
            jsonschema.validate(json.loads(result.text), schema)


def test_il_suggeritore_drafts_forced_text_and_greedy_answers_do_not_change(native_libraries, smollm2_path):
    """Also from the answer's first token: a whole answer's prompt step verifies the schema's opening."""
    def answer(speculate):
        with LlamaBackend(settings_for(smollm2_path, n_seq_max=1)) as backend:
            source = Suggeritore(backend.token_piece, lambda t: backend.tokenize(t, add_special=False,
                                                                                parse_special=False),
                                 backend.detokenize)
            speculation = Speculation(source, max_draft=12, cost=FreeDrafts()) if speculate else None
            decode, rows = backend.decode, []
            backend.decode = lambda tokens, *rest: rows.append(len(tokens)) or decode(tokens, *rest)
            with Engine(backend, speculation=speculation) as engine:
                prompt = backend.apply_chat_template([{"role": "user", "content": "The weather in Rome, as JSON."}])
                params = SamplingParams(temperature=0, max_tokens=200, grammar=schema_to_gbnf(SCHEMAS[1]))
                return engine.generate(GenerationRequest(prompt, params)), rows[1], len(backend.tokenize(prompt))
    (plain, plain_prefill, n_prompt), (fast, fast_prefill, _) = answer(False), answer(True)
    assert fast.tokens == plain.tokens
    jsonschema.validate(json.loads(fast.text), SCHEMAS[1])
    assert fast.finish.usage.accepted_draft_tokens >= 5
    assert plain_prefill == n_prompt < fast_prefill  # `{"city": "` drafted after the prompt's last token


@pytest.mark.parametrize("bias", [{}, {"\n": 4.0, " ": 2.0}], ids=["greedy", "greedy with a logit bias"])
def test_the_grammar_checks_only_the_drawn_token_and_picks_what_applying_it_everywhere_picks(backend, bias):
    """The sampler asks the grammar about the unconstrained draw and, when it is refused, about the best-ranked
    tokens before the whole vocabulary; greedy (a logit bias included), every token equals the grammar-masked
    argmax of a chain that applies the grammar to the whole vocabulary."""
    logit_bias = {backend.tokenize(text, add_special=False)[0]: value for text, value in bias.items()}
    steps = chain_steps(SamplingParams(temperature=0, grammar=schema_to_gbnf(SCHEMAS[1]), logit_bias=logit_bias))
    checked, everywhere = backend.new_sampler(steps), backend._chain(steps)
    refusals, ranked = [], []
    allows, best_allowed = checked.allows, checked._best_allowed
    checked.allows = lambda api, token: allows(api, token) or refusals.append(token)
    checked._best_allowed = lambda api, ctx, index: ranked.append(best_allowed(api, ctx, index)) or ranked[-1]
    prompt = backend.tokenize(backend.apply_chat_template([{"role": "user", "content": "Rome's weather, in YAML."}]))
    backend.decode(prompt, range(len(prompt)), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
    index, position, answer = len(prompt) - 1, len(prompt), []
    while len(answer) < 80:
        token = backend.sample(checked, index)
        assert backend.sample(everywhere, index) == token, backend.detokenize(answer)
        if backend.is_eog(token):
            break
        answer.append(token)
        backend.decode([token], [position], [0], [True])
        index, position = 0, position + 1
    backend.free_sampler(checked)
    backend.free_sampler(everywhere)
    jsonschema.validate(json.loads(backend.detokenize(answer)), SCHEMAS[1])
    assert refusals  # asked for YAML, the model's own choices were refused and drawn again
    assert len(ranked) == len(refusals) and any(token is not None for token in ranked)


class LogitsOf:
    """llama's API with the logits of every row replaced by `logits`: the ranking and the grammar are llama's."""

    def __init__(self, api, logits):
        self._api, self._logits = api, logits

    def llama_get_logits_ith(self, ctx, index):
        return ctypes.cast(self._logits, ctypes.POINTER(ctypes.c_float))

    def __getattr__(self, name):
        return getattr(self._api, name)


def test_a_refused_greedy_draw_is_the_best_ranked_allowed_token_unless_it_ties_or_none_is_ranked(backend):
    """Of tokens the grammar allows, the best by logit replaces a refused greedy draw when it stands alone at its
    logit among the RANKED_CANDIDATES best; a tie, or no allowed token among them, is left to the whole vocabulary
    (None), whose pick between equals follows llama's own order."""
    sampler = backend.new_sampler(chain_steps(SamplingParams(temperature=0, grammar='root ::= "x" | "y"')))
    x, y = (backend.tokenize(letter, add_special=False)[0] for letter in "xy")
    logits = (ctypes.c_float * backend.n_vocab)()
    api = LogitsOf(backend._api, logits)

    def best(scores: dict[int, float]) -> int | None:
        ctypes.memset(logits, 0, ctypes.sizeof(logits))
        for token, score in scores.items():
            logits[token] = score
        return sampler._best_allowed(api, None, 0)

    try:
        assert best({x: 5.0, y: 4.0, max(x, y) + 1: 9.0}) == x  # the best refused, the next allowed
        assert best({x: 4.0, y: 5.0}) == y
        assert best({x: 5.0, y: 5.0}) is None  # equals: llama's greedy picks the lower id; not guessed here
        assert best({x: -1.0, y: -1.0}) is None  # every ranked token has 0.0 and the grammar refuses them all
        ranked_ahead = {token: 1.0 for token in range(RANKED_CANDIDATES + 8) if token not in (x, y)}
        assert best({**ranked_ahead, x: 0.5}) is None
        assert best({**{token: 1.0 for token in range(RANKED_CANDIDATES - 8) if token not in (x, y)}, x: 0.5}) == x
    finally:
        backend.free_sampler(sampler)
