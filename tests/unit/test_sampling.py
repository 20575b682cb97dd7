from reame.engine.request import SamplingParams
from reame.model.sampling import chain_steps


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
