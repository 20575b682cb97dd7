"""Structured output on the real model: llama.cpp takes every grammar the converter writes, answers always
validate, and Il Suggeritore leaves greedy answers unchanged while its drafts are accepted."""

import json

import jsonschema
import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.llama import LlamaBackend
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


def test_the_grammar_checks_only_the_drawn_token_and_picks_what_applying_it_everywhere_picks(backend):
    """The sampler asks the grammar about the unconstrained draw and resamples only when it is refused;
    greedy, every token equals the grammar-masked argmax of a chain that applies the grammar to the whole
    vocabulary."""
    steps = chain_steps(SamplingParams(temperature=0, grammar=schema_to_gbnf(SCHEMAS[1])))
    checked, everywhere = backend.new_sampler(steps), backend._chain(steps)
    refusals = []
    allows = checked.allows
    checked.allows = lambda api, token: allows(api, token) or refusals.append(token)
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
