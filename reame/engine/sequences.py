"""The slots of the shared KV and the requests running in them: a request's start in a slot, the tokens it
emits, its end, and the KV moves these call for (a follower taking over its leader's prefill, room made for
whatever needs cells).

Engine thread only. What a start does is decided by the pure rules of admission.py; what a step feeds and
samples, by step.py; this module carries out the transitions of each request's `Phase` (slots.py).

The KV that idle slots keep is a cache, never a reservation, and this class alone decides what becomes of it
(kv.py counts the cells): behind a prefix cache a request's start leaves no other idle cache in the KV
(`_compact`), and whenever a restore or a decode needs cells, `make_room` frees them from idle slots, least
recently used first; either way a snapshot of what goes is kept in the prefix cache when that is worth it,
and no running sequence is touched.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence

from reame.cache import PrefixCache, Snapshot, common_prefix
from reame.cache.heads import ResidentHeads
from reame.engine import admission
from reame.engine.kv import KvCells, KvStats
from reame.engine.request import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FinishEvent,
    Handle,
    SessionState,
    TokenEvent,
    Usage,
)
from reame.engine.slots import Phase, Running, Slot
from reame.model.backend import Backend
from reame.model.sampling import chain_steps
from reame.speculative import Speculation
from reame.structured.grammar import GrammarTooAmbiguous

log = logging.getLogger("reame.engine")

# A prompt with at least this many tokens to prefill has its last token decoded in a step of its own.
# A repeat of that prompt finds all but the last token in KV (slot reuse, session, prefix cache) and
# decodes it alone too, so it computes exactly what the first request did: llama.cpp's numerics for a
# token alone differ from those of the same token in a larger batch, and a repeated prompt would
# otherwise get another greedy answer. The price, one decode step, is under 12% of such a prefill here;
# a short tail after a restored prefix is prefilled in one step, as a cold run of it would be. (The
# token also rides in the prompt's batch, its cell dropped after: plan_step says why.)
SOLO_LAST_TOKEN_PREFILL = 64


class Sequences:
    """Owns the slots and the running requests (in admission order), on the engine thread."""

    def __init__(self, backend: Backend, limits: admission.ContextLimits, cache: PrefixCache | None,
                 speculation: Speculation | None, max_answer_tokens: int) -> None:
        self.backend = backend
        self.kv = KvCells(backend)
        self.limits = limits
        self.cache = cache
        # Behind a prefix cache idle slots give their KV up at every start: the openings they held are kept here.
        self.heads = ResidentHeads() if cache is not None else None
        self.speculation = speculation
        self.max_answer_tokens = max_answer_tokens
        self.slots = [Slot(seq_id) for seq_id in range(backend.n_seq_max)]
        self.running: list[Running] = []
        self.first_tokens: list[Handle] = []  # streamed requests whose first token the last step emitted
        self.changed = False  # what the engine publishes of the slots is out of date
        self._admissions = itertools.count()
        self._releases = itertools.count(1)
        self._restores: Counter[tuple[str, str]] = Counter()  # (source, outcome) -> restores
        self._cells_given_up = self._idle_snapshots = 0
        self._reused_tokens = 0  # prompt tokens whose KV was moved into place (cache reuse) instead of prefilled

    @property
    def full(self) -> bool:
        return len(self.running) >= len(self.slots)

    def fits(self, handle: Handle) -> bool:
        """The shared KV holds the request's reservation beside what runs."""
        return not self.running or \
            admission.reserved_with(self.running, handle, self.limits) <= self.backend.n_ctx

    # --- a start ----------------------------------------------------------------------

    def start(self, handle: Handle) -> Running:
        """Give a request a slot with its KV ready to extend, and its own sampler chain."""
        backend = self.backend
        params = handle.request.params
        steps = chain_steps(params, backend.eog_tokens() if params.ignore_eos else (), history=handle.prompt_tokens)
        # A warm request fills the prefix cache, which keeps only what a prefill computes: it moves nothing.
        reuse = handle.request.cache_reuse if backend.can_shift and not handle.request.warm else 0
        slot, shared, runs = admission.pick_slot(self.slots, handle.prompt_tokens, reuse)
        self._newer_snapshot(handle, shared)
        head = self._head(handle) if not runs else 0
        if shared < head and not self._resident_head(handle, shared):
            # Less than the prompt's head in its slot, and no head kept yet: the prompt is prefilled from its start
            # (at most a head's tokens more), so its head's KV is what a cold prefill computes and can be kept. A few
            # tokens another prompt computed (a batch line's "<|im_start|>system\n") would move the rows' batches.
            shared = 0
        # On the CPU, over the logits: sampling inside the graph measured slower (see new_sampler).
        sampler = backend.new_sampler(steps)
        try:
            room = self.limits.n_ctx_seq - len(handle.prompt_tokens)
            most = min(params.max_tokens or room, room, self.max_answer_tokens or room)
            running = Running(handle, slot, sampler, most, next(self._admissions))
            start = admission.plan_start(handle, shared, self.running, backend.supports_rollback)
            if runs and start.source == "slot" and self.kv.exclusive(slot.seq_id) == self.kv.length(slot.seq_id):
                # Its runs move into place (cells no other sequence holds): the KV is no longer what a prefill
                # computes, so it is never snapshotted, and what the slot gives up is not kept either.
                self.kv.reuse(slot.seq_id, runs)
                self._reused_tokens += shared - runs[0][2] if runs[0][0] == runs[0][1] else shared
            else:
                runs = []
                # What the slot held beyond this prompt's start goes (all of it unless the start is the slot's).
                shared = self._give_up(slot, start.shared if start.source == "slot" else 0)
            if self.cache is not None:
                self._compact(slot)
            if start.source == "donor":  # the cells are shared, not copied
                assert start.donor is not None
                self.kv.copy(start.donor.seq_id, slot.seq_id, start.shared)
                shared = start.shared
            elif start.source == "saved":
                assert start.saved is not None
                shared = self._restore(start.saved, slot.seq_id, start.shared)
            running.n_fed = running.cached = shared
            running.head = head if not shared else 0  # a head is kept only from a prefill from the start
            running.solo_last = not handle.request.warm and \
                len(handle.prompt_tokens) - 1 - shared >= SOLO_LAST_TOKEN_PREFILL
            running.snapshot_at = self._snapshot_point(running) if not runs else -1
            if self.speculation is not None and not handle.request.warm:
                running.draftings = self.speculation.start(handle.prompt_tokens, handle.grammar)
        except BaseException:
            backend.free_sampler(sampler)
            self.kv.remove(slot.seq_id)
            slot.held = []
            raise
        slot.running, slot.held = running, []  # only now: a failed start must not lose its slot
        if start.leader is not None:
            running.follow(start.leader)
        self.running.append(running)
        if start.leader is None:
            running.report_progress()
        self.changed = True
        return running

    def _newer_snapshot(self, handle: Handle, in_slot: int) -> None:
        """A snapshot of more of the prompt than the request found when it was submitted, if one reached the RAM
        tier since (the same document prefilled for a request ahead of it in the queue) and it covers enough to
        be worth a restore (as much as the cache thinks worth a snapshot)."""
        cache, prompt = self.cache, handle.prompt_tokens
        if cache is None or handle.request.session is not None:
            return
        found = common_prefix(handle.snapshot.tokens, prompt) if handle.snapshot is not None else 0
        newer = cache.in_ram(prompt[:-1], better_than=max(found, in_slot, cache.min_new_tokens - 1))
        if newer is not None:
            handle.snapshot = newer

    def _head(self, handle: Handle) -> int:
        """How long the prompt's head is (ResidentHeads.learn); 0 without heads, and for a session's turn or a warm
        request."""
        if self.heads is None or handle.request.session is not None or handle.request.warm:
            return 0
        return self.heads.learn(handle.prompt_tokens)

    def _resident_head(self, handle: Handle, in_slot: int) -> bool:
        """Whether a kept template head covers more of the prompt than its slot and its snapshot (it becomes the
        request's snapshot): a chat whose slot gave its KV up to a batch line's start restores the template's
        opening in a millisecond."""
        assert self.heads is not None
        prompt = handle.prompt_tokens
        found = common_prefix(handle.snapshot.tokens, prompt) if handle.snapshot is not None else 0
        head = self.heads.find(prompt)
        if head is None or len(head.tokens) <= max(found, in_slot):
            return False
        handle.snapshot = head
        return True

    def _snapshot_point(self, running: Running) -> int:
        """Where a prompt's KV is snapshotted into the prefix cache (-1: never): when all but its last
        token are in, if that took enough prefill to be worth it. A warm request is snapshotted whole."""
        cache = self.cache
        request = running.handle.request
        if cache is None or request.session is not None:
            return -1
        if request.warm:
            return len(running.prompt) if not cache.has(running.prompt) else -1
        end = len(running.prompt) - 1
        return end if running.solo_last and end - running.cached >= cache.min_new_tokens else -1

    def _restore(self, saved: SessionState | Snapshot, seq_id: int, shared: int) -> int:
        """Restore saved KV into the empty sequence `seq_id` and keep its first `shared` tokens; return how many
        were kept (0: the prompt is prefilled, the reason logged and counted)."""
        heads = self.heads if self.heads is not None and self.heads.holds(saved) else None
        cache = self.cache if isinstance(saved, Snapshot) and heads is None else None
        source = "head" if heads is not None else "snapshot" if cache is not None else "session"
        cells = len(saved.tokens)  # all of them are placed, however many are kept
        if not self.make_room(cells, seq_id):
            outcome = "no_room"
        elif self.kv.restore(seq_id, saved.blob, cells) and self.kv.remove(seq_id, shared):
            outcome = "restored"
        elif self.kv.exact or not self.kv.used():
            outcome = "rejected"  # refused with its cells free: not a state this context can take
        else:
            outcome = "no_room"  # a sliding window's cells, which the ledger does not count, may be what was missing
        self._restores[source, outcome] += 1
        self.changed = True
        if outcome == "restored":
            if cache is not None:
                cache.restored(shared)
            return shared
        self.kv.remove(seq_id)
        log.info("a %s of %d tokens was not restored (%s): its prompt is prefilled", source, cells,
                 "running sequences hold the cells it needs" if outcome == "no_room"
                 else "this context refused the state")
        if outcome == "rejected" and isinstance(saved, Snapshot):  # never offered here again (no room: kept)
            if heads is not None:
                heads.forget(saved)
            elif cache is not None:
                cache.restore_failed(saved)
        return 0

    # --- the KV's cells ---------------------------------------------------------------------

    def make_room(self, cells: int, seq_id: int) -> bool:
        """Whether `cells` free cells are there for `seq_id` once idle slots sharing its stream have given up
        what they keep, least recently used first and only as many as needed (slots whose cells a running
        sequence shares free nothing, and keep theirs)."""
        kv = self.kv
        if kv.free(seq_id) >= cells:
            return True
        for slot in self._idle_caches(seq_id):
            if kv.exclusive(slot.seq_id):
                self._give_up(slot)
                if kv.free(seq_id) >= cells:
                    return True
        return False

    def room_for(self, seq_ids: Sequence[int]) -> bool:
        """Whether a decode with a row for each of `seq_ids` finds its cells (make_room for each stream)."""
        if self.kv.unified:
            return self.make_room(len(seq_ids), seq_ids[0])
        return all(self.make_room(rows, seq_id) for seq_id, rows in Counter(seq_ids).items())

    def _idle_caches(self, seq_id: int) -> list[Slot]:
        """Idle slots holding KV in `seq_id`'s stream, least recently used first."""
        return sorted((slot for slot in self.slots if slot.running is None and slot.held
                       and self.kv.same_stream(seq_id, slot.seq_id)), key=lambda slot: slot.used)

    def _compact(self, chosen: Slot) -> None:
        """A request starts in `chosen`: every other idle slot gives up what it keeps (kept first as a snapshot if
        worth it), unless a running sequence shares those cells. Behind a prefix cache, cells kept idle save only a
        restore of a few milliseconds, while every decode attends over all the cells up to the highest one in
        use: a 2,000-token document kept idle beside another made each prefill step ~25% slower (SmolLM2-135M,
        docs/engine.md). It also starts every request on the same cells as the first time, so its numerics are
        the same (llama.cpp's attention depends on where a sequence's cells lie)."""
        for slot in self._idle_caches(chosen.seq_id):
            if slot is not chosen and self.kv.exclusive(slot.seq_id):
                self._give_up(slot)

    def _give_up(self, slot: Slot, keep: int = 0) -> int:
        """An idle slot's KV beyond its first `keep` tokens goes, kept first in the prefix cache if no snapshot
        covers it yet and it took enough prefill to be worth one; return how many tokens the slot still holds
        (0 when the memory cannot cut it there)."""
        held = slot.held
        if len(held) <= keep and self.kv.length(slot.seq_id) <= keep:
            return keep
        before = self.kv.free(slot.seq_id)
        if len(held) > keep:
            self._keep_snapshot(slot)
            self._keep_head(slot, keep)
        if not self.kv.remove(slot.seq_id, keep):
            self.kv.remove(slot.seq_id)
            keep = 0
        self._cells_given_up += self.kv.free(slot.seq_id) - before
        slot.held = held[:keep]
        self.changed = True
        return keep

    def _keep_snapshot(self, slot: Slot) -> None:
        cache = self.cache
        if cache is None or slot.private or len(slot.held) - cache.covered(slot.held) < cache.min_new_tokens:
            return
        if cache.offer(Snapshot(tuple(slot.held), self.kv.state(slot.seq_id))):
            self._idle_snapshots += 1

    def _keep_head(self, slot: Slot, keep: int) -> None:
        """Keep the opening of what an idle slot gives up beyond `keep` as a template head, if other prompts
        share it and no head holds it yet (the slot is first cut to it, as its KV goes anyway)."""
        heads, head = self.heads, slot.head
        if heads is None or slot.private or not keep < head <= len(slot.held) or heads.has(slot.held[:head]):
            return
        if self.kv.remove(slot.seq_id, head):
            heads.keep(Snapshot(tuple(slot.held[:head]), self.kv.state(slot.seq_id)))

    def kv_stats(self, other_decodes: int = 0) -> KvStats:
        """The KV's cells and what was done with them, for the engine's status (`other_decodes`: the embedding
        decodes, counted with the generations')."""
        kv = self.kv
        cells = kv.capacity if kv.unified else kv.capacity * len(self.slots)
        return KvStats(cells, kv.used(), tuple((source, outcome, count) for (source, outcome), count
                                               in sorted(self._restores.items())),
                       self._cells_given_up, self._idle_snapshots, kv.decodes + other_decodes, self._reused_tokens,
                       kv.interrupted)

    # --- while running -----------------------------------------------------------------

    def retire(self) -> None:
        """End what needs no step: cancelled requests, and warm requests whose prompt is snapshotted."""
        for running in list(self.running):
            if running.handle.cancelled:
                self.finish(running, FINISH_CANCELLED)
            elif running.handle.request.warm and running.n_fed >= max(running.snapshot_at, 0):
                self.finish(running, FINISH_STOP)

    def emit(self, running: Running, token: int, logprob: float | None = None,
             top: tuple[tuple[int, float], ...] = ()) -> None:
        """The sequence drew `token`: stream it, or end the request (an end-of-generation token, a stop
        string, its length, a grammar grown too ambiguous)."""
        backend = self.backend
        if not running.first_token_at:
            running.first_token_at = time.perf_counter()
        if backend.is_eog(token):
            self.finish(running, FINISH_STOP)
            return
        running.generated_tokens.append(token)
        piece = backend.token_piece(token)
        if running.grammar is not None and not self._follow_grammar(running, piece):
            return
        if running.draftings:
            assert self.speculation is not None
            self.speculation.observe(running.draftings, (token,))
        text = running.stream.push(piece)
        running.handle._put(TokenEvent(token, text, logprob, top))
        if len(running.generated_tokens) == 1 and running.handle.request.streamed:
            self.first_tokens.append(running.handle)
        if running.stream.stopped:
            self.finish(running, FINISH_STOP)
        elif len(running.generated_tokens) >= running.max_tokens:
            self.finish(running, FINISH_LENGTH)
        elif running.n_fed + 1 > self.limits.n_ctx_seq:
            self.finish(running, FINISH_LENGTH, "the context is full")
        else:
            running.generate(token)

    def _follow_grammar(self, running: Running, piece: bytes) -> bool:
        """Read the token's text into the request's grammar state; False when that ended the request (the
        text leaves the grammar more ambiguous than it may be: a clear error, not a stalled engine)."""
        assert running.grammar is not None
        try:
            if not running.grammar.feed(running.grammar_text.decode(piece)):
                running.grammar = None  # llama.cpp's sampler allowed what ours refuses: nothing to bound
        except GrammarTooAmbiguous as error:
            self.finish(running, FINISH_ERROR, str(error), code="grammar_too_ambiguous")
            return False
        return True

    def _hand_over(self, leader: Running) -> None:
        """A leader ends before its prompt is in: the first follower takes over what it prefilled so
        far and leads the others."""
        heir, *others = leader.followers
        leader.followers = []
        self.kv.copy(leader.seq_id, heir.seq_id, leader.n_fed)
        heir.lead(leader.n_fed, others)

    def relieve_full_kv(self) -> None:
        """The shared context is full (with no drafts to drop): the KV that idle slots keep for reuse goes
        first, least recently used first; only then does a running sequence give way."""
        cached = [slot for slot in self._idle_caches(self.running[0].seq_id) if self.kv.exclusive(slot.seq_id)] \
            if self.running else []
        if cached:
            self._give_up(cached[0])
            return
        # The one furthest beyond its reservation ran the KV out (ties: the newest).
        offender = max(self.running, key=lambda r: (r.n_fed - admission.reservation(r.handle, self.limits),
                                                    r.admission))
        self.finish(offender, FINISH_LENGTH, "the context is full")

    # --- an end --------------------------------------------------------------------------

    def finish(self, running: Running, reason: str, message: str = "", code: str = "") -> None:
        """Answer the request and free its slot, which keeps the KV of the answer for reuse: a completed one,
        or, for a request that reuses the cache (llama-server's routes), one its client cut short: an editor
        plugin's time limit or its next keystroke's request ends every completion early, and the next request
        shares all of it but the words typed since. Other cancelled requests (a Conclave's outvoted attempts,
        a client gone) free their cells."""
        now = time.perf_counter()
        running.phase = Phase.FINISHED
        session = running.handle.request.session
        completed = reason in (FINISH_STOP, FINISH_LENGTH)
        cut_short = reason == FINISH_CANCELLED and running.handle.request.cache_reuse > 0
        held = running.held() if completed or cut_short else []
        if session is not None and completed:
            session.state = running.session_state(self.kv.state(running.seq_id))
        tail = "" if reason == FINISH_CANCELLED else running.stream.flush()
        first = running.first_token_at or now
        usage = Usage(len(running.prompt), len(running.generated_tokens), first - running.admitted_at, now - first,
                      running.cached, running.drafted, running.accepted_drafts)
        self.running.remove(running)
        if running.followers:
            self._hand_over(running)
        if running.leader is not None:
            running.leader.followers.remove(running)
        slot = running.slot
        if not held:
            self.kv.remove(slot.seq_id)
        elif self.kv.length(slot.seq_id) > len(held) and not self.kv.remove(slot.seq_id, len(held)):
            self.kv.remove(slot.seq_id)
            held = []
        self.backend.free_sampler(running.sampler)
        Speculation.release(running.draftings)
        # Kept for the next request that shares its prefix; `used` makes it the most recently used.
        slot.running, slot.held, slot.used = None, held, next(self._releases)
        slot.head = running.head if session is None else 0
        slot.private = session is not None  # a conversation's KV is its session's: never snapshotted
        self.changed = True
        matched = running.stream.matched if reason == FINISH_STOP else ""
        running.handle._put(FinishEvent(reason, usage, message, text=tail, code=code, stop_sequence=matched))

    def finish_all(self, reason: str, why: str) -> None:
        """Answer every running request (the engine is stopping or failed): even when the backend, which
        may be what failed, cannot free their slots."""
        for running in list(self.running):
            try:
                self.finish(running, reason, why)
            except Exception:  # the client still gets its answer
                running.handle._put(FinishEvent(reason, Usage(len(running.prompt), len(running.generated_tokens),
                                                               0.0, 0.0), why))
        self.running.clear()
