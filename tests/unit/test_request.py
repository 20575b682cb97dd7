import math

import pytest

from reame.engine.request import GenerationRequest, SamplingParams, Usage
from reame.errors import RequestError


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", "10"), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", "hot"),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.5),
    ("repeat_penalty", 0.0), ("repeat_last_n", -2),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("seed", -1), ("seed", 2**32), ("seed", "42"),
    ("stop", "END"), ("stop", ("",)), ("stop", tuple(str(i) for i in range(17))), ("stop", (1,)),
    ("ignore_eos", 1), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: "x"}), ("logit_bias", {5: math.nan}),
])
def test_invalid_sampling_parameter_is_rejected_naming_the_field(field, value):
    with pytest.raises(RequestError) as raised:
        SamplingParams(**{field: value})
    assert raised.value.param == field


def test_defaults_are_valid_and_not_greedy():
    params = SamplingParams()
    assert not params.greedy
    assert not params.penalised
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(presence_penalty=0.5).penalised


@pytest.mark.parametrize("prompt", ["", [], [1, "2"], [True], None, 42])
def test_invalid_prompt_is_rejected(prompt):
    with pytest.raises(RequestError) as raised:
        GenerationRequest(prompt)
    assert raised.value.param == "prompt"


def test_tokens_per_step_counts_each_pass_with_the_drafts_it_accepted():
    assert Usage(5, 100, 0.1, 1.0, draft_tokens=60, accepted_draft_tokens=50).tokens_per_step == 2.0
    assert Usage(5, 100, 0.1, 1.0).tokens_per_step == 1.0
    assert Usage(5, 0, 0.1, 0.0).tokens_per_step == 1.0
