"""Embeddings on the engine thread: jobs of token inputs, computed between generation steps.

A job is checked in its caller's thread (EmbeddingJob.checked) and queued through the engine's inbox; the
engine thread owns `Embeddings` and runs one embedding decode per loop turn (the next inputs of the oldest
job that fit one batch), so a large request slows the running generations, never stalls them. Vectors are
unit length, as OpenAI's are (a dot product is the cosine).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Sequence

from reame.errors import ModelError, RequestError
from reame.model.backend import Backend

log = logging.getLogger("reame.engine")


class EmbeddingJob:
    """Token inputs to embed, and the caller's end of the job: the engine thread fills `vectors`
    (unit length, in input order) or `error`, then sets `done`."""

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.vectors: list[list[float]] = []
        self.error = ""
        self.done = threading.Event()

    @classmethod
    def checked(cls, inputs: list[list[int]], backend: Backend) -> EmbeddingJob:
        """A job for `inputs`; RequestError for one the embedding context cannot hold or a token outside the
        vocabulary (in the caller's thread, before anything is queued)."""
        limit = backend.embedding_context_tokens
        for index, tokens in enumerate(inputs):
            if not tokens:
                raise RequestError(f"input {index} is empty", param="input")
            if len(tokens) > limit:
                raise RequestError(f"This model's maximum context length for embeddings is {limit} tokens. However, "
                                   f"input {index} has {len(tokens)} tokens. Please reduce its length.",
                                   param="input", code="context_length_exceeded")
            for token in tokens:
                if not 0 <= token < backend.n_vocab:
                    raise RequestError(f"token id {token} is outside the vocabulary", param="input")
        return cls(inputs)

    def failed(self, why: str) -> None:
        self.error = why
        self.done.set()

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

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def add(self, job: EmbeddingJob) -> None:
        self._jobs.append((job, 0))

    def step(self, backend: Backend) -> None:
        """One embedding decode: the next inputs of the oldest job that fit one batch."""
        job, done = self._jobs[0]
        end, tokens = done, 0
        while end < len(job.inputs) and end - done < backend.embedding_batch and \
                tokens + len(job.inputs[end]) <= backend.embedding_context_tokens:
            tokens += len(job.inputs[end])
            end += 1
        try:
            job.vectors.extend(unit_length(vector) for vector in backend.embed(job.inputs[done:end]))
        except Exception as error:  # one failed job fails alone
            log.exception("embedding failed")
            job.error = str(error) if isinstance(error, ModelError) else f"internal error: {error!r}"
            end = len(job.inputs)
        if end < len(job.inputs):
            self._jobs[0] = (job, end)
            return
        self._jobs.popleft()
        job.done.set()

    def fail_all(self, why: str) -> None:
        while self._jobs:
            self._jobs.popleft()[0].failed(why)


def unit_length(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to length 1 (OpenAI's embeddings are normalised: a dot product is the cosine)."""
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return [value / norm for value in vector] if norm > 0 else list(vector)
