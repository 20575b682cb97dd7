"""The engine thread: admit requests, prefill, step, stream, cancel.

Exactly one thread (started by `Engine.start`) calls the backend for inference
and owns every slot, running request and speculation state. Callers `submit()`
from any thread and read events from the returned Handle; other threads read
only the frozen `EngineStatus` the engine publishes.

The loop takes what arrived, admits waiting requests to free slots (admission.py
decides where each one's KV comes from; sequences.py carries it out) and runs
one step (step.py): a pure plan of the next decode's rows, its execution (drafts,
the decode, each sequence's draws with its own sampler chain) and its outcome
applied to the sequences (tokens streamed, requests ended, caches fed).

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

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reame.cache import PrefixCache, common_prefix
from reame.engine import admission
from reame.engine.embeddings import EmbeddingJob, Embeddings
from reame.engine.interruption import BackgroundInterruption
from reame.engine.kv import KvStats
from reame.engine.prompt import prompt_tokens
from reame.engine.request import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_TIMEOUT,
    Completion,
    FinishEvent,
    GenerationRequest,
    Handle,
    Usage,
)
from reame.engine.sequences import Sequences
from reame.engine.step import Stepper
from reame.errors import ContextExceeded, EngineUnavailable, ModelError, OverloadedError, RequestError
from reame.model.backend import Backend
from reame.speculative import Speculation
from reame.structured.gbnf import compiled

log = logging.getLogger("reame.engine")

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
    kv: KvStats = KvStats()  # the KV's cells, restores and what idle slots gave up


class Engine:
    """Owns a backend and the one thread that drives it."""

    def __init__(self, backend: Backend, max_queue: int = 0, queue_timeout_s: float = 0.0,
                 prefill_chunk_tokens: int = 128, reserve_tokens: int = 256, cache: PrefixCache | None = None,
                 speculation: Speculation | None = None, first_token_handoff_s: float = FIRST_TOKEN_HANDOFF_S,
                 max_answer_tokens: int = 0, context_per_request: int = 0, owns_backend: bool = False,
                 warm_up: bool = True, rowwise: bool = False) -> None:
        """`max_queue`: most generations waiting for a slot (0 = no limit); `queue_timeout_s`: how long
        one may wait before it fails with FINISH_TIMEOUT (0 = forever); `prefill_chunk_tokens`:
        most prompt tokens fed in a step that also decodes (0 = the whole batch);
        `reserve_tokens`: KV reserved for the answer of a request without max_tokens;
        `cache`: the prefix cache; `speculation`: draft and verify several tokens per step where
        that pays (speculative/). The engine closes both. `first_token_handoff_s`: see FIRST_TOKEN_HANDOFF_S.
        `max_answer_tokens`: the most tokens any answer gets, whatever its request asks (0: the context's room).
        `context_per_request`: the most KV cells one request fills, its prompt and answer together (0, or more
        than one sequence may hold: what one sequence may hold), as llama-server's context per slot is.
        `owns_backend`: close() closes the backend too (once the thread has ended). `warm_up`: a throwaway decode
        before the first request (LlamaBackend.warm_up); a one-shot prompt, whose prompt decodes next, skips it
        (10 ms of SmolLM2-135M's 125 to its first token here). `rowwise`: a step of generating sequences
        alone that carries a greedy or seeded one computes each row as a one-row step does (plan_step), so
        such answers depend neither on drafts nor on the sequences beside them (Backend.supports_rowwise)."""
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
        limits = admission.ContextLimits(backend.n_ctx, min(context_per_request or backend.n_ctx_seq,
                                                            backend.n_ctx_seq), backend.n_seq_max, reserve_tokens)
        self.max_answer_tokens = max_answer_tokens
        self.owns_backend = owns_backend
        self.warms_up = warm_up
        self._exit_lock = threading.Lock()  # close() and the thread's end agree on who frees what, once
        self._release_on_exit = False
        self._released = False
        # Set while no request holds a slot: the prefix cache's disk writer waits for it.
        self.idle = threading.Event()
        self.idle.set()
        if cache is not None:
            cache.follow(self.idle)
        self.status = EngineStatus(idle_prefixes=((),) * backend.n_seq_max)
        self._inbox: queue.SimpleQueue[list[Handle] | EmbeddingJob | None] = queue.SimpleQueue()
        # Generations submitted and not yet admitted to a slot (or answered), and embedding jobs not yet ended,
        # every one counted against max_queue.
        self._queue_lock = threading.Lock()
        self._queued = 0
        # Engine thread only, from here on.
        self._sequences = Sequences(backend, limits, cache, speculation, max_answer_tokens)
        self._interruption = BackgroundInterruption(backend)
        self._stepper = Stepper(backend, self._sequences, cache, speculation, prefill_chunk_tokens,
                                self._interruption, rowwise and backend.supports_rowwise)
        self._waiting: deque[Handle] = deque()
        self._embeddings = Embeddings()
        self._changed = False  # the waiting queue changed since the status was published
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
        # After the put: the engine thread, taking them, must find them there when a decode stops for them.
        self._interruption.arrived(_foreground(handles))
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

    @property
    def context_per_request(self) -> int:
        """The most KV cells one request fills, prompt and answer together (see __init__)."""
        return self._sequences.limits.n_ctx_seq

    def _handle(self, request: GenerationRequest, sink: queue.SimpleQueue | None, tag: int) -> Handle:
        tokens = self.prompt_tokens(request)
        if len(tokens) >= self.context_per_request:
            # max_tokens beyond what the context leaves is clamped instead (the answer then ends with "length"),
            # as llama-server does.
            raise ContextExceeded(len(tokens), self.context_per_request)
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
        job = EmbeddingJob.checked(inputs, self.backend).counted(self._embedding_ended)
        with self._queue_lock:  # a job waits and runs beside generations: it counts against max_queue as one
            self._check_room(1)
            self._queued += 1
            self._inbox.put(job)
        return job

    def _embedding_ended(self) -> None:
        with self._queue_lock:
            self._queued -= 1

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
        """The request's prompt as tokens (see prompt.py)."""
        return prompt_tokens(self.backend, request)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    enable_thinking: bool | None = None) -> str:
        """The model's chat template applied to `messages` (and `tools`), ready for the assistant's turn;
        `enable_thinking`: a thinking model's switch, where its template has one."""
        return self.backend.apply_chat_template(messages, add_assistant=True, tools=tools,
                                                enable_thinking=enable_thinking)

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
            if self.warms_up:
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
            if not self._sequences.running and not self._waiting and not self._embeddings.pending:
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
            if self._changed or self._sequences.changed:
                self._publish()
            if self._sequences.running:
                self._step()

    def _take(self, item: list[Handle] | EmbeddingJob | None) -> bool:
        """File an inbox item; False when it asks the engine to stop."""
        if item is None:
            return False
        if isinstance(item, EmbeddingJob):
            self._embeddings.add(item)
        else:
            self._interruption.taken(_foreground(item))
            self._waiting.extend(item)
            self._changed = True
        return True

    def _publish(self) -> None:
        """Swap in a fresh status (one assignment: readers get all of it or the previous one)."""
        sequences = self._sequences
        idle = tuple(tuple(slot.held) for slot in sequences.slots if slot.running is None)
        recorded = sum(map(len, idle)) + sum(running.n_fed for running in sequences.running)
        in_memory = sum(self.backend.seq_pos_max(slot.seq_id) + 1 for slot in sequences.slots)
        self.status = EngineStatus(len(self._waiting), len(sequences.running), idle, recorded, in_memory,
                                   self.status.dead, sequences.kv_stats(self._embeddings.decodes))
        if sequences.running:
            self.idle.clear()
        else:
            self.idle.set()
        self._changed = sequences.changed = False

    def _die(self, error: BaseException) -> None:
        """Something escaped the loop: every request gets an error, and nothing new is taken."""
        log.critical("the engine thread failed; every request gets an error and the server answers 503 until "
                     "restarted", exc_info=error)
        self.status = EngineStatus(dead=_describe(error) if isinstance(error, Exception) else repr(error))
        self._end(f"the engine failed: {self.status.dead}", FINISH_ERROR)
        self.idle.set()

    def _end(self, why: str, reason: str = FINISH_CANCELLED) -> None:
        """Answer everything still here, and whatever arrives until callers see the engine is gone."""
        self._sequences.finish_all(reason, why)
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
                item.end(why)

    # --- engine thread: admission -----------------------------------------------------------

    def _expire_waiting(self) -> None:
        if not self.queue_timeout_s:
            return
        deadline = time.monotonic() - self.queue_timeout_s
        while self._waiting and self._waiting[0].submitted_at < deadline:
            self._reject(self._waiting.popleft(), FINISH_TIMEOUT,
                         f"no sequence slot became free within {self.queue_timeout_s:g} s")

    def _admit(self) -> None:
        while self._waiting and not self._sequences.full:
            handle = self._waiting[0]
            if handle.cancelled:
                self._reject(self._waiting.popleft(), FINISH_CANCELLED)
                continue
            # Admit only what the shared KV can hold beside what is running; the head of the queue
            # waits (and so does everyone behind it: first come, first served, no starvation).
            if not self._sequences.fits(handle):
                break
            self._waiting.popleft()
            self._dequeued(handle)
            self._changed = True
            try:
                self._sequences.start(handle)
            except Exception as error:  # one bad admission fails its request, not the engine
                log.exception("cannot start a request")
                self._reject(handle, FINISH_ERROR, _describe(error))

    # --- engine thread: a step ----------------------------------------------------------

    def _step(self) -> None:
        """Retire what needs no step, then plan, execute, apply (step.py); a failed step ends what it
        carried, never the thread."""
        self._sequences.retire()
        try:
            self._stepper.step()
        except Exception as error:
            log.exception("engine step failed")
            for running in list(self._sequences.running):
                self._sequences.finish(running, FINISH_ERROR, _describe(error))
        self._hand_over_first_tokens()

    def _hand_over_first_tokens(self) -> None:
        """Let the callers of streamed requests that just got their first token send it before the next
        step takes the cores (at most `first_token_handoff_s` in all)."""
        deadline = time.monotonic() + self.first_token_handoff_s
        first_tokens = self._sequences.first_tokens
        for handle in first_tokens:
            handle.first_delivered.wait(max(0.0, deadline - time.monotonic()))
        first_tokens.clear()

    def _reject(self, handle: Handle, reason: str, message: str = "") -> None:
        self._dequeued(handle)
        self._changed = True
        handle._put(FinishEvent(reason, Usage(len(handle.prompt_tokens), 0, 0.0, 0.0), message))


def _foreground(handles: list[Handle]) -> int:
    """How many of the generations are a person's (not a batch's lines): they interrupt background decodes."""
    return sum(not handle.request.background for handle in handles)


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, ModelError) else f"internal error: {error!r}"
