"""llama-server's post-sampling probabilities, computed in Python (sampling.post_sampling_of), against
llama.cpp's own samplers on a real model's logits: the chain a request builds, applied to the logits, leaves
the same most likely tokens with the same probabilities (its dist sampler's softmax)."""

import math

import pytest

from reame.ctypes_llama import types as t
from reame.model.llama import LlamaBackend
from reame.model.sampler_chain import new_chain
from reame.model.sampling import SamplingParams, chain_steps, post_sampling_of

from .conftest import settings_for

CASES = [
    SamplingParams(temperature=1.0),  # Reame's defaults: nothing cut
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama-server's
    SamplingParams(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
    SamplingParams(temperature=1.5, top_k=5, top_p=1.0, min_p=0.1, repeat_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.2, logit_bias={11: 3.0, 198: -2.0}),
]


def llama_survivors(backend: LlamaBackend, logits: list[float], params: SamplingParams,
                    history: list[int]) -> dict[int, float]:
    """What llama.cpp's chain leaves of `logits`, with its probabilities."""
    chain = new_chain(backend._api, backend._vocab, backend.n_vocab, chain_steps(params, history=history))
    data = (t.llama_token_data * len(logits))(*[t.llama_token_data(i, value, 0.0) for i, value in enumerate(logits)])
    candidates = t.llama_token_data_array(data, len(logits), -1, False)
    try:
        backend._api.llama_sampler_apply(chain, candidates)
        return {data[i].id: data[i].p for i in range(candidates.size) if data[i].p > 0.0}
    finally:
        backend._api.llama_sampler_free(chain)


@pytest.mark.parametrize("params", CASES, ids=["reame", "llama-server", "top-p", "penalties-bias"])
def test_post_sampling_probabilities_are_llama_cpps(native_libraries, smollm2_path, params):
    with LlamaBackend(settings_for(smollm2_path, n_ctx=512, n_seq_max=1)) as backend:
        prompt = backend.tokenize("Today was the day. Today I would finally become a", add_special=True)
        backend.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
        logits = list(backend.logits(len(prompt) - 1))
        expected = llama_survivors(backend, logits, params, prompt)
        best = max(expected, key=expected.__getitem__)
        drawn, top = post_sampling_of(logits, best, 20, params, prompt)
    assert len(expected) >= 2  # a case where the chain leaves a choice
    # The most likely 20 (what a request may ask), best first, with llama.cpp's probabilities. (Where a cut
    # falls among near-equal tails, float32 sums and Python's may keep a token or two more or less: far below
    # any top list.)
    ranked = sorted(expected.items(), key=lambda item: -item[1])[:20]
    assert [token for token, _ in top] == [token for token, _ in ranked]
    for (_, logprob), (_, probability) in zip(top, ranked):
        assert math.exp(logprob) == pytest.approx(probability, rel=1e-3, abs=1e-6)
    assert math.exp(drawn) == pytest.approx(expected[best], rel=1e-3)
