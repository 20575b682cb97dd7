from reame.engine.request import SamplingParams
import math

import pytest

from reame.model.sampling import chain_steps, post_sampling_of


def kinds(params: SamplingParams, **kwargs) -> list[str]:
    return [step.kind for step in chain_steps(params, **kwargs)]


def test_greedy_chain_is_just_greedy():
    assert kinds(SamplingParams(temperature=0)) == ["greedy"]


def test_full_chain_follows_llama_order():
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1,
                            logit_bias={3: 1.0}, seed=7)
    assert kinds(params) == ["logit_bias", "penalties", "top_k", "top_p", "min_p", "temp", "dist"]
    assert chain_steps(params)[-1].args == (7,)


def test_ignore_eos_bans_every_end_of_generation_token():
    steps = chain_steps(SamplingParams(temperature=0, ignore_eos=True), eog_tokens=[2, 9])
    assert steps[0].kind == "logit_bias"
    assert dict(steps[0].args[0]) == {2: float("-inf"), 9: float("-inf")}


def test_missing_seed_becomes_a_concrete_random_seed():
    seed = chain_steps(SamplingParams(temperature=1.0))[-1].args[0]
    assert 0 <= seed < 2**32 - 1


def post_probabilities(logits, token, params, history=(), banned=()):
    drawn, top = post_sampling_of(logits, token, 10, params, history, banned)
    return round(math.exp(drawn), 4), {i: round(math.exp(lp), 4) for i, lp in top}


def test_post_sampling_probabilities_follow_llama_cpps_chain_by_hand():
    logits = [0.0, 1.0, 2.0, 3.0, -50.0]
    # top-k 3 keeps 3, 2, 1; their softmax 0.665, 0.245, 0.090: top-p 0.9 stops at the second; then the softmax
    # of what is left, e^0 and e^-1.
    assert post_probabilities(logits, 2, SamplingParams(temperature=1.0, top_k=3, top_p=0.9)) == \
        (0.2689, {3: 0.7311, 2: 0.2689})
    # min-p 0.3 keeps what is at least 0.3 of the best (logit >= 3 + ln 0.3 = 1.80); temperature 0.5 doubles.
    assert post_probabilities(logits, 3, SamplingParams(temperature=0.5, min_p=0.3)) == (0.8808, {3: 0.8808,
                                                                                               2: 0.1192})
    # The penalties over the history: 3 / 2 (repeat) - 2 x 0.5 (frequency) - 0.25 (presence) = 0.25 for token 3;
    # the bias lifts 0 to 1.0, the ban drops 1: top-k 2 keeps 2 (2.0) and 0 (1.0).
    penalised = SamplingParams(temperature=1.0, top_k=2, repeat_penalty=2.0, frequency_penalty=0.5,
                               presence_penalty=0.25, logit_bias={0: 1.0})
    assert post_probabilities(logits, 2, penalised, history=[3, 3], banned=[1]) == \
        (0.7311, {2: 0.7311, 0: 0.2689})
    assert post_probabilities(logits, 3, SamplingParams(temperature=0)) == (1.0, {3: 1.0})  # greedy: certain


@pytest.mark.parametrize("size", [50_000, 152_000])
def test_post_sampling_over_a_whole_vocabulary_stays_cheap(size):
    import random
    from tests.cpu import cpu_clock
    rng = random.Random(size)
    logits = [rng.gauss(0, 3) for _ in range(size)]
    with cpu_clock() as clock:
        drawn, top = post_sampling_of(logits, 0, 20, SamplingParams(temperature=1.0), range(64))
    assert len(top) == 20 and drawn <= 0
    assert clock.seconds < 2.0  # a bound far above the ~0.1 s it takes, not a benchmark
