"""The engine thread: admit requests, prefill, step, stream, cancel.

Exactly one thread (started by `Engine.start`) calls the backend for inference.
Callers `submit()` from any thread and read events from the returned Handle.
Every step is one `backend.decode` carrying the next token of every decoding
sequence plus, in the room left under the batch size, chunks of prompts still
being prefilled; each sequence samples with its own sampler chain.

An idle slot keeps the KV of its last request: a new request goes to the idle
slot whose cached tokens share the longest prefix with its prompt and prefills
only the rest. Cached KV of idle slots is given up first when the context fills.
With a prefix cache, a prompt whose start was seen before (by this process or
another, in RAM or on disk) restores that KV snapshot instead of prefilling it,
and a prompt that needed much prefill is snapshotted once it is in the KV.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from reame.cache import PrefixCache, Snapshot, common_prefix
from reame.engine.backend import DECODE_NO_KV_SLOT, Backend
from reame.engine.request import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    Completion,
    EmbeddingJob,
    FinishEvent,
    GenerationRequest,
    Handle,
    SessionState,
    TokenEvent,
    Usage,
)
from reame.engine.sampling import chain_steps, log_softmax_of
from reame.engine.textstream import TextStream
from reame.errors import ModelError, OverloadedError, RequestError
from reame.speculative import Drafting, Speculation

log = logging.getLogger("reame.engine")

# A cached prefix is worth taking a slot for when it covers this much of the new prompt.
MIN_REUSED_TOKENS = 2
MIN_REUSED_SHARE = 0.1
# A prompt with at least this many tokens to prefill has its last token decoded in a step of its own.
# A repeat of that prompt finds all but the last token in KV (slot reuse, session, prefix cache) and
# decodes it alone too, so it computes exactly what the first request did: llama.cpp's numerics for a
# token alone differ from those of the same token in a larger batch, and a repeated prompt would
# otherwise get another greedy answer. The price, one decode step, is under 12% of such a prefill here;
# a short tail after a restored prefix is prefilled in one step, as a cold run of it would be.
SOLO_LAST_TOKEN_PREFILL = 64


class _Sequence:
    """One admitted request while it holds a sequence slot."""

    __slots__ = (
        "accepted_drafts",
        "drafted",
        "draftings",
        "generated_tokens",
        "cached",
        "admission",
        "admitted_at",
        "first_token_at",
        "handle",
        "max_tokens",
        "n_fed",
        "next_token",
        "prompt",
        "sampler",
        "seq_id",
        "snapshot_at",
        "solo_last",
        "stream",
    )

    def __init__(self, handle: Handle, seq_id: int, sampler: object, max_tokens: int, admission: int) -> None:
        self.handle = handle
        self.admission = admission  # admission order: breaks ties when the KV is full
        self.seq_id = seq_id
        self.sampler = sampler
        self.prompt = handle.prompt_tokens
        self.n_fed = 0  # tokens of this sequence in the KV cache
        self.next_token: int | None = None  # sampled, not yet decoded
        self.generated_tokens: list[int] = []  # emitted so far; with the prompt, what the slot will hold
        self.cached = 0  # prompt tokens found in the KV instead of prefilled
        self.snapshot_at = -1  # KV length at which to snapshot the prompt into the prefix cache (-1: never)
        self.solo_last = False  # decode the last prompt token in a step of its own (SOLO_LAST_TOKEN_PREFILL)
        self.max_tokens = max_tokens
        self.stream = TextStream(handle.request.params.stop)
        self.admitted_at = time.perf_counter()
        self.first_token_at = 0.0
        self.draftings: list[Drafting] = []  # speculative decoding's sources, when the request allows it
        self.drafted = self.accepted_drafts = 0


class Engine:
    """Owns a backend and the one thread that drives it."""

    def __init__(self, backend: Backend, max_queue: int = 0, queue_timeout_s: float = 0.0,
                 prefill_chunk_tokens: int = 128, reserve_tokens: int = 256, cache: PrefixCache | None = None,
                 speculation: Speculation | None = None) -> None:
        """`max_queue`: most requests waiting for a slot (0 = no limit); `queue_timeout_s`: how long
        one may wait before it fails with FINISH_TIMEOUT (0 = forever); `prefill_chunk_tokens`:
        most prompt tokens fed in a step that also decodes (0 = the whole batch);
        `reserve_tokens`: KV reserved for the answer of a request without max_tokens;
        `cache`: the prefix cache; `speculation`: draft and verify several tokens per step where
        that pays (speculative/). The engine closes both."""
        self.backend = backend
        self.cache = cache
        if speculation is not None and not backend.supports_rollback:
            log.info("speculative decoding is off: this model's memory cannot drop rejected drafts")
            speculation.close()
            speculation = None
        self.speculation = speculation
        self._drafts_paused = False  # one step without drafts after the KV ran full with them
        if cache is not None:
            cache.engine_busy = lambda: bool(self._active)  # its disk writer waits for the gaps
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.reserve_tokens = reserve_tokens
        self._inbox: queue.SimpleQueue[Handle | EmbeddingJob | None] = queue.SimpleQueue()
        self._waiting: deque[Handle] = deque()
        self._embedding: deque[tuple[EmbeddingJob, int]] = deque()  # jobs and how many inputs are done
        self._active: list[_Sequence] = []
        # Idle sequence slots and the tokens their KV still holds, least recently used first.
        self._idle: dict[int, list[int]] = {seq_id: [] for seq_id in range(backend.n_seq_max)}
        self._admissions = itertools.count()
        self._thread: threading.Thread | None = None
        self._closing = False

    # --- caller side (any thread) ---------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="reame-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, request: GenerationRequest, sink: "queue.SimpleQueue | None" = None, tag: int = 0) -> Handle:
        """Validate and queue a request; RequestError before any work if it cannot run.

        With `sink`, events arrive there as `(tag, event)` instead of on the handle.
        """
        if self._closing:
            raise RequestError("the engine is shutting down")
        if self.max_queue and self.load()[0] >= self.max_queue:
            raise OverloadedError(f"{self.max_queue} requests are already waiting; retry shortly")
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
        if self.cache is not None and request.session is None:
            # Read here, in the caller's thread, so the engine thread never waits on the disk.
            handle.snapshot = self.cache.lookup(tokens[:-1], better_than=self._best_idle_prefix(tokens))
        self._inbox.put(handle)
        return handle

    def embed(self, inputs: list[list[int]]) -> EmbeddingJob:
        """Queue token inputs for embedding (RequestError at once for one the embedding context cannot
        hold); the engine thread computes them between generation steps."""
        if self._closing:
            raise RequestError("the engine is shutting down")
        limit = self.backend.embedding_context_tokens
        for index, tokens in enumerate(inputs):
            if not tokens:
                raise RequestError(f"input {index} is empty", param="input")
            if len(tokens) > limit:
                raise RequestError(f"This model's maximum context length for embeddings is {limit} tokens. However, "
                                   f"input {index} has {len(tokens)} tokens. Please reduce its length.",
                                   param="input", code="context_length_exceeded")
            for token in tokens:
                if not 0 <= token < self.backend.n_vocab:
                    raise RequestError(f"token id {token} is outside the vocabulary", param="input")
        job = EmbeddingJob(inputs)
        self._inbox.put(job)
        return job

    def _best_idle_prefix(self, tokens: list[int]) -> int:
        """How much of `tokens` an idle slot already holds (a hint read outside the engine thread)."""
        return max((common_prefix(cached, tokens) for cached in list(self._idle.values())), default=0)

    def load(self) -> tuple[int, int]:
        """(requests waiting, sequences running): a snapshot for metrics, read from any thread."""
        return len(self._waiting) + self._inbox.qsize(), len(self._active)

    def generate(self, request: GenerationRequest, timeout_s: float | None = None) -> Completion:
        """Submit and wait for the whole result."""
        return self.submit(request).result(timeout_s)

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        backend = self.backend
        if isinstance(request.prompt, str):
            tokens = backend.tokenize(request.prompt, add_special=request.add_special, parse_special=True)
            # A chat template may already start with the BOS text: never feed BOS twice.
            if len(tokens) > 1 and tokens[0] == tokens[1] == backend.bos_token:
                del tokens[0]
            if not tokens:
                raise RequestError("the prompt tokenized to zero tokens", param="prompt")
            return tokens
        tokens = list(request.prompt)
        for token in tokens:
            if not 0 <= token < backend.n_vocab:
                raise RequestError(f"token id {token} is outside the vocabulary (0..{backend.n_vocab - 1})",
                                   param="prompt")
        return tokens

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The model's chat template applied to `messages` (and `tools`), ready for the assistant's turn."""
        return self.backend.apply_chat_template(messages, add_assistant=True, tools=tools)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel what is running, stop the thread. Safe to call twice."""
        self._closing = True
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout_s)
            self._thread = None
        if self.cache is not None:
            self.cache.close()
        if self.speculation is not None:
            self.speculation.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.backend.warm_up()  # here, on the thread that will decode (see LlamaBackend.warm_up)
            if self.speculation is not None:
                self.speculation.warm_up()
        except Exception:
            log.exception("warm-up decode failed")
        inbox = self._inbox
        while True:
            if not self._active and not self._waiting and not self._embedding:
                item = inbox.get()
                if item is None:
                    break
                self._take(item)
            stop = False
            while True:
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                self._take(item)
            if stop:
                break
            if self._embedding:
                self._embed_some()
            self._admit()
            if self._active:
                try:
                    self._step()
                except Exception as error:  # a failed step ends what it carried, never the thread
                    log.exception("engine step failed")
                    for sequence in list(self._active):
                        self._finish(sequence, FINISH_ERROR, _describe(error))
        for sequence in list(self._active):
            self._finish(sequence, FINISH_CANCELLED, "the engine shut down")
        while self._waiting:
            self._reject(self._waiting.popleft(), FINISH_CANCELLED, "the engine shut down")
        while self._embedding:
            job, _ = self._embedding.popleft()
            job.error = "the engine shut down"
            job.done.set()

    def _take(self, item: Handle | EmbeddingJob) -> None:
        if isinstance(item, EmbeddingJob):
            self._embedding.append((item, 0))
        else:
            self._waiting.append(item)

    def _embed_some(self) -> None:
        """One embedding decode: the next inputs of the oldest job that fit one batch. Between two of
        them the running generations take a step, so a large embeddings request slows them, never stalls them."""
        job, done = self._embedding[0]
        backend = self.backend
        end, tokens = done, 0
        while end < len(job.inputs) and end - done < backend.embedding_batch and \
                tokens + len(job.inputs[end]) <= backend.embedding_context_tokens:
            tokens += len(job.inputs[end])
            end += 1
        try:
            job.vectors.extend(unit_length(vector) for vector in backend.embed(job.inputs[done:end]))
        except Exception as error:  # one failed job fails alone
            log.exception("embedding failed")
            job.error = _describe(error)
            end = len(job.inputs)
        if end < len(job.inputs):
            self._embedding[0] = (job, end)
            return
        self._embedding.popleft()
        job.done.set()

    def _admit(self) -> None:
        if self.queue_timeout_s:
            deadline = time.monotonic() - self.queue_timeout_s
            while self._waiting and self._waiting[0].submitted_at < deadline:
                self._reject(self._waiting.popleft(), FINISH_TIMEOUT,
                             f"no sequence slot became free within {self.queue_timeout_s:g} s")
        while self._waiting and self._idle:
            handle = self._waiting[0]
            if handle.cancelled:
                self._reject(self._waiting.popleft(), FINISH_CANCELLED)
                continue
            # Admit only what the shared KV can hold beside what is running; the head of the queue
            # waits (and so does everyone behind it: first come, first served, no starvation).
            if self._active and self._reserved() + self._reservation(handle) > self.backend.n_ctx:
                break
            self._waiting.popleft()
            try:
                sequence = self._start(handle)
            except Exception as error:  # one bad admission fails its request, not the engine
                log.exception("cannot start a request")
                self._reject(handle, FINISH_ERROR, _describe(error))
                continue
            self._active.append(sequence)

    def _start(self, handle: Handle) -> _Sequence:
        """Give a request a sequence slot with an empty KV and its own sampler chain."""
        backend = self.backend
        params = handle.request.params
        steps = chain_steps(params, backend.eog_tokens() if params.ignore_eos else ())
        seq_id, shared = self._pick_slot(handle.prompt_tokens)
        speculate = self.speculation is not None and not handle.request.warm
        # On the CPU, over the logits: sampling inside the graph measured slower (see new_sampler).
        sampler = backend.new_sampler(steps)
        try:
            if params.penalised:
                window = handle.prompt_tokens if params.repeat_last_n < 0 else \
                    handle.prompt_tokens[-params.repeat_last_n:]
                for token in window:
                    backend.accept(sampler, token)
            room = backend.n_ctx_seq - len(handle.prompt_tokens)
            max_tokens = min(params.max_tokens or room, room)
            sequence = _Sequence(handle, seq_id, sampler, max_tokens, next(self._admissions))
            saved = self._best_saved_state(handle)
            from_saved = min(common_prefix(saved.tokens, handle.prompt_tokens), len(handle.prompt_tokens) - 1) \
                if saved is not None else 0
            if from_saved > shared:
                backend.seq_rm(seq_id)
                shared = self._restore(saved, seq_id, from_saved)
            elif not (shared and backend.seq_rm(seq_id, shared, -1)):
                backend.seq_rm(seq_id)
                shared = 0
            sequence.n_fed = sequence.cached = shared
            sequence.solo_last = not handle.request.warm and \
                len(handle.prompt_tokens) - 1 - shared >= SOLO_LAST_TOKEN_PREFILL
            sequence.snapshot_at = self._snapshot_point(sequence)
            if speculate:
                assert self.speculation is not None
                sequence.draftings = self.speculation.start(handle.prompt_tokens)
        except BaseException:
            backend.free_sampler(sampler)
            backend.seq_rm(seq_id)
            self._idle[seq_id] = []
            raise
        del self._idle[seq_id]  # only now: a failed start must not lose its slot
        return sequence

    def _snapshot_point(self, sequence: _Sequence) -> int:
        """Where a prompt's KV is snapshotted into the prefix cache (-1: never): when all but its last
        token are in, if that took enough prefill to be worth it. A warm request is snapshotted whole."""
        cache = self.cache
        request = sequence.handle.request
        if cache is None or request.session is not None:
            return -1
        if request.warm:
            return len(sequence.prompt) if not cache.has(sequence.prompt) else -1
        end = len(sequence.prompt) - 1
        return end if sequence.solo_last and end - sequence.cached >= cache.min_new_tokens else -1

    def _reservation(self, handle: Handle) -> int:
        """KV cells a request may fill: its prompt and its answer (max_tokens, or a default share)."""
        params = handle.request.params
        room = self.backend.n_ctx_seq - len(handle.prompt_tokens)
        return len(handle.prompt_tokens) + min(room, params.max_tokens or self.reserve_tokens)

    def _reserved(self) -> int:
        return sum(self._reservation(sequence.handle) for sequence in self._active)

    def _pick_slot(self, prompt: list[int]) -> tuple[int, int]:
        """The idle slot sharing the longest prefix with `prompt`, and how many of its cached
        tokens can be kept (never the whole prompt: the last prompt token is always decoded,
        for its logits). When no slot shares a useful prefix (a BOS is not one), an empty slot
        or else the least recently used one is taken, so other slots keep their caches."""
        best, best_shared = next(iter(self._idle)), 0
        for seq_id, cached in self._idle.items():
            shared = common_prefix(cached, prompt)
            if shared > best_shared:
                best, best_shared = seq_id, shared
        if best_shared < max(MIN_REUSED_TOKENS, len(prompt) * MIN_REUSED_SHARE):
            best = next((seq_id for seq_id, cached in self._idle.items() if not cached), next(iter(self._idle)))
            best_shared = common_prefix(self._idle[best], prompt)
        return best, min(best_shared, len(prompt) - 1)

    @staticmethod
    def _best_saved_state(handle: Handle) -> SessionState | Snapshot | None:
        """The request's session or its prefix-cache snapshot, whichever covers more of the prompt."""
        saved = [state for state in (handle.request.session, handle.snapshot) if state is not None and state.blob]
        return max(saved, key=lambda state: common_prefix(state.tokens, handle.prompt_tokens), default=None)

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

    def _step(self) -> None:
        backend = self.backend
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        outputs: list[bool] = []
        # sequence, its first output's index, its drafts and the source that made them
        samplers: list[tuple[_Sequence, int, list[int], Drafting | None]] = []
        decoding = []
        for sequence in list(self._active):
            if sequence.handle.cancelled:
                self._finish(sequence, FINISH_CANCELLED)
            elif sequence.handle.request.warm and sequence.n_fed >= max(sequence.snapshot_at, 0):
                self._finish(sequence, FINISH_STOP)  # prefilled and snapshotted: warming ends here
            elif sequence.next_token is not None:
                decoding.append(sequence)
        drafted_here = len(decoding)  # tokens the step carries so far: what the draft controllers weigh
        for sequence in decoding:
            drafting, drafts = self._drafts(sequence, drafted_here, len(decoding)) if sequence.draftings \
                else (None, [])
            drafted_here += len(drafts)
            samplers.append((sequence, len(tokens), drafts, drafting))
            tokens.append(sequence.next_token)
            tokens.extend(drafts)
            positions.extend(range(sequence.n_fed, sequence.n_fed + 1 + len(drafts)))
            seq_ids.extend([sequence.seq_id] * (1 + len(drafts)))
            outputs.extend([True] * (1 + len(drafts)))
        # Prompts are fed beside the decoding sequences, at most `prefill_chunk_tokens` per step so
        # a long newcomer delays running streams by one chunk, never by its whole prompt. With no
        # stream to protect, a prompt takes the whole batch.
        budget = backend.n_batch - len(tokens)
        if tokens and self.prefill_chunk_tokens:
            budget = min(budget, self.prefill_chunk_tokens)
        prefilled: list[tuple[_Sequence, int]] = []
        for sequence in self._active:
            if sequence.next_token is not None or sequence.n_fed >= len(sequence.prompt) or budget <= 0:
                continue
            end = len(sequence.prompt)
            if sequence.solo_last and sequence.n_fed < end - 1:
                end -= 1  # the last token goes alone, in a later step
            take = min(budget, end - sequence.n_fed)
            start = sequence.n_fed
            tokens.extend(sequence.prompt[start:start + take])
            positions.extend(range(start, start + take))
            seq_ids.extend([sequence.seq_id] * take)
            outputs.extend([False] * take)
            if start + take == len(sequence.prompt) and not sequence.handle.request.warm:
                outputs[-1] = True
                samplers.append((sequence, len(tokens) - 1, [], None))
            prefilled.append((sequence, take))
            budget -= take
        if not tokens:
            return
        started = time.perf_counter()
        if backend.decode(tokens, positions, seq_ids, outputs) == DECODE_NO_KV_SLOT:
            # The shared context is full. Drafts go first (the next step runs without them), then the
            # KV that idle slots keep for reuse; only then does a running sequence give way (below).
            if drafted_here > len(decoding):
                self._drafts_paused = True
                return
            cached = [seq_id for seq_id, tokens in self._idle.items() if tokens]
            if cached:
                largest = max(cached, key=lambda seq_id: len(self._idle[seq_id]))
                backend.seq_rm(largest)
                self._idle[largest] = []
                return
            # The one furthest beyond its reservation ran the KV out (ties: the newest).
            offender = max(self._active, key=lambda s: (s.n_fed - self._reservation(s.handle), s.admission))
            self._finish(offender, FINISH_LENGTH, "the context is full")
            return
        for sequence, take in prefilled:
            sequence.n_fed += take
            if sequence.n_fed == sequence.snapshot_at:
                self.cache.offer(Snapshot(tuple(sequence.prompt[:sequence.n_fed]),
                                          backend.seq_state_get(sequence.seq_id)))
        self._drafts_paused = False
        for sequence, index, drafts, drafting in samplers:
            self._verify(sequence, index, drafts, drafting)
        if self.speculation is not None:
            if not prefilled:  # prompt tokens need no logits: cheaper than the rows a verification outputs
                self.speculation.cost.observe(len(tokens), time.perf_counter() - started)
            self.speculation.stats.step(drafted_here > len(decoding))

    def _drafts(self, sequence: _Sequence, batch_tokens: int, sequences: int) -> tuple[Drafting | None, list[int]]:
        """Tokens to verify after the sequence's next one, and their source: as many as its
        controller finds worth it, within the answer's and the context's room and the batch."""
        assert self.speculation is not None
        if self._drafts_paused:
            return None, []
        room = min(sequence.max_tokens - len(sequence.generated_tokens) - 1,
                   self.backend.n_ctx_seq - sequence.n_fed - 1,
                   self.backend.n_batch - batch_tokens - 1)
        if room <= 0:
            return None, []
        return self.speculation.propose(sequence.draftings, batch_tokens, sequences, room)

    def _verify(self, sequence: _Sequence, index: int, drafts: list[int], drafting: Drafting | None) -> None:
        """Sample the sequence's outputs in order: drafts are accepted while the model's own choice
        equals them; its first different choice (or the token after the last draft) ends the run.

        Drafts put all their probability on one token, so Leviathan's rule (accept with p(d), else
        draw from p without d) is exactly "draw from p, keep it if it is d": every emitted token is
        a plain draw from the model with the request's chain, greedy or not.
        """
        backend = self.backend
        top = sequence.handle.request.logprobs
        chosen: list[tuple[int, tuple]] = []
        for row in range(len(drafts) + 1):
            token = backend.sample(sequence.sampler, index + row)
            chosen.append((token, () if top is None else log_softmax_of(backend.logits(index + row), token, top)))
            if row == len(drafts) or token != drafts[row]:
                break
        accepted = len(chosen) - 1
        if sequence.next_token is not None:  # it and the accepted drafts are in the KV; the rest goes
            sequence.n_fed += 1 + accepted
            if accepted < len(drafts):
                backend.seq_rm(sequence.seq_id, sequence.n_fed, -1)
        if drafting is not None:
            assert self.speculation is not None
            self.speculation.verified(drafting, len(drafts), accepted)
            sequence.drafted += len(drafts)
            sequence.accepted_drafts += accepted
        for token, logprobs in chosen:
            self._on_token(sequence, token, *logprobs)
            if sequence.next_token is None or sequence not in self._active:
                break

    def _on_token(self, sequence: _Sequence, token: int, logprob: float | None = None,
                  top: tuple[tuple[int, float], ...] = ()) -> None:
        backend = self.backend
        if not sequence.first_token_at:
            sequence.first_token_at = time.perf_counter()
        if backend.is_eog(token):
            sequence.next_token = None
            self._finish(sequence, FINISH_STOP)
            return
        sequence.generated_tokens.append(token)
        if sequence.draftings:
            assert self.speculation is not None
            self.speculation.observe(sequence.draftings, (token,))
        text = sequence.stream.push(backend.token_piece(token))
        sequence.handle._put(TokenEvent(token, text, logprob, top))
        if sequence.stream.stopped:
            self._finish(sequence, FINISH_STOP)
        elif len(sequence.generated_tokens) >= sequence.max_tokens:
            self._finish(sequence, FINISH_LENGTH)
        elif sequence.n_fed + 1 > backend.n_ctx_seq:
            self._finish(sequence, FINISH_LENGTH, "the context is full")
        else:
            sequence.next_token = token

    def _finish(self, sequence: _Sequence, reason: str, message: str = "") -> None:
        now = time.perf_counter()
        session = sequence.handle.request.session
        kept = reason in (FINISH_STOP, FINISH_LENGTH)
        # What the KV now holds: the prompt and the generated tokens already decoded.
        held = (sequence.prompt + sequence.generated_tokens)[:sequence.n_fed] if kept else []
        if session is not None and kept:
            session.tokens = held
            session.blob = self.backend.seq_state_get(sequence.seq_id)
        tail = "" if reason == FINISH_CANCELLED else sequence.stream.flush()
        first = sequence.first_token_at or now
        usage = Usage(len(sequence.prompt), len(sequence.generated_tokens), first - sequence.admitted_at, now - first,
                      sequence.cached, sequence.drafted, sequence.accepted_drafts)
        self._active.remove(sequence)
        if not held:
            self.backend.seq_rm(sequence.seq_id)
        self.backend.free_sampler(sequence.sampler)
        Speculation.release(sequence.draftings)
        self._idle[sequence.seq_id] = held  # kept for the next request that shares its prefix (dict order = LRU)
        sequence.handle._put(FinishEvent(reason, usage, message, tail))

    def _reject(self, handle: Handle, reason: str, message: str = "") -> None:
        handle._put(FinishEvent(reason, Usage(len(handle.prompt_tokens), 0, 0.0, 0.0), message))


def unit_length(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to length 1 (OpenAI's embeddings are normalised: a dot product is the cosine)."""
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return [value / norm for value in vector] if norm > 0 else list(vector)


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, ModelError) else f"internal error: {error!r}"
