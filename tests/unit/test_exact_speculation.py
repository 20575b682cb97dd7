"""Greedy means greedy: on a backend whose batched kernels round differently (as llama.cpp's tiled CPU kernels
do past 3 rows on Q4_K_M files), drafts never change a greedy or seeded answer, and a source whose drafts all
fail costs a bounded share of the answer's time."""

import math

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model import sampling
from reame.model.batch_numerics import exact_batch_rows
from reame.speculative import CostModel, PromptLookup, Speculation
from tests.fakes.backend import BATCH_NOISE, N_VOCAB, FakeBackend
from tests.unit.test_speculative import COPY_TEXT, FrozenCost

EXACT_ROWS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.3, seed=11, max_tokens=150, ignore_eos=True)


def near_tie_copying_rule(history):
    """Continues what followed the last occurrence of the last two tokens, as a copying head does, with a
    rival token nearly tied at every fifth position: a batched row there picks the rival."""
    for start in range(len(history) - 3, -1, -1):
        if history[start:start + 2] == history[-2:]:
            logits = [-math.inf] * N_VOCAB
            logits[history[start + 2]] = 5.0
            rival = ord("q") if history[start + 2] != ord("q") else ord("x")
            logits[rival] = 5.0 - BATCH_NOISE / 2 if len(history) % 5 == 0 else 1.0
            return logits
    logits = [0.0] * N_VOCAB
    logits[ord(" ")] = 3.0
    return logits


def backend(n_seq_max=1):
    fake = FakeBackend(n_ctx=4096, n_seq_max=n_seq_max, n_batch=256, rule=near_tie_copying_rule)
    fake.exact_rows = EXACT_ROWS
    return fake


def measured_speculation(fake, source=None, cost=None, rowwise=False):
    """Speculation as assembly builds it: the exact batch size measured on the engine thread at warm-up."""
    return Speculation(source or PromptLookup(), max_draft=8, cost=cost or FrozenCost(),
                       measure_exact_rows=lambda: exact_batch_rows(fake, 9, rowwise=rowwise))


def answers(params, prompts, speculate, measure=True, n_seq_max=1, rowwise=False):
    fake = backend(n_seq_max)
    speculation = None
    if speculate:
        speculation = measured_speculation(fake, rowwise=rowwise) if measure else \
            Speculation(PromptLookup(), max_draft=8, cost=FrozenCost())
    with Engine(fake, speculation=speculation, rowwise=rowwise).start() as engine:
        fake.decode_calls.clear()  # the warm-up's and the probe's
        fake.rowwise_calls.clear()
        handles = engine.submit_together([GenerationRequest(prompt, params) for prompt in prompts])
        results = [handle.result(timeout_s=20) for handle in handles]
    return results, fake


def generating_rows(fake):
    """The rows of each decode that carried no prompt chunk."""
    return [len(call) for call in fake.decode_calls if all(output for *_, output in call)]


def test_the_probe_finds_the_largest_exact_batch_and_leaves_the_kv_empty():
    fake = backend()
    assert exact_batch_rows(fake, 9) == EXACT_ROWS
    assert fake.kv_tokens(0) == []
    fake.exact_rows = None
    assert exact_batch_rows(fake, 9) == 9
    fake.exact_rows = 1
    assert exact_batch_rows(fake, 9) == 1


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_leave_a_reproducible_answer_unchanged_where_batches_round_differently(params):
    plain, _ = answers(params, [COPY_TEXT * 3], speculate=False)
    fast, fake = answers(params, [COPY_TEXT * 3], speculate=True)
    assert fast[0].text == plain[0].text
    assert fast[0].finish.usage.accepted_draft_tokens > 40
    assert max(generating_rows(fake)) == EXACT_ROWS


def test_the_same_check_fails_when_drafts_may_fill_bigger_batches():
    plain, _ = answers(GREEDY, [COPY_TEXT * 3], speculate=False)
    unbounded, _ = answers(GREEDY, [COPY_TEXT * 3], speculate=True, measure=False)
    assert unbounded[0].text != plain[0].text


def test_an_unseeded_sampled_answer_still_drafts_past_the_exact_size(monkeypatch):
    # The request has no seed (it promises no particular answer); the seed the engine then draws is fixed
    # here so that the sample copies the text (some draws leave it early, and nothing is left to draft).
    monkeypatch.setattr(sampling.random, "randrange", lambda *_: 0)
    _, fake = answers(SamplingParams(temperature=0.9, max_tokens=150, ignore_eos=True), [COPY_TEXT * 3],
                      speculate=True)
    assert max(generating_rows(fake)) > EXACT_ROWS


def test_streams_decoded_together_keep_their_answers_with_drafts_within_the_exact_size():
    prompts = [COPY_TEXT * 3, "one two three four " * 6]
    plain, _ = answers(GREEDY, prompts, speculate=False, n_seq_max=2)
    fast, fake = answers(GREEDY, prompts, speculate=True, n_seq_max=2)
    assert [r.text for r in fast] == [r.text for r in plain]
    assert sum(r.finish.usage.accepted_draft_tokens for r in fast) > 20
    assert max(generating_rows(fake)) <= EXACT_ROWS


def test_row_by_row_every_probed_size_is_exact():
    fake = backend()
    assert exact_batch_rows(fake, 9, rowwise=True) == 9
    assert fake.kv_tokens(0) == []


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_row_by_row_steps_verify_more_drafts_and_leave_the_answer_unchanged(params):
    plain, _ = answers(params, [COPY_TEXT * 3], speculate=False)
    fast, fake = answers(params, [COPY_TEXT * 3], speculate=True, rowwise=True)
    assert fast[0].text == plain[0].text
    assert max(generating_rows(fake)) > EXACT_ROWS
    assert fast[0].finish.usage.accepted_draft_tokens > 60
    generating = [(len(call), rowwise) for call, rowwise in zip(fake.decode_calls, fake.rowwise_calls)
                  if all(output for *_, output in call)]
    assert generating[0] == (1, False)  # the prompt's last token, decoded alone: a prompt row
    assert any(rows > 1 for rows, _ in generating) and all(rowwise for rows, rowwise in generating if rows > 1)
    assert not any(rowwise for rows, rowwise in generating if rows == 1), "one row alone: ggml's own one-row step"


def test_row_by_row_an_answer_is_the_same_alone_or_beside_another():
    prompts = [COPY_TEXT * 3, "one two three four " * 6]
    alone = [answers(GREEDY, [prompt], speculate=False)[0][0].text for prompt in prompts]
    together, fake = answers(GREEDY, prompts, speculate=True, n_seq_max=2, rowwise=True)
    assert [r.text for r in together] == alone
    assert max(generating_rows(fake)) > EXACT_ROWS


def test_a_step_that_carries_prompt_rows_is_not_computed_row_by_row():
    _, fake = answers(GREEDY, [COPY_TEXT * 3], speculate=True, rowwise=True)
    with_prompt = [rowwise for call, rowwise in zip(fake.decode_calls, fake.rowwise_calls)
                   if not all(output for *_, output in call)]
    assert with_prompt and not any(with_prompt)


def test_a_sampled_answer_alone_is_not_computed_row_by_row(monkeypatch):
    monkeypatch.setattr(sampling.random, "randrange", lambda *_: 0)
    _, fake = answers(SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True), [COPY_TEXT * 3],
                      speculate=True, rowwise=True)
    assert fake.rowwise_calls and not any(fake.rowwise_calls)


def test_until_the_size_is_measured_a_greedy_answer_drafts_nothing():
    fake = backend()
    speculation = Speculation(PromptLookup(), max_draft=8, cost=FrozenCost(), measure_exact_rows=lambda: 1)
    with Engine(fake, speculation=speculation).start() as engine:
        fake.decode_calls.clear()
        result = engine.generate(GenerationRequest(COPY_TEXT * 3, GREEDY))
    assert result.finish.usage.accepted_draft_tokens == 0
    assert set(generating_rows(fake)) == {1}


# --- a source whose every draft fails ---------------------------------------------------------------------

QWEN_STEP_SECONDS = {1: 0.041, 2: 0.061, 3: 0.070, 4: 0.076, 5: 0.11, 6: 0.12, 7: 0.14, 8: 0.163, 9: 0.17}
CHEAP_STEP_SECONDS = {n: 0.01 * (1 + 0.05 * (n - 1)) for n in range(1, 10)}  # drafts look almost free


class MeasuredCost(CostModel):
    """A machine with these step costs, as the engine would have measured them."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        for n, value in seconds.items():
            super().observe(n, value)
            super().observe(n, value)

    def observe(self, n_tokens, seconds):
        pass


class AlwaysWrong:
    """A draft source whose guesses the model never takes."""

    name = "wrong"
    matched = 0

    def __init__(self, free):
        self.free = free

    def drafter(self, prompt, grammar=None):
        return self

    def observe(self, tokens):
        pass

    def propose(self, limit):
        return [ord("#")] * limit

    def close(self):
        pass

    def warm_up(self):
        pass


@pytest.mark.parametrize("free", [True, False], ids=["free source", "computed source"])
@pytest.mark.parametrize("seconds", [QWEN_STEP_SECONDS, CHEAP_STEP_SECONDS], ids=["qwen-1.5b", "cheap drafts"])
def test_a_source_whose_drafts_always_fail_costs_at_most_five_percent_of_an_answer(free, seconds):
    fake = FakeBackend(n_ctx=4096, n_batch=256)
    speculation = Speculation(AlwaysWrong(free), max_draft=8, cost=MeasuredCost(seconds))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with Engine(fake, speculation=speculation) as engine:
        for _ in range(3):  # later requests start from what the source achieved lately
            fake.decode_calls.clear()
            result = engine.generate(GenerationRequest("write something", params))
            decode_rows = [len(call) for call in fake.decode_calls[1:]]
            spent = sum(seconds[n] for n in decode_rows)
            plain = (len(result.tokens) - 1) * seconds[1]
            assert result.finish.usage.accepted_draft_tokens == 0
            assert spent <= 1.05 * plain, f"{spent / plain:.3f}x the plain decode's time"
