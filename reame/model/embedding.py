"""Embeddings over the model's weights: a second context that pools each sequence into one vector (or, with
pooling "none", gives each token's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reame.errors import ModelError
from reame.model.backend import DECODE_OK, EMBEDDING_SEQUENCES
from reame.model.library import last_llama_error


class EmbeddingContext:
    """A second context over the same weights that pools each sequence into one vector.

    Its own KV and batch, cleared after every call, so embeddings never touch what generation holds;
    it shares the generation context's threadpool and is driven by the same (engine) thread.
    A sequence must fit one physical batch (pooling needs all its tokens at once): n_ubatch = n_ctx.
    """

    def __init__(self, api: Any, model: Any, threads: int, n_ctx: int, pooling: int, threadpool: Any) -> None:
        self._api = api
        params = api.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = EMBEDDING_SEQUENCES
        params.n_threads = params.n_threads_batch = threads
        params.embeddings = True
        params.pooling_type = pooling
        params.kv_unified = True
        params.no_perf = True
        self._ctx = api.llama_init_from_model(model, params)
        if not self._ctx:
            raise ModelError(f"cannot create an embedding context of {n_ctx} tokens{last_llama_error()}")
        if threadpool:
            api.llama_attach_threadpool(self._ctx, threadpool, threadpool)
        self._memory = api.llama_get_memory(self._ctx)
        self._batch = api.llama_batch_init(n_ctx, 0, 1)

    def embed(self, inputs: Sequence[Sequence[int]], n_embd: int, pooled: bool = True) -> list[list[float]]:
        """Each input's pooled vector; not `pooled` (a context made with pooling "none"), each token's, every
        input's in turn."""
        n = sum(len(tokens) for tokens in inputs)
        if not inputs or len(inputs) > EMBEDDING_SEQUENCES or n > self._api.llama_n_batch(self._ctx):
            raise ModelError(f"an embedding batch takes 1..{EMBEDDING_SEQUENCES} inputs within its context")
        batch = self._batch
        i = 0
        for seq_id, tokens in enumerate(inputs):
            for position, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.seq_id[i][0], batch.logits[i] = token, position, seq_id, True
                batch.n_seq_id[i] = 1
                i += 1
        batch.n_tokens = n
        try:
            status = self._api.llama_decode(self._ctx, batch)
            if status != DECODE_OK:
                raise ModelError(f"embedding decode failed with status {status}{last_llama_error()}")
            vectors = []
            if not pooled:
                for row in range(n):
                    pointer = self._api.llama_get_embeddings_ith(self._ctx, row)
                    if not pointer:
                        raise ModelError("the embedding context returned no vector for a token")
                    vectors.append(pointer[:n_embd])
                return vectors
            for seq_id in range(len(inputs)):
                pointer = self._api.llama_get_embeddings_seq(self._ctx, seq_id)
                if not pointer:
                    raise ModelError("the embedding context returned no pooled vector")
                vectors.append(pointer[:n_embd])
            return vectors
        finally:
            self._api.llama_memory_clear(self._memory, True)

    def close(self) -> None:
        if self._batch is not None:
            self._api.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            self._api.llama_free(self._ctx)
            self._ctx = None
