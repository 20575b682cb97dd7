"""A smaller model with the target's vocabulary drafts greedily for it (source name "draft").

The draft model has a context of its own, with as many sequence slots as the
target, and decodes on the engine thread like everything else. Its KV
persists: a drafter keeps its slot in line with its sequence (what was emitted
since the last draft is fed in one step), and a finished sequence's KV stays
in the slot for the next prompt that starts the same way, as the target's
slots do.

Drafts are the draft's argmax, so each puts all its probability on one token
and the engine's draw-and-compare verification stays exact. A draft stops
early when the draft's own confidence in its next token (its share among its
TOP_CANDIDATES best, measured as llama.cpp's speculative decoding does) falls
under `min_probability`: a token the draft doubts is rarely the target's. The
top candidates are picked inside the draft's graph, so no vocabulary-sized
array crosses into Python.

Catch-up is bounded: at most CATCH_UP_TOKENS are fed per proposal, so a long
new prompt delays a step by one chunk at a time, never by its whole prefill,
and a proposal still catching up drafts nothing. The engine charges the time
all this takes to the source, so where drafting does not pay the controller
stops asking (see controller.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from reame.cache import common_prefix
from reame.model.backend import DECODE_OK, Backend
from reame.model.sampling import Step
from reame.errors import ModelError

if TYPE_CHECKING:
    from reame.structured.grammar import Grammar

log = logging.getLogger("reame.speculative")

TOP_CANDIDATES = 10
CATCH_UP_TOKENS = 128
MAX_VOCAB_DIFFERENCE = 128  # as llama.cpp: models of one family may differ in a few trailing special tokens
FIRST_COMPARED_TOKEN = 5  # as llama.cpp: the first few ids are control tokens that families number freely


def check_same_vocabulary(target: Backend, draft: Backend, draft_name: str) -> None:
    """Refuse a draft model whose token ids do not mean what the target's mean."""
    reason = None
    if abs(target.n_vocab - draft.n_vocab) > MAX_VOCAB_DIFFERENCE:
        reason = f"its vocabulary has {draft.n_vocab} tokens, the model's {target.n_vocab}"
    elif (target.bos_token, target.eos_token, target.add_bos) != (draft.bos_token, draft.eos_token, draft.add_bos):
        reason = "its begin/end-of-text tokens differ from the model's"
    else:
        for token in range(FIRST_COMPARED_TOKEN, min(target.n_vocab, draft.n_vocab)):
            if target.token_piece(token) != draft.token_piece(token):
                reason = (f"token {token} is {draft.token_piece(token)!r} to it and "
                          f"{target.token_piece(token)!r} to the model")
                break
    if reason is not None:
        raise ModelError(f"the draft model {draft_name} does not share the model's vocabulary: {reason}")


def confidence(candidates: Sequence[tuple[int, float]]) -> float:
    """The best candidate's probability among `candidates` (token, logit), best first."""
    best = candidates[0][1]
    return 1.0 / sum(math.exp(logit - best) for _, logit in candidates)


class DraftModel:
    """The draft-model source. Owns `backend` (closed with the source)."""

    name = "draft"
    free = False

    def __init__(self, backend: Backend, target: Backend, draft_name: str, min_probability: float = 0.75) -> None:
        check_same_vocabulary(target, backend, draft_name)
        self.backend = backend
        self.min_probability = min_probability
        self.target_vocab = target.n_vocab
        self._idle: dict[int, list[int]] = {slot: [] for slot in range(backend.n_seq_max)}  # LRU first
        # Each slot's top candidates are picked inside the draft's graph.
        self._samplers = [backend.new_sampler([Step("top_k", (TOP_CANDIDATES,))], slot)
                          for slot in range(backend.n_seq_max)]

    def drafter(self, prompt: Sequence[int], grammar: Grammar | None = None) -> DraftModelDrafter:
        """A drafter on the idle slot whose KV shares the longest start with `prompt`."""
        if not self._idle:
            return DraftModelDrafter(self, None, [], prompt)  # more sequences than slots: it drafts nothing
        slot = max(self._idle, key=lambda candidate: common_prefix(self._idle[candidate], prompt))
        return DraftModelDrafter(self, slot, self._idle.pop(slot), prompt)

    def release(self, slot: int, kv: list[int]) -> None:
        self._idle[slot] = kv

    def evict_idle(self) -> bool:
        """Give up the KV idle slots keep; True when that freed anything."""
        freed = False
        for slot, kv in self._idle.items():
            if kv:
                self.backend.seq_rm(slot)
                self._idle[slot] = []
                freed = True
        return freed

    def warm_up(self) -> None:
        self.backend.warm_up()

    def close(self) -> None:
        for sampler in self._samplers:
            self.backend.free_sampler(sampler)
        self._samplers = []
        self.backend.close()


class DraftModelDrafter:
    matched = 0  # not a copying source: one match class (Drafter.matched)

    def __init__(self, model: DraftModel, slot: int | None, kv: list[int], prompt: Sequence[int]) -> None:
        self.model = model
        self.slot = slot
        self.kv = kv  # the tokens the slot's KV holds, from position 0
        self.history = list(prompt)
        self.failed = slot is None
        self._output = 0  # batch index of the logits of the last token fed

    def observe(self, tokens: Sequence[int]) -> None:
        self.history.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        backend, history, slot = self.model.backend, self.history, self.slot
        if slot is None or self.failed or limit <= 0 or len(history) + 1 >= backend.n_ctx_seq:
            return []
        try:
            pending = self._rewind(slot)
            caught_up = len(self.kv) + len(pending) == len(history)
            drafts: list[int] = []
            while pending:
                if not self._feed(slot, pending):
                    return []
                if not caught_up:
                    return []  # the rest of the history is fed at the next proposals
                token, probability = self._best()
                if probability < self.model.min_probability or token >= self.model.target_vocab:
                    break
                drafts.append(token)
                if len(drafts) == limit or len(history) + len(drafts) + 1 >= backend.n_ctx_seq:
                    break
                pending = [token]
            return drafts
        except ModelError as error:
            log.warning("the draft model failed, drafting stops for this sequence: %s", error)
            self.failed = True
            return []

    def _rewind(self, slot: int) -> list[int]:
        """Drop the KV the history no longer agrees with (rejected drafts); return the next tokens
        to feed. The last history token is always fed, for its logits."""
        backend, kv = self.model.backend, self.kv
        keep = min(common_prefix(kv, self.history), len(self.history) - 1)
        if keep < len(kv):
            if not backend.seq_rm(slot, keep, -1):
                backend.seq_rm(slot)
                keep = 0
            del kv[keep:]
        return self.history[keep:keep + CATCH_UP_TOKENS]

    def _feed(self, slot: int, tokens: list[int]) -> bool:
        """Decode `tokens` after `slot`'s KV, with logits for the last; False when there is no room."""
        backend, kv = self.model.backend, self.kv
        start = len(kv)
        batch = (tokens, range(start, start + len(tokens)), [slot] * len(tokens),
                 [False] * (len(tokens) - 1) + [True])
        status = backend.decode(*batch)
        if status != DECODE_OK and self.model.evict_idle():
            status = backend.decode(*batch)
        if status != DECODE_OK:
            return False
        kv.extend(tokens)
        self._output = len(tokens) - 1
        return True

    def _best(self) -> tuple[int, float]:
        """The draft's next token after what was fed last, and its confidence in it."""
        candidates = self.model.backend.top_tokens(self._output, TOP_CANDIDATES)
        return candidates[0][0], confidence(candidates)

    def close(self) -> None:
        if self.slot is not None:
            self.model.release(self.slot, self.kv)
            self.slot = None
            self.failed = True
