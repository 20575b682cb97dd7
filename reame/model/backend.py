"""The seam between the engine and a language model.

`Backend` is what the engine may ask of a model; `LlamaBackend` implements it
over our ctypes binding and is the only module that calls into libllama.
`FakeBackend` (fake.py) implements the same protocol without a model.

Threading: a backend is owned by the engine thread. Only `tokenize`,
`detokenize`, `token_piece` and `apply_chat_template` (read-only vocabulary
work) may be called from other threads.
"""

from __future__ import annotations

import array
import collections
import ctypes
import heapq
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from reame.model.fingerprint import kv_fingerprint, model_content_hash
from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library
from reame.model.chat_template import ChatTemplate
from reame.model.sampling import Step
from reame.errors import ModelError, ModelFileError

KV_TYPES = ("f16", "q8_0", "q4_0")
FLASH_ATTN_MODES = ("auto", "on", "off")
# "jinja": the model's own template (the GGUF's, rendered as Hugging Face does); "builtin":
# llama.cpp's detection of well-known formats. Models without a template use llama.cpp's either way.
CHAT_TEMPLATE_MODES = ("jinja", "builtin")
# How an embedding pools a sequence's token vectors.
EMBEDDING_POOLING = {"mean": t.LLAMA_POOLING_TYPE_MEAN, "cls": t.LLAMA_POOLING_TYPE_CLS,
                     "last": t.LLAMA_POOLING_TYPE_LAST}
EMBEDDING_SEQUENCES = 8  # inputs embedded in one decode
# The special tokens a template may name, and the GGUF keys holding their ids.
TEMPLATE_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                           "unk_token": "tokenizer.ggml.unknown_token_id",
                           "pad_token": "tokenizer.ggml.padding_token_id"}
GGUF_MAGIC = b"GGUF"
# Chat templates of architectures whose GGUF carries none, by llama.cpp's built-in names.
BUILTIN_TEMPLATE_BY_ARCH = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}

DECODE_OK = 0
DECODE_NO_KV_SLOT = 1  # llama_decode: no room in the KV cache for this batch


class Backend(Protocol):
    n_vocab: int
    n_ctx: int  # the whole KV cache, in tokens
    n_ctx_seq: int  # what one sequence may use
    n_seq_max: int
    n_batch: int  # most tokens one decode() call takes
    bos_token: int
    eos_token: int
    add_bos: bool  # the model wants BOS in front of a prompt
    has_chat_template: bool

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def token_piece(self, token: int) -> bytes: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def is_eog(self, token: int) -> bool: ...
    def eog_tokens(self) -> list[int]: ...
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_assistant: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt for `messages`; `tools` (OpenAI function tools) are laid out by the template when
        `template_supports_tools`, else the caller describes them in a message of its own."""
        ...

    @property
    def template_supports_tools(self) -> bool: ...
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) fill-in-the-middle tokens, or None when the model has none."""
        ...

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool]) -> int:
        """Evaluate one batch; return DECODE_OK or DECODE_NO_KV_SLOT, raise ModelError otherwise.

        Entry i puts tokens[i] at positions[i] of sequence seq_ids[i]; where
        outputs[i] is true, sample(…, i) and logits(i) may be called afterwards.
        """
        ...

    def new_sampler(self, steps: Sequence[Step], seq_id: int | None = None) -> object:
        """A sampler chain; given `seq_id`, the backend may run it inside the model's graph
        (one output per sequence and step)."""
        ...

    def sample(self, sampler: object, index: int) -> int: ...
    def free_sampler(self, sampler: object) -> None: ...
    def logits(self, index: int) -> Sequence[float]: ...
    def top_tokens(self, index: int, k: int) -> list[tuple[int, float]]:
        """The k highest-scoring tokens at output `index` with their logits, best first."""
        ...

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def seq_keep(self, seq_id: int) -> None: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def clear(self) -> None: ...
    def seq_state_get(self, seq_id: int) -> bytes | memoryview: ...
    def seq_state_set(self, seq_id: int, blob: bytes | memoryview) -> bool: ...
    n_embd: int  # size of an embedding vector
    embedding_context_tokens: int  # longest input `embed` takes

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One pooled (not normalised) embedding per input, computed beside generation without touching
        its KV; at most `embedding_batch` inputs of at most `embedding_context_tokens` tokens in all."""
        ...

    @property
    def embedding_batch(self) -> int: ...

    def kv_fingerprint(self) -> bytes:
        """Names what a state blob depends on; the prefix cache and saved sessions are keyed by it."""
    def warm_up(self) -> None:
        """Get the first request's one-time costs out of the way (called on the engine thread)."""
    def close(self) -> None: ...


def fallback_chat_format(messages: Sequence[Mapping[str, Any]], add_assistant: bool) -> str:
    """`role: content` lines, for models without a usable chat template."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_assistant else "")


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ModelSettings:
    """How to load a model and size its context."""

    path: str
    n_ctx: int = 4096
    n_threads: int = 0  # 0: every usable core
    n_threads_batch: int = 0  # 0: same as n_threads
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    # One KV buffer that any sequence may fill whole. Only worth it with several sequences: for a
    # single one the split layout decoded ~4% faster here (and it is llama-server's default).
    kv_unified: bool | None = None  # None: unified exactly when n_seq_max > 1
    kv_type: str = "f16"
    flash_attn: str = "auto"
    chat_template: str = "jinja"  # CHAT_TEMPLATE_MODES
    embedding_ctx: int = 2048  # tokens of the embedding context, made on the first embeddings request
    embedding_pooling: str = "auto"  # EMBEDDING_POOLING, or auto: the model's own, else mean
    use_mmap: bool = True
    use_mlock: bool = False

    @property
    def unified_kv(self) -> bool:
        return self.n_seq_max > 1 if self.kv_unified is None else self.kv_unified

    def kv_fingerprint(self) -> bytes:
        """What a saved sequence state from this model and context depends on (see model/fingerprint.py)."""
        n_stream = 1 if self.unified_kv else self.n_seq_max
        return kv_fingerprint(model_content_hash(self.path), self.kv_type, self.flash_attn, n_stream)

    def validated(self) -> ModelSettings:
        path = Path(self.path)
        if not path.exists():
            raise ModelFileError(f"model file not found: {self.path}")
        if not path.is_file():
            raise ModelFileError(f"model path is not a file: {self.path}")
        try:
            with path.open("rb") as stream:
                magic = stream.read(4)
        except OSError as error:
            raise ModelFileError(f"cannot read model file {self.path}: {error.strerror}") from None
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{self.path} is not a GGUF model file (it does not start with 'GGUF')")
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            if getattr(self, name) < 1:
                raise ModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_threads < 0 or self.n_threads_batch < 0:
            raise ModelError("thread counts must be positive")
        if self.kv_type not in KV_TYPES:
            raise ModelError(f"kv type must be one of {', '.join(KV_TYPES)}, got '{self.kv_type}'")
        if self.flash_attn not in FLASH_ATTN_MODES:
            raise ModelError(f"flash_attn must be one of {', '.join(FLASH_ATTN_MODES)}, got '{self.flash_attn}'")
        if self.embedding_pooling != "auto" and self.embedding_pooling not in EMBEDDING_POOLING:
            raise ModelError(f"embedding pooling must be auto or one of {', '.join(EMBEDDING_POOLING)}, "
                             f"got '{self.embedding_pooling}'")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ModelError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, "
                             f"got '{self.chat_template}'")
        if self.kv_type != "f16" and self.flash_attn == "off":
            raise ModelError(f"a {self.kv_type} KV cache needs flash attention: set flash_attn to auto or on")
        return self


# --- llama.cpp's log lines through our logger ------------------------------------------

log = logging.getLogger("reame.engine")
_llama_log = logging.getLogger("reame.llama")
_recent_errors: collections.deque[str] = collections.deque(maxlen=4)
_log_state = {"partial": "", "level": 0}
_log_callback = None  # keeps the ctypes callback alive
_init_lock = threading.Lock()
_backend_ready = False


def _on_llama_log(level: int, text: bytes | None, _user: object) -> None:
    # Called from inside llama_decode too (dozens of debug lines when a graph is rebuilt): lines
    # nobody reads are dropped before any work, unless REAME_LLAMA_VERBOSE asked for them.
    if level != t.GGML_LOG_LEVEL_CONT:
        _log_state["level"] = level
    if _log_state["level"] < t.GGML_LOG_LEVEL_WARN and not _llama_log.isEnabledFor(logging.DEBUG):
        return
    chunk = (text or b"").decode("utf-8", "replace")
    _log_state["partial"] += chunk
    if not _log_state["partial"].endswith("\n"):
        return
    line = _log_state["partial"].rstrip()
    _log_state["partial"] = ""
    if not line:
        return
    level = _log_state["level"]
    if level == t.GGML_LOG_LEVEL_ERROR:
        _recent_errors.append(line)
        _llama_log.error("%s", line)
    elif level == t.GGML_LOG_LEVEL_WARN:
        _llama_log.warning("%s", line)
    else:
        _llama_log.debug("%s", line)


def init_native() -> None:
    """Load the library, route its logs, init the backend: once per process."""
    global _backend_ready, _log_callback
    with _init_lock:
        if _backend_ready:
            return
        from reame.ctypes_llama import _lib, api
        api.load()
        if os.environ.get("REAME_LLAMA_VERBOSE"):
            _llama_log.setLevel(logging.DEBUG)
        elif _llama_log.level == logging.NOTSET:
            _llama_log.setLevel(logging.ERROR)
        _log_callback = t.ggml_log_callback(_on_llama_log)
        api.llama_log_set(_log_callback, None)
        libraries = _lib.loaded_libraries()
        if libraries is not None and libraries.cpu_variants:
            api.ggml_backend_load_all_from_path(os.fsencode(libraries.lib_dir))
        api.llama_backend_init()
        _backend_ready = True


def last_llama_error() -> str:
    return f" ({_recent_errors[-1]})" if _recent_errors else ""


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
        _recent_errors.clear()

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
        template = api.llama_model_chat_template(self._model, None)
        self._chat_template: bytes | None = template or (
            BUILTIN_TEMPLATE_BY_ARCH[self.architecture].encode()
            if self.architecture in BUILTIN_TEMPLATE_BY_ARCH else None)
        self.has_chat_template = self._chat_template is not None
        self._jinja = self._jinja_template(template) if settings.chat_template == "jinja" else None

        self.n_embd = api.llama_model_n_embd(self._model)
        self.embedding_context_tokens = settings.embedding_ctx
        self._embedder: _EmbeddingContext | None = None  # made by the first `embed`
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
        if self._eog_list is None:
            is_eog, vocab = self._api.llama_vocab_is_eog, self._vocab
            self._eog_list = [token for token in range(self.n_vocab) if is_eog(vocab, token)]
        return self._eog_list

    def fim_tokens(self) -> tuple[int, int, int] | None:
        api, vocab = self._api, self._vocab
        tokens = (api.llama_vocab_fim_pre(vocab), api.llama_vocab_fim_suf(vocab), api.llama_vocab_fim_mid(vocab))
        return None if any(token < 0 for token in tokens) else tokens

    def _jinja_template(self, source: bytes | None) -> ChatTemplate | None:
        """The GGUF's own template, compiled; None (llama.cpp's detection instead) without one, or when
        it does not compile (said once)."""
        if not source:
            return None
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

    def token_text(self, token: int) -> str:
        """A token's text as the vocabulary spells it (special tokens included)."""
        return (self._api.llama_vocab_get_text(self._vocab, token) or b"").decode("utf-8", "replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_assistant: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        if self._jinja is not None:
            return self._jinja.render(messages, add_assistant, tools)
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

    def describe(self) -> dict[str, object]:
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
        """A sampler for `steps`. A grammar without penalties gets a `_GrammarOnRejection`: the grammar is
        asked only about the token drawn without it, and over the vocabulary only when it refuses that."""
        kinds = [step.kind for step in steps]
        if kinds[:1] == ["grammar"] and "penalties" not in kinds and seq_id is None:
            return self._grammar_on_rejection(steps)
        return self._chain(steps, seq_id)

    def _grammar_on_rejection(self, steps: Sequence[Step]) -> _GrammarOnRejection:
        rest = list(steps[1:])
        unconstrained = self._chain(rest)
        # The fallback draws with its own seed: a resample is a new draw, not the refused one again.
        fallback_steps = [Step("dist", ((step.args[0] + 1) % (2**32 - 1),)) if step.kind == "dist" else step
                          for step in rest]
        try:
            constrained = self._chain([steps[0], *fallback_steps])
        except ModelError:
            self._api.llama_sampler_free(unconstrained)
            raise
        grammar = self._api.llama_sampler_chain_get(constrained, 0)
        return _GrammarOnRejection(unconstrained, constrained, grammar)

    def _chain(self, steps: Sequence[Step], seq_id: int | None = None) -> object:
        """Build a llama sampler chain; with `seq_id`, attach it to that sequence.

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
        api = self._api
        chain = api.llama_sampler_chain_init(api.llama_sampler_chain_default_params())
        for step in steps:
            kind, args = step.kind, step.args
            if kind == "logit_bias":
                pairs = args[0]
                biases = (t.llama_logit_bias * len(pairs))(*[t.llama_logit_bias(tok, bias) for tok, bias in pairs])
                sampler = api.llama_sampler_init_logit_bias(self.n_vocab, len(pairs), biases)
            elif kind == "grammar":
                sampler = api.llama_sampler_init_grammar(self._vocab, args[0].encode("utf-8"), b"root")
                if not sampler:
                    api.llama_sampler_free(chain)
                    raise ModelError(f"llama.cpp refused the grammar{last_llama_error()}")
            elif kind == "penalties":
                last_n, repeat, frequency, presence, window = args
                sampler = api.llama_sampler_init_penalties(self.n_vocab, last_n, repeat, frequency, presence)
                for token in window:  # the prompt counts for the penalties (and only for them)
                    api.llama_sampler_accept(sampler, token)
            elif kind == "greedy":
                sampler = api.llama_sampler_init_greedy()
            elif kind == "top_k":
                sampler = api.llama_sampler_init_top_k(args[0])
            elif kind == "top_p":
                sampler = api.llama_sampler_init_top_p(args[0], 1)
            elif kind == "min_p":
                sampler = api.llama_sampler_init_min_p(args[0], 1)
            elif kind == "temp":
                sampler = api.llama_sampler_init_temp(args[0])
            elif kind == "dist":
                sampler = api.llama_sampler_init_dist(args[0])
            else:
                api.llama_sampler_free(chain)
                raise ModelError(f"unknown sampler step {kind}")
            api.llama_sampler_chain_add(chain, sampler)
        if seq_id is not None and api.llama_set_sampler(self._ctx, seq_id, chain):
            self._attached[chain] = seq_id
        return chain

    def sample(self, sampler: object, index: int) -> int:
        # A wrong index makes llama.cpp abort the whole process: check it here.
        if index not in self._outputs:
            raise ModelError(f"no logits at batch index {index}")
        api = self._api
        if not isinstance(sampler, _GrammarOnRejection):
            return api.llama_sampler_sample(sampler, self._ctx, index)
        token = api.llama_sampler_sample(sampler.unconstrained, self._ctx, index)
        if sampler.allows(api, token):
            api.llama_sampler_accept(sampler.constrained, token)  # the grammar (and the rest) read it
            return token
        return api.llama_sampler_sample(sampler.constrained, self._ctx, index)

    def free_sampler(self, sampler: object) -> None:
        if isinstance(sampler, _GrammarOnRejection):
            self._api.llama_sampler_free(sampler.unconstrained)
            self._api.llama_sampler_free(sampler.constrained)
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

    def seq_keep(self, seq_id: int) -> None:
        self._api.llama_memory_seq_keep(self._memory, seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self._api.llama_memory_seq_pos_max(self._memory, seq_id)

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
            self._embedder = _EmbeddingContext(self._api, self._model, self.n_threads, self.settings.embedding_ctx,
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


class _GrammarOnRejection:
    """Grammar-constrained sampling at the price of one token's check, as llama-server samples.

    Applying a grammar means walking every vocabulary token's text through it:
    milliseconds per token with a 150k-token vocabulary, per drafted position
    too. So the token is drawn without the grammar first (`unconstrained`),
    the grammar checks just that token, and only when it refuses is the token
    drawn again from `constrained` (the grammar, then the same steps).
    Greedy, the result is the grammar-masked argmax either way; with a
    temperature it is the masked distribution too (a draw from p kept when
    allowed, else one from p restricted to what is allowed, sums to p
    restricted); top-k/top-p/min-p then cut the whole vocabulary on the first
    draw and the allowed part on the second, as in llama-server. Only chains
    without penalties qualify: the unconstrained chain already counted the
    refused token, and penalties would remember it.
    """

    def __init__(self, unconstrained: object, constrained: object, grammar: object) -> None:
        self.unconstrained, self.constrained, self.grammar = unconstrained, constrained, grammar
        self._candidate = t.llama_token_data()
        self._candidates = t.llama_token_data_array(ctypes.pointer(self._candidate), 1, -1, False)

    def allows(self, api: Any, token: int) -> bool:
        self._candidate.id, self._candidate.logit, self._candidate.p = token, 1.0, 0.0
        self._candidates.size, self._candidates.selected = 1, -1
        api.llama_sampler_apply(self.grammar, ctypes.byref(self._candidates))
        return self._candidate.logit != float("-inf")


class _EmbeddingContext:
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

    def embed(self, inputs: Sequence[Sequence[int]], n_embd: int) -> list[list[float]]:
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
