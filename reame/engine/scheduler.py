"""The engine thread: admit requests, prefill, step, stream, cancel.

Exactly one thread (started by `Engine.start`) calls the backend for inference
and owns every slot, running request and speculation state. Callers `submit()`
from any thread and read events from the returned Handle; other threads read
only the frozen `EngineStatus` the engine publishes, or ask the engine thread
to run something for them (`Engine.call`).

Every step is plan → execute → apply: the plan holds the next token of every
decoding sequence (plus the drafts speculation proposes) and, in the room left
under the batch size, chunks of prompts still being prefilled; execute is one
`backend.decode`; apply samples and verifies each sequence's outputs with its
own sampler chain, emits events and feeds the caches and the cost model.

An idle slot keeps the KV of its last request: a new request goes to the idle
slot whose cached tokens share the longest prefix with its prompt and prefills
only the rest. Cached KV of idle slots is given up first when the context fills.
A request whose prompt another is still prefilling waits for it and then shares its
KV cells and its last prompt token's logits (OpenAI `n`, the Conclave, identical
requests arriving together: one prefill for all); one arriving later starts from the
longest prompt start a running sequence holds, when that beats the idle slots.
With a prefix cache, a prompt whose start was seen before (by this process or
another, in RAM or on disk) restores that KV snapshot instead of prefilling it,
and a prompt that needed much prefill is snapshotted once it is in the KV.

Nothing ends the engine thread without an answer: anything escaping its loop
fails every waiting and running request with an error event, marks the engine
dead (`status.dead`) and refuses new work with EngineUnavailable.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reame.cache import PrefixCache, Snapshot, common_prefix
from reame.model.backend import DECODE_NO_KV_SLOT, Backend
from reame.structured.grammar import GrammarTooAmbiguous
from reame.structured.gbnf import compiled
from reame.engine import admission
from reame.engine.embeddings import EmbeddingJob, Embeddings
from reame.engine.request import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    Completion,
    FinishEvent,
    GenerationRequest,
    Handle,
    SessionState,
    TokenEvent,
    Usage,
)
from reame.model.sampling import chain_steps, log_softmax_of
from reame.engine.slots import Running, Slot
from reame.errors import EngineUnavailable, ModelError, OverloadedError, RequestError
from reame.speculative import Drafting, Speculation

log = logging.getLogger("reame.engine")

# A prompt with at least this many tokens to prefill has its last token decoded in a step of its own.
# A repeat of that prompt finds all but the last token in KV (slot reuse, session, prefix cache) and
# decodes it alone too, so it computes exactly what the first request did: llama.cpp's numerics for a
# token alone differ from those of the same token in a larger batch, and a repeated prompt would
# otherwise get another greedy answer. The price, one decode step, is under 12% of such a prefill here;
# a short tail after a restored prefix is prefilled in one step, as a cold run of it would be.
SOLO_LAST_TOKEN_PREFILL = 64
# The longest a start waits for the prefix cache's check of its newest snapshots (a slow disk).
STARTUP_VERIFICATION_WAIT_S = 10.0
# The longest the step after a streamed request's first token waits for its caller to send that token
# (GenerationRequest.streamed). Sent while that step ran, the handler thread competed with llama.cpp's
# threads for the cores: 0.6-5.3 ms from the decode's end to the first chunk written (a warm question
# after a 2,000-token document, Qwen2.5-Coder-1.5B, 2 threads), against ~0.5 ms handed over.
FIRST_TOKEN_HANDOFF_S = 0.005


@dataclass(frozen=True)
class EngineStatus:
    """What other threads may know of the engine, published whole by the engine thread when it changes."""

    waiting: int = 0  # admitted to the queue, not yet to a slot
    running: int = 0  # requests holding a slot
    idle_prefixes: tuple[tuple[int, ...], ...] = ()  # what each idle slot's KV holds
    kv_recorded: int = 0  # KV cells the slots' records account for (idle caches and running requests)
    kv_in_memory: int = 0  # KV cells the model's memory holds: more than recorded would be a leak
    dead: str = ""  # why the engine stopped working, once it has


@dataclass
class StepPlan:
    """One decode: its rows, and what to do with the outputs once it ran."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    outputs: list[bool] = field(default_factory=list)
    # A sequence, the row of its first output, the drafts that follow it and the source that made them.
    draws: list[tuple[Running, int, list[int], Drafting | None]] = field(default_factory=list)
    prefills: list[tuple[Running, int]] = field(default_factory=list)  # a sequence and the prompt tokens fed
    clones: list[Running] = field(default_factory=list)  # leaders whose followers get their prompt's KV
    decoding: int = 0  # sequences decoding their next token
    drafted: int = 0  # draft tokens carried

    def add(self, tokens: Sequence[int], first_position: int, seq_id: int, output: bool) -> None:
        self.tokens.extend(tokens)
        self.positions.extend(range(first_position, first_position + len(tokens)))
        self.seq_ids.extend([seq_id] * len(tokens))
        self.outputs.extend([output] * len(tokens))


class _Call:
    """A function to run on the engine thread, and its outcome for the caller waiting on it."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function = function
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class Engine:
    """Owns a backend and the one thread that drives it."""

    def __init__(self, backend: Backend, max_queue: int = 0, queue_timeout_s: float = 0.0,
                 prefill_chunk_tokens: int = 128, reserve_tokens: int = 256, cache: PrefixCache | None = None,
                 speculation: Speculation | None = None, first_token_handoff_s: float = FIRST_TOKEN_HANDOFF_S,
                 max_answer_tokens: int = 0, owns_backend: bool = False) -> None:
        """`max_queue`: most generations waiting for a slot (0 = no limit); `queue_timeout_s`: how long
        one may wait before it fails with FINISH_TIMEOUT (0 = forever); `prefill_chunk_tokens`:
        most prompt tokens fed in a step that also decodes (0 = the whole batch);
        `reserve_tokens`: KV reserved for the answer of a request without max_tokens;
        `cache`: the prefix cache; `speculation`: draft and verify several tokens per step where
        that pays (speculative/). The engine closes both. `first_token_handoff_s`: see FIRST_TOKEN_HANDOFF_S.
        `max_answer_tokens`: the most tokens any answer gets, whatever its request asks (0: the context's room).
        `owns_backend`: close() closes the backend too (once the thread has ended)."""
        self.backend = backend
        self.first_token_handoff_s = first_token_handoff_s
        self.cache = cache
        if speculation is not None and not backend.supports_rollback:
            log.info("speculative decoding is off: this model's memory cannot drop rejected drafts")
            speculation.close()
            speculation = None
        self.speculation = speculation
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.reserve_tokens = reserve_tokens
        self._limits = admission.ContextLimits(backend.n_ctx, backend.n_ctx_seq, backend.n_seq_max, reserve_tokens)
        self.max_answer_tokens = max_answer_tokens
        self.owns_backend = owns_backend
        self._exit_lock = threading.Lock()  # close() and the thread's end agree on who frees what, once
        self._release_on_exit = False
        self._released = False
        # Set while no request holds a slot: the prefix cache's disk writer waits for it.
        self.idle = threading.Event()
        self.idle.set()
        if cache is not None:
            cache.follow(self.idle)
        self.status = EngineStatus(idle_prefixes=((),) * backend.n_seq_max)
        self._inbox: queue.SimpleQueue[list[Handle] | EmbeddingJob | _Call | None] = queue.SimpleQueue()
        # Generations submitted and not yet admitted to a slot (or answered), every one counted against max_queue.
        self._queue_lock = threading.Lock()
        self._queued = 0
        # Engine thread only, from here on.
        self._slots = [Slot(seq_id) for seq_id in range(backend.n_seq_max)]
        self._running: list[Running] = []  # in admission order
        self._waiting: deque[Handle] = deque()
        self._embeddings = Embeddings()
        self._admissions = itertools.count()
        self._releases = itertools.count(1)
        self._drafts_paused = False  # one step without drafts after the KV ran full with them
        self._first_tokens: list[Handle] = []  # streamed requests whose first token this step emitted
        self._changed = False  # the status is out of date
        self._thread: threading.Thread | None = None
        self._warmed = threading.Event()  # set once the engine thread's warm-up is over (or failed)
        self._closing = False

    # --- caller side (any thread) ---------------------------------------------------

    def start(self) -> Engine:
        """Start the engine thread; return once its warm-up decode is done and the prefix cache has
        verified its newest snapshots (both at once), so that a server reports ready only when the
        first request no longer pays for them (42 ms and 16 ms a 112 MB snapshot on Qwen2.5-Coder-1.5B)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="reame-engine", daemon=True)
            self._thread.start()
            self._warmed.wait()
            if self.cache is not None and not self.cache.wait_verified(STARTUP_VERIFICATION_WAIT_S):
                log.info("still verifying the prefix cache's newest snapshots; serving meanwhile")
        return self

    def submit(self, request: GenerationRequest, sink: queue.SimpleQueue | None = None, tag: int = 0) -> Handle:
        """Validate and queue a request; RequestError before any work if it cannot run, OverloadedError
        when the queue is full, EngineUnavailable when the engine is stopping or has failed.

        With `sink`, events arrive there as `(tag, event)` instead of on the handle.
        """
        return self.submit_together([request], sink, tag)[0]

    def submit_together(self, requests: Sequence[GenerationRequest], sink: queue.SimpleQueue | None = None,
                        first_tag: int = 0) -> list[Handle]:
        """Validate every request, then queue them as one: they reach the engine thread in the same
        step, so those with one prompt share one prefill (OpenAI `n`, the Conclave). Tags follow on
        from `first_tag`. Nothing is queued if one of them is refused."""
        self._check_available()
        if self.max_queue and len(requests) > self.max_queue:
            raise RequestError(f"this server queues at most {self.max_queue} generations (server.max_queue); this "
                               f"request asks {len(requests)}", param="n", code="too_many_generations")
        self._check_room(len(requests))  # before tokenizing: full is full
        handles = [self._handle(request, sink, first_tag + i) for i, request in enumerate(requests)]
        with self._queue_lock:  # checked and counted as one: two callers cannot both take the last places
            self._check_room(len(handles))
            self._queued += len(handles)
            self._inbox.put(handles)
        return handles

    def _check_room(self, generations: int) -> None:
        if self.max_queue and self._queued + generations > self.max_queue:
            raise OverloadedError(f"{self._queued} generations are already waiting (at most {self.max_queue}); "
                                  "retry shortly")

    def _dequeued(self, handle: Handle) -> None:
        """A submitted generation left the queue (admitted, or answered without a slot): engine thread, once
        per handle."""
        if handle.queued:
            handle.queued = False
            with self._queue_lock:
                self._queued -= 1

    def _handle(self, request: GenerationRequest, sink: queue.SimpleQueue | None, tag: int) -> Handle:
        tokens = self.prompt_tokens(request)
        limit = self.backend.n_ctx_seq
        if len(tokens) >= limit:
            # OpenAI's wording and code, which clients look for; max_tokens beyond what the context
            # leaves is clamped instead (the answer then ends with "length"), as llama-server does.
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt "
                               f"resulted in {len(tokens)} tokens. Please reduce the length of the prompt.",
                               param="prompt", code="context_length_exceeded")
        for token in request.params.logit_bias:
            if token >= self.backend.n_vocab:
                raise RequestError(f"logit_bias token {token} is outside the vocabulary", param="logit_bias")
        handle = Handle(request, tokens, sink, tag)
        if request.params.grammar is not None:  # here, in the caller's thread: never on the engine's
            handle.grammar = compiled(request.params.grammar)
            handle.grammar.start()  # a start already too ambiguous is refused now
        if self.cache is not None and request.session is None:
            # Read here, in the caller's thread, so the engine thread never waits on the disk.
            held = max((common_prefix(prefix, tokens) for prefix in self.status.idle_prefixes), default=0)
            handle.snapshot = self.cache.lookup(tokens[:-1], better_than=held)
        return handle

    def embed(self, inputs: list[list[int]]) -> EmbeddingJob:
        """Queue token inputs for embedding (RequestError at once for one the embedding context cannot
        hold); the engine thread computes them between generation steps."""
        self._check_available()
        job = EmbeddingJob.checked(inputs, self.backend)
        self._inbox.put(job)
        return job

    def call(self, function: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """Run `function` on the engine thread, between two steps, and return what it returns."""
        self._check_available()
        job = _Call(function)
        self._inbox.put(job)
        if not job.done.wait(timeout_s):
            raise EngineUnavailable("the engine did not get to the call in time")
        if job.error is not None:
            raise job.error
        return job.result

    def forget_idle_kv(self) -> None:
        """Drop what idle slots keep for reuse (the KV and the record of it): as after a restart,
        only the prefix cache and sessions remember."""
        def forget() -> None:
            for slot in self._slots:
                if slot.running is None and slot.held:
                    self.backend.seq_rm(slot.seq_id)
                    slot.held = []
            self._changed = True
        self.call(forget)

    def _check_available(self) -> None:
        if self.status.dead:
            raise EngineUnavailable(f"the engine failed and serves nothing until restarted: {self.status.dead}")
        if self._closing:
            raise EngineUnavailable("the engine is shutting down")

    def load(self) -> tuple[int, int]:
        """(generations waiting for a slot, generations running)."""
        return self._queued, self.status.running

    def generate(self, request: GenerationRequest, timeout_s: float | None = None) -> Completion:
        """Submit and wait for the whole result."""
        return self.submit(request).result(timeout_s)

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as tokens: text tokenized with BOS (never twice), a fill-in-the-middle
        prompt built from the model's FIM tokens, or token ids checked against the vocabulary."""
        backend = self.backend
        if request.suffix is not None:
            return self._fill_in_the_middle(request.prompt, request.suffix)
        if isinstance(request.prompt, str):
            tokens = backend.tokenize(request.prompt, add_special=request.add_special, parse_special=True)
            # A chat template may already start with the BOS text: never feed BOS twice.
            if len(tokens) > 1 and tokens[0] == tokens[1] == backend.bos_token:
                del tokens[0]
            if not tokens:
                raise RequestError("the prompt tokenized to zero tokens", param="prompt")
            return tokens
        return self._checked_tokens(request.prompt)

    def _checked_tokens(self, tokens: Sequence[int]) -> list[int]:
        for token in tokens:
            if not 0 <= token < self.backend.n_vocab:
                raise RequestError(f"token id {token} is outside the vocabulary (0..{self.backend.n_vocab - 1})",
                                   param="prompt")
        return list(tokens)

    def _fill_in_the_middle(self, prefix: str | Sequence[int], suffix: str) -> list[int]:
        """Prefix-suffix-middle tokens, as code editors send `prompt` + `suffix`: the model writes the middle.
        User text is tokenized without parsing special tokens, so it cannot forge FIM markers."""
        backend = self.backend
        fim = backend.fim_tokens()
        if fim is None:
            raise RequestError("this model has no fill-in-the-middle tokens; 'suffix' needs a code model such as "
                               "qwen2.5-coder", param="suffix", code="unsupported_parameter")
        pre, suf, mid = fim
        before = backend.tokenize(prefix, add_special=False, parse_special=False) if isinstance(prefix, str) \
            else self._checked_tokens(prefix)
        bos = [backend.bos_token] if backend.add_bos and backend.bos_token >= 0 else []
        return bos + [pre] + before + [suf] + backend.tokenize(suffix, add_special=False, parse_special=False) + [mid]

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The model's chat template applied to `messages` (and `tools`), ready for the assistant's turn."""
        return self.backend.apply_chat_template(messages, add_assistant=True, tools=tools)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Cancel what is running, stop the thread, then free what it used (the cache, the draft sources, and
        the backend when the engine owns it). Never while the thread lives: one still in a step after
        `timeout_s` frees them itself when that step ends (said in the log), and close() returns False.
        Safe to call twice."""
        self._closing = True
        thread = self._thread
        if thread is not None:
            self._inbox.put(None)
            thread.join(timeout_s)
        with self._exit_lock:
            if thread is not None and thread.is_alive():
                self._release_on_exit = True
                log.warning("the engine thread is still in a step after %g s; it frees the model when that step "
                            "ends", timeout_s)
                return False
            self._release()
        return True

    def _release(self) -> None:
        """Free what the engine thread used (once, after it ended; `_exit_lock` held)."""
        if self._released:
            return
        self._released = True
        if self.cache is not None:
            self.cache.close()
        if self.speculation is not None:
            self.speculation.close()
        if self.owns_backend:
            self.backend.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- engine thread: the loop ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._warm_up()
            self._loop()
        except BaseException as error:  # noqa: BLE001 (nothing may end this thread without an answer)
            self._die(error)
        else:
            self._end("the engine shut down")
        finally:
            with self._exit_lock:  # close() gave up waiting: what the thread used is freed now it ends
                if self._release_on_exit:
                    self._release()

    def _warm_up(self) -> None:
        try:
            self.backend.warm_up()  # here, on the thread that will decode (see LlamaBackend.warm_up)
            if self.speculation is not None:
                self.speculation.warm_up()
        except Exception:
            log.exception("warm-up decode failed")
        finally:
            self._warmed.set()

    def _loop(self) -> None:
        inbox = self._inbox
        while True:
            if not self._running and not self._waiting and not self._embeddings.pending:
                self._publish()
                if not self._take(inbox.get()):
                    return
            while True:
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    break
                if not self._take(item):
                    return
            self._expire_waiting()
            if self._embeddings.pending:
                self._embeddings.step(self.backend)
            self._admit()
            if self._changed:
                self._publish()
            if self._running:
                self._step()

    def _take(self, item: list[Handle] | EmbeddingJob | _Call | None) -> bool:
        """File an inbox item; False when it asks the engine to stop."""
        if item is None:
            return False
        if isinstance(item, EmbeddingJob):
            self._embeddings.add(item)
        elif isinstance(item, _Call):
            try:
                item.result = item.function()
            except BaseException as error:  # noqa: BLE001 (the caller gets it)
                item.error = error
            item.done.set()
        else:
            self._waiting.extend(item)
            self._changed = True
        return True

    def _publish(self) -> None:
        """Swap in a fresh status (one assignment: readers get all of it or the previous one)."""
        idle = tuple(tuple(slot.held) for slot in self._slots if slot.running is None)
        recorded = sum(map(len, idle)) + sum(running.n_fed for running in self._running)
        in_memory = sum(self.backend.seq_pos_max(slot.seq_id) + 1 for slot in self._slots)
        self.status = EngineStatus(len(self._waiting), len(self._running), idle, recorded, in_memory,
                                   self.status.dead)
        if self._running:
            self.idle.clear()
        else:
            self.idle.set()
        self._changed = False

    def _die(self, error: BaseException) -> None:
        """Something escaped the loop: every request gets an error, and nothing new is taken."""
        log.critical("the engine thread failed; every request gets an error and the server answers 503 until "
                     "restarted", exc_info=error)
        self.status = EngineStatus(dead=_describe(error) if isinstance(error, Exception) else repr(error))
        self._end(f"the engine failed: {self.status.dead}", FINISH_ERROR)
        self.idle.set()

    def _end(self, why: str, reason: str = FINISH_CANCELLED) -> None:
        """Answer everything still here, and whatever arrives until callers see the engine is gone."""
        for running in list(self._running):
            try:
                self._finish(running, reason, why)
            except Exception:  # the backend may be what failed: the client still gets its answer
                running.handle._put(FinishEvent(reason, Usage(len(running.prompt), len(running.generated_tokens),
                                                               0.0, 0.0), why))
        self._running.clear()
        while self._waiting:
            self._reject(self._waiting.popleft(), reason, why)
        self._embeddings.fail_all(why)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, list):
                for handle in item:
                    self._reject(handle, reason, why)
            elif isinstance(item, EmbeddingJob):
                item.failed(why)
            elif isinstance(item, _Call):
                item.error = EngineUnavailable(why)
                item.done.set()

    # --- engine thread: admission -----------------------------------------------------------

    def _expire_waiting(self) -> None:
        if not self.queue_timeout_s:
            return
        deadline = time.monotonic() - self.queue_timeout_s
        while self._waiting and self._waiting[0].submitted_at < deadline:
            self._reject(self._waiting.popleft(), FINISH_TIMEOUT,
                         f"no sequence slot became free within {self.queue_timeout_s:g} s")

    def _admit(self) -> None:
        while self._waiting and len(self._running) < len(self._slots):
            handle = self._waiting[0]
            if handle.cancelled:
                self._reject(self._waiting.popleft(), FINISH_CANCELLED)
                continue
            # Admit only what the shared KV can hold beside what is running; the head of the queue
            # waits (and so does everyone behind it: first come, first served, no starvation).
            if self._running and admission.reserved_with(self._running, handle, self._limits) > self.backend.n_ctx:
                break
            self._waiting.popleft()
            self._dequeued(handle)
            self._changed = True
            try:
                running = self._start(handle)
            except Exception as error:  # one bad admission fails its request, not the engine
                log.exception("cannot start a request")
                self._reject(handle, FINISH_ERROR, _describe(error))
                continue
            self._running.append(running)

    def _start(self, handle: Handle) -> Running:
        """Give a request a slot with its KV ready to extend, and its own sampler chain."""
        backend = self.backend
        params = handle.request.params
        steps = chain_steps(params, backend.eog_tokens() if params.ignore_eos else (), history=handle.prompt_tokens)
        slot, shared = admission.pick_slot(self._slots, handle.prompt_tokens)
        # On the CPU, over the logits: sampling inside the graph measured slower (see new_sampler).
        sampler = backend.new_sampler(steps)
        try:
            room = backend.n_ctx_seq - len(handle.prompt_tokens)
            most = min(params.max_tokens or room, room, self.max_answer_tokens or room)
            running = Running(handle, slot, sampler, most, next(self._admissions))
            start = admission.plan_start(handle, shared, self._running, backend.supports_rollback)
            leader = start.leader
            if start.source != "slot":
                backend.seq_rm(slot.seq_id)  # what the slot held is not this prompt's start
            if start.source == "donor":  # the cells are shared, not copied
                assert start.donor is not None
                backend.seq_cp(start.donor.seq_id, slot.seq_id, 0, start.shared)
                shared = start.shared
            elif start.source == "saved":
                assert start.saved is not None
                shared = self._restore(start.saved, slot.seq_id, start.shared)
            elif start.source == "slot" and not backend.seq_rm(slot.seq_id, shared, -1):
                backend.seq_rm(slot.seq_id)
                shared = 0
            else:
                shared = start.shared if start.source == "slot" else 0
            running.n_fed = running.cached = shared
            running.solo_last = not handle.request.warm and \
                len(handle.prompt_tokens) - 1 - shared >= SOLO_LAST_TOKEN_PREFILL
            running.snapshot_at = self._snapshot_point(running)
            if self.speculation is not None and not handle.request.warm:
                running.draftings = self.speculation.start(handle.prompt_tokens, handle.grammar)
        except BaseException:
            backend.free_sampler(sampler)
            backend.seq_rm(slot.seq_id)
            slot.held = []
            raise
        slot.running, slot.held = running, []  # only now: a failed start must not lose its slot
        if leader is not None:
            running.leader = leader
            leader.followers.append(running)
        return running

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
        """Restore saved KV into `seq_id` and keep its first `shared` tokens; return how many were kept."""
        cache = self.cache if isinstance(saved, Snapshot) else None
        if not self.backend.seq_state_set(seq_id, saved.blob) or not self.backend.seq_rm(seq_id, shared, -1):
            self.backend.seq_rm(seq_id)  # a blob this context cannot take: prefill everything
            if cache is not None:
                cache.restore_failed(saved)
            return 0
        if cache is not None:
            cache.restored(shared)
        return shared

    # --- engine thread: a step ----------------------------------------------------------

    def _step(self) -> None:
        """Plan, execute, apply; a failed step ends what it carried, never the thread."""
        self._retire()
        plan = self._plan()
        if not plan.tokens:
            return
        try:
            started = time.perf_counter()
            status = self.backend.decode(plan.tokens, plan.positions, plan.seq_ids, plan.outputs)
            seconds = time.perf_counter() - started
            if status == DECODE_NO_KV_SLOT:
                self._relieve_full_kv(plan)
                return
            self._apply(plan, seconds)
        except Exception as error:
            log.exception("engine step failed")
            for running in list(self._running):
                self._finish(running, FINISH_ERROR, _describe(error))
        self._hand_over_first_tokens()

    def _hand_over_first_tokens(self) -> None:
        """Let the callers of streamed requests that just got their first token send it before the next
        step takes the cores (at most `first_token_handoff_s` in all)."""
        deadline = time.monotonic() + self.first_token_handoff_s
        for handle in self._first_tokens:
            handle.first_delivered.wait(max(0.0, deadline - time.monotonic()))
        self._first_tokens.clear()

    def _retire(self) -> None:
        """End what needs no step: cancelled requests, and warm requests whose prompt is snapshotted."""
        for running in list(self._running):
            if running.handle.cancelled:
                self._finish(running, FINISH_CANCELLED)
            elif running.handle.request.warm and running.n_fed >= max(running.snapshot_at, 0):
                self._finish(running, FINISH_STOP)

    def _plan(self) -> StepPlan:
        """The next decode: each decoding sequence's next token and the drafts its controller finds worth
        verifying, then prompt chunks in the room left."""
        plan = StepPlan()
        decoding = [running for running in self._running if running.next_token is not None]
        plan.decoding = len(decoding)
        for running in decoding:
            drafting, drafts = self._drafts(running, plan.decoding + plan.drafted, plan.decoding) \
                if running.draftings else (None, [])
            plan.drafted += len(drafts)
            plan.draws.append((running, len(plan.tokens), drafts, drafting))
            plan.add([running.next_token, *drafts], running.n_fed, running.seq_id, True)
        # Prompts are fed beside the decoding sequences, at most `prefill_chunk_tokens` per step so
        # a long newcomer delays running streams by one chunk, never by its whole prompt. With no
        # stream to protect, a prompt takes the whole batch.
        budget = self.backend.n_batch - len(plan.tokens)
        if plan.tokens and self.prefill_chunk_tokens:
            budget = min(budget, self.prefill_chunk_tokens)
        for running in self._running:
            if running.next_token is not None or running.n_fed >= len(running.prompt) or budget <= 0 or \
                    running.leader is not None:
                continue
            end = len(running.prompt)
            if running.solo_last and running.n_fed < end - 1:
                end -= 1  # the last token goes alone, in a later step
            take = min(budget, end - running.n_fed)
            start = running.n_fed
            plan.add(running.prompt[start:start + take], start, running.seq_id, False)
            if start + take == len(running.prompt) and not running.handle.request.warm:
                plan.outputs[-1] = True
                plan.draws.append((running, len(plan.tokens) - 1, [], None))
                plan.draws.extend((follower, len(plan.tokens) - 1, [], None) for follower in running.followers)
                if running.followers:
                    plan.clones.append(running)
            plan.prefills.append((running, take))
            budget -= take
        return plan

    def _relieve_full_kv(self, plan: StepPlan) -> None:
        """The shared context is full. Drafts go first (the next step runs without them), then the KV
        that idle slots keep for reuse; only then does a running sequence give way."""
        if plan.drafted:
            self._drafts_paused = True
            return
        cached = [slot for slot in self._slots if slot.running is None and slot.held]
        if cached:
            largest = max(cached, key=lambda slot: len(slot.held))
            self.backend.seq_rm(largest.seq_id)
            largest.held = []
            self._changed = True
            return
        # The one furthest beyond its reservation ran the KV out (ties: the newest).
        offender = max(self._running, key=lambda r: (r.n_fed - admission.reservation(r.handle, self._limits),
                                                     r.admission))
        self._finish(offender, FINISH_LENGTH, "the context is full")

    def _apply(self, plan: StepPlan, seconds: float) -> None:
        """What a decode that ran means: prompt progress (and snapshots), each sequence's draws, the cost model."""
        for running, take in plan.prefills:
            running.n_fed += take
            if running.n_fed == running.snapshot_at:
                assert self.cache is not None
                self.cache.offer(Snapshot(tuple(running.prompt[:running.n_fed]),
                                          self.backend.seq_state_get(running.seq_id)))
        for leader in plan.clones:
            self._clone_prompt(leader)
        self._drafts_paused = False
        for running, index, drafts, drafting in plan.draws:
            self._verify(running, index, drafts, drafting)
        if self.speculation is not None:
            if not plan.prefills:  # prompt tokens need no logits: cheaper than the rows a verification outputs
                self.speculation.cost.observe(len(plan.tokens), seconds)
            self.speculation.stats.step(plan.drafted > 0)

    def _clone_prompt(self, leader: Running) -> None:
        """The leader's whole prompt is in its KV: its followers share those cells from now on."""
        for follower in leader.followers:
            self.backend.seq_cp(leader.seq_id, follower.seq_id, 0, len(leader.prompt))
            follower.n_fed = follower.cached = len(leader.prompt)
            follower.leader = None
        leader.followers = []

    def _hand_over(self, leader: Running) -> None:
        """A leader ends before its prompt is in: the first follower takes over what it prefilled so
        far and leads the others."""
        heir, *others = leader.followers
        leader.followers = []
        self.backend.seq_cp(leader.seq_id, heir.seq_id, 0, leader.n_fed)
        heir.n_fed = heir.cached = leader.n_fed
        heir.leader, heir.followers = None, others
        for follower in others:
            follower.leader = heir

    def _drafts(self, running: Running, batch_tokens: int, sequences: int) -> tuple[Drafting | None, list[int]]:
        """Tokens to verify after the sequence's next one, and their source: as many as its
        controller finds worth it, within the answer's and the context's room and the batch."""
        assert self.speculation is not None
        if self._drafts_paused or len(running.generated_tokens) < 2:
            # Not in the step right after the first token: drafting (a long prompt's lookup index, the
            # Palimpsest's search) would keep this thread on the GIL while the handler waits to send it.
            return None, []
        room = min(running.max_tokens - len(running.generated_tokens) - 1,
                   self.backend.n_ctx_seq - running.n_fed - 1,
                   self.backend.n_batch - batch_tokens - 1)
        if room <= 0:
            return None, []
        return self.speculation.propose(running.draftings, batch_tokens, sequences, room)

    def _verify(self, running: Running, index: int, drafts: list[int], drafting: Drafting | None) -> None:
        """Sample the sequence's outputs in order: drafts are accepted while the model's own choice
        equals them; its first different choice (or the token after the last draft) ends the run.

        Drafts put all their probability on one token, so Leviathan's rule (accept with p(d), else
        draw from p without d) is exactly "draw from p, keep it if it is d": every emitted token is
        a plain draw from the model with the request's chain, greedy or not.
        """
        backend = self.backend
        top = running.handle.request.logprobs
        chosen: list[tuple[int, tuple]] = []
        for row in range(len(drafts) + 1):
            token = backend.sample(running.sampler, index + row)
            chosen.append((token, () if top is None else log_softmax_of(backend.logits(index + row), token, top)))
            if row == len(drafts) or token != drafts[row]:
                break
        accepted = len(chosen) - 1
        if running.next_token is not None:  # it and the accepted drafts are in the KV; the rest goes
            running.n_fed += 1 + accepted
            if accepted < len(drafts):
                backend.seq_rm(running.seq_id, running.n_fed, -1)
        if drafting is not None:
            assert self.speculation is not None
            self.speculation.verified(drafting, len(drafts), accepted)
            running.drafted += len(drafts)
            running.accepted_drafts += accepted
        for token, logprobs in chosen:
            self._on_token(running, token, *logprobs)
            if running.next_token is None or running.slot.running is not running:
                break

    def _on_token(self, running: Running, token: int, logprob: float | None = None,
                  top: tuple[tuple[int, float], ...] = ()) -> None:
        backend = self.backend
        if not running.first_token_at:
            running.first_token_at = time.perf_counter()
        if backend.is_eog(token):
            running.next_token = None
            self._finish(running, FINISH_STOP)
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
            self._first_tokens.append(running.handle)
        if running.stream.stopped:
            self._finish(running, FINISH_STOP)
        elif len(running.generated_tokens) >= running.max_tokens:
            self._finish(running, FINISH_LENGTH)
        elif running.n_fed + 1 > backend.n_ctx_seq:
            self._finish(running, FINISH_LENGTH, "the context is full")
        else:
            running.next_token = token

    def _follow_grammar(self, running: Running, piece: bytes) -> bool:
        """Read the token's text into the request's grammar state; False when that ended the request (the
        text leaves the grammar more ambiguous than it may be: a clear error, not a stalled engine)."""
        assert running.grammar is not None
        try:
            if not running.grammar.feed(running.grammar_text.decode(piece)):
                running.grammar = None  # llama.cpp's sampler allowed what ours refuses: nothing to bound
        except GrammarTooAmbiguous as error:
            running.next_token = None
            self._finish(running, FINISH_ERROR, str(error), code="grammar_too_ambiguous")
            return False
        return True

    def _finish(self, running: Running, reason: str, message: str = "", code: str = "") -> None:
        now = time.perf_counter()
        session = running.handle.request.session
        kept = reason in (FINISH_STOP, FINISH_LENGTH)
        held = running.held() if kept else []
        if session is not None and kept:
            session.state = running.session_state(self.backend.seq_state_get(running.seq_id))
        tail = "" if reason == FINISH_CANCELLED else running.stream.flush()
        first = running.first_token_at or now
        usage = Usage(len(running.prompt), len(running.generated_tokens), first - running.admitted_at, now - first,
                      running.cached, running.drafted, running.accepted_drafts)
        self._running.remove(running)
        if running.followers:
            self._hand_over(running)
        if running.leader is not None:
            running.leader.followers.remove(running)
        slot = running.slot
        if not held:
            self.backend.seq_rm(slot.seq_id)
        self.backend.free_sampler(running.sampler)
        Speculation.release(running.draftings)
        # Kept for the next request that shares its prefix; `used` makes it the most recently used.
        slot.running, slot.held, slot.used = None, held, next(self._releases)
        self._changed = True
        running.handle._put(FinishEvent(reason, usage, message, text=tail, code=code))

    def _reject(self, handle: Handle, reason: str, message: str = "") -> None:
        self._dequeued(handle)
        self._changed = True
        handle._put(FinishEvent(reason, Usage(len(handle.prompt_tokens), 0, 0.0, 0.0), message))


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, ModelError) else f"internal error: {error!r}"
