"""The admission rules alone, without a backend: which idle slot a prompt takes, what the context holds beside
the running sequences, and where a request's KV comes from (a twin's prefill, a donor, a saved state, its slot)."""

from reame.engine import GenerationRequest, SamplingParams, Session, SessionState
from reame.engine.admission import ContextLimits, pick_slot, plan_start, reserved_with
from reame.engine.request import Handle
from reame.engine.slots import Running, Slot

LIMITS = ContextLimits(n_ctx=1000, n_ctx_seq=1000, n_seq_max=4, reserve_tokens=50)


def handle(prompt, max_tokens=None, session=None):
    return Handle(GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens), session=session),
                  list(prompt))


def running(prompt, seq_id=0, fed=None, generated=()):
    sequence = Running(handle(prompt), Slot(seq_id), object(), 100, seq_id)
    sequence.n_fed = len(prompt) if fed is None else fed
    sequence.generated_tokens = list(generated)
    return sequence


def test_a_prompt_takes_the_idle_slot_sharing_its_longest_prefix_else_an_empty_one():
    slots = [Slot(0), Slot(1), Slot(2)]
    slots[0].held, slots[1].held = [1, 2, 3], [1, 2, 3, 4, 5]
    assert pick_slot(slots, [1, 2, 3, 4, 9]) == (slots[1], 4, [])
    assert pick_slot(slots, [7, 8, 9]) == (slots[2], 0, [])  # nothing useful shared: the empty slot, caches kept
    assert pick_slot(slots, [1, 2, 3, 4, 5]) == (slots[1], 4, [])  # never the whole prompt: its last token is decoded


def test_a_slot_sharing_too_little_to_be_worth_it_is_taken_whole_keeping_nothing():
    only = Slot(0)
    only.held = [1, 2, 3] + list(range(100, 200))  # a chat template's system prompt, then another document
    assert pick_slot([only], [1, 2, 3] + list(range(300, 400))) == (only, 0, [])  # 3 of 103: computed afresh
    assert pick_slot([only], [1, 2, 3] + list(range(100, 130)) + [7]) == (only, 33, [])


def test_sequences_with_one_prompt_count_its_cells_once():
    twins = [running(range(100), 0), running(range(100), 1)]
    alone = reserved_with([], handle(range(100)), LIMITS)
    assert alone == 100 + 50
    assert reserved_with(twins, handle(range(100)), LIMITS) == 100 + 3 * 50  # one prompt, three answers
    assert reserved_with(twins, handle(range(1, 101)), LIMITS) == 200 + 3 * 50


def test_an_answer_reserves_at_most_a_slots_share_of_the_context():
    assert reserved_with([], handle(range(10), max_tokens=2**63), LIMITS) == 10 + 1000 // 4


def test_the_kv_comes_from_a_twins_prefill_then_a_donor_then_a_saved_state_then_the_slot():
    prompt = list(range(50))
    twin = running(prompt, 0, fed=10)  # prefilling the same prompt, nothing generated yet
    assert plan_start(handle(prompt), 5, [twin], rollback=True).source == "leader"
    donor = running(prompt[:40] + [999], 1, generated=[7])
    start = plan_start(handle(prompt), 5, [donor], rollback=True)
    assert (start.source, start.shared, start.donor) == ("donor", 40, donor)
    assert plan_start(handle(prompt), 5, [donor], rollback=False).source == "slot"  # a recurrent model
    session = Session(SessionState(tuple(prompt[:45]), b"state"))
    start = plan_start(handle(prompt, session=session), 5, [donor], rollback=True)
    assert (start.source, start.shared) == ("saved", 45)
    assert plan_start(handle(prompt), 0, [], rollback=True).source == "fresh"
