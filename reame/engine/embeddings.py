"""Embeddings on the engine thread: jobs of token inputs, computed between generation steps.

A job is checked in its caller's thread (EmbeddingJob.checked) and queued through the engine's inbox; the
engine thread owns `Embeddings` and runs one embedding decode per loop turn (the next inputs of the oldest
job that fit one batch), so a large request slows the running generations, never stalls them. Pooled
vectors are unit length, as OpenAI's are (a dot product is the cosine); a model whose embeddings are not
pooled (pooling "none") gives each token's vector as computed, every input's in turn.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence

from reame.errors import ModelError, RequestError
from reame.model.backend import Backend

log = logging.getLogger("reame.engine")
MAX_INPUTS = 2048  # per job, every route's (OpenAI's limit per request): a job is computed whole once queued


class EmbeddingJob:
    """Token inputs to embed, and the caller's end of the job: the engine thread fills `vectors`
    (unit length, in input order) or `error`, then sets `done`. A job counts against the engine's queue
    from its submission to its end (`on_end`, called once)."""

    def __init__(self, inputs: list[list[int]], on_end: Callable[[], None] = lambda: None) -> None:
        self.inputs = inputs
        self.vectors: list[list[float]] = []
        self.error = ""
        self.done = threading.Event()
        self.cancelled = False  # set by the caller whose client left: the engine drops the rest of the job
        self._on_end = on_end

    @classmethod
    def checked(cls, inputs: list[list[int]], backend: Backend) -> EmbeddingJob:
        """A job for `inputs`; RequestError for too many inputs, one the embedding context cannot hold or a
        token outside the vocabulary (in the caller's thread, before anything is queued)."""
        if len(inputs) > MAX_INPUTS:
            raise RequestError(f"at most {MAX_INPUTS} inputs per request; this one has {len(inputs)}",
                               param="input", code="invalid_value")
        limit = backend.embedding_context_tokens
        for index, tokens in enumerate(inputs):
            if not tokens:
                raise RequestError(f"input {index} is empty", param="input")
            if len(tokens) > limit:
                raise RequestError(f"This model's maximum context length for embeddings is {limit} tokens. However, "
                                   f"input {index} has {len(tokens)} tokens, too large: please reduce its length.",
                                   param="input", code="context_length_exceeded")
            for token in tokens:
                if not 0 <= token < backend.n_vocab:
                    raise RequestError(f"token id {token} is outside the vocabulary", param="input")
        return cls(inputs)

    def counted(self, on_end: Callable[[], None]) -> EmbeddingJob:
        """This job, calling `on_end` once when it ends (the engine's queue count)."""
        self._on_end = on_end
        return self

    def end(self, error: str = "") -> None:
        """The job is over, computed (no `error`), failed or cancelled; once."""
        if self.done.is_set():
            return
        self.error = error
        self._on_end()
        self.done.set()

    def cancel(self) -> None:
        """The caller no longer wants the vectors: the engine drops the job before its next batch."""
        self.cancelled = True

    def result(self, timeout_s: float | None = None) -> list[list[float]]:
        if not self.done.wait(timeout_s):
            raise TimeoutError("the embeddings were not ready in time")
        if self.error:
            raise ModelError(self.error)
        return self.vectors


class Embeddings:
    """The queued jobs and how far each is. Engine thread only."""

    def __init__(self) -> None:
        self._jobs: deque[tuple[EmbeddingJob, int]] = deque()  # jobs and how many of their inputs are done
        self.decodes = 0  # embedding decode calls made, for the engine's status

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def add(self, job: EmbeddingJob) -> None:
        self._jobs.append((job, 0))

    def step(self, backend: Backend) -> None:
        """One embedding decode: the next inputs of the oldest job that fit one batch (a cancelled job is
        dropped instead)."""
        job, done = self._jobs[0]
        if job.cancelled:
            self._jobs.popleft()
            job.end("cancelled: the client left")
            return
        end, tokens = done, 0
        while end < len(job.inputs) and end - done < backend.embedding_batch and \
                tokens + len(job.inputs[end]) <= backend.embedding_context_tokens:
            tokens += len(job.inputs[end])
            end += 1
        self.decodes += 1
        try:
            vectors = backend.embed(job.inputs[done:end])
            # A token's vector (pooling "none") is given as the model computed it, as llama-server gives it.
            job.vectors.extend(map(unit_length, vectors) if backend.embeddings_pooled else vectors)
        except Exception as error:  # one failed job fails alone
            log.exception("embedding failed")
            self._jobs.popleft()
            job.end(str(error) if isinstance(error, ModelError) else f"internal error: {error!r}")
            return
        if end < len(job.inputs):
            self._jobs[0] = (job, end)
            return
        self._jobs.popleft()
        job.end()

    def fail_all(self, why: str) -> None:
        while self._jobs:
            self._jobs.popleft()[0].end(why)


def unit_length(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to length 1 (OpenAI's embeddings are normalised: a dot product is the cosine)."""
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return [value / norm for value in vector] if norm > 0 else list(vector)
