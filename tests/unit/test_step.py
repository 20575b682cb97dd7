"""A step's plan from the sequences' phases alone (no backend), and the phases a request goes through in real
steps on the FakeBackend: prompt, generating, finished; a follower waiting on its twin's prefill."""

from reame.engine import GenerationRequest, SamplingParams
from reame.engine.admission import ContextLimits
from reame.engine.interruption import BackgroundInterruption
from reame.engine.request import Handle
from reame.engine.sequences import Sequences
from reame.engine.slots import Phase, Running, Slot
from reame.engine.step import Decode, PromptChunk, StepPlan, Stepper, plan_step
from tests.fakes.backend import FakeBackend


def sequence(prompt_length, seq_id=0, fed=0, phase=Phase.PROMPT, generated=(), draftings=(), max_tokens=100,
             background=False, streamed=False, params=SamplingParams()):
    prompt = list(range(1, prompt_length + 1))
    request = GenerationRequest(prompt, params, background=background, streamed=streamed)
    running = Running(Handle(request, prompt),
                      Slot(seq_id), object(), max_tokens, seq_id)
    running.n_fed, running.phase = fed, phase
    running.generated_tokens = list(generated)
    running.draftings = list(draftings)
    if phase is Phase.GENERATING:
        running.next_token = 7
    return running


def test_generating_sequences_decode_first_and_prompts_share_the_room_left_in_chunks():
    decoding = sequence(10, 0, fed=12, phase=Phase.GENERATING, generated=[5, 6])
    long_prompt = sequence(500, 1)
    next_prompt = sequence(50, 2)
    plan = plan_step([decoding, long_prompt, next_prompt], n_batch=512, n_ctx_seq=1000, prefill_chunk_tokens=128,
                     drafts_allowed=True)
    assert plan == StepPlan((Decode(decoding, 0),), (PromptChunk(long_prompt, 0, 128),))
    alone = plan_step([long_prompt, next_prompt], n_batch=512, n_ctx_seq=1000, prefill_chunk_tokens=128,
                      drafts_allowed=True)
    assert alone == StepPlan((), (PromptChunk(long_prompt, 0, 500), PromptChunk(next_prompt, 0, 12)))


def test_background_sequences_step_aside_while_a_foreground_prompt_is_prefilled():
    batch_line = sequence(10, 0, fed=12, phase=Phase.GENERATING, generated=[5, 6], background=True)
    batch_prompt = sequence(40, 1, background=True)
    person = sequence(30, 2)
    plan = plan_step([batch_line, batch_prompt, person], n_batch=512, n_ctx_seq=1000, prefill_chunk_tokens=128,
                     drafts_allowed=True)
    assert plan == StepPlan((), (PromptChunk(person, 0, 30),))
    person.n_fed, person.phase, person.next_token = 31, Phase.GENERATING, 7  # its prompt is in: all share steps
    plan = plan_step([batch_line, batch_prompt, person], n_batch=512, n_ctx_seq=1000, prefill_chunk_tokens=128,
                     drafts_allowed=True)
    assert plan == StepPlan((Decode(batch_line, 0), Decode(person, 0)), (PromptChunk(batch_prompt, 0, 40),))


def test_a_plan_asks_for_drafts_only_within_the_answers_and_the_contexts_room():
    drafting = [object()]
    streamed = sequence(10, 0, fed=11, phase=Phase.GENERATING, generated=[5], draftings=drafting, streamed=True)
    whole = sequence(10, 3, fed=11, phase=Phase.GENERATING, generated=[5], draftings=drafting)
    going = sequence(10, 1, fed=12, phase=Phase.GENERATING, generated=[5, 6], draftings=drafting, max_tokens=8)
    near_the_end = sequence(10, 2, fed=95, phase=Phase.GENERATING, generated=[5, 6], draftings=drafting)
    plan = plan_step([streamed, whole, going, near_the_end], n_batch=64, n_ctx_seq=100, prefill_chunk_tokens=128,
                     drafts_allowed=True)
    # a streamed answer's first token goes out before anything is drafted after it; a whole answer drafts at once
    assert [decode.draft_room for decode in plan.decodes] == [0, 88, 5, 4]
    paused = plan_step([going], n_batch=64, n_ctx_seq=100, prefill_chunk_tokens=128, drafts_allowed=False)
    assert paused.decodes == (Decode(going, 0),)


def test_the_chunk_that_ends_a_whole_answers_prompt_has_room_for_drafts_of_its_first_tokens():
    drafting = [object()]
    whole = sequence(30, 0, draftings=drafting, params=SamplingParams(temperature=0.7))
    streamed = sequence(30, 1, draftings=drafting, streamed=True)
    cut = sequence(300, 2, draftings=drafting)  # its prompt does not end in this step
    plan = plan_step([whole, streamed, cut], n_batch=128, n_ctx_seq=100, prefill_chunk_tokens=0,
                     drafts_allowed=True)
    assert plan.chunks == (PromptChunk(whole, 0, 30, 69), PromptChunk(streamed, 0, 30), PromptChunk(cut, 0, 68))
    # With exactness, a greedy sequence beside it would decode its rows in another batch than without drafts
    greedy = sequence(30, 3, draftings=drafting, params=SamplingParams(temperature=0))
    exact = plan_step([whole, greedy], n_batch=128, n_ctx_seq=100, prefill_chunk_tokens=0, drafts_allowed=True,
                      exact_rows=3)
    assert exact.chunks == (PromptChunk(whole, 0, 30), PromptChunk(greedy, 0, 30))
    alone = plan_step([whole], n_batch=128, n_ctx_seq=100, prefill_chunk_tokens=0, drafts_allowed=True,
                      exact_rows=3)
    assert alone.chunks == (PromptChunk(whole, 0, 30, 69),)


def test_a_step_of_generating_sequences_beside_a_greedy_one_is_computed_row_by_row():
    drafting = [object()]
    greedy = sequence(10, 0, fed=12, phase=Phase.GENERATING, generated=[5, 6], draftings=drafting,
                      params=SamplingParams(temperature=0))
    sampled = sequence(10, 1, fed=12, phase=Phase.GENERATING, generated=[5, 6], draftings=drafting,
                       params=SamplingParams(temperature=0.7))
    prompt = sequence(30, 2)

    def plan(running, rowwise=True):
        return plan_step(running, n_batch=128, n_ctx_seq=100, prefill_chunk_tokens=0, drafts_allowed=True,
                         exact_rows=9, rowwise=rowwise)
    both = plan([greedy, sampled])
    assert both.rowwise and both.draft_rows == 7
    assert both.decodes == (Decode(greedy, 87), Decode(sampled, 87))
    assert not plan([sampled]).rowwise  # nothing reproducible: the batched kernels
    assert not plan([greedy, sampled], rowwise=False).rowwise  # the backend cannot, or exactness is off
    beside_a_prompt = plan([greedy, prompt])  # prompt rows take the batched kernels: no drafts for the greedy one
    assert not beside_a_prompt.rowwise and beside_a_prompt.decodes == (Decode(greedy, 0),)


def test_followers_finished_requests_and_warm_prompts_fed_whole_get_no_rows():
    follower = sequence(20, 0, phase=Phase.FOLLOWING)
    finished = sequence(20, 1, phase=Phase.FINISHED)
    warmed = sequence(20, 2, fed=20)
    solo_last = sequence(100, 3, fed=0)
    solo_last.solo_last = True
    plan = plan_step([follower, finished, warmed, solo_last], n_batch=512, n_ctx_seq=1000, prefill_chunk_tokens=0,
                     drafts_allowed=True)
    # Fed whole; its last token's cell is dropped after the step and decoded alone in a later one (or, where the
    # memory cannot cut a sequence's end, held back from the batch).
    assert plan == StepPlan((), (PromptChunk(solo_last, 0, 100, drop_last=True),))
    assert plan_step([solo_last], n_batch=512, n_ctx_seq=1000, prefill_chunk_tokens=0, drafts_allowed=True,
                     can_drop=False) == StepPlan((), (PromptChunk(solo_last, 0, 99),))
    assert not plan_step([follower, finished, warmed], n_batch=512, n_ctx_seq=1000, prefill_chunk_tokens=0,
                         drafts_allowed=True)


def test_a_request_goes_from_prompt_to_generating_to_finished_and_a_twin_follows_its_prefill():
    backend = FakeBackend(n_ctx=512, n_seq_max=2, n_batch=16)
    sequences = Sequences(backend, ContextLimits(512, 512, 2, 64), None, None, 0)
    stepper = Stepper(backend, sequences, None, None, prefill_chunk_tokens=8,
                      interruption=BackgroundInterruption(backend))
    prompt = list(b"a prompt of twenty-two")

    def start():
        return sequences.start(Handle(GenerationRequest(prompt, SamplingParams(max_tokens=3, ignore_eos=True)),
                                      prompt))

    leader, twin = start(), start()
    assert (leader.phase, twin.phase, twin.leader) == (Phase.PROMPT, Phase.FOLLOWING, leader)
    stepper.step()  # 16 prompt tokens: the whole batch, nothing decodes yet
    assert (leader.n_fed, leader.phase, twin.phase) == (16, Phase.PROMPT, Phase.FOLLOWING)
    stepper.step()  # the rest; the twin shares the cells and draws from the same row
    assert (leader.n_fed, twin.n_fed, twin.cached) == (22, 22, 22)
    assert (leader.phase, twin.phase, twin.leader) == (Phase.GENERATING, Phase.GENERATING, None)
    assert backend.kv_tokens(twin.seq_id) == prompt
    stepper.step()
    stepper.step()  # the third token: max_tokens
    assert (leader.phase, twin.phase, sequences.running) == (Phase.FINISHED, Phase.FINISHED, [])
    assert not stepper.plan()
    assert [slot.held for slot in sequences.slots] == [prompt + leader.generated_tokens[:2],
                                                       prompt + twin.generated_tokens[:2]]
