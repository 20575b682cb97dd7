"""The Conclave on FakeBackend: one prefill for N attempts, the election rules, early stop."""

import math

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.conclave import Election, answer_key, attempts, convene, medoid, numbers, similarity
from tests.fakes.backend import EOS, N_VOCAB, FakeBackend
from tests.waiting import wait_until

PROMPT = "Read the document and answer: what is the total? " * 2


def prompt_rows(backend: FakeBackend, length: int) -> int:
    """Rows that fed prompt positions (every decode row below the prompt's length). A long prompt's last token is
    fed twice: with the others, then alone (engine/step.py, plan_step)."""
    return sum(1 for call in backend.decode_calls for _, position, _, _ in call if position < length)


def alone(prompt: str, params: SamplingParams) -> list[int]:
    with Engine(FakeBackend()) as engine:
        return engine.generate(GenerationRequest(prompt, params)).tokens


def together(backend, params, before_start=lambda handles: None, prompt=PROMPT):
    """Requests with one prompt queued before the engine starts (so they are admitted in one step): their
    handles and results."""
    engine = Engine(backend)
    handles = [engine.submit(GenerationRequest(prompt, p)) for p in params]
    before_start(handles)
    engine.start()
    try:
        return handles, [handle.result(timeout_s=10) for handle in handles]
    finally:
        engine.close()


def test_identical_prompts_arriving_together_are_prefilled_once_and_answer_as_if_alone():
    params = [SamplingParams(temperature=0.9, max_tokens=30, seed=seed, ignore_eos=True) for seed in range(4)]
    backend = FakeBackend(n_seq_max=4, n_ctx=2048)
    handles, results = together(backend, params)
    length = len(handles[0].prompt_tokens)
    assert prompt_rows(backend, length) == length + 1
    assert [r.tokens for r in results] == [alone(PROMPT, p) for p in params]
    assert [r.finish.usage.cached_tokens for r in results] == [0, length, length, length]


class CancellingBackend(FakeBackend):
    """Cancels a handle right after the decode call number `at` (in the engine thread, between steps)."""

    def __init__(self, at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.handle = at, None

    def decode(self, *args, **kwargs) -> int:
        status = super().decode(*args, **kwargs)
        if len(self.decode_calls) == self.at and self.handle is not None:
            self.handle.cancel()
        return status


def test_a_leader_cancelled_mid_prefill_hands_what_it_computed_to_a_follower():
    backend = CancellingBackend(at=1, n_seq_max=3, n_batch=16, n_ctx=2048)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    handles, results = together(backend, [greedy] * 3, lambda handles: setattr(backend, "handle", handles[0]))
    length = len(handles[0].prompt_tokens)
    assert results[0].finish.reason == "cancelled"
    assert results[1].tokens == results[2].tokens == alone(PROMPT, greedy)
    assert prompt_rows(backend, length) == length + 1  # the heir went on from the leader's first chunk
    assert backend.kv_tokens(0) == []


def test_a_request_arriving_while_another_decodes_shares_the_kv_of_their_common_start():
    document = "a long document about totals and counts. " * 4
    backend = FakeBackend(n_seq_max=2, n_ctx=2048)
    long_answer = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    with Engine(backend) as engine:
        first = engine.submit(GenerationRequest(document + "first question?", long_answer))
        next(first.events(timeout_s=10))
        fed_before = len(backend.decode_calls)
        second = engine.submit(GenerationRequest(document + "second question?", SamplingParams(temperature=0,
                                                                                               max_tokens=5)))
        result = second.result(timeout_s=10)
        first.cancel()
    rows = sum(1 for call in backend.decode_calls[fed_before:] for _, _, seq, output in call if seq == 1)
    assert result.finish.usage.cached_tokens == len(backend.tokenize(document))
    assert rows == len(second.prompt_tokens) - result.finish.usage.cached_tokens + len(result.tokens) - 1
    assert result.tokens == alone(document + "second question?", SamplingParams(temperature=0, max_tokens=5))


def test_clones_reserve_their_shared_prompt_once():
    prompt = "p" * 100
    backend = FakeBackend(n_seq_max=3, n_ctx=200)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    _, results = together(backend, [params] * 3, prompt=prompt)  # 3 × 121 > 200; 101 + 60 fits
    assert all(len(r.tokens) == 20 for r in results)
    assert max(len({seq for _, _, seq, _ in call}) for call in backend.decode_calls) == 3


# --- the election --------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("12 x 13 = 156, minus 50 gives 106.", ["12", "13", "156", "50", "106"]),
    ("it is -3.5 degrees", ["-3.5"]),
    ("1,024 bytes and 1,234,567 more", ["1024", "1234567"]),
    ("12.50 EUR, 3.0 kg, 0.500", ["12.5", "3", "0.5"]),
    ("twenty-two, A-4, x-1", ["4", "1"]),
    ("1,2 and 1,23", ["1", "2", "1", "23"]),
    ("-0 and 7.", ["0", "7"]),
    ("no numbers here", []),
])
def test_numbers_are_found_and_normalised(text, expected):
    assert numbers(text) == expected


@pytest.mark.parametrize("text, key", [
    ("€1,200", "1200"), ("1200 EUR", "1200"), ("The total is 1,200.00 euros.", "1200"),
    ("No.", "no"), ("  no ", "no"), ("Paris", "paris"), ("PARIS!", "paris"),
    ("3 March 2021", "3 2021"), ("March 3, 2021", "3 2021"),
    ("First we add 12 and 13 which gives 25, and then we subtract the 5 returned items to get 20 in all.", "20"),
    ("This is a long answer without any number in it at all, so it does not vote in the election.", None),
    ("", None), ("...", None),
])
def test_answer_keys(text, key):
    assert answer_key(text) == key


def test_similarity_and_medoid():
    assert similarity("the cat sat", "The cat, sat!") == 1.0
    assert similarity("", "a") == 0.0
    assert math.isclose(similarity("a b", "b c"), 1 / 3)
    assert medoid(["red apple pie", "green apple pie", "blue sky"]) == 0
    assert medoid(["x"]) == 0


def elect(*answers: tuple[str, str]):
    election = Election(len(answers))
    decisions = [election.finished(i, text, reason, 1) for i, (text, reason) in enumerate(answers)]
    return election.verdict(), decisions


@pytest.mark.parametrize("answers, winner, consensus, decisions", [
    # An absolute majority decides at the vote that makes it, not before.
    ([("42", "stop"), ("41", "stop"), ("42", "stop"), ("42.0", "stop"), ("7", "stop")], 0, 3,
     [False, False, False, True, False]),
    ([("41", "stop"), ("42", "stop"), ("42", "stop"), ("42", "stop")], 1, 3, [False, False, False, True]),
    # No majority: the most voted key with at least two votes, the first attempt's among equals.
    ([("1", "stop"), ("2", "stop"), ("2", "stop"), ("3", "stop"), ("1", "stop")], 0, 2, [False] * 5),
    ([("1", "stop"), ("2", "stop"), ("3", "stop"), ("4", "stop"), ("5", "stop")], 0, 1, [False] * 5),
    # Cut by max_tokens or cancelled: no vote.
    ([("9", "length"), ("9", "length"), ("8", "stop")], 0, 1, [False] * 3),
    ([("9", "cancelled"), ("8", "stop"), ("8", "stop")], 1, 2, [False, False, True]),
])
def test_the_election_rules(answers, winner, consensus, decisions):
    verdict, decided = elect(*answers)
    assert (verdict.winner, verdict.consensus, decided) == (winner, consensus, decisions)


def test_prose_without_keys_elects_the_medoid():
    long = " and then some more words to make it a long answer without numbers"
    verdict, _ = elect(("the sky is blue" + long, "stop"), ("a cat is on the mat" + long, "stop"),
                       ("the sky is blue today" + long, "stop"), ("the sky is blue" + long, "stop"))
    assert (verdict.winner, verdict.consensus, verdict.early) == (0, 1, False)


def test_attempts_keep_the_anchor_and_spread_the_explorers():
    greedy = SamplingParams(temperature=0, max_tokens=10, seed=5)
    settings = attempts(greedy, 4)
    assert settings[0] == greedy
    assert [s.seed for s in settings] == [5, 6, 7, 8]
    assert [s.temperature for s in settings] == [0, 0.7, 0.7, 0.7]
    assert [s.temperature for s in attempts(SamplingParams(temperature=1.2), 3)] == [1.2, 1.2, 1.2]
    assert len({s.seed for s in attempts(SamplingParams(), 5)}) == 5
    with pytest.raises(ValueError):
        attempts(greedy, 0)


# --- convene: the engine and the election together ------------------------------------

def exam_rule(hold):
    """After the prompt, 'A' or 'B' about equally likely ('A' a little more: greedy takes it); 'A' is
    followed by the answer "7" at once, 'B' by a long ramble that calls `hold()` after ten tokens."""
    def rule(history):
        logits = [-math.inf] * N_VOCAB
        last = history[-1]
        if last == ord("?"):
            logits[ord("A")], logits[ord("B")] = 0.1, 0.0
        elif last == ord("A"):
            logits[ord("7")] = 30.0
        elif last == ord("7"):
            logits[EOS] = 30.0
        else:
            if history[-10:] == [ord("b")] * 10:
                hold()
            logits[ord("b")] = 30.0
        return logits
    return rule


def test_best_of_stops_the_others_once_a_majority_is_certain_and_frees_their_kv():
    handles = []
    # The ramblers wait (inside the engine's step) until every attempt has ended or been cancelled.
    decided = lambda: wait_until(lambda: all(h.cancelled or h.finish for h in handles), timeout_s=10)  # noqa: E731
    backend = FakeBackend(n_seq_max=5, n_ctx=4096, rule=exam_rule(decided))
    request = GenerationRequest("What is the answer?", SamplingParams(temperature=0, max_tokens=200, seed=3))
    with Engine(backend) as engine:
        submit = engine.submit_together
        engine.submit_together = lambda *args: handles.extend(submit(*args)) or handles
        outcome = convene(engine, request, 5, timeout_s=10)
        wait_until(lambda: engine.status.running == 0)
    verdict = outcome.verdict
    chose_a = [i for i, c in enumerate(outcome.completions) if c.text.startswith("A")]
    assert 0 in chose_a and 3 <= len(chose_a) < 5, "seed 3 lets three or four attempts pick A: the test needs it"
    assert (verdict.winner, outcome.winner.text, verdict.early) == (0, "A7", True)
    assert verdict.consensus == len(chose_a)
    for i, completion in enumerate(outcome.completions):
        if i not in chose_a:
            assert completion.finish.reason == "cancelled" and len(completion.tokens) <= 12
    prompt_length = len(backend.tokenize("What is the answer?"))
    assert prompt_rows(backend, prompt_length) == prompt_length
    # The stopped attempts' KV is gone; the slots keep the finished answers' ("A7") beside the shared prompt.
    assert backend.cells_in_use() == prompt_length + 2 * len(chose_a)
