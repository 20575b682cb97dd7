"""LlamaBackend: the Backend over our ctypes binding: a LoadedModel (model/loaded_model.py) with a context.

Threading: a backend is owned by the engine thread. Only `tokenize`,
`detokenize`, `token_piece` and `apply_chat_template` (read-only vocabulary
work) may be called from other threads.
"""

from __future__ import annotations

import array
import ctypes
import heapq
import threading
from collections.abc import Sequence
from typing import Any

from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library
from reame.errors import ModelError
from reame.model.backend import (DECODE_INTERRUPTED, DECODE_NO_KV_SLOT, DECODE_OK, EMBEDDING_POOLING,
                                 EMBEDDING_SEQUENCES, ModelSettings, usable_cores)
from reame.model.embedding import EmbeddingContext
from reame.model.library import forget_llama_errors, last_llama_error
from reame.model.loaded_model import LoadedModel
from reame.model.sampler_chain import Candidates, GrammarOnRejection, new_chain
from reame.model.sampling import Step

# What ggml's per-thread reference-kernel flag (Reame's patch) was last set to on each decoding thread.
_decoding_thread = threading.local()


class LlamaBackend(LoadedModel):
    """A llama model and one context over it, driven through ctypes."""

    def __init__(self, settings: ModelSettings, loaded: LoadedModel | None = None) -> None:
        """`loaded`: the same model file already loaded (a one-shot tokenized its prompt with it to size the
        context), taken over instead of loading the file again."""
        settings = settings.validated()
        if loaded is None:
            super().__init__(settings)
        else:
            if loaded.settings.path != settings.path:
                raise ValueError(f"{loaded.settings.path} is not {settings.path}")
            self._take_over(loaded)
        api = self._api
        self.settings = settings
        self._ctx = None
        self._batch = None
        self._threadpool: int | None = None
        self._attached: dict[object, int] = {}  # sampler chain -> the sequence it samples in-graph
        self._candidates: Candidates | None = None  # the greedy grammar fallback's scratch (GrammarOnRejection)
        self._embedder: EmbeddingContext | None = None  # made by the first `embed`
        forget_llama_errors()

        threads = settings.n_threads or usable_cores()
        ctx_params = api.llama_context_default_params()
        ctx_params.n_ctx = settings.n_ctx
        ctx_params.n_batch = settings.n_batch
        ctx_params.n_ubatch = min(settings.n_ubatch, settings.n_batch)
        ctx_params.n_seq_max = settings.n_seq_max
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = settings.n_threads_batch or threads
        ctx_params.kv_unified = settings.unified_kv
        ctx_params.no_perf = False
        kv_type = {"f16": t.GGML_TYPE_F16, "q8_0": t.GGML_TYPE_Q8_0, "q4_0": t.GGML_TYPE_Q4_0}[settings.kv_type]
        ctx_params.type_k = kv_type
        ctx_params.type_v = kv_type
        ctx_params.flash_attn_type = {"auto": t.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": t.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                      "off": t.LLAMA_FLASH_ATTN_TYPE_DISABLED}[settings.flash_attn]
        self._ctx = api.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            self.close()
            raise ModelError(f"cannot create a context of {settings.n_ctx} tokens for {settings.path}"
                             f"{last_llama_error()}")
        self._threadpool = self._attach_threadpool(threads)
        self._set_rowwise = self._cpu_function(b"ggml_cpu_set_thread_use_ref", t.ggml_cpu_set_thread_use_ref_t)
        self.supports_rowwise = self._set_rowwise is not None
        # ggml asks the abort callback after every graph node, on the decoding thread with the GIL released:
        # it is libc's strlen over a two-byte flag (1, 0: stop; 0, 0: go on), so that no Python runs there.
        self._stop_flag = ctypes.create_string_buffer(2)
        self._stop_check = ctypes.cast(ctypes.CDLL(None).strlen, t.ggml_abort_callback)
        api.llama_set_abort_callback(self._ctx, self._stop_check, ctypes.cast(self._stop_flag, ctypes.c_void_p))
        self._memory = api.llama_get_memory(self._ctx)

        self.n_threads = threads
        self.n_ctx = api.llama_n_ctx(self._ctx)
        self.n_ctx_seq = api.llama_n_ctx_seq(self._ctx)
        self.n_seq_max = api.llama_n_seq_max(self._ctx)
        self.n_batch = api.llama_n_batch(self._ctx)
        self.supports_rollback = not (api.llama_model_is_recurrent(self._model)
                                      or api.llama_model_is_hybrid(self._model))
        self.can_shift = bool(api.llama_memory_can_shift(self._memory))
        self.embedding_context_tokens = settings.embedding_ctx
        self._batch = api.llama_batch_init(self.n_batch, 0, 1)
        for i in range(self.n_batch):
            self._batch.n_seq_id[i] = 1
        self._outputs: frozenset[int] = frozenset()

    def _attach_threadpool(self, threads: int) -> int | None:
        """A persistent CPU threadpool for this context, as llama-server has.

        Without one, ggml builds and frees a throwaway pool for every graph
        computation; keeping one measured about 3% faster decode on 2 cores.
        Returns the pool (freed in close), or None when the CPU backend offers none.
        """
        api = self._api
        make = self._cpu_function(b"ggml_threadpool_new", t.ggml_threadpool_new_t)
        free = self._cpu_function(b"ggml_threadpool_free", t.ggml_threadpool_free_t)
        if make is None or free is None:
            return None
        params = api.ggml_threadpool_params_default(threads)
        pool = make(ctypes.byref(params))
        if not pool:
            return None
        self._free_threadpool = free
        api.llama_attach_threadpool(self._ctx, pool, pool)
        return pool

    def _rowwise_kernels(self, on: bool) -> None:
        """ggml's reference kernels on or off for the graphs this (the decoding) thread computes next: Reame's
        patch to the pinned ggml (third_party/patches), read where a graph is planned, so decode by decode. A
        thread's flag, not a context's: a draft model and the embedding context decode on the same thread."""
        if on != getattr(_decoding_thread, "rowwise", False) and self._set_rowwise is not None:
            self._set_rowwise(on)
            _decoding_thread.rowwise = on

    def _cpu_function(self, name: bytes, prototype: Any) -> Any:
        """A function of ggml's CPU backend (ggml-cpu.h) by name, reached through its registry because the
        backend may be a run-time-loaded variant library; None where the library has none."""
        api = self._api
        if not api.available("ggml_backend_reg_get_proc_address"):
            return None
        device = api.ggml_backend_dev_by_type(t.GGML_BACKEND_DEVICE_TYPE_CPU)
        registry = api.ggml_backend_dev_backend_reg(device) if device else None
        address = api.ggml_backend_reg_get_proc_address(registry, name) if registry else None
        return prototype(address) if address else None

    def describe(self) -> dict[str, Any]:
        buffer = ctypes.create_string_buffer(256)
        self._api.llama_model_desc(self._model, buffer, 256)
        return {
            "description": buffer.value.decode("utf-8", "replace"),
            "architecture": self.architecture,
            "parameters": self._api.llama_model_n_params(self._model),
            "size_bytes": self._api.llama_model_size(self._model),
            "n_ctx_train": self._api.llama_model_n_ctx_train(self._model),
            "n_vocab": self.n_vocab,
            "n_ctx": self.n_ctx,
            "n_threads": self.n_threads,
            "chat_template": self.has_chat_template,
        }

    # --- inference (engine thread only) -----------------------------------------------

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool], rowwise: bool = False) -> int:
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ModelError(f"a batch must hold 1..{self.n_batch} tokens, got {n}")
        self._rowwise_kernels(rowwise)
        batch = self._batch
        assert batch is not None, "allocated with the context"
        token_array, pos_array, seq_array, logit_array = batch.token, batch.pos, batch.seq_id, batch.logits
        for i in range(n):
            token_array[i] = tokens[i]
            pos_array[i] = positions[i]
            seq_array[i][0] = seq_ids[i]
            logit_array[i] = outputs[i]
        batch.n_tokens = n
        status = self._api.llama_decode(self._ctx, batch)
        if status == DECODE_OK:
            self._outputs = frozenset(i for i in range(n) if outputs[i])
            return DECODE_OK
        self._outputs = frozenset()
        if status == DECODE_NO_KV_SLOT:
            return DECODE_NO_KV_SLOT
        if status == DECODE_INTERRUPTED:
            # llama.cpp dropped the positions of the micro-batch it stopped in; earlier ones (a batch over
            # n_ubatch) stay unless dropped here, and the caller counts on none of the batch being kept.
            starts: dict[int, int] = {}
            for i in range(n):
                starts[seq_ids[i]] = min(starts.get(seq_ids[i], positions[i]), positions[i])
            for seq_id, start in starts.items():
                self.seq_rm(seq_id, start, -1)
            return DECODE_INTERRUPTED
        raise ModelError(f"llama_decode failed with status {status}{last_llama_error()}")

    def interrupt(self, stop: bool) -> None:
        self._stop_flag[0] = b"\x01" if stop else b"\x00"

    def new_sampler(self, steps: Sequence[Step], seq_id: int | None = None) -> object:
        """A sampler for `steps`. A grammar without penalties gets a `GrammarOnRejection`: the grammar is
        asked only about the token drawn without it and, when it refuses that, greedy, about the best-ranked
        tokens (this backend's `Candidates`), over the whole vocabulary only when none of those settles it."""
        kinds = [step.kind for step in steps]
        if kinds[:1] == ["grammar"] and "penalties" not in kinds and seq_id is None:
            if self._candidates is None:
                self._candidates = Candidates(self.n_vocab)
            return GrammarOnRejection.of(self._api, self._vocab, self.n_vocab, steps, self._candidates)
        return self._chain(steps, seq_id)

    def _chain(self, steps: Sequence[Step], seq_id: int | None = None) -> object:
        """A llama sampler chain; with `seq_id`, attached to that sequence.

        An attached chain runs inside the decode graph ("backend sampling") and
        `sample()`/`top_tokens()` read what the graph picked. On this CPU backend
        that is slower than sampling afterwards over the logits (bench/sampling.py:
        a step takes 1.03-1.09x as long greedy or with a temperature, 1.46-1.57x
        with top_p, which sorts the vocabulary in the graph), so the engine keeps
        its chains on the CPU. The draft model attaches its top-k: its ten
        candidates come out of the graph instead of a vocabulary-sized array read
        in Python. A chain is attached at most once (llama.cpp asserts on a second
        attach) and detached by `free_sampler`.
        """
        chain = new_chain(self._api, self._vocab, self.n_vocab, steps)
        if seq_id is not None and self._api.llama_set_sampler(self._ctx, seq_id, chain):
            self._attached[chain] = seq_id
        return chain

    def sample(self, sampler: object, index: int) -> int:
        # A wrong index makes llama.cpp abort the whole process: check it here.
        if index not in self._outputs:
            raise ModelError(f"no logits at batch index {index}")
        api = self._api
        if isinstance(sampler, GrammarOnRejection):
            return sampler.sample(api, self._ctx, index)
        return api.llama_sampler_sample(sampler, self._ctx, index)

    def free_sampler(self, sampler: object) -> None:
        if isinstance(sampler, GrammarOnRejection):
            sampler.free(self._api)
            return
        seq_id = self._attached.pop(sampler, None)
        if seq_id is not None:
            self._api.llama_set_sampler(self._ctx, seq_id, None)
        self._api.llama_sampler_free(sampler)

    def logits(self, index: int) -> Sequence[float]:
        if index not in self._outputs:
            raise ModelError(f"no logits at batch index {index}")
        pointer = self._api.llama_get_logits_ith(self._ctx, index)
        values = array.array("f")
        values.frombytes(ctypes.string_at(pointer, self.n_vocab * 4))
        return values

    def top_tokens(self, index: int, k: int) -> list[tuple[int, float]]:
        """Cheap when a chain attached to the sequence kept only its top k candidates inside the
        graph (as the draft model's does); otherwise a scan of the whole vocabulary's logits."""
        if index not in self._outputs:
            raise ModelError(f"no logits at batch index {index}")
        api, ctx = self._api, self._ctx
        count = api.llama_get_sampled_candidates_count_ith(ctx, index)
        if count and api.llama_get_sampled_logits_count_ith(ctx, index) == count:
            ids = api.llama_get_sampled_candidates_ith(ctx, index)
            values = api.llama_get_sampled_logits_ith(ctx, index)
            pairs = [(ids[i], values[i]) for i in range(count)]
        else:
            logits = self.logits(index)
            pairs = [(token, logits[token]) for token in heapq.nlargest(k, range(self.n_vocab), key=logits.__getitem__)]
        pairs.sort(key=lambda pair: -pair[1])
        return pairs[:k]

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self._api.llama_memory_seq_rm(self._memory, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._api.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int) -> int:
        return self._api.llama_memory_seq_pos_max(self._memory, seq_id)

    def seq_reuse(self, seq_id: int, chunks: Sequence[tuple[int, int, int]]) -> None:
        # As llama-server moves them (server-context.cpp, cache reuse): what lies between a run's new and old
        # start goes (earlier runs are already below it, later ones still at their old positions), the run
        # moves down; then whatever is past the last run goes. llama.cpp re-rotates the moved keys at the
        # next decode.
        end = 0
        for old, new, n in chunks:
            if old != new:
                self._api.llama_memory_seq_rm(self._memory, seq_id, new, old)
                self._api.llama_memory_seq_add(self._memory, seq_id, old, old + n, new - old)
            end = new + n
        self._api.llama_memory_seq_rm(self._memory, seq_id, end, -1)

    def clear(self) -> None:
        self._api.llama_memory_clear(self._memory, True)

    def seq_state_get(self, seq_id: int) -> memoryview:
        """The sequence's state, written by llama.cpp straight into the buffer returned (no copy)."""
        size = self._api.llama_state_seq_get_size(self._ctx, seq_id)
        data = bytearray(size)
        written = self._api.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size,
                                                     seq_id)
        return memoryview(data)[:written]

    @property
    def embedding_pooling(self) -> str:
        """The pooling embeddings use: the setting, else the model's own (embedding models say), else mean."""
        if self.settings.embedding_pooling != "auto":
            return self.settings.embedding_pooling
        own = self.meta(f"{self.architecture}.pooling_type")
        by_number = {str(number): name for name, number in EMBEDDING_POOLING.items()}
        return by_number.get(own or "", "mean")

    @property
    def embedding_batch(self) -> int:
        return EMBEDDING_SEQUENCES

    @property
    def embeddings_pooled(self) -> bool:
        return self.embedding_pooling != "none"

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        self._rowwise_kernels(False)  # an embedding is the same whatever step came before it
        if self._embedder is None:
            self._embedder = EmbeddingContext(self._api, self._model, self.n_threads, self.settings.embedding_ctx,
                                               EMBEDDING_POOLING[self.embedding_pooling], self._threadpool)
        return self._embedder.embed(inputs, self.n_embd, self.embeddings_pooled)

    def kv_fingerprint(self) -> bytes:
        return self.settings.kv_fingerprint()

    def warm_up(self) -> None:
        """One throwaway decode, as llama.cpp's tools do at load, so the first request does not pay for
        faulting in the mapped weights (0.1-0.2 s on Qwen2.5-Coder-1.5B here); and the vocabulary's
        end-of-generation tokens, listed once.

        Call it from the thread that will decode: ggml's OpenMP team belongs to the thread that first
        computes, and a second team (a warm-up on another thread) made every later step ~18% slower.
        """
        self.decode([max(self.bos_token, 0)], [0], [0], [True])
        self.seq_rm(0)
        # The end-of-generation list asks llama.cpp about every token (38 ms for Qwen2.5's 151,936): a
        # first request with ignore_eos paid it between its prefix-cache lookup and its restore.
        self.eog_tokens()

    def seq_state_set(self, seq_id: int, blob: bytes | memoryview) -> bool:
        """Restore a sequence; False (never garbage) when the blob does not fit this context."""
        if not blob:
            return False
        array_type = ctypes.c_uint8 * len(blob)
        writable = isinstance(blob, bytearray) or (isinstance(blob, memoryview) and not blob.readonly)
        buffer = array_type.from_buffer(blob) if writable else array_type.from_buffer_copy(blob)
        return self._api.llama_state_seq_set_data(self._ctx, buffer, len(blob), seq_id) > 0

    def close(self) -> None:
        api = self._api
        for sampler in list(self._attached):
            self.free_sampler(sampler)
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        if self._batch is not None:
            api.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            api.llama_free(self._ctx)
            self._ctx = None
        if self._threadpool:
            self._free_threadpool(self._threadpool)
            self._threadpool = None
        super().close()
