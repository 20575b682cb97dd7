"""LoadedModel: a model file's weights and vocabulary in libllama, before any context is made.

Everything that reads only the vocabulary or the file's metadata lives here:
tokenizing, pieces, the chat template, fill-in-the-middle tokens. A one-shot
prompt needs that much to know how long its prompt is, and so how large a
context to make (a context's KV is allocated and cleared whole: 8,192 tokens
of it cost SmolLM2-135M 139 ms against 13 ms for 512). `LlamaBackend` is a
LoadedModel with a context; it is made from the model file, or takes over one
already loaded, so the weights are read once either way.

Threading: the methods here are read-only and may be called from any thread.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library
from reame.errors import ModelError
from reame.model.backend import (BUILTIN_TEMPLATE_BY_ARCH, TEMPLATE_SPECIAL_TOKENS, ModelSettings,
                                 fallback_chat_format)
from reame.config import LLAMA_CHAT_TEMPLATES
from reame.model.fingerprint import remembered
from reame.model.library import forget_llama_errors, init_native, last_llama_error

if TYPE_CHECKING:
    from reame.model.chat_template import ChatTemplate

log = logging.getLogger("reame.engine")


class LoadedModel:
    """A llama model's weights and vocabulary, without a context."""

    def __init__(self, settings: ModelSettings) -> None:
        settings = settings.validated()
        init_native()
        from reame.ctypes_llama import api
        self._api = api
        self.settings = settings
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
        self._vocab = api.llama_model_get_vocab(self._model)
        self.n_vocab = api.llama_vocab_n_tokens(self._vocab)
        self.bos_token = api.llama_vocab_bos(self._vocab)
        self.eos_token = api.llama_vocab_eos(self._vocab)
        self.add_bos = bool(api.llama_vocab_get_add_bos(self._vocab))
        self.architecture = self.meta("general.architecture") or ""
        self.n_embd = api.llama_model_n_embd(self._model)
        self.sliding_window = api.llama_model_n_swa(self._model)
        template = api.llama_model_chat_template(self._model, None)
        if settings.chat_template in LLAMA_CHAT_TEMPLATES:  # a format named instead of the model's own
            template = settings.chat_template.encode()
        self._chat_template: bytes | None = template or (
            BUILTIN_TEMPLATE_BY_ARCH[self.architecture].encode()
            if self.architecture in BUILTIN_TEMPLATE_BY_ARCH else None)
        self.has_chat_template = self._chat_template is not None
        # The model's own Jinja template, compiled when first used: a raw one-shot prompt never imports jinja2.
        self._jinja_source = template if settings.chat_template == "jinja" else None
        self._jinja_compiled: ChatTemplate | None = None
        self._jinja_lock = threading.Lock()
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_list: list[int] | None = None

    def _take_over(self, loaded: LoadedModel) -> None:
        """Become `loaded` (weights, vocabulary and what was learned of them, such as a compiled template);
        `loaded` is spent: closing it frees nothing."""
        self.__dict__.update(loaded.__dict__)
        loaded._model = None

    def close(self) -> None:
        if self._model:
            self._api.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- vocabulary and metadata (thread-safe reads) ----------------------------------

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
    def template_reads_clock(self) -> bool:
        """Whether the chat template renders the date (strftime_now): its prompts differ from day to day."""
        return self._chat_template is not None and b"strftime_now" in self._chat_template

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

