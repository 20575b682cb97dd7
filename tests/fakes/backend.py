"""FakeBackend: a deterministic toy language model with the real backend's API.

Tokens are bytes (ids 0..255) plus a few ChatML-like specials, so any text
tokenizes and multi-byte characters split across tokens exactly as they can
with a real BPE vocabulary. The next-token logits are a pure function of the
tokens a sequence holds (by default a hash of the last three), so an output is
reproducible token for token: whether a sequence runs alone or batched with
others, from a fresh prefill or a restored state. Tests that need a specific
distribution pass their own `rule`.

The KV "cache" is one token list per sequence with the same rules as llama's:
positions must follow on, a whole context is shared by every sequence (a copied
sequence shares its cells), and a full cache makes decode() report DECODE_NO_KV_SLOT;
while `interrupt(True)` holds, a decode keeps nothing and reports DECODE_INTERRUPTED.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reame.model.backend import DECODE_INTERRUPTED, DECODE_NO_KV_SLOT, DECODE_OK, fallback_chat_format
from reame.model.chat_template import ChatTemplate
from reame.structured.grammar import GrammarState, GrammarTooAmbiguous
from reame.structured.gbnf import compiled
from reame.model.sampling import Step
from reame.errors import ModelError

BOS, EOS, IM_START, IM_END, FIM_PRE, FIM_SUF, FIM_MID, FIM_REP, FIM_SEP = range(256, 265)
SPECIALS = {"<s>": BOS, "</s>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END,
            "<|fim_prefix|>": FIM_PRE, "<|fim_suffix|>": FIM_SUF, "<|fim_middle|>": FIM_MID,
            "<|repo_name|>": FIM_REP, "<|file_sep|>": FIM_SEP}
N_VOCAB = 265
EMBEDDING_SIZE = 16
STATE_MAGIC = "reame-fake-state-1"

# Bytes the default rule chooses from: lowercase letters, space, full stop,
# and the two bytes of "é" so that UTF-8 splitting happens in ordinary output.
_ALPHABET = list(b"abcdefghijklmnopqrstuvwxyz .") + [0xC3]
_E_ACUTE_LEAD, _E_ACUTE_TAIL = 0xC3, 0xA9

Rule = Callable[[Sequence[int]], Sequence[float]]

# ChatML, rendered through the real Jinja path; with `tools`, a system block lists them and earlier
# calls are written as <tool_call> JSON, as Hermes-style templates (Qwen2.5's) do.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def default_rule(history: Sequence[int]) -> list[float]:
    """Logits after `history`: a hash of its last three tokens, with a rare end of text."""
    logits = [-math.inf] * N_VOCAB
    if history and history[-1] == _E_ACUTE_LEAD:
        logits[_E_ACUTE_TAIL] = 10.0  # complete the character
        return logits
    seed = zlib.crc32(bytes(token & 0xFF for token in history[-3:]) + bytes([len(history) % 7]))
    for index, token in enumerate(_ALPHABET):
        logits[token] = ((seed >> (index % 24)) * 2654435761 + index * 40503) % 997 / 100.0
    logits[EOS] = 12.0 if seed % 31 == 0 else -2.0
    return logits


def reply_rule(reply: str) -> Rule:
    """A rule that answers every chat turn with `reply` (greedy), then ends the turn: the text after
    the last `<|im_start|>assistant\\n` is continued along `reply`, whatever the prompt prefilled of it."""
    target = list(reply.encode("utf-8"))
    marker = [IM_START, *b"assistant\n"]

    def rule(history: Sequence[int]) -> list[float]:
        logits = [0.0] * N_VOCAB
        start = next((i + len(marker) for i in range(len(history) - len(marker), -1, -1)
                      if list(history[i:i + len(marker)]) == marker), len(history))
        written = list(history[start:])
        following = target[len(written)] if written == target[:len(written)] and len(written) < len(target) \
            else IM_END
        logits[following] = 10.0
        return logits
    return rule


def gated_rule(gate: "threading.Event", token: int = ord("a"), wait_s: float = 5.0) -> Rule:
    """A rule that always prefers `token` but first waits for `gate`: tests hold the engine
    inside a decode (to queue, cancel or time out requests) and let it go when they are ready."""
    def rule(history: Sequence[int]) -> list[float]:
        gate.wait(wait_s)
        logits = [0.0] * N_VOCAB
        logits[token] = 5.0
        return logits
    return rule


BATCH_NOISE = 0.05


def _batch_noise(logits: list[float]) -> None:
    """What a batched kernel's rounding does: every logit moves a little, and at a near tie the two best
    tokens trade places."""
    first, second = sorted(range(len(logits)), key=logits.__getitem__, reverse=True)[:2]
    if logits[first] - logits[second] < BATCH_NOISE:
        logits[first], logits[second] = logits[second], logits[first]
    for index, value in enumerate(logits):
        logits[index] = value + BATCH_NOISE / 64


class FakeSampler:
    """A sampler chain interpreted in Python, with the same steps as llama's."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = list(steps)
        self.history: list[int] = list(next((step.args[4] for step in steps if step.kind == "penalties"), ()))
        seed = next((step.args[0] for step in steps if step.kind == "dist"), 0)
        self.rng = random.Random(seed)
        grammar = next((step.args[0] for step in steps if step.kind == "grammar"), None)
        # Bytes are characters here: the grammar reads ASCII (the toy vocabulary's other bytes it refuses).
        self.grammar = GrammarState(compiled(grammar)) if grammar is not None else None

    def accept(self, token: int) -> None:
        """The token was drawn: the penalties count it, the grammar reads it."""
        self.history.append(token)
        if self.grammar is not None and token < 128:
            try:
                self.grammar.feed(chr(token))
            except GrammarTooAmbiguous:  # llama.cpp's matcher has no such bound: it goes on, unconstrained here
                self.grammar = None

    def probabilities(self, logits: Sequence[float]) -> dict[int, float]:
        """The distribution the chain samples from (greedy: all mass on the argmax)."""
        candidates = {token: value for token, value in enumerate(logits) if value != -math.inf}
        for step in self.steps:
            candidates = self._apply(step, candidates)
        if not candidates:
            raise ModelError("every token was filtered out")
        if any(step.kind == "greedy" for step in self.steps):
            best = max(candidates, key=lambda token: (candidates[token], -token))
            return {best: 1.0}
        top = max(candidates.values())
        weights = {token: math.exp(value - top) for token, value in candidates.items()}
        total = sum(weights.values())
        return {token: weight / total for token, weight in weights.items()}

    def _apply(self, step: Step, candidates: dict[int, float]) -> dict[int, float]:
        kind, args = step.kind, step.args
        if kind == "grammar":
            if self.grammar is None:  # dropped when it grew too ambiguous (see accept)
                return candidates
            grammar, stacks = self.grammar.grammar, self.grammar.stacks
            can_end = () in stacks

            def allowed(token: int) -> bool:
                try:
                    return bool(grammar.advance(stacks, token))
                except GrammarTooAmbiguous:  # llama.cpp's matcher has no such bound: it allows the token
                    return True
            return {token: value for token, value in candidates.items()
                    if (token < 128 and allowed(token)) or (can_end and token in (EOS, IM_END))}
        if kind == "logit_bias":
            adjusted = dict(candidates)
            for token, bias in args[0]:
                if token in adjusted:
                    adjusted[token] += bias
            return {t: v for t, v in adjusted.items() if v != -math.inf}
        if kind == "penalties":
            last_n, repeat, frequency, presence, _ = args
            window = self.history if last_n < 0 else self.history[-last_n:] if last_n else []
            counts: dict[int, int] = {}
            for token in window:
                counts[token] = counts.get(token, 0) + 1
            adjusted = dict(candidates)
            for token, count in counts.items():
                if token in adjusted:
                    value = adjusted[token]
                    value = value / repeat if value > 0 else value * repeat
                    adjusted[token] = value - count * frequency - presence
            return adjusted
        if kind == "top_k":
            kept = sorted(candidates, key=lambda t: (-candidates[t], t))[:args[0]]
            return {t: candidates[t] for t in kept}
        if kind in ("top_p", "min_p"):
            ordered = sorted(candidates, key=lambda t: (-candidates[t], t))
            top = candidates[ordered[0]]
            weights = [math.exp(candidates[t] - top) for t in ordered]
            total = sum(weights)
            if kind == "min_p":
                return {t: candidates[t] for t, w in zip(ordered, weights) if w >= args[0]}
            nucleus: dict[int, float] = {}
            mass = 0.0
            for token, weight in zip(ordered, weights):
                nucleus[token] = candidates[token]
                mass += weight / total
                if mass >= args[0]:
                    break
            return nucleus
        if kind == "temp":
            return {t: v / args[0] for t, v in candidates.items()}
        if kind in ("dist", "greedy"):
            return candidates
        raise ModelError(f"unknown sampler step {kind}")

    def pick(self, logits: Sequence[float]) -> int:
        probabilities = self.probabilities(logits)
        if len(probabilities) == 1:
            return next(iter(probabilities))
        draw = self.rng.random()
        for token in sorted(probabilities):
            draw -= probabilities[token]
            if draw <= 0:
                return token
        return max(probabilities)


class FakeBackend:
    """Deterministic stand-in for LlamaBackend (see the module docstring)."""

    has_chat_template = True
    has_fim = True
    has_fim_repo = True  # the repo-level FIM tokens (<|repo_name|>, <|file_sep|>), as Qwen2.5-Coder has
    supports_rollback = True
    supports_rowwise = True
    can_shift = True
    sliding_window = 0

    def __init__(self, n_ctx: int = 512, n_seq_max: int = 1, n_batch: int = 64, rule: Rule = default_rule,
                 template_tools: bool = True, template: str | None = None, pooled_embeddings: bool = True) -> None:
        """`template_tools`: whether the chat template lays tools out itself (False: a template
        that knows nothing of tools, like SmolLM2's); `template`: another chat template's source;
        `pooled_embeddings` False: a vector per token, as with pooling "none"."""
        self.n_vocab = N_VOCAB
        self.n_ctx = n_ctx
        self.n_ctx_seq = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.bos_token = BOS
        self.eos_token = EOS
        self.add_bos = True
        self.rule = rule
        # As llama.cpp's tiled CPU kernels do (model/batch_numerics.py): in a decode of more rows than this,
        # each output row's two best logits trade places when they are within BATCH_NOISE. None: exact.
        self.exact_rows: int | None = None
        self.n_embd = EMBEDDING_SIZE
        self.embedding_context_tokens = n_ctx
        self.embedding_batch = 4
        self.embeddings_pooled = pooled_embeddings
        self.embed_calls: list[int] = []  # inputs per embed() call
        source = template or (CHAT_TEMPLATE if template_tools else CHAT_TEMPLATE.replace("tools", "none_of_them"))
        self._template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
        self._kv: dict[int, list[int]] = {}
        # Each position's cell, as in llama's unified KV: seq_cp shares cells instead of copying them.
        self._cells: dict[int, list[int]] = {}
        self._new_cells = itertools.count()
        self._outputs: dict[int, list[float]] = {}
        # What tests look at: how the engine drove the model.
        self.decode_calls: list[list[tuple[int, int, int, bool]]] = []
        self.rowwise_calls: list[bool] = []  # each successful decode's `rowwise`
        self.reuses: list[list[tuple[int, int, int]]] = []  # seq_reuse's runs, call by call
        self.refused_restores = 0  # states refused for want of free cells (llama.cpp logs "failed to find")
        self.sampler_seq_ids: list[int | None] = []  # per chain: the sequence it was attached to, if any
        self.stop = False  # Backend.interrupt's flag
        self.interrupted_calls: list[list[tuple[int, int, int, bool]]] = []  # decodes it stopped

    # --- vocabulary ---

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        tokens = [BOS] if add_special else []
        data = text.encode("utf-8")
        i = 0
        while i < len(data):
            if parse_special and data[i:i + 1] == b"<":
                special = next((s for s in SPECIALS if data.startswith(s.encode(), i)), None)
                if special:
                    tokens.append(SPECIALS[special])
                    i += len(special)
                    continue
            tokens.append(data[i])
            i += 1
        return tokens

    def token_piece(self, token: int) -> bytes:
        self._check_token(token)
        return bytes([token]) if token < 256 else b""

    def detokenize(self, tokens: Sequence[int]) -> str:
        names = {v: k for k, v in SPECIALS.items()}
        out = bytearray()
        for token in tokens:
            self._check_token(token)
            out += bytes([token]) if token < 256 else names[token].encode()
        return out.decode("utf-8", "replace")

    def _check_token(self, token: int) -> None:
        if not 0 <= token < N_VOCAB:
            raise ModelError(f"token id {token} is outside the vocabulary (0..{N_VOCAB - 1})")

    def is_eog(self, token: int) -> bool:
        return token in (EOS, IM_END)

    def eog_tokens(self) -> list[int]:
        return [EOS, IM_END]

    def fim_tokens(self) -> tuple[int, int, int] | None:
        return (FIM_PRE, FIM_SUF, FIM_MID) if self.has_fim else None

    def fim_repo_tokens(self) -> tuple[int, int]:
        return (FIM_REP, FIM_SEP) if self.has_fim and self.has_fim_repo else (-1, -1)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_assistant: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            enable_thinking: bool | None = None) -> str:
        if not self.has_chat_template:
            return fallback_chat_format(messages, add_assistant)
        return self._template.render(messages, add_assistant, tools, enable_thinking)

    @property
    def template_supports_tools(self) -> bool:
        return self.has_chat_template and self._template.supports_tools

    @property
    def template_reads_clock(self) -> bool:
        return self.has_chat_template and "strftime_now" in self._template.source

    @property
    def template_thinks(self) -> tuple[bool, bool]:
        return (self._template.thinks, self._template.thinking_switch) if self.has_chat_template else (False, False)

    # --- inference ---

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """A bag of tokens: each token adds to a few hashed dimensions, so texts sharing tokens point alike."""
        if not inputs or len(inputs) > self.embedding_batch or \
                sum(map(len, inputs)) > self.embedding_context_tokens:
            raise ModelError("an embedding batch takes 1..4 inputs within its context")
        self.embed_calls.append(len(inputs))
        vectors = []
        for tokens in inputs:
            vector = [0.0] * EMBEDDING_SIZE
            for token in tokens:
                vector[token % EMBEDDING_SIZE] += 1.0
                vector[(token * 7 + 3) % EMBEDDING_SIZE] += 0.5
                if not self.embeddings_pooled:  # each token's own vector
                    vectors.append(vector)
                    vector = [0.0] * EMBEDDING_SIZE
            if self.embeddings_pooled:
                vectors.append(vector)
        return vectors

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool], rowwise: bool = False) -> int:
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ModelError(f"a batch must hold 1..{self.n_batch} tokens, got {n}")
        if self.cells_in_use() + n > self.n_ctx:
            self._outputs = {}
            return DECODE_NO_KV_SLOT
        staged = {seq: list(cells) for seq, cells in self._kv.items()}
        staged_cells = {seq: list(cells) for seq, cells in self._cells.items()}
        results: dict[int, list[float]] = {}
        for i in range(n):
            seq = seq_ids[i]
            if not 0 <= seq < self.n_seq_max:
                raise ModelError(f"seq_id {seq} is outside 0..{self.n_seq_max - 1}")
            self._check_token(tokens[i])
            cells = staged.setdefault(seq, [])
            if positions[i] != len(cells):
                raise ModelError(f"sequence {seq}: position {positions[i]} does not follow {len(cells)}")
            cells.append(tokens[i])
            staged_cells.setdefault(seq, []).append(next(self._new_cells))
            if outputs[i]:
                results[i] = list(self.rule(cells))
                if self.exact_rows is not None and n > self.exact_rows and not rowwise:
                    _batch_noise(results[i])
        if self.stop:  # set while the rows were computed (a rule can submit a request): nothing is kept
            self._outputs = {}
            self.interrupted_calls.append(list(zip(tokens, positions, seq_ids, outputs)))
            return DECODE_INTERRUPTED
        self._kv, self._cells = staged, staged_cells
        self._outputs = results
        self.decode_calls.append(list(zip(tokens, positions, seq_ids, outputs)))
        self.rowwise_calls.append(rowwise)
        return DECODE_OK

    def interrupt(self, stop: bool) -> None:
        self.stop = stop

    def new_sampler(self, steps: Sequence[Step], seq_id: int | None = None) -> FakeSampler:
        self.sampler_seq_ids.append(seq_id)
        return FakeSampler(steps)

    def sample(self, sampler: object, index: int) -> int:
        assert isinstance(sampler, FakeSampler), "a chain this backend made"
        token = sampler.pick(self.logits(index))
        sampler.accept(token)
        return token

    def free_sampler(self, sampler: object) -> None:
        assert isinstance(sampler, FakeSampler), "a chain this backend made"
        sampler.steps = []

    def logits(self, index: int) -> list[float]:
        if index not in self._outputs:
            raise ModelError(f"no logits at batch index {index}")
        return self._outputs[index]

    def top_tokens(self, index: int, k: int) -> list[tuple[int, float]]:
        logits = self.logits(index)
        return sorted(((token, value) for token, value in enumerate(logits) if value != -math.inf),
                      key=lambda pair: (-pair[1], pair[0]))[:k]

    # --- memory ---

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        for seq in ([seq_id] if seq_id >= 0 else list(self._kv)):
            cells = self._kv.get(seq, [])
            start = max(p0, 0)
            end = len(cells) if p1 < 0 else min(p1, len(cells))
            if end < len(cells) and start < end:
                return False  # a hole in the middle of a sequence is not supported
            del cells[start:end]
            del self._cells.get(seq, [])[start:end]
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        cells = self._kv.get(src, [])
        end = len(cells) if p1 < 0 else min(p1, len(cells))
        if max(p0, 0) != 0:
            raise ModelError("FakeBackend copies sequences from position 0 only")
        self._kv[dst] = list(cells[:end])
        self._cells[dst] = list(self._cells.get(src, [])[:end])

    def seq_pos_max(self, seq_id: int) -> int:
        return len(self._kv.get(seq_id, [])) - 1

    def seq_reuse(self, seq_id: int, chunks: Sequence[tuple[int, int, int]]) -> None:
        tokens, cells = self._kv.get(seq_id, []), self._cells.get(seq_id, [])
        expected = 0
        for old, new, n in chunks:
            if new != expected or new > old or old + n > len(tokens):
                raise ModelError(f"run {(old, new, n)} does not follow the last one or is outside the sequence")
            expected = new + n
        self._kv[seq_id] = [token for old, _, n in chunks for token in tokens[old:old + n]]
        self._cells[seq_id] = [cell for old, _, n in chunks for cell in cells[old:old + n]]
        self.reuses.append(list(chunks))

    def clear(self) -> None:
        self._kv, self._cells = {}, {}

    def cells_in_use(self) -> int:
        return len({cell for cells in self._cells.values() for cell in cells})

    def seq_state_get(self, seq_id: int) -> bytes:
        return json.dumps({"magic": STATE_MAGIC, "tokens": self._kv.get(seq_id, [])}).encode()

    def seq_state_set(self, seq_id: int, blob: bytes | memoryview) -> bool:
        try:
            state = json.loads(bytes(blob))
        except (ValueError, UnicodeDecodeError):
            return False
        if not isinstance(state, dict) or state.get("magic") != STATE_MAGIC:
            return False
        # As llama.cpp: the sequence's own cells are freed, then the state takes as many free cells as it
        # holds tokens (anywhere); a state that finds too few leaves the sequence empty.
        self._kv.pop(seq_id, None)
        self._cells.pop(seq_id, None)
        if self.cells_in_use() + len(state["tokens"]) > self.n_ctx:
            self.refused_restores += 1
            return False
        self._kv[seq_id] = list(state["tokens"])
        self._cells[seq_id] = [next(self._new_cells) for _ in state["tokens"]]
        return True

    def warm_up(self) -> None:
        pass

    def kv_fingerprint(self) -> bytes:
        return hashlib.sha256(f"{STATE_MAGIC}/{getattr(self.rule, '__name__', 'rule')}".encode()).digest()

    def describe(self) -> dict[str, object]:
        return {"description": "fake 1M F32", "architecture": "fake", "parameters": 1_000_000,
                "size_bytes": 4_000_000, "n_ctx_train": self.n_ctx, "n_vocab": self.n_vocab, "n_ctx": self.n_ctx,
                "n_threads": 1, "chat_template": self.has_chat_template}

    def kv_tokens(self, seq_id: int) -> list[int]:
        """What a sequence holds (tests only)."""
        return list(self._kv.get(seq_id, []))

    def close(self) -> None:
        self.clear()


def printable_rule(history: Sequence[int]) -> list[float]:
    """Every printable ASCII character and the end of text possible, some more than others (what structured
    output needs: a JSON grammar finds its characters)."""
    rng = random.Random(hash(tuple(history[-4:])))
    logits = [float("-inf")] * N_VOCAB
    for token in [*range(32, 127), ord("\n"), EOS]:
        logits[token] = rng.uniform(0, 3)
    return logits
