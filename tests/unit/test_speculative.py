"""Speculative decoding on FakeBackend: exact outputs, exact distribution, the controller's decisions."""

import json
import math
from collections import Counter

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams, step
from tests.fakes.backend import EOS, N_VOCAB, FakeBackend, default_rule
from reame.speculative import CostModel, DraftController, PromptLookup, Speculation
from reame.speculative.controller import (COST_MEMORY_STEPS, COST_SAMPLES, MODELLED_TOKENS, REPROBE_STEPS,
                                          expected_tokens)
from reame.speculative.lookup import MATCH_WINDOW
from reame.speculative.speculation import CostMemory, match_class

COPY_TEXT = "the cat sat on the mat and the dog sat on the log; "


def step_seconds(cost: CostModel, n_tokens: int) -> float | None:
    """A size's step cost as the controller sees it: measured, or estimated; None before any step."""
    curve = cost.curve(n_tokens, n_tokens)
    return curve[0] if curve is not None else None


def copying_rule(history):
    """Like an induction head: continue what followed the last occurrence of the last two tokens."""
    for start in range(len(history) - 3, -1, -1):
        if history[start:start + 2] == history[-2:]:
            logits = [-math.inf] * N_VOCAB
            logits[history[start + 2]] = 5.0
            logits[ord("z")] = 0.0  # rarely, something new
            return logits
    return default_rule(history)


def step_decoding(backend, position):
    """The rows of the first decode that fed `position` (of the sequence in slot 0) asking its logits (a long
    prompt's last token is fed with the others first, its cell dropped, then decoded alone)."""
    return next(call for call in backend.decode_calls
                if (0, position, True) in {(seq, pos, output) for _, pos, seq, output in call})


def measured(cost, n_tokens, *seconds):
    """Steps of `n_tokens` took `seconds`; the cost model skips a size's first step (llama.cpp builds the
    new shape's graph in it), so one is shown first."""
    cost.observe(n_tokens, 99.0)
    for value in seconds:
        cost.observe(n_tokens, value)


class FrozenCost(CostModel):
    """A machine where a draft token costs `per_token` of a step: lets a test force the controller's hand."""

    def __init__(self, per_token: float = 0.0) -> None:
        super().__init__()
        self.per_token = per_token

    def observe(self, n_tokens, seconds):
        pass

    def measured(self, n_tokens):
        return True

    def curve(self, first, last, optimistic=False):
        return [1.0 + self.per_token * (n - 1) for n in range(first, last + 1)]


def generate(prompt, params, speculation=None, n_seq_max=1, rule=copying_rule, backend_class=FakeBackend):
    backend = backend_class(n_ctx=4096, n_seq_max=n_seq_max, n_batch=256, rule=rule)
    with Engine(backend, speculation=speculation) as engine:
        result = engine.generate(GenerationRequest(prompt, params))
    return result, backend


def test_prompt_lookup_follows_the_longest_then_most_recent_match():
    lookup = PromptLookup(max_ngram=2, min_ngram=1)
    assert lookup.drafter([1, 2, 3, 4, 2, 3]).propose(8) == [4, 2, 3]
    assert PromptLookup(max_ngram=3, min_ngram=1).drafter([5, 1, 9, 1]).propose(8) == [9, 1]
    assert PromptLookup(max_ngram=3, min_ngram=2).drafter([5, 1, 9, 1]).propose(8) == []
    drafter = lookup.drafter([7, 8, 9])
    assert drafter.propose(4) == []
    drafter.observe([7])
    assert drafter.propose(2) == [8, 9]
    assert drafter.propose(0) == []


def test_prompt_lookup_copies_the_occurrence_whose_context_matches_furthest_back():
    lookup = PromptLookup(max_ngram=3, min_ngram=2)
    first, second = [9, 1, 2, 3, 40, 41], [8, 1, 2, 3, 50, 51]  # two records sharing a field's name
    assert lookup.drafter([*first, *second, 7, 9, 1, 2, 3]).propose(2) == [40, 41]  # the older record
    assert lookup.drafter([*first, *second, 7, 8, 1, 2, 3]).propose(2) == [50, 51]
    assert lookup.drafter([*first, *second, 7, 6, 1, 2, 3]).propose(2) == [50, 51]  # equal: the newest


def test_prompt_lookup_says_how_long_a_context_its_guess_was_found_after():
    lookup = PromptLookup(max_ngram=3, min_ngram=2)
    first, second = [9, 1, 2, 3, 40, 41], [8, 1, 2, 3, 50, 51]
    drafter = lookup.drafter([*first, *second, 7, 9, 1, 2, 3])
    assert (drafter.propose(2), drafter.matched) == ([40, 41], 4)  # 9 1 2 3
    drafter = lookup.drafter([5, 6, 7, 1, 5, 6])
    assert (drafter.propose(2), drafter.matched) == ([7, 1], 2)  # a bigram only
    drafter.observe([8])
    assert (drafter.propose(2), drafter.matched) == ([], 0)
    copied = list(range(100, 200))
    drafter = lookup.drafter([*copied, 1, *copied[:80]])
    assert (drafter.propose(3), drafter.matched) == ([180, 181, 182], MATCH_WINDOW)  # measured up to the window


class QuietSource:
    """A test draft source: nothing to warm up or release."""

    free = True

    def warm_up(self):
        pass

    def close(self):
        pass


class QuietDrafter:
    """A test drafter: nothing to release."""

    matched = 0

    def close(self):
        pass


class ClassedGuesses(QuietSource):
    """A free source whose guesses are right after a long context match and wrong after a short one, as
    prompt lookup's are where a model copies its input (Drafter.matched alternates by position)."""

    name = "classed"

    def drafter(self, prompt, grammar=None):
        source = self

        class Drafter(QuietDrafter):
            def __init__(self):
                self.history = list(prompt)

            def observe(self, tokens):
                self.history.extend(tokens)

            def propose(self, limit):
                self.matched = 32 if (len(self.history) // 8) % 2 else 2
                right = source.truth(self.history)
                return right[:limit] if self.matched == 32 else [ord("#")] * limit
        return Drafter()

    def truth(self, history):
        return [ord("a") + (len(history) + i) % 26 for i in range(16)]


def alphabet_rule(history):
    logits = [-math.inf] * N_VOCAB
    logits[ord("a") + len(history) % 26] = 0.0
    return logits


def test_guesses_after_a_long_match_learn_their_own_acceptance_and_draft_where_short_ones_do_not():
    """One acceptance for all a source's guesses would average the two kinds (about half accepted) and draft
    neither on a machine where a draft costs 0.3 of a step: each match class learns its own."""
    speculation = Speculation(ClassedGuesses(), max_draft=8, cost=FrozenCost(per_token=0.3))
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    usage = [generate("x" * 20, params, speculation, rule=alphabet_rule)[0].finish.usage for _ in range(2)]
    assert usage[0].draft_tokens > 100 and usage[0].accepted_draft_tokens > 0.95 * usage[0].draft_tokens
    assert usage[1].draft_tokens > 100 and usage[1].accepted_draft_tokens == usage[1].draft_tokens, \
        "the second request starts from what the first taught each class: only long matches are verified"
    acceptance = [estimate.value for estimate in speculation._records["classed"].by_class]
    assert acceptance[match_class(32)] > 0.9 and acceptance[match_class(2)] < 0.1


class AlphabetGuesses(QuietSource):
    """A free source that guesses up to `length` tokens of alphabet_rule's text, right or all wrong: Il
    Suggeritore's few forced tokens, or the Palimpsest's copy of a whole repeated answer."""

    def __init__(self, name, length, matched, right=True):
        self.name, self.length, self.matched, self.right = name, length, matched, right

    def drafter(self, prompt, grammar=None):
        source = self

        class Drafter(QuietDrafter):
            matched = source.matched

            def __init__(self):
                self.history = list(prompt)

            def observe(self, tokens):
                self.history.extend(tokens)

            def propose(self, limit):
                n = min(limit, source.length)
                return ClassedGuesses().truth(self.history)[:n] if source.right else [ord("#")] * n

        return Drafter()


LONG_GREEDY = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.mark.parametrize("copy_right", [True, False])
def test_free_sources_offering_at_once_are_weighed_not_taken_in_order(copy_right):
    """The first source's two sure tokens do not displace a copy worth eight; a copy that is wrong does not
    displace them for long; the source not taken still learns from its guesses as the text is emitted."""
    forced = AlphabetGuesses("forced", 2, matched=0)
    copy = AlphabetGuesses("copy", 16, matched=32, right=copy_right)
    speculation = Speculation(forced, copy, max_draft=8, cost=FrozenCost(per_token=0.3))
    plain, _ = generate("x" * 20, LONG_GREEDY, rule=alphabet_rule)
    fast, _ = generate("x" * 20, LONG_GREEDY, speculation, rule=alphabet_rule)
    assert fast.tokens == plain.tokens
    drafted = {name: counts.drafted for name, counts in speculation.stats.snapshot().sources.items()}
    if copy_right:
        assert drafted.get("forced", 0) == 0 and drafted["copy"] > 150
    else:
        assert drafted["forced"] > 100 and drafted.get("copy", 0) <= 16, \
            "a long match is believed at first (CLASS_PRIORS): a draft or two, then its class learned it is wrong"
    acceptance = speculation.acceptance()
    assert acceptance["forced"] > 0.9 and (acceptance["copy"] > 0.9) == copy_right


GREEDY = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)


@pytest.mark.parametrize("per_token", [0.0, 0.3])
def test_greedy_output_is_identical_with_and_without_speculation(per_token):
    plain, plain_backend = generate(COPY_TEXT * 3, GREEDY)
    speculation = Speculation(PromptLookup(), max_draft=6, cost=FrozenCost(per_token))
    fast, fast_backend = generate(COPY_TEXT * 3, GREEDY, speculation)
    assert fast.tokens == plain.tokens
    assert fast.finish.usage.accepted_draft_tokens > 60
    assert len(fast_backend.decode_calls) < len(plain_backend.decode_calls) / 2
    assert speculation.stats.snapshot().sources["lookup"].accepted == fast.finish.usage.accepted_draft_tokens


def test_stop_strings_max_tokens_and_end_of_text_hold_inside_an_accepted_run():
    speculation = Speculation(PromptLookup(), max_draft=8, cost=FrozenCost())
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    result, _ = generate(COPY_TEXT * 3, params, speculation)
    assert len(result.tokens) == 37
    stopped, _ = generate(COPY_TEXT * 3, SamplingParams(temperature=0, max_tokens=200, stop=("dog",)),
                          Speculation(PromptLookup(), max_draft=8, cost=FrozenCost()))
    plain, _ = generate(COPY_TEXT * 3, SamplingParams(temperature=0, max_tokens=200, stop=("dog",)))
    assert stopped.text == plain.text and "dog" not in stopped.text


def test_several_sequences_speculate_in_one_batch_with_their_solo_outputs():
    prompts = [COPY_TEXT * 2, "abc abd abe abc abd ", "one two one two one "]
    solo = [generate(p, GREEDY)[0].tokens for p in prompts]
    backend = FakeBackend(n_ctx=4096, n_seq_max=3, n_batch=256, rule=copying_rule)
    engine = Engine(backend, speculation=Speculation(PromptLookup(), max_draft=4, cost=FrozenCost()))
    handles = [engine.submit(GenerationRequest(p, GREEDY)) for p in prompts]
    with engine:
        together = [h.result(timeout_s=10).tokens for h in handles]
    assert together == solo
    assert any(len({seq for _, _, seq, _ in call}) == 3 and len(call) > 3 for call in backend.decode_calls)


def test_a_whole_answer_verifies_its_first_drafts_in_its_prompts_step_a_streamed_one_does_not():
    """The lookup finds the prompt's end earlier in it: an answer nobody reads token by token gets those
    drafts after its prompt's last token, in the prefill's decode; a streamed one sends its first token
    first. Both answers are the plain one."""
    prompt = COPY_TEXT * 3
    plain, _ = generate(prompt, GREEDY)
    whole, whole_backend = generate(prompt, GREEDY, Speculation(PromptLookup(), max_draft=6, cost=FrozenCost()))
    streamed_request = GenerationRequest(prompt, GREEDY, streamed=True)
    backend = FakeBackend(n_ctx=4096, n_seq_max=1, n_batch=256, rule=copying_rule)
    with Engine(backend, speculation=Speculation(PromptLookup(), max_draft=6, cost=FrozenCost())) as engine:
        streamed = engine.generate(streamed_request)
    assert whole.tokens == streamed.tokens == plain.tokens
    n_prompt = len(whole_backend.tokenize(prompt))
    last = step_decoding(whole_backend, n_prompt - 1)  # the prompt's last token (alone: a long prompt's)
    assert [(position, output) for _, position, _, output in last] == [(n_prompt - 1 + n, True) for n in range(7)]
    assert [token for token, *_ in last[1:5]] == plain.tokens[:4]  # its first four drafts were the answer's
    assert len(step_decoding(backend, n_prompt - 1)) == 1  # the streamed answer's: alone
    assert len(step_decoding(backend, n_prompt)) == 1  # and its first token alone, as it is being sent


def test_drafts_rejected_in_the_prompts_step_leave_the_kv_with_the_prompt_and_what_was_emitted():
    source = AlwaysDraft(ord("q"))  # never what the copying model writes
    prompt = COPY_TEXT * 2
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain, _ = generate(prompt, params)
    backend = FakeBackend(n_ctx=4096, n_batch=256, rule=copying_rule)
    with Engine(backend, speculation=Speculation(source, max_draft=4, cost=FrozenCost())) as engine:
        result = engine.generate(GenerationRequest(prompt, params))
        held = backend.kv_tokens(0)
    n_prompt = len(backend.tokenize(prompt))
    assert result.tokens == plain.tokens
    assert len(step_decoding(backend, n_prompt - 1)) == 5 and result.finish.usage.accepted_draft_tokens == 0
    assert held == backend.tokenize(prompt) + result.tokens[:4]  # the last token is never decoded


def test_the_kv_holds_exactly_the_emitted_tokens_after_rejections():
    speculation = Speculation(PromptLookup(), max_draft=8, cost=FrozenCost())
    prompt = COPY_TEXT + "zzz " + COPY_TEXT
    backend = FakeBackend(n_ctx=4096, n_batch=256, rule=copying_rule)
    with Engine(backend, speculation=speculation) as engine:
        result = engine.generate(GenerationRequest(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=80)))
        held = backend.kv_tokens(0)
    assert held == backend.tokenize(prompt) + result.tokens[:len(held) - len(backend.tokenize(prompt))]
    assert len(held) >= len(backend.tokenize(prompt)) + len(result.tokens) - 1


def fixed_distribution_rule(probabilities):
    logits = [-math.inf] * N_VOCAB
    for token, p in probabilities.items():
        logits[token] = math.log(p)
    return lambda history: logits


class AlwaysDraft(QuietSource):
    """A source that always proposes the same token: accepted with probability p(token)."""

    name = "always"

    def __init__(self, token):
        self.token = token

    def drafter(self, prompt, grammar=None):
        token = self.token

        class Drafter(QuietDrafter):
            def observe(self, tokens):
                pass

            def propose(self, limit):
                return [token] * limit
        return Drafter()


P = {ord("a"): 0.5, ord("b"): 0.3, ord("c"): 0.2}
CHI_SQUARE_P001 = 13.8  # 2 degrees of freedom, p = 0.001


def speculated_draws(speculation, **engine):
    """6,000 draws with temperature 1 from the fixed distribution P, c always drafted: counts and
    (drafted, accepted)."""
    params = SamplingParams(temperature=1.0, max_tokens=2000, ignore_eos=True)
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(3):
        result, _ = generate("x", SamplingParams(**{**params.__dict__, "seed": seed}), speculation,
                             rule=fixed_distribution_rule(P), **engine)
        counts.update(result.tokens)
        drafted += result.finish.usage.draft_tokens
        accepted += result.finish.usage.accepted_draft_tokens
    return counts, drafted, accepted


def chi_square(counts):
    total = sum(counts.values())
    return sum((counts[token] - total * share) ** 2 / (total * share) for token, share in P.items())


def test_sampled_output_follows_the_models_distribution_exactly():
    """Chi-square goodness of fit of 6,000 speculated draws against p, with a fixed seed."""
    speculation = Speculation(AlwaysDraft(ord("c")), max_draft=4, cost=FrozenCost())
    counts, drafted, accepted = speculated_draws(speculation)
    assert set(counts) == set(P) and sum(counts.values()) == 6000
    assert chi_square(counts) < CHI_SQUARE_P001, f"chi-square {chi_square(counts):.1f}: {counts}"
    first = speculation.stats.snapshot()
    assert drafted > 3000 and accepted > 300
    assert 0.17 < first.accepted_at[1] / first.drafted_at[1] < 0.23, "a first draft of c passes with p(c)"


class ForcingBackend(FakeBackend):
    """Samples as usual, except that the rows listed in `forced` come out as the token given there."""

    forced: dict[int, int] = {}

    def sample(self, sampler, index):
        token = super().sample(sampler, index)
        return self.forced.get(index, token)


REAL_VERIFY = step.verify


def accept_everything(backend, draw, top):
    """A broken verifier: every draft is kept, whatever the model would have drawn."""
    backend.forced = {draw.row + row: token for row, token in enumerate(draw.drafts)}
    try:
        return REAL_VERIFY(backend, draw, top)
    finally:
        backend.forced = {}


def test_the_same_test_fails_a_verifier_that_accepts_every_draft(monkeypatch):
    """The test above has teeth: run through a verifier that keeps every draft, c shows far too often."""
    monkeypatch.setattr(step, "verify", accept_everything)
    speculation = Speculation(AlwaysDraft(ord("c")), max_draft=4, cost=FrozenCost())
    counts, drafted, accepted = speculated_draws(speculation, backend_class=ForcingBackend)
    assert accepted == drafted > 3000
    assert counts[ord("c")] > 2 * 0.2 * 6000 and chi_square(counts) > 100 * CHI_SQUARE_P001


def test_the_controller_switches_off_for_useless_drafts_and_back_on_when_they_pay():
    cost = CostModel()
    for n in range(1, 10):  # a CPU: each extra token costs 30% of a step
        measured(cost, n, 0.1 * (1 + 0.3 * (n - 1)))
    controller = DraftController(max_draft=8)
    assert controller.draft_length(cost, 1) > 0, "a 0.6 acceptance prior pays"
    for _ in range(6):
        controller.verified(controller.draft_length(cost, 1) or 2, 0)
    assert controller.draft_length(cost, 1) == 0, "nothing accepted: off"
    lengths = [controller.draft_length(cost, 1) for _ in range(REPROBE_STEPS)]
    assert sorted(lengths) == [0] * (REPROBE_STEPS - 1) + [1], "re-probed once: never off for good"
    for _ in range(8):
        k = controller.draft_length(cost, 1) or 1
        controller.verified(k, k)
    assert controller.draft_length(cost, 1) >= 4, "drafts that all pass earn longer drafts"


def test_a_free_source_is_never_probed_it_learns_from_the_guesses_it_did_not_verify():
    cost = CostModel()
    for n in range(1, 10):
        measured(cost, n, 0.1 * (1 + 0.3 * (n - 1)))
    controller = DraftController(max_draft=8, probes=False)
    for _ in range(6):
        controller.verified(4, 0)
    assert [controller.draft_length(cost, 1) for _ in range(10 * REPROBE_STEPS)] == [0] * 10 * REPROBE_STEPS
    for _ in range(3):  # guesses the model then emitted, checked for free
        controller.verified(8, 8)
    assert controller.draft_length(cost, 1) > 0


@pytest.mark.parametrize("rule, learned", [(copying_rule, "good"), (default_rule, "bad")])
def test_prompt_lookup_acceptance_is_measured_without_spending_a_step(rule, learned):
    """Drafts cost a whole step here, so none pays: no draft is verified, yet the lookup's
    acceptance follows what the model emitted after each guess."""
    speculation = Speculation(PromptLookup(), max_draft=8, cost=FrozenCost(per_token=1.0))
    result, _ = generate(COPY_TEXT * 2, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                         speculation, rule=rule)
    assert result.finish.usage.draft_tokens == 0
    acceptance = speculation.acceptance()["lookup"]
    assert acceptance > 0.9 if learned == "good" else acceptance < 0.1


def test_expected_tokens_and_the_measured_step_costs():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    cost = CostModel()
    assert step_seconds(cost, 3) is None
    cost.observe(1, 0.05)
    assert step_seconds(cost, 3) is None, "a size's first step is not counted: its graph was built then"
    cost.observe(1, 0.04)
    assert step_seconds(cost, 5) == pytest.approx(0.04 * 3), "one size known: extra tokens cost half of it"
    measured(cost, 4, 0.08, 0.18, 0.10)
    assert step_seconds(cost, 4) == pytest.approx(0.10), "the median of the size's recent steps"
    assert step_seconds(cost, 7) == pytest.approx(0.1 + 0.02 * 3), "beyond: the line through what was measured"
    assert step_seconds(cost, 1) == 0.04


def test_a_step_slowed_by_a_neighbour_does_not_set_the_curve_a_lasting_change_does():
    """On two cores a step whose second thread waited for the core can take 20 times its cost: one such step
    leaves a size's cost where it was (so drafts are not judged against a one-row step that seemed to take 1.2 s,
    in this process or, remembered, the next), and a machine that stays slower is followed within a few steps."""
    cost = CostModel()
    measured(cost, 1, 0.05, 0.05, 0.05)
    cost.observe(1, 1.2)
    assert step_seconds(cost, 1) == pytest.approx(0.05)
    for _ in range(COST_SAMPLES // 2 + 1):
        cost.observe(1, 0.08)
    assert step_seconds(cost, 1) == pytest.approx(0.08)
    seeded = CostModel()
    seeded.seed({1: 1.2})
    measured(seeded, 1, 0.05, 0.05)
    assert step_seconds(seeded, 1) == pytest.approx(0.05), "a remembered outlier is one vote, outvoted"


def test_a_remembered_step_far_dearer_than_its_rows_one_by_one_is_not_believed():
    """A size a neighbour slowed when it was last measured would look too dear to draft for, and so never be
    measured again: past twice its rows' one-row cost it is estimated from the other sizes instead."""
    cost = CostModel()
    cost.seed({1: 0.01, 2: 1.6, 4: 0.03, 8: 0.16})
    assert cost.snapshot() == {1: 0.01, 4: 0.03, 8: 0.16}
    assert step_seconds(cost, 2) < 0.03


def test_costs_below_every_measured_size_and_long_prefills_stay_sane():
    """The first decode after a short prompt knows only the prompt's step: no zero, no negative cost."""
    for prompt_tokens in (2, 3, 9, 40):
        cost = CostModel()
        measured(cost, prompt_tokens, 0.3)
        measured(cost, 500, 9.0)  # a long prefill is not modelled
        assert all(step_seconds(cost, n) > 0 for n in range(1, 40))
        assert DraftController(max_draft=16).draft_length(cost, 1) >= 0
    assert step_seconds(CostModel(), 1) is None


def test_penalised_requests_speculate_with_their_penalties_applied_token_by_token():
    """The chain samples on the CPU and records each draw before the next one, as without drafts."""
    speculation = Speculation(PromptLookup(), max_draft=4, cost=FrozenCost())
    params = SamplingParams(temperature=0, max_tokens=60, repeat_penalty=1.3, frequency_penalty=0.5,
                            repeat_last_n=8, ignore_eos=True)
    result, _ = generate(COPY_TEXT * 2, params, speculation)
    assert result.finish.usage.draft_tokens > 0
    assert result.tokens == generate(COPY_TEXT * 2, params)[0].tokens


def test_an_end_of_text_inside_drafts_ends_the_answer_like_plain_decoding():
    def ends_after_cat(history):
        logits = copying_rule(history)
        if bytes(t for t in history[-3:] if t < 256) == b"cat":
            logits = [-math.inf] * N_VOCAB
            logits[EOS] = 1.0
        return logits
    prompt = "a cat, a cat, a ca"
    plain, _ = generate(prompt, SamplingParams(temperature=0, max_tokens=50), rule=ends_after_cat)
    fast, _ = generate(prompt, SamplingParams(temperature=0, max_tokens=50),
                       Speculation(PromptLookup(), max_draft=6, cost=FrozenCost()), rule=ends_after_cat)
    assert fast.tokens == plain.tokens and fast.finish.reason == plain.finish.reason == "stop"


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=1, max_tokens=40)])
def test_the_engine_samples_on_the_cpu_never_inside_the_graph(params):
    """An attached chain measured slower on the CPU backend (see LlamaBackend.new_sampler)."""
    backend = FakeBackend(n_ctx=4096, n_batch=256, rule=copying_rule)
    with Engine(backend, speculation=Speculation(PromptLookup(), max_draft=4, cost=FrozenCost())) as engine:
        result = engine.generate(GenerationRequest(COPY_TEXT * 2, params))
    assert backend.sampler_seq_ids == [None]
    assert result.finish.usage.draft_tokens > 0


def test_only_decode_steps_teach_the_cost_model():
    """Prompt rows carry no logits: a prefill step would make long drafts look cheap."""
    class Recording(FrozenCost):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def observe(self, n_tokens, seconds):
            self.sizes.append(n_tokens)
    cost = Recording()
    generate(COPY_TEXT, GREEDY, Speculation(PromptLookup(), max_draft=4, cost=cost))
    assert cost.sizes and max(cost.sizes) <= 5 < len(COPY_TEXT)


def test_a_draft_beside_other_streams_must_pay_for_slowing_them_all():
    cost = CostModel()
    for n in range(1, 12):
        measured(cost, n, 0.1 * (1 + 0.3 * (n - 1)))  # each extra row costs 30% of a one-token step
    alone = DraftController(max_draft=8, prior=0.6)
    crowded = DraftController(max_draft=8, prior=0.6)
    assert alone.draft_length(cost, 1, batch_yield=1) > 0
    assert crowded.draft_length(cost, 4, batch_yield=4) == 0, "(3 + E) / 4 tokens for a 16% longer step: a loss"
    assert DraftController(max_draft=8, prior=0.98).draft_length(cost, 4, batch_yield=4) > 0


def test_a_size_measured_too_slow_once_is_forgotten_and_tried_again():
    cost = CostModel()
    measured(cost, 1, 0.1)
    measured(cost, 2, 0.5)  # a hiccup: drafting one token now looks five times as dear
    controller = DraftController(max_draft=1, prior=0.95, probes=False)
    assert controller.draft_length(cost, 1) == 0
    for _ in range(COST_MEMORY_STEPS + 1):
        cost.observe(1, 0.1)  # plain steps go on; size 2 is never used, so never measured again
    assert step_seconds(cost, 2) == pytest.approx(0.15), "forgotten: estimated from one-token steps again"
    assert controller.draft_length(cost, 1) > 0


def test_an_unmeasured_longer_draft_is_tried_once_when_even_its_least_cost_would_pay_much_more():
    cost = CostModel()
    for n in range(1, 9):
        measured(cost, n, 0.1 * n)  # up to 8 tokens, every token costs a whole step: no draft pays
    controller = DraftController(max_draft=16, prior=0.95, probes=False)
    k = controller.draft_length(cost, 1)
    assert k == 15, "16 tokens could cost as little as 8: worth one try (no further than twice 8 yet)"
    measured(cost, 16, 0.5)  # it did not: 16 tokens for five one-token steps
    assert controller.draft_length(cost, 1) == 15, "measured, it pays: kept"
    poor = DraftController(max_draft=16, prior=0.1, probes=False)
    assert poor.draft_length(cost, 1) == 0, "drafts that fail are not tried at any length"


def test_exploring_climbs_from_short_steps_so_a_wrong_prior_costs_a_short_step():
    """A fresh server knows only one-row steps: a 0.6 prior would gain 2.5x at a 16-row step's least cost,
    but the first try is a 2-row step, and once drafts fail nothing longer is explored."""
    cost = CostModel()
    measured(cost, 1, 0.065)
    controller = DraftController(max_draft=16, prior=0.6, probes=False)
    assert controller.draft_length(cost, 1) == 1
    measured(cost, 2, 0.1)
    controller.verified(1, 0)
    controller.verified(1, 0)
    assert controller.draft_length(cost, 1) == 0
    assert DraftController(max_draft=16, prior=0.95, probes=False).draft_length(cost, 1) == 3, "twice 2 rows"


def test_a_guess_is_weighed_at_its_own_length_and_exploring_never_plans_past_it():
    """A copying source's guess may be shorter than the best draft the curve allows. Weighed at the planned
    length, a 3-token guess was verified where only a 16-token one would pay; and an exploration of a 31-row
    step was granted to guesses of 10 (SmolLM2-135M, JSON triage: 38 of 140 verifications, re-explored at every
    one since the size they were for was never measured)."""
    cost = CostModel()
    for n in range(1, 17):
        measured(cost, n, 0.01 + 0.001 * (n - 1))
    controller = DraftController(max_draft=30, prior=0.99, probes=False)
    assert controller.draft_length(cost, 1) == 30, "a 31-row step was never measured: explored"
    assert controller.draft(cost, 1, longest=20)[0] == 20, "with a 20-token guess: a 21-row step explored"
    dear = CostModel()
    measured(dear, 1, 0.01)
    for n in range(2, 17):
        measured(dear, n, 0.05)
    controller = DraftController(max_draft=15, prior=0.99, probes=False)
    assert controller.draft_length(dear, 1) == 15
    assert controller.draft(dear, 1, longest=3)[0] == 0, "3 drafts in a step as dear as 15 do not pay"


def kept_in(memory: dict) -> CostMemory:
    """A cost memory held in `memory["text"]`, as the model facts file holds it between processes."""
    return CostMemory(lambda: memory.get("text"), lambda text: memory.__setitem__("text", text))


def test_step_costs_measured_by_one_process_start_the_next_one():
    memory: dict = {}
    first = Speculation(PromptLookup(), max_draft=4, cost_memory=kept_in(memory))
    first.warm_up()
    measured(first.rowwise_cost, 1, 0.040, 0.040)
    measured(first.rowwise_cost, 3, 0.110)
    measured(first.cost, 2, 0.070)
    first.close()
    second = Speculation(PromptLookup(), max_draft=4, cost_memory=kept_in(memory))
    assert second.rowwise_cost.curve(1, 3) is None, "seeded at warm-up, on the engine thread"
    second.warm_up()
    assert second.rowwise_cost.snapshot() == {1: 0.040, 3: 0.110} and second.cost.snapshot() == {2: 0.070}
    second.rowwise_cost.observe(3, 9.0)
    assert second.rowwise_cost.snapshot()[3] == 0.110, "a size's first step in a process builds its graph"
    second.rowwise_cost.observe(3, 0.120)
    assert second.rowwise_cost.snapshot()[3] == pytest.approx(0.115), "the remembered time is one of its samples"
    for _ in range(COST_MEMORY_STEPS + 1):
        second.rowwise_cost.observe(1, 0.040)
    assert 3 not in second.rowwise_cost.snapshot(), "a remembered size no step uses is forgotten like any"
    memory["text"] = json.dumps({"rowwise": {"1": 0.040, "3": 0.110, "5": 0.2}})  # another process kept size 5
    second.close()
    assert json.loads(memory["text"])["rowwise"] == {"1": 0.040, "5": 0.2}, "and the memory forgets it too"


def test_short_processes_forget_a_remembered_size_none_of_them_measures():
    """A size whose remembered time looks too dear is never drafted for, so never measured again: a time one
    noisy process left (Qwen2.5-Coder-1.5B's 26 rows at 1.26 s beside 25 at 0.66) outlived every server of a
    benchmark, each running fewer steps than COST_MEMORY_STEPS. Steps are counted over the processes."""
    memory = {"text": json.dumps({"rowwise": {"1": 0.040, "26": 1.26}})}
    steps_each = COST_MEMORY_STEPS // 3
    kept_after = []
    for _ in range(4):
        process = Speculation(PromptLookup(), max_draft=4, cost_memory=kept_in(memory))
        process.warm_up()
        for _ in range(steps_each):
            process.rowwise_cost.observe(1, 0.040)
        process.close()
        kept_after.append(sorted(json.loads(memory["text"])["rowwise"]))
    assert kept_after == [["1", "26"], ["1", "26"], ["1", "26"], ["1"]]
    assert json.loads(memory["text"])["ages"]["rowwise"] == {"1": 0}


def test_a_remembered_curve_spares_a_new_process_exploring_sizes_that_do_not_pay():
    """On two AMD cores each row of a step costs about 0.9 of a one-row step, so no draft of a 0.75
    acceptance pays; a process that must find that out tries longer steps first (3-20% lost on each of a
    fresh Qwen2.5-Coder-1.5B server's first summaries); one that remembers the curve does not."""
    times = {n: 0.040 * (1 + 0.9 * (n - 1)) for n in range(1, 18)}
    memory = {"text": json.dumps({"rowwise": times})}
    remembering = Speculation(PromptLookup(), max_draft=16, cost_memory=kept_in(memory))
    remembering.warm_up()
    fresh = Speculation(PromptLookup(), max_draft=16)
    measured(fresh.rowwise_cost, 1, 0.040)
    controller = DraftController(max_draft=16, prior=0.75, probes=False)
    assert controller.draft_length(remembering.rowwise_cost, 1) == 0
    assert controller.draft_length(fresh.rowwise_cost, 1) > 0


@pytest.mark.parametrize("text", ["{", "[1]", '{"rowwise": [1]}', '{"rowwise": {"x": 0.1}}', '{"rowwise": {"1": []}}',
                                  '{"rowwise": {"1": "nan", "2": -1, "3": 1e9, "0": 0.1, "999": 0.1, "4": 0.2}}',
                                  '{"rowwise": {"4": 0.2}, "ages": {"rowwise": {"4": -5, "x": 1, "7": 3}}}',
                                  '{"rowwise": {"4": 0.2}, "ages": {"rowwise": {"4": 1e999}}}',
                                  '{"rowwise": {"4": 0.2}, "ages": [1]}',
                                  '{"rowwise": {"4": 0.2}, "ages": {"rowwise": 3}}',
                                  '{"rowwise": {"' + "9" * 5000 + '": 0.1}}', "[" * 100_000 + "]" * 100_000])
def test_a_remembered_curve_is_read_as_the_hostile_input_it_may_be(text):
    """A file in the cache directory is input: what cannot be a step's size and time is not believed, the
    rest seeds the curve, and what the process keeps is well formed again."""
    memory = {"text": text}
    speculation = Speculation(PromptLookup(), max_draft=4, cost_memory=kept_in(memory))
    speculation.warm_up()
    assert all(1 <= n <= MODELLED_TOKENS and 0 < t < 60 for n, t in speculation.rowwise_cost.snapshot().items())
    assert speculation.rowwise_cost.snapshot() in ({}, {4: 0.2})
    speculation.close()
    assert json.loads(memory["text"])["rowwise"] in ({}, {"4": 0.2})


@pytest.mark.parametrize("matched, drafts", [(32, 10), (2, 0)])
def test_a_fresh_process_drafts_a_long_match_at_once_and_a_short_one_not(matched, drafts):
    """After a restart the Palimpsest's copy of a repeated answer (a match of 16 tokens or more) is drafted
    from its first step, where a 17-row exact step costs about ten one-row steps (AMD EPYC); a 2-token
    match's guess is only checked against what the model emits."""
    speculation = Speculation(AlphabetGuesses("copy", 16, matched=matched), max_draft=16, cost=FrozenCost(0.6))
    draftings = speculation.start([ord("x")] * 20)
    assert len(speculation.propose(draftings, 1, 1, 16)[1]) == drafts  # 10: the best length at 0.99 there
