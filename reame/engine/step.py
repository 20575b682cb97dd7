"""One engine step: plan → execute → apply.

`plan_step` is pure: from the running sequences' phases it decides which rows the next decode carries (each
generating sequence's next token, with the room its drafts may take; then prompt chunks in the room left
under the batch size). `Stepper.execute` does everything that calls the model: it asks the draft sources
for drafts, fits the prompt chunks into what they left of the batch, runs the one `backend.decode`, draws
every sequence's tokens with its own sampler chain (verifying drafts), and makes the KV edits the outputs
call for (rejected drafts dropped, a prompt snapshotted, followers given their leader's prompt).
`Stepper.apply` then updates the sequences from that outcome: prompt progress, tokens emitted (which may
end requests), the speculation controllers, statistics and cost model.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from reame.cache import PrefixCache, Snapshot
from reame.engine.interruption import BackgroundInterruption
from reame.engine.sequences import Sequences
from reame.engine.slots import Phase, Running
from reame.model.backend import DECODE_INTERRUPTED, DECODE_NO_KV_SLOT, Backend
from reame.model.sampling import log_softmax_of, post_sampling_of
from reame.speculative import Drafting, Speculation


@dataclass(frozen=True)
class Decode:
    """A generating sequence's next token, and how many drafts may follow it (0: none asked)."""

    running: Running
    draft_room: int


@dataclass(frozen=True)
class PromptChunk:
    """Up to `take` prompt tokens of a sequence, from `start` (fewer when drafts took the batch's room), and
    when it ends the prompt, how many drafts of the answer's first tokens may follow it (0: none asked)."""

    running: Running
    start: int
    take: int
    draft_room: int = 0
    drop_last: bool = False  # the prompt's last token rides along, then its cell is dropped (see plan_step)


@dataclass(frozen=True)
class StepPlan:
    """What the next decode carries, decided from the sequences' state alone (no model call)."""

    decodes: tuple[Decode, ...] = ()
    chunks: tuple[PromptChunk, ...] = ()
    draft_rows: int | None = None  # the most draft tokens the whole step may carry (None: the batch's room)
    rowwise: bool = False  # each row computed as a one-row step computes it (Backend.decode)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.chunks)

    @property
    def background_only(self) -> bool:
        """Every row is a background request's (a batch's lines): a foreground arrival may interrupt it."""
        rows: list[Decode | PromptChunk] = [*self.decodes, *self.chunks]
        return all(row.running.handle.request.background for row in rows)


def plan_step(running: list[Running], n_batch: int, n_ctx_seq: int, prefill_chunk_tokens: int,
              drafts_allowed: bool, exact_rows: int | None = None, rowwise: bool = False,
              can_drop: bool = True) -> StepPlan:
    """The next decode's rows: each generating sequence's next token (with room for drafts, see
    `_draft_room`), then prompts (the chunk that ends one with room for drafts of its answer's first
    tokens, see `_answer_draft_room`), at most `prefill_chunk_tokens` per step while sequences
    decode, so a long newcomer delays running streams by one chunk, never by its whole prompt. With no
    stream to protect, a prompt takes the whole batch.

    `exact_rows`: the most rows a step may carry and still decode each row exactly as a one-row step does.
    Beside a greedy or seeded sequence, drafts keep the whole step within it, so that sequence's answer is
    the one it would have been without them; where the step is bigger anyway (several streams, a prompt
    chunk), such a sequence drafts nothing and decodes exactly as it would without speculation.

    `rowwise` (the backend can, and exactness is asked for): a step of generating sequences alone (no prompt
    rows) that carries a greedy or seeded one computes each row with the one-row kernels, drafts or not, so
    such an answer is the same whatever rows share its steps; `exact_rows` is then measured that way.

    Background sequences (a batch's lines) step aside while a foreground prompt is being prefilled: the step
    carries only foreground rows, so a person's first token costs what it does on an idle server.

    A prompt whose last token is decoded alone (Running.solo_last) is prefilled whole all the same, that token
    with the rest, and the step after drops that token's cell and decodes it alone (`drop_last`): the KV of the
    tokens before it is then what a batch of the whole prompt computes, as llama-server's first request of a
    prompt computes it (ggml's kernels group a batch's rows, and the last rows' group depends on the batch's
    size), so a repeat of the prompt on llama-server, which decodes the last token alone over that KV, answers
    what Reame does. `can_drop` False (a memory that cannot cut a sequence's end): the last token is held back
    from the batch instead."""
    if any(sequence.phase is Phase.PROMPT and sequence.n_fed < len(sequence.prompt)
           and not sequence.handle.request.background for sequence in running):
        running = [sequence for sequence in running if not sequence.handle.request.background]
    decodes = tuple(Decode(sequence, _draft_room(sequence, n_ctx_seq) if drafts_allowed else 0)
                    for sequence in running if sequence.phase is Phase.GENERATING)
    budget = n_batch - len(decodes)
    if decodes and prefill_chunk_tokens:
        budget = min(budget, prefill_chunk_tokens)
    chunks = []
    for sequence in running:
        if budget <= 0:
            break
        if sequence.phase is not Phase.PROMPT or sequence.n_fed >= len(sequence.prompt):
            continue
        end = len(sequence.prompt)
        take = min(budget, end - sequence.n_fed)
        ends = sequence.n_fed + take == len(sequence.prompt)
        drop_last = ends and sequence.solo_last and sequence.n_fed < end - 1
        if drop_last and not can_drop:
            take, ends, drop_last = take - 1, False, False
        chunks.append(PromptChunk(sequence, sequence.n_fed, take,
                                  _answer_draft_room(sequence, n_ctx_seq) if drafts_allowed and ends and not drop_last
                                  else 0, drop_last))
        budget -= take
    reproducible = any(decode.running.reproducible for decode in decodes) or \
        any(chunk.running.reproducible for chunk in chunks)
    if exact_rows is not None and reproducible:
        # A prompt's rows in a bigger batch than without drafts would decode another way for the sequences
        # beside it (and for its own first token): exactness keeps such drafts out.
        chunks = [replace(chunk, draft_room=0) for chunk in chunks]
    draft_rows = None
    if exact_rows is not None and any(decode.draft_room and decode.running.reproducible for decode in decodes):
        if chunks or len(decodes) > exact_rows:
            decodes = tuple(Decode(decode.running, 0) if decode.running.reproducible else decode
                            for decode in decodes)
        else:
            draft_rows = exact_rows - len(decodes)
    return StepPlan(decodes, tuple(chunks), draft_rows, rowwise and reproducible and not chunks)


def _draft_room(sequence: Running, n_ctx_seq: int) -> int:
    """How many drafts may follow the sequence's next token. None in the step right after a streamed answer's
    first token: proposing (a long prompt's lookup index, the Palimpsest's search) would hold the GIL while
    its caller sends that token. An answer nobody reads token by token (a batch's line, a whole answer)
    drafts from its first token on: a schema's keys after its opening brace are a step saved per answer."""
    if not sequence.draftings or (len(sequence.generated_tokens) < 2 and sequence.handle.request.streamed):
        return 0
    return max(0, min(sequence.max_tokens - len(sequence.generated_tokens) - 1, n_ctx_seq - sequence.n_fed - 1))


def _answer_draft_room(sequence: Running, n_ctx_seq: int) -> int:
    """How many drafts of the answer's first tokens may follow the prompt's last token in the step that
    decodes it: a schema's opening (`{"category": "`) is verified with the prompt instead of in steps of its
    own. None for a streamed answer (its first token would wait for the drafts' rows), a warm request (no
    answer), or a prompt whose followers draw from its last row (they would have to share its drafts)."""
    request = sequence.handle.request
    if not sequence.draftings or request.streamed or request.warm or sequence.followers:
        return 0
    return max(0, min(sequence.max_tokens - 1, n_ctx_seq - len(sequence.prompt) - 1))


Chosen = tuple[int, float | None, tuple[tuple[int, float], ...]]  # a token, its logprob, the top logprobs


@dataclass
class Draw:
    """A sequence's outputs in a decode: its first output row, the drafts after it and their source, and
    (once executed) the tokens its sampler chain chose."""

    running: Running
    row: int
    drafts: list[int]
    drafting: Drafting | None
    drafts_at: int  # the sequence's position of its first draft (of the token it draws first)
    chosen: list[Chosen] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return len(self.chosen) - 1


@dataclass
class Batch:
    """The rows of one decode."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    outputs: list[bool] = field(default_factory=list)

    def add(self, tokens: list[int], first_position: int, seq_id: int, output: bool) -> None:
        self.tokens.extend(tokens)
        self.positions.extend(range(first_position, first_position + len(tokens)))
        self.seq_ids.extend([seq_id] * len(tokens))
        self.outputs.extend([output] * len(tokens))


@dataclass
class StepOutcome:
    """What a decode did: the prompt tokens fed, each sequence's draws, the snapshots taken, the leaders
    whose followers now share their prompt, and what the step cost."""

    kv_full: bool = False
    interrupted: bool = False  # stopped for a foreground arrival: nothing of it happened
    rows: int = 0
    seconds: float = 0.0
    rowwise: bool = False  # the decode's rows were computed as one-row steps compute them
    drafted: int = 0
    fed: list[tuple[Running, int]] = field(default_factory=list)
    dropped: list[Running] = field(default_factory=list)  # their prompt's last cell goes (PromptChunk.drop_last)
    draws: list[Draw] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    clones: list[Running] = field(default_factory=list)


def verify(backend: Backend, draw: Draw, top: int | None) -> list[Chosen]:
    """Sample the sequence's outputs in order: drafts are accepted while the model's own choice
    equals them; its first different choice (or the token after the last draft) ends the run.

    Drafts put all their probability on one token, so Leviathan's rule (accept with p(d), else
    draw from p without d) is exactly "draw from p, keep it if it is d": every emitted token is
    a plain draw from the model with the request's chain, greedy or not.
    """
    chosen: list[Chosen] = []
    request = draw.running.handle.request
    for offset in range(len(draw.drafts) + 1):
        row = draw.row + offset
        token = backend.sample(draw.running.sampler, row)
        if top is None:
            logprobs: tuple[float | None, tuple[tuple[int, float], ...]] = (None, ())
        elif request.post_sampling:
            history = [*draw.running.prompt, *draw.running.generated_tokens, *(item[0] for item in chosen)]
            logprobs = post_sampling_of(backend.logits(row), token, top, request.params, history,
                                        backend.eog_tokens() if request.params.ignore_eos else ())
        else:
            logprobs = log_softmax_of(backend.logits(row), token, top)
        chosen.append((token, *logprobs))
        if offset == len(draw.drafts) or token != draw.drafts[offset]:
            break
    return chosen


class Stepper:
    """Executes step plans on the engine thread, and applies their outcome to the sequences."""

    def __init__(self, backend: Backend, sequences: Sequences, cache: PrefixCache | None,
                 speculation: Speculation | None, prefill_chunk_tokens: int,
                 interruption: BackgroundInterruption, rowwise: bool = False) -> None:
        """`rowwise`: see plan_step (the backend must support it)."""
        self.backend = backend
        self.rowwise = rowwise
        self.interruption = interruption
        self.sequences = sequences
        self.cache = cache
        self.speculation = speculation
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.drafts_paused = False  # one step without drafts after the KV ran full with them

    def plan(self) -> StepPlan:
        speculation = self.speculation
        return plan_step(self.sequences.running, self.backend.n_batch, self.sequences.limits.n_ctx_seq,
                         self.prefill_chunk_tokens, speculation is not None and not self.drafts_paused,
                         None if speculation is None else speculation.exact_rows, self.rowwise,
                         self.backend.supports_rollback)

    def step(self) -> None:
        """Plan, execute, apply one decode (nothing when no sequence has a row to feed)."""
        plan = self.plan()
        if plan:
            self.apply(self.execute(plan))

    def execute(self, plan: StepPlan) -> StepOutcome:
        """Drafts, the decode, the draws, and the KV edits they call for."""
        backend = self.backend
        batch, outcome = Batch(), StepOutcome()
        for decode in plan.decodes:
            running = decode.running
            drafting, drafts = self._drafts(running, decode.draft_room, len(plan.decodes) + outcome.drafted,
                                            len(plan.decodes), self._step_room(plan, outcome), plan.rowwise)
            outcome.drafted += len(drafts)
            assert running.next_token is not None
            outcome.draws.append(Draw(running, len(batch.tokens), drafts, drafting, running.n_fed + 1))
            batch.add([running.next_token, *drafts], running.n_fed, running.seq_id, True)
        room = backend.n_batch - len(batch.tokens)  # drafts come first: a chunk shrinks by what they took
        for chunk in plan.chunks:
            running, take = chunk.running, min(chunk.take, room)
            if take <= 0:
                break
            room -= take
            ends = chunk.start + take == len(running.prompt)
            last = ends and not running.handle.request.warm and not chunk.drop_last
            batch.add(running.prompt[chunk.start:chunk.start + take], chunk.start, running.seq_id, False)
            if ends and chunk.drop_last:
                outcome.dropped.append(running)
                take -= 1
            outcome.fed.append((running, take))
            if last:
                batch.outputs[-1] = True
                row, end = len(batch.tokens) - 1, len(running.prompt)
                drafting, drafts = self._drafts(running, chunk.draft_room, len(batch.tokens),
                                                len(outcome.draws) + 1, self._step_room(plan, outcome), False)
                batch.add(drafts, end, running.seq_id, True)
                room -= len(drafts)
                outcome.drafted += len(drafts)
                outcome.draws.append(Draw(running, row, drafts, drafting, end))
                outcome.draws.extend(Draw(follower, row, [], None, end) for follower in running.followers)
                if running.followers:
                    outcome.clones.append(running)
        kv = self.sequences.kv
        if not self.sequences.room_for(batch.seq_ids):  # idle caches gave up all they could
            outcome.kv_full = True
            return outcome
        # One row alone is what a row computed row by row is made to equal (test_lone_row_attention): ggml's own
        # one-row step computes it so, 2-4% sooner here (bench/rowwise.py, 1 row).
        rowwise = plan.rowwise and len(batch.tokens) > 1
        started = time.perf_counter()
        with self.interruption.background_decode() if plan.background_only else nullcontext():
            status = kv.decode(batch.tokens, batch.positions, batch.seq_ids, batch.outputs, rowwise)
        outcome.seconds, outcome.rows, outcome.rowwise = time.perf_counter() - started, len(batch.tokens), plan.rowwise
        if status == DECODE_INTERRUPTED:
            outcome.interrupted = True
            return outcome
        if status == DECODE_NO_KV_SLOT:
            outcome.kv_full = True
            return outcome
        for running in outcome.dropped:  # decoded alone next, as a repeat of the prompt decodes it
            kv.remove(running.seq_id, len(running.prompt) - 1)
        for running, take in outcome.fed:
            if running.n_fed + take == running.snapshot_at:
                outcome.snapshots.append(Snapshot(tuple(running.prompt[:running.snapshot_at]),
                                                  kv.state(running.seq_id)))
        for leader in outcome.clones:
            for follower in leader.followers:
                kv.copy(leader.seq_id, follower.seq_id, len(leader.prompt))
        for draw in outcome.draws:
            draw.chosen = verify(backend, draw, draw.running.handle.request.logprobs)
            if draw.accepted < len(draw.drafts):  # the rejected drafts' KV goes
                kv.remove(draw.running.seq_id, draw.drafts_at + draw.accepted)
        return outcome

    @staticmethod
    def _step_room(plan: StepPlan, outcome: StepOutcome) -> int | None:
        """Draft tokens the step may still carry (None: as many as the batch takes)."""
        return None if plan.draft_rows is None else plan.draft_rows - outcome.drafted

    def _drafts(self, running: Running, draft_room: int, batch_tokens: int, sequences: int,
                step_room: int | None, rowwise: bool) -> tuple[Drafting | None, list[int]]:
        """Tokens to verify after the sequence's next one (or its prompt's last), and their source: as many as
        its controller finds worth it, within the plan's room for them (`draft_room`, the sequence's, and
        `step_room` left in the step's) and the batch's; `rowwise`: the step's rows are costed as such."""
        room = min(draft_room, self.backend.n_batch - batch_tokens - 1)
        if step_room is not None:
            room = min(room, step_room)
        if room <= 0:
            return None, []
        assert self.speculation is not None
        return self.speculation.propose(running.draftings, batch_tokens, sequences, room, rowwise)

    def apply(self, outcome: StepOutcome) -> None:
        """The sequences' new state: prompt progress and snapshots, followers sharing their leader's prompt,
        each draw's tokens emitted (ending requests as they say), drafts learned from, the step's cost."""
        sequences = self.sequences
        if outcome.interrupted:  # the rows go again in a later step, after the foreground request's
            return
        if outcome.kv_full:
            if outcome.drafted:
                self.drafts_paused = True  # the drafts go first: the next step runs without them
            else:
                sequences.relieve_full_kv()
            return
        for running, take in outcome.fed:
            running.n_fed += take
            running.report_progress()
        if self.cache is not None:
            for snapshot in outcome.snapshots:
                self.cache.offer(snapshot)
        for leader in outcome.clones:
            for follower in leader.followers:
                follower.lead(len(leader.prompt), [])
                follower.report_progress()
            leader.followers = []
        self.drafts_paused = False
        for draw in outcome.draws:
            self._emit(draw)
        if self.speculation is not None:
            if not outcome.fed:  # prompt tokens need no logits: cheaper than the rows a verification outputs
                self.speculation.cost_of(outcome.rowwise).observe(outcome.rows, outcome.seconds)
            self.speculation.stats.step(outcome.drafted > 0)

    def _emit(self, draw: Draw) -> None:
        running = draw.running
        running.n_fed = draw.drafts_at + draw.accepted  # its KV: all before its drafts, and the drafts accepted
        if draw.drafting is not None:
            assert self.speculation is not None
            self.speculation.verified(draw.drafting, len(draw.drafts), draw.accepted)
            running.drafted += len(draw.drafts)
            running.accepted_drafts += draw.accepted
        for token, logprob, top in draw.chosen:
            self.sequences.emit(running, token, logprob, top)
            if running.phase is Phase.FINISHED:
                break
