"""Template heads: the KV of a chat template's fixed opening, kept on disk for the next one-shot.

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
from collections.abc import Sequence
from pathlib import Path

from reame.cache.prefix import snapshot_name
from reame.cache.store import (SUFFIX, Snapshot, decode, encode_parts, enforce_budget, map_copy_on_write,
                               write_atomically)
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
