"""Template heads: the KV of a chat template's fixed opening, kept on disk for the next one-shot, and in RAM
for a server's next request (`ResidentHeads`, at the end).

Every one-shot prompt to a chat model starts with the same tokens: the template's system part and the
opening of the user's turn (24 of SmolLM2's 31 tokens for "Hi"). The prefix cache does not keep them: it
indexes whole blocks of 32 tokens and snapshots prompts that took at least 64 tokens of prefill, so a short
prompt is prefilled whole every time. A one-shot whose prompt is short restores its head from here instead
(16 rows of SmolLM2's 31: 110 -> 55 ms of prefill here) and the first run without one writes it.

The answer must not change with it (a restored head and a whole prefill give bit-identical logits), and on
this pin that holds only at some split points: ggml's CPU kernels may compute a batch's rows in groups, so a
row's numerics can depend on where it falls in its batch. Measured on Qwen2.5-Coder-0.5B/1.5B Q4_K_M,
SmolLM2-135M Q4_1 and gemma-3-270m Q4_K_M over prompts of 1-20 words: a head cut at a multiple of 8 tokens
with at least 8 prompt tokens left to prefill gave the logits of the whole prefill bit for bit in every case;
cut elsewhere, or with fewer than 8 tokens left, Qwen's logits differed by up to 0.48 in some. So a head is
used only at such a cut (`usable_length`); tests/integration/test_template_heads_real.py keeps checking it.

Files: `<cache.dir>/heads/<snapshot name>.kvs`, the prefix cache's file format (cache/store.py), named by
the model's KV fingerprint and the head's tokens; a few hundred KB each, the least recently used removed
past HEADS_BUDGET_BYTES. A damaged, foreign or planted file is removed and the prompt prefilled.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from reame.cache.prefix import snapshot_name
from reame.cache.store import (SUFFIX, Snapshot, common_prefix, decode, encode_parts, enforce_budget,
                               map_copy_on_write, write_atomically)
from reame.errors import CacheError
from reame.files import private_directory

log = logging.getLogger("reame.cache")

HEAD_ALIGN = 8  # a head is cut at a multiple of this many tokens
MIN_PREFILL_ROWS = 8  # and leaves at least this many prompt tokens to prefill in one batch
HEADS_BUDGET_BYTES = 64 << 20
DIRECTORY = "heads"


def usable_length(head: int, prompt_tokens: int) -> int:
    """How many tokens of a prompt's `head` (its tokens shared with the template's opening) may be restored
    so that the answer does not change: a multiple of HEAD_ALIGN leaving MIN_PREFILL_ROWS; 0 if none."""
    return max(0, min(head, prompt_tokens - MIN_PREFILL_ROWS)) // HEAD_ALIGN * HEAD_ALIGN


class TemplateHeads:
    """The head files of one model and KV layout (`fingerprint`) under the cache directory."""

    def __init__(self, cache_directory: Path, fingerprint: bytes) -> None:
        self.directory = cache_directory / DIRECTORY
        self.fingerprint = fingerprint

    def _path(self, tokens: Sequence[int]) -> Path:
        return self.directory / (snapshot_name(self.fingerprint, tokens) + SUFFIX)

    def find(self, tokens: Sequence[int]) -> Snapshot | None:
        """The head holding exactly `tokens`, if one was written; a file that is not one is removed (one larger
        than all heads may be before its checksum is read)."""
        path = self._path(tokens)
        try:
            data, status = map_copy_on_write(path)
        except OSError:  # none (the usual miss), or unreadable
            return None
        try:
            if status.st_size > HEADS_BUDGET_BYTES:
                raise CacheError("it is larger than all template heads may be")
            snapshot = decode(data, self.fingerprint)
            if snapshot.tokens != tuple(tokens):
                raise CacheError("it holds other tokens")
        except CacheError as error:
            log.warning("removing template head %s: %s", path.name, error)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: the budget removes others first
        except OSError:
            pass
        return snapshot

    def keep(self, snapshot: Snapshot) -> None:
        """Write a head for the next run (not durable: a crash loses a file that the next run writes again)."""
        try:
            private_directory(self.directory)
            write_atomically(self._path(snapshot.tokens), encode_parts(self.fingerprint, snapshot, compress=False),
                             durable=False)
            enforce_budget(self.directory, SUFFIX, HEADS_BUDGET_BYTES)
        except OSError as error:  # a speed-up: the answer was given
            log.info("cannot keep the template head in %s: %s", self.directory, error.strerror or error)


MAX_HEAD_TOKENS = 64  # longer shared openings are the prefix cache's (cache.min_new_tokens, 32-token blocks)
RECENT_OPENINGS = 16  # prompts' openings compared with a new prompt's to find what they share
HEADS_RAM_BYTES = 32 << 20


class ResidentHeads:
    """A server's template heads: the KV of the opening many prompts share (a chat template's system part and
    the start of the user's turn), kept in RAM when the idle slot holding it gives its cells up.

    A server keeps a chat's KV in its slot, and the next chat reuses the template's opening from there; but
    behind a prefix cache every other request's start makes idle slots give up their KV (Sequences._compact),
    and an opening of 27 tokens (Qwen's) is below what the prefix cache indexes and snapshots. So a chat sent
    while a batch runs found 4 cached tokens instead of 27 and waited 0.9-1.5 s for its first token instead of
    0.5 s. Heads are learned, not configured: a prompt's head is as much of its opening as it shares with one
    of the last RECENT_OPENINGS prompts, cut (as a one-shot's, `usable_length`) where restoring it gives the
    logits of a whole prefill. Engine thread only; the least recently used goes past HEADS_RAM_BYTES."""

    def __init__(self, budget_bytes: int = HEADS_RAM_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._recent: list[tuple[int, ...]] = []
        self._heads: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()
        self._bytes = 0

    def learn(self, prompt: Sequence[int]) -> int:
        """How long the head of `prompt` is (0: it shares no opening worth keeping); `prompt` is then one of
        the recent openings the next ones are compared with."""
        opening = tuple(prompt[:MAX_HEAD_TOKENS])
        shared = max((common_prefix(opening, other) for other in self._recent), default=0)
        self._recent = [opening, *self._recent[:RECENT_OPENINGS - 1]]
        return shared // HEAD_ALIGN * HEAD_ALIGN

    def has(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._heads

    def holds(self, saved: object) -> bool:
        """Whether `saved` is one of these heads (not a prefix-cache snapshot of the same tokens)."""
        return isinstance(saved, Snapshot) and self._heads.get(saved.tokens) is saved

    def forget(self, snapshot: Snapshot) -> None:
        """A head the context refused: never offered again."""
        if self._heads.pop(snapshot.tokens, None) is not None:
            self._bytes -= len(snapshot.blob)

    def keep(self, snapshot: Snapshot) -> None:
        """Keep a head (its snapshot holds exactly its tokens); the least recently used go past the budget."""
        size = len(snapshot.blob)
        if snapshot.tokens in self._heads or size > self.budget_bytes:
            return
        self._heads[snapshot.tokens] = snapshot
        self._bytes += size
        while self._bytes > self.budget_bytes:
            _, dropped = self._heads.popitem(last=False)
            self._bytes -= len(dropped.blob)

    def find(self, prompt: Sequence[int]) -> Snapshot | None:
        """The longest kept head that `prompt` starts with and that can be restored without changing its
        answer (`usable_length`)."""
        for length in range(usable_length(MAX_HEAD_TOKENS, len(prompt)), 0, -HEAD_ALIGN):
            found = self._heads.get(tuple(prompt[:length]))
            if found is not None:
                self._heads.move_to_end(found.tokens)
                return found
        return None
