"""The seam between the engine and a language model: the `Backend` protocol, the decode codes, and the
settings a llama model is loaded with.

`LlamaBackend` (llama.py) implements the protocol over our ctypes binding and
is the only class that calls into libllama; `FakeBackend` (tests/fakes/)
implements it without a model.

Threading: a backend is owned by the engine thread. Only `tokenize`,
`detokenize`, `token_piece` and `apply_chat_template` (read-only vocabulary
work) may be called from other threads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from reame.config import LLAMA_CHAT_TEMPLATES
from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library
from reame.errors import ModelError, ModelFileError
from reame.model.fingerprint import kv_fingerprint, model_content_hash
from reame.model.sampling import Step

KV_TYPES = ("f16", "q8_0", "q4_0")
FLASH_ATTN_MODES = ("auto", "on", "off")
# "jinja": the model's own template (the GGUF's, rendered as Hugging Face does); "builtin":
# llama.cpp's detection of well-known formats; or one of llama.cpp's formats by name, instead of the model's.
# Models without a template use llama.cpp's detection when not given a name.
CHAT_TEMPLATE_MODES = ("jinja", "builtin", *LLAMA_CHAT_TEMPLATES)
# How an embedding pools a sequence's token vectors.
EMBEDDING_POOLING = {"mean": t.LLAMA_POOLING_TYPE_MEAN, "cls": t.LLAMA_POOLING_TYPE_CLS,
                     "last": t.LLAMA_POOLING_TYPE_LAST, "none": t.LLAMA_POOLING_TYPE_NONE}
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
DECODE_INTERRUPTED = 2  # llama_decode: stopped by Backend.interrupt before its end; nothing of the batch is kept


class Vocabulary(Protocol):
    """What a model file says before any context is made (LoadedModel): enough to render and tokenize a prompt."""

    n_vocab: int
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
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            enable_thinking: bool | None = None) -> str:
        """The prompt for `messages`; `tools` (OpenAI function tools) are laid out by the template when
        `template_supports_tools`, else the caller describes them in a message of its own;
        `enable_thinking`: the template's thinking switch (None: its default)."""
        ...

    @property
    def template_supports_tools(self) -> bool: ...
    @property
    def template_thinks(self) -> tuple[bool, bool]:
        """(the model thinks in <think>…</think>, a request can turn that off) by its chat template."""
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) fill-in-the-middle tokens, or None when the model has none."""
        ...

    def fim_repo_tokens(self) -> tuple[int, int]:
        """(repository, file separator) tokens of repo-level fill-in-the-middle, -1 where the model has none."""
        ...


class Backend(Vocabulary, Protocol):
    n_ctx: int  # the whole KV cache, in tokens
    n_ctx_seq: int  # what one sequence may use
    n_seq_max: int
    n_batch: int  # most tokens one decode() call takes
    sliding_window: int  # tokens a sliding-window layer attends to (0: the model has none)
    supports_rollback: bool  # seq_rm can drop a sequence's last positions (not a recurrent model's)
    can_shift: bool  # its memory can move cells to other positions (seq_reuse)
    supports_rowwise: bool  # decode(rowwise=True) computes each row as a batch of that one row does

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool], rowwise: bool = False) -> int:
        """Evaluate one batch; return DECODE_OK, DECODE_NO_KV_SLOT or DECODE_INTERRUPTED (the KV then holds
        nothing of the batch), raise ModelError otherwise.

        Entry i puts tokens[i] at positions[i] of sequence seq_ids[i]; where
        outputs[i] is true, sample(…, i) and logits(i) may be called afterwards.
        `rowwise` (where `supports_rowwise`): every row is computed with the kernels a batch of that one row
        uses, so its result does not depend on the rows beside it (slower per row in bigger batches).
        """
        ...

    def interrupt(self, stop: bool) -> None:
        """While `stop` is set, a decode stops within one graph node and returns DECODE_INTERRUPTED; a
        decode starting while it is set stops at once. Any thread may call it (a store of one byte)."""
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
    def seq_pos_max(self, seq_id: int) -> int: ...

    def seq_reuse(self, seq_id: int, chunks: Sequence[tuple[int, int, int]]) -> None:
        """Keep only the runs `(old, new, n)` of the sequence's cells, positions old..old+n moved to
        new..new+n (new <= old, ascending, each new run right after the last): llama-server's cache reuse."""
        ...

    def clear(self) -> None: ...
    def seq_state_get(self, seq_id: int) -> bytes | memoryview: ...
    def seq_state_set(self, seq_id: int, blob: bytes | memoryview) -> bool: ...
    n_embd: int  # size of an embedding vector
    embedding_context_tokens: int  # longest input `embed` takes

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One pooled (not normalised) embedding per input, computed beside generation without touching
        its KV; at most `embedding_batch` inputs of at most `embedding_context_tokens` tokens in all. Not
        `embeddings_pooled` (pooling "none"): one per token instead, every input's in turn."""
        ...

    @property
    def embeddings_pooled(self) -> bool: ...

    @property
    def embedding_batch(self) -> int: ...

    def kv_fingerprint(self) -> bytes:
        """Names what a state blob depends on; the prefix cache and saved sessions are keyed by it."""
    def describe(self) -> dict[str, object]:
        """Facts about the model: description ("llama 135M Q4_1"), architecture, parameters, size_bytes,
        n_ctx_train, n_vocab, n_ctx, n_threads, chat_template."""
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
            raise ModelError(f"chat_template must be jinja, builtin or one of llama.cpp's formats by name "
                             f"({', '.join(LLAMA_CHAT_TEMPLATES)}), "
                             f"got '{self.chat_template}'")
        if self.kv_type != "f16" and self.flash_attn == "off":
            raise ModelError(f"a {self.kv_type} KV cache needs flash attention: set flash_attn to auto or on")
        return self
