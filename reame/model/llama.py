"""LlamaBackend: the Backend over our ctypes binding, the only class that calls into libllama.

Threading: a backend is owned by the engine thread. Only `tokenize`,
`detokenize`, `token_piece` and `apply_chat_template` (read-only vocabulary
work) may be called from other threads.
"""

from __future__ import annotations

import array
import ctypes
import heapq
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library
from reame.errors import ModelError
from reame.model.backend import (BUILTIN_TEMPLATE_BY_ARCH, DECODE_NO_KV_SLOT, DECODE_OK, EMBEDDING_POOLING,
                                 EMBEDDING_SEQUENCES,
                                 TEMPLATE_SPECIAL_TOKENS, ModelSettings, fallback_chat_format, usable_cores)
from reame.model.fingerprint import remembered
from reame.model.embedding import EmbeddingContext
from reame.model.library import forget_llama_errors, init_native, last_llama_error
from reame.model.sampler_chain import GrammarOnRejection, new_chain
from reame.model.sampling import Step

if TYPE_CHECKING:
    from reame.model.chat_template import ChatTemplate

log = logging.getLogger("reame.engine")


class LlamaBackend:
    """A llama model and one context over it, driven through ctypes."""

    def __init__(self, settings: ModelSettings) -> None:
        settings = settings.validated()
        init_native()
        from reame.ctypes_llama import api
        self._api = api
        self.settings = settings
        self._model = None
        self._ctx = None
        self._batch = None
        self._threadpool: int | None = None
        self._attached: dict[object, int] = {}  # sampler chain -> the sequence it samples in-graph
        forget_llama_errors()

        model_params = api.llama_model_default_params()
        model_params.n_gpu_layers = 0
        mode = t.LLAMA_LOAD_MODE_MMAP if settings.use_mmap else t.LLAMA_LOAD_MODE_NONE
        if settings.use_mlock:
            mode = t.LLAMA_LOAD_MODE_MMAP_MLOCK if settings.use_mmap else t.LLAMA_LOAD_MODE_MLOCK
        model_params.load_mode = mode
        self._model = api.llama_model_load_from_file(os.fsencode(settings.path), model_params)
        if not self._model:
            raise ModelError(f"cannot load model {settings.path}{last_llama_error()}")

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
        self._memory = api.llama_get_memory(self._ctx)
        self._vocab = api.llama_model_get_vocab(self._model)

        self.n_threads = threads
        self.n_vocab = api.llama_vocab_n_tokens(self._vocab)
        self.n_ctx = api.llama_n_ctx(self._ctx)
        self.n_ctx_seq = api.llama_n_ctx_seq(self._ctx)
        self.n_seq_max = api.llama_n_seq_max(self._ctx)
        self.n_batch = api.llama_n_batch(self._ctx)
        self.bos_token = api.llama_vocab_bos(self._vocab)
        self.eos_token = api.llama_vocab_eos(self._vocab)
        self.add_bos = bool(api.llama_vocab_get_add_bos(self._vocab))
        self.architecture = self.meta("general.architecture") or ""
        self.supports_rollback = not (api.llama_model_is_recurrent(self._model)
                                      or api.llama_model_is_hybrid(self._model))
        self.can_shift = bool(api.llama_memory_can_shift(self._memory))
        template = api.llama_model_chat_template(self._model, None)
        self._chat_template: bytes | None = template or (
            BUILTIN_TEMPLATE_BY_ARCH[self.architecture].encode()
            if self.architecture in BUILTIN_TEMPLATE_BY_ARCH else None)
        self.has_chat_template = self._chat_template is not None
        # The model's own Jinja template, compiled when first used: a raw one-shot prompt never imports jinja2.
        self._jinja_source = template if settings.chat_template == "jinja" else None
        self._jinja_compiled: ChatTemplate | None = None
        self._jinja_lock = threading.Lock()

        self.n_embd = api.llama_model_n_embd(self._model)
        self.sliding_window = api.llama_model_n_swa(self._model)
        self.embedding_context_tokens = settings.embedding_ctx
        self._embedder: EmbeddingContext | None = None  # made by the first `embed`
        self._batch = api.llama_batch_init(self.n_batch, 0, 1)
        for i in range(self.n_batch):
            self._batch.n_seq_id[i] = 1
        self._outputs: frozenset[int] = frozenset()
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_list: list[int] | None = None

    def _attach_threadpool(self, threads: int) -> int | None:
        """A persistent CPU threadpool for this context, as llama-server has.

        Without one, ggml builds and frees a throwaway pool for every graph
        computation; keeping one measured about 3% faster decode on 2 cores.
        Returns the pool (freed in close), or None when the CPU backend offers none.
        """
        api = self._api
        if not api.available("ggml_backend_reg_get_proc_address"):
            return None
        device = api.ggml_backend_dev_by_type(t.GGML_BACKEND_DEVICE_TYPE_CPU)
        registry = api.ggml_backend_dev_backend_reg(device) if device else None
        make = api.ggml_backend_reg_get_proc_address(registry, b"ggml_threadpool_new") if registry else None
        free = api.ggml_backend_reg_get_proc_address(registry, b"ggml_threadpool_free") if registry else None
        if not make or not free:
            return None
        params = api.ggml_threadpool_params_default(threads)
        pool = t.ggml_threadpool_new_t(make)(ctypes.byref(params))
        if not pool:
            return None
        self._free_threadpool = t.ggml_threadpool_free_t(free)
        api.llama_attach_threadpool(self._ctx, pool, pool)
        return pool

    # --- vocabulary (thread-safe reads) -----------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        api = self._api
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buffer = (ctypes.c_int32 * capacity)()
            n = api.llama_tokenize(self._vocab, data, len(data), buffer, capacity, add_special, parse_special)
            if n >= 0:
                return list(buffer[:n])
            if -n <= capacity:
                raise ModelError(f"tokenization failed for a text of {len(data)} bytes")
            capacity = -n

    def token_piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            if not 0 <= token < self.n_vocab:
                raise ModelError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
            buffer = ctypes.create_string_buffer(64)
            n = self._api.llama_token_to_piece(self._vocab, token, buffer, 64, 0, False)
            if n < 0:
                buffer = ctypes.create_string_buffer(-n)
                n = self._api.llama_token_to_piece(self._vocab, token, buffer, -n, 0, False)
            piece = buffer.raw[:n]
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        if not tokens:
            return ""
        for token in tokens:
            if not 0 <= token < self.n_vocab:
                raise ModelError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        array_type = ctypes.c_int32 * len(tokens)
        ids = array_type(*tokens)
        capacity = len(tokens) * 8 + 16
        while True:
            buffer = ctypes.create_string_buffer(capacity)
            n = self._api.llama_detokenize(self._vocab, ids, len(tokens), buffer, capacity, False, True)
            if n >= 0:
                return buffer.raw[:n].decode("utf-8", "replace")
            capacity = -n

    def is_eog(self, token: int) -> bool:
        known = self._eog.get(token)
        if known is None:
            known = bool(self._api.llama_vocab_is_eog(self._vocab, token))
            self._eog[token] = known
        return known

    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token: asking llama.cpp about each token of the vocabulary costs
        15-50 ms, so the answer is remembered per model file."""
        if self._eog_list is None:
            is_eog, vocab = self._api.llama_vocab_is_eog, self._vocab
            self._eog_list = remembered(
                self.settings.path, "end-of-generation tokens",
                lambda: json.dumps([token for token in range(self.n_vocab) if is_eog(vocab, token)]), self._token_list)
        return self._eog_list

    def _token_list(self, text: str) -> list[int]:
        """A remembered list of tokens read back: token ids of this vocabulary, or ValueError."""
        tokens = json.loads(text)
        if not isinstance(tokens, list) or \
                not all(type(token) is int and 0 <= token < self.n_vocab for token in tokens):
            raise ValueError("not a list of tokens")
        return tokens

    def fim_tokens(self) -> tuple[int, int, int] | None:
        api, vocab = self._api, self._vocab
        tokens = (api.llama_vocab_fim_pre(vocab), api.llama_vocab_fim_suf(vocab), api.llama_vocab_fim_mid(vocab))
        return None if any(token < 0 for token in tokens) else tokens

    def fim_repo_tokens(self) -> tuple[int, int]:
        api, vocab = self._api, self._vocab
        return max(-1, api.llama_vocab_fim_rep(vocab)), max(-1, api.llama_vocab_fim_sep(vocab))

    @property
    def _jinja(self) -> ChatTemplate | None:
        """The GGUF's own template, compiled on first use (by any thread, once); None (llama.cpp's
        detection instead) without one, or when it does not compile (said once)."""
        with self._jinja_lock:
            if self._jinja_source:
                self._jinja_compiled = self._compile_template(self._jinja_source)
                self._jinja_source = None
            return self._jinja_compiled

    def _compile_template(self, source: bytes) -> ChatTemplate | None:
        from reame.model.chat_template import ChatTemplate  # jinja2: 40 ms to import, only for templates
        special_tokens = {}
        for name, key in TEMPLATE_SPECIAL_TOKENS.items():
            token_id = self.meta(key)
            if token_id is not None and token_id.isdigit() and int(token_id) < self.n_vocab:
                special_tokens[name] = self.token_text(int(token_id))
        try:
            return ChatTemplate(source.decode("utf-8", "replace"), special_tokens)
        except ModelError as error:
            log.warning("%s; using llama.cpp's built-in template detection", error)
            return None

    @property
    def template_supports_tools(self) -> bool:
        return self._jinja is not None and self._jinja.supports_tools

    @property
    def template_thinks(self) -> tuple[bool, bool]:
        return (self._jinja.thinks, self._jinja.thinking_switch) if self._jinja is not None else (False, False)

    def token_text(self, token: int) -> str:
        """A token's text as the vocabulary spells it (special tokens included)."""
        return (self._api.llama_vocab_get_text(self._vocab, token) or b"").decode("utf-8", "replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_assistant: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            enable_thinking: bool | None = None) -> str:
        if self._jinja is not None:
            return self._jinja.render(messages, add_assistant, tools, enable_thinking)
        if self._chat_template is None:
            return fallback_chat_format(messages, add_assistant)
        encoded = [(m["role"].encode("utf-8"), m["content"].encode("utf-8")) for m in messages]
        chat = (t.llama_chat_message * len(encoded))(*[t.llama_chat_message(r, c) for r, c in encoded])
        capacity = sum(len(r) + len(c) for r, c in encoded) * 2 + 256
        for _ in range(2):
            buffer = ctypes.create_string_buffer(capacity)
            n = self._api.llama_chat_apply_template(self._chat_template, chat, len(encoded), add_assistant,
                                                    buffer, capacity)
            if n < 0:  # a template llama.cpp does not recognise
                return fallback_chat_format(messages, add_assistant)
            if n <= capacity:
                return buffer.raw[:n].decode("utf-8", "replace")
            capacity = n
        raise ModelError("chat template rendering did not converge")

    def meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        n = self._api.llama_model_meta_val_str(self._model, key.encode(), buffer, 256)
        if n < 0:
            return None
        if n >= 256:
            buffer = ctypes.create_string_buffer(n + 1)
            self._api.llama_model_meta_val_str(self._model, key.encode(), buffer, n + 1)
        return buffer.value.decode("utf-8", "replace")

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
               outputs: Sequence[bool]) -> int:
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ModelError(f"a batch must hold 1..{self.n_batch} tokens, got {n}")
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
        raise ModelError(f"llama_decode failed with status {status}{last_llama_error()}")

    def new_sampler(self, steps: Sequence[Step], seq_id: int | None = None) -> object:
        """A sampler for `steps`. A grammar without penalties gets a `GrammarOnRejection`: the grammar is
        asked only about the token drawn without it, and over the vocabulary only when it refuses that."""
        kinds = [step.kind for step in steps]
        if kinds[:1] == ["grammar"] and "penalties" not in kinds and seq_id is None:
            return GrammarOnRejection.of(self._api, self._vocab, self.n_vocab, steps)
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

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        if self._embedder is None:
            self._embedder = EmbeddingContext(self._api, self._model, self.n_threads, self.settings.embedding_ctx,
                                               EMBEDDING_POOLING[self.embedding_pooling], self._threadpool)
        return self._embedder.embed(inputs, self.n_embd)

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
        if self._model:
            api.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
