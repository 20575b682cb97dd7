"""The draft-model source on FakeBackend: exact answers, persistent draft KV, bounded catch-up, refusals."""

import math

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import N_VOCAB, FakeBackend, default_rule
from reame.errors import ModelError
from reame.speculative import CostModel, DraftController, PromptLookup, Speculation
from reame.speculative.controller import REPROBE_STEPS
from reame.speculative.draft_model import CATCH_UP_TOKENS, DraftModel, confidence

from .test_speculative import COPY_TEXT, GREEDY, FrozenCost, copying_rule, measured


def draft_backend(rule=copying_rule, n_seq_max=1):
    return FakeBackend(n_ctx=4096, n_seq_max=n_seq_max, n_batch=CATCH_UP_TOKENS, rule=rule)


def run(prompts, params=GREEDY, draft_rule=copying_rule, lookup=False, n_seq_max=1, cost=None):
    """Answers to `prompts` (one after another) from a copying target, drafted for by a model of `draft_rule`."""
    target = FakeBackend(n_ctx=4096, n_seq_max=n_seq_max, n_batch=256, rule=copying_rule)
    draft = draft_backend(draft_rule, n_seq_max)
    sources = ([PromptLookup()] if lookup else []) + [DraftModel(draft, target, "fake-draft")]
    speculation = Speculation(*sources, max_draft=6, cost=cost or FrozenCost())
    with Engine(target, speculation=speculation) as engine:
        results = [engine.generate(GenerationRequest(prompt, params)) for prompt in prompts]
    return results, draft, speculation


def plain(prompt, params=GREEDY):
    with Engine(FakeBackend(n_ctx=4096, n_batch=256, rule=copying_rule)) as engine:
        return engine.generate(GenerationRequest(prompt, params))


def fed_tokens(backend):
    return sum(len(call) for call in backend.decode_calls)


def test_a_draft_model_that_agrees_with_the_target_has_every_draft_accepted():
    (result,), _, speculation = run([COPY_TEXT])
    assert result.tokens == plain(COPY_TEXT).tokens
    usage = result.finish.usage
    assert usage.draft_tokens > 60 and usage.accepted_draft_tokens == usage.draft_tokens
    assert speculation.stats.snapshot().sources["draft"].accepted == usage.accepted_draft_tokens


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, seed=5, max_tokens=80)])
def test_a_draft_model_that_disagrees_cannot_change_the_answer(params):
    (result,), _, _ = run([COPY_TEXT], params, draft_rule=default_rule)
    assert result.tokens == plain(COPY_TEXT, params).tokens
    assert result.finish.usage.draft_tokens > result.finish.usage.accepted_draft_tokens


def test_the_draft_kv_follows_the_sequence_and_serves_the_next_request_with_the_same_start():
    (first, second), draft, _ = run([COPY_TEXT, COPY_TEXT])
    assert first.tokens == second.tokens
    prompt = len(FakeBackend().tokenize(COPY_TEXT))
    second_request_calls = [call for call in draft.decode_calls if call[0][1] == 0]
    assert len(second_request_calls) == 1, "the prompt was fed once, the second request reused it"
    # Everything fed is the prompt, the answers, and each step's drafts: nothing fed twice.
    assert fed_tokens(draft) <= prompt + first.finish.usage.draft_tokens + second.finish.usage.draft_tokens \
        + len(first.tokens) + len(second.tokens)


def test_a_long_prompt_is_caught_up_in_bounded_chunks():
    prompt = COPY_TEXT * 12
    (result,), draft, _ = run([prompt])
    assert len(FakeBackend().tokenize(prompt)) > 3 * CATCH_UP_TOKENS
    assert max(len(call) for call in draft.decode_calls) <= CATCH_UP_TOKENS
    assert result.tokens == plain(prompt).tokens and result.finish.usage.accepted_draft_tokens > 0


def test_drafts_stop_where_the_draft_model_doubts():
    def undecided(history):
        logits = [-math.inf] * N_VOCAB
        for token in b"abc":
            logits[token] = 1.0
        return logits
    (result,), _, _ = run([COPY_TEXT], draft_rule=undecided)
    assert result.finish.usage.draft_tokens == 0
    assert confidence([(1, 2.0), (2, 2.0)]) == pytest.approx(0.5)
    assert confidence([(1, 9.0), (2, 0.0)]) > 0.99


ALPHABET = b"abcdefghijklmnopqrstuvwxyz "


def alphabet_rule(history):
    """The letter after the last one: a draft model knows it at once, prompt lookup after a round."""
    logits = [-math.inf] * N_VOCAB
    last = history[-1] if history else ord(" ")
    logits[ALPHABET[(ALPHABET.find(bytes([last & 0xFF])) + 1) % len(ALPHABET)]] = 3.0
    return logits


def test_prompt_lookup_goes_first_and_the_draft_model_fills_in():
    target = FakeBackend(n_ctx=4096, n_batch=256, rule=alphabet_rule)
    speculation = Speculation(PromptLookup(), DraftModel(draft_backend(alphabet_rule), target, "fake-draft"),
                              max_draft=6, cost=FrozenCost())
    with Engine(target, speculation=speculation) as engine:
        result = engine.generate(GenerationRequest("a", GREEDY))
    assert result.text.startswith("bcdefghijklmnopqrstuvwxyz abc")
    sources = speculation.stats.snapshot().sources
    assert sources["draft"].drafted > 0 and sources["lookup"].drafted > sources["draft"].drafted
    assert sources["lookup"].accepted + sources["draft"].accepted == result.finish.usage.accepted_draft_tokens


def test_several_sequences_draft_in_their_own_slots():
    target = FakeBackend(n_ctx=4096, n_seq_max=3, n_batch=256, rule=copying_rule)
    speculation = Speculation(DraftModel(draft_backend(n_seq_max=3), target, "fake-draft"), max_draft=4,
                              cost=FrozenCost())
    prompts = [COPY_TEXT, "the owl and the cat; the owl and the", COPY_TEXT[::-1]]
    with Engine(target, speculation=speculation) as engine:
        handles = [engine.submit(GenerationRequest(prompt, GREEDY)) for prompt in prompts]
        results = [handle.result(timeout_s=30) for handle in handles]
    assert [r.tokens for r in results] == [plain(prompt).tokens for prompt in prompts]
    assert all(r.finish.usage.accepted_draft_tokens > 0 for r in results)


class OtherVocabulary(FakeBackend):
    def token_piece(self, token):
        return b"?" if token == ord("e") else super().token_piece(token)


def test_a_draft_model_with_another_vocabulary_is_refused():
    target = FakeBackend()
    with pytest.raises(ModelError, match=r"draft model d.gguf does not share the model's vocabulary: token 101"):
        DraftModel(OtherVocabulary(), target, "d.gguf")
    shorter = FakeBackend()
    shorter.n_vocab = N_VOCAB - 200
    with pytest.raises(ModelError, match=f"vocabulary has {N_VOCAB - 200} tokens"):
        DraftModel(shorter, target, "d.gguf")
    other_eos = FakeBackend()
    other_eos.eos_token = 5
    with pytest.raises(ModelError, match="begin/end-of-text"):
        DraftModel(other_eos, target, "d.gguf")


def test_a_source_whose_drafting_costs_more_than_it_saves_stays_off_and_is_probed_rarely():
    cost = CostModel()
    for n in range(1, 10):
        measured(cost, n, 0.1 * (1 + 0.3 * (n - 1)))  # verification is cheap: drafts would pay if free
    free, dear = DraftController(max_draft=8, prior=0.9), DraftController(max_draft=8, prior=0.9)
    assert free.draft_length(cost, 1, seconds_per_draft=0.0) > 0
    assert dear.draft_length(cost, 1, seconds_per_draft=0.2) == 0, "drafting a token costs two steps"
    probes = sum(bool(dear.draft_length(cost, 1, seconds_per_draft=0.2)) for _ in range(2000))
    # A probe costs 0.03 s of verification and 0.2 s of drafting: at most 2% of the plain steps' time.
    assert 1 <= probes <= 2000 * 0.1 * 0.02 / 0.23 + 1
    cheap = DraftController(max_draft=8, prior=0.0)
    probes = sum(bool(cheap.draft_length(cost, 1)) for _ in range(REPROBE_STEPS * 4))
    assert probes == 4, "a free source that does not pay is re-probed every REPROBE_STEPS steps"


def test_the_engine_charges_drafting_time_to_its_source():
    class SlowRule:
        def __call__(self, history):
            import time
            time.sleep(0.002)
            return copying_rule(history)
    (result,), _, speculation = run([COPY_TEXT], draft_rule=SlowRule())
    assert speculation.seconds_per_draft()["draft"] >= 0.002
    assert result.tokens == plain(COPY_TEXT).tokens
