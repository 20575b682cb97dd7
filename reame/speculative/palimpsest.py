"""The Palimpsest: drafts from everything this server (and its siblings) generated before.

Narrow, repetitive work repeats itself: the same request tomorrow, the same
template over another product, the same boilerplate in every answer. Every
finished generation is appended with the end of its prompt to the archive
(`archive.py`: on disk, per tokenizer, shared by processes, kept across
restarts), and a sequence drafts the continuation that followed its own last
tokens there before.

The index is LZ77's hash chains over one flat array of tokens (records
separated by SEPARATOR): for a key (the last SHORT or LONG tokens), `head`
holds the newest position that followed it and `chain` links each position
to the previous one with the same key; 4 bytes per token per key length and
no per-key objects, so millions of tokens fit a small machine. A lookup walks
the LONG key's chain first (the end of a prompt the archive saw whole, the
middle of a repeated answer) and then the SHORT one's; each candidate is
checked token by token (keys are hashes) and scored by how far back it
matches the context. Among the candidates that match furthest, the draft
follows the most frequent continuation, token by token, and never crosses
into the next record.

A sequence keeps its place in the record it drafts from (`Place`): each
token it emits moves the place on. A repeated request rarely repeats its
answer exactly — greedy decoding under speculation is exact only up to float
rounding, and a near tie can go the other way — and after such a token the
context's end is new to the archive: the keys find nothing, or a chance
match of a few tokens elsewhere, until a key's worth of tokens after the
divergence matched. The place instead re-aligns at once (the token replaced
the archived one, or skipped a few of them, or was put in before one) and is
drafted from again as soon as one emitted token confirms it, so a divergence
costs two steps, not five or the rest of the answer. Drafting from the place
before that confirmation was tried and lost: on a real repeat (Qwen2.5-Coder-
1.5B, whose greedy answer drafted from one decoded without drafts rephrases
a third of it) most divergences are rephrasings, not single tokens, and the
eager drafts were rejected. After MAX_MISSES tokens in a row that do not
fit, the texts have parted and the place is dropped.
"""

from __future__ import annotations

import array
import collections
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from pathlib import Path

from reame.speculative import checkpoint
from reame.speculative.archive import Archive

if TYPE_CHECKING:
    from reame.structured.grammar import Grammar

log = logging.getLogger("reame.palimpsest")

SHORT, LONG = 3, 12  # key lengths in tokens
TABLE_BITS = 20  # head table entries per key length: 2^20 (4 MiB each)
MAX_CHAIN = 48  # candidates looked at per key length and lookup
MATCH_WINDOW = 64  # how far back a candidate's match with the context is measured
MIN_MATCH = 4  # tokens a candidate must share with the context's end to be drafted from
AGREEMENT = 0.5  # a draft goes on only while more than this share of the candidates agree
PROMPT_TOKENS = 512  # the end of a prompt kept with its answer
SEPARATOR = -1  # between records in the flat array: no key spans it, no draft crosses it
SYNC_SECONDS = 1.0  # fsync and read what other processes appended at this interval
SKIP_AHEAD = 4  # archived tokens an emitted token may have skipped and still re-align the place
STEP_BACK = 2  # tokens an emitted token may have been put in before, and still re-align the place
MAX_MISSES = 4  # emitted tokens in a row that do not fit the place before it is dropped
# Under a grammar, a match that does not reach back into the answer's own prompt (past the chat template's few
# tokens before an answer, which every request shares) is mostly text the grammar forces on every answer: keys,
# quotes, commas. It is worth a short match's evidence, not its length's: the record it found goes on with another
# request's values. On SmolLM2-135M's JSON triage such copies were drafted 15-31 tokens long and lost 4-8% of the
# decode time (replayed over 32 tickets: 1.02 -> 1.07x speculation off, repeats unchanged).
ANSWER_HEADER_TOKENS = 8
FORCED_MATCH_EVIDENCE = 7
CHECKPOINT_TOKENS = 16384  # the index is kept on disk once it grew by this much (checkpoint.py)


class ContinuationIndex:
    """Hash chains over the archived tokens. Appended to by one thread at a time (the Palimpsest holds
    its lock); read by the engine thread under the same lock."""

    def __init__(self, arrays: list[array.array] | None = None) -> None:
        """`arrays`: an index's own (`arrays()`), as a checkpoint kept them; else an empty index."""
        self._mask = (1 << TABLE_BITS) - 1
        if arrays is None:
            self.tokens = array.array("i")
            self._heads = {n: array.array("i", [-1]) * (1 << TABLE_BITS) for n in (SHORT, LONG)}
            self._chains = {n: array.array("i") for n in (SHORT, LONG)}
        else:
            self.tokens, short_heads, long_heads, short_chain, long_chain = arrays
            self._heads = {SHORT: short_heads, LONG: long_heads}
            self._chains = {SHORT: short_chain, LONG: long_chain}

    def arrays(self) -> list[array.array]:
        """The tokens, the heads and the chains (SHORT's, then LONG's), as a checkpoint keeps them."""
        return [self.tokens, self._heads[SHORT], self._heads[LONG], self._chains[SHORT], self._chains[LONG]]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, record: Sequence[int]) -> None:
        """Index one record: every position after at least SHORT of its tokens becomes a continuation."""
        tokens = self.tokens
        start = len(tokens)
        tokens.extend(record)
        tokens.append(SEPARATOR)
        for n, chain in self._chains.items():
            head, mask = self._heads[n], self._mask
            chain.extend([-1] * (len(tokens) - len(chain)))
            for position in range(start + n, len(tokens) - 1):
                key = hash(tuple(tokens[position - n:position])) & mask
                chain[position] = head[key]
                head[key] = position

    def continuation(self, context: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that most often followed the longest archived match of `context`'s end."""
        return self.find(context, limit)[0]

    def find(self, context: Sequence[int], limit: int) -> tuple[list[int], int, int]:
        """(the continuation, where the newest candidate that gave it all starts, how many of the
        context's last tokens it matched); ([], -1, 0) when nothing matches."""
        if limit <= 0 or len(context) < SHORT:
            return [], -1, 0
        tail = list(context[-MATCH_WINDOW:])
        best, candidates = MIN_MATCH - 1, []  # three tokens in common say little
        for n in (LONG, SHORT):
            if len(tail) < n:
                continue
            key = tuple(tail[-n:])
            position = self._heads[n][hash(key) & self._mask]
            chain, tokens = self._chains[n], self.tokens
            for _ in range(MAX_CHAIN):
                if position < 0:
                    break
                if tuple(tokens[position - n:position]) == key:
                    length = self._match_length(tail, position, n)
                    if length > best:
                        best, candidates = length, [position]
                    elif length == best:
                        candidates.append(position)
                position = chain[position]
            if candidates:
                break  # the long key found something: the short one can only match less far back
        draft, survivors = self._most_frequent(candidates, limit)
        if not draft:
            return [], -1, 0
        return draft, max(survivors) - len(draft), best

    def _match_length(self, tail: list[int], position: int, known: int) -> int:
        tokens, length = self.tokens, known
        while length < len(tail) and position - length - 1 >= 0:
            token = tokens[position - length - 1]
            if token != tail[-length - 1] or token == SEPARATOR:
                break
            length += 1
        return length

    def follow(self, position: int, limit: int) -> list[int]:
        """Up to `limit` archived tokens from `position`, within its record."""
        tokens, end = self.tokens, min(position + limit, len(self.tokens))
        draft = tokens[position:end].tolist()
        return draft[:draft.index(SEPARATOR)] if SEPARATOR in draft else draft

    def realign(self, position: int, token: int) -> tuple[int, bool] | None:
        """The place after `token` was emitted where `position`'s token was expected, and whether it
        was that token; None when the record ended there. A token found a few places on means the
        ones before it were skipped; one found just before, that the one emitted earlier was put in;
        otherwise it stands for the expected one."""
        tokens = self.tokens
        if position >= len(tokens) or tokens[position] == SEPARATOR:
            return None
        if tokens[position] == token:
            return position + 1, True
        for ahead in range(position + 1, min(position + 1 + SKIP_AHEAD, len(tokens))):
            if tokens[ahead] == SEPARATOR:
                break
            if tokens[ahead] == token:
                return ahead + 1, False
        for back in range(position - 1, max(position - 1 - STEP_BACK, -1), -1):
            if tokens[back] == SEPARATOR:
                break
            if tokens[back] == token:
                return back + 1, False
        return position + 1, False

    def _most_frequent(self, candidates: list[int], limit: int) -> tuple[list[int], list[int]]:
        """Follow the continuation most candidates share, while more than AGREEMENT of them do: where
        earlier answers went different ways (a product's name after the same `Name:`), the draft stops.
        Also the candidates that followed it to its end."""
        tokens, draft = self.tokens, list[int]()
        while candidates and len(draft) < limit:
            counts = collections.Counter(tokens[p] for p in candidates if tokens[p] != SEPARATOR)
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # among equals the newest: counted first
            if counts[token] <= AGREEMENT * len(candidates):
                break
            draft.append(token)
            candidates = [p + 1 for p in candidates if tokens[p] == token]
        return draft, candidates


@dataclass
class Place:
    """Where a sequence is in the record it drafts from: the archived token it should emit next."""

    index: ContinuationIndex  # positions mean nothing in another index (the archive was read afresh)
    position: int
    misses: int = 0  # emitted tokens in a row that were not the expected one


class Closable(Protocol):
    def close(self) -> None: ...


class Palimpsest:
    """The draft source (`name` "palimpsest"); free: a lookup reads a few array entries.

    A background thread reads the archive into the index, then wakes every SYNC_SECONDS (or when a
    generation ended) to append the finished generations, fsync them, and read what other processes
    appended. Until the first read is done it drafts nothing. A finished generation is indexed at once,
    so the next request drafts from it; it reaches the disk within a second."""

    name = "palimpsest"
    free = True

    def __init__(self, directory: Path, vocabulary: bytes, budget_bytes: int) -> None:
        """`vocabulary`: the tokenizer's 32-byte hash (`vocabulary_hash`, computed by the caller: the
        background thread touches files only, never the model, which may be freed before it stops)."""
        self.directory, self._vocabulary, self.budget_bytes = directory, vocabulary, budget_bytes
        self._lock = threading.Lock()
        self._index: ContinuationIndex | None = None
        self._pending: list[list[int]] = []  # finished generations not appended to the archive yet
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.loaded = threading.Event()  # set once the archive was read (or could not be)
        self.listener: Callable[[Sequence[int]], None] | None = None  # gets every generation recorded here
        self._attached: list[Closable] = []  # closed with it (the corpus link to other nodes)
        self._thread = threading.Thread(target=self._run, name="reame-palimpsest", daemon=True)
        self._thread.start()

    def drafter(self, prompt: Sequence[int], grammar: Grammar | None = None) -> PalimpsestDrafter:
        return PalimpsestDrafter(self, prompt, structured=grammar is not None)

    def continuation(self, context: Sequence[int], limit: int) -> list[int]:
        return self.find(context, limit)[0]

    def find(self, context: Sequence[int], limit: int) -> tuple[list[int], int, Place | None]:
        """The continuation of `context`'s longest archived match, how many tokens matched, and the
        place it was drafted from."""
        with self._lock:
            if self._index is None:
                return [], 0, None
            try:
                draft, start, matched = self._index.find(context, limit)
            except IndexError:  # a damaged checkpoint's positions: no draft (checkpoint.py)
                return [], 0, None
            return draft, matched, Place(self._index, start) if draft else None

    def follow(self, place: Place, limit: int) -> list[int]:
        with self._lock:
            return place.index.follow(place.position, limit) if place.index is self._index else []

    def advance(self, place: Place, tokens: Sequence[int]) -> bool:
        """Move `place` past the emitted `tokens`; False once it is lost (the record ended, the texts
        parted, the archive was read afresh)."""
        with self._lock:
            if place.index is not self._index:
                return False
            for token in tokens:
                moved = place.index.realign(place.position, token)
                if moved is None:
                    return False
                place.position, expected = moved
                place.misses = 0 if expected else place.misses + 1
                if place.misses >= MAX_MISSES:
                    return False
            return True

    def record(self, tokens: Sequence[int]) -> None:
        """A generation ended (with the end of its prompt): index it now, archive it within a second,
        and hand it to the listener (the corpus other nodes read, when there is one)."""
        with self._lock:
            if self._index is None:
                return
            self._index.add(tokens)
            self._pending.append(list(tokens))
        self._wake.set()
        if self.listener is not None:
            self.listener(tokens)

    def absorb(self, tokens: Sequence[int]) -> None:
        """Another node's generation: drafted from, not archived here (the store keeps it)."""
        with self._lock:
            if self._index is not None:
                self._index.add(tokens)

    def warm_up(self) -> None:
        pass

    def attach(self, companion: Closable) -> None:
        """Something that lives as long as the Palimpsest (closed first when it closes)."""
        self._attached.append(companion)

    def close(self) -> None:
        for companion in self._attached:
            companion.close()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            archive = Archive(self.directory, self._vocabulary, self.budget_bytes)
        except (OSError, ValueError) as error:
            log.warning("the Palimpsest is off: cannot use %s (%s)", self.directory, error)
            self.loaded.set()
            return
        kept = checkpoint.path_of(archive.path)
        saved = self._resume(archive, kept)  # tokens in the checkpoint on disk
        while True:
            self._append_pending(archive)
            new = archive.read_new()
            if new.restarted or self._index is None:
                index = ContinuationIndex()
                for frame in new.frames:
                    if self._stop.is_set():  # closing while reading: keep what ended meanwhile, and go
                        self._flush(archive)
                        self.loaded.set()
                        return
                    index.add(frame)
                with self._lock:
                    self._index = index
            elif new.frames:
                with self._lock:
                    for frame in new.frames:
                        self._index.add(frame)
            if not self.loaded.is_set():
                self.loaded.set()
                if len(self._index):
                    log.info("the Palimpsest holds %d tokens of earlier generations", len(self._index))
            archive.sync()
            saved = self._checkpoint(archive, kept, saved)
            if self._stop.is_set():  # what ended since this pass took the pending ones goes too
                self._flush(archive)
                return
            self._wake.wait(SYNC_SECONDS)
            self._wake.clear()

    def _resume(self, archive: Archive, kept: Path) -> int:
        """The index as its checkpoint kept it, when the archive is still the one it was made of; how many
        tokens it holds (0: none, the archive is read from its start)."""
        loaded = checkpoint.load(kept, TABLE_BITS)
        if loaded is None:
            return 0
        generation, offset, arrays = loaded
        if not archive.resume(generation, offset):
            return 0
        with self._lock:
            self._index = ContinuationIndex(arrays)
        return len(arrays[0])

    def _checkpoint(self, archive: Archive, kept: Path, saved: int) -> int:
        """Keep the index on disk when it grew by CHECKPOINT_TOKENS since the last checkpoint, and it is the
        archive's up to where it was read (nothing of this process's left to append); the tokens kept."""
        with self._lock:
            index, position = self._index, archive.position()
            if index is None or position is None or self._pending or len(index) - saved < CHECKPOINT_TOKENS:
                return saved
            arrays = [values[:] for values in index.arrays()]  # copies: the engine adds to the index meanwhile
        checkpoint.save(kept, *position, arrays, TABLE_BITS)
        return len(arrays[0])

    def _flush(self, archive: Archive) -> None:
        """The last pass before the flusher stops: what ended and is not appended yet goes, and to the disk."""
        self._append_pending(archive)
        archive.sync()

    def _append_pending(self, archive: Archive) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for record in pending:
            archive.append(record)


class PalimpsestDrafter:
    def __init__(self, source: Palimpsest, prompt: Sequence[int], structured: bool = False) -> None:
        """`structured`: the answer follows a grammar (see FORCED_MATCH_EVIDENCE)."""
        self.source = source
        self.structured = structured
        self.prompt = list(prompt[-PROMPT_TOKENS:])
        self.context = list(self.prompt)
        self.generated = 0
        self.place: Place | None = None
        self.matched = 0

    def observe(self, tokens: Sequence[int]) -> None:
        self.context.extend(tokens)
        self.generated += len(tokens)
        if self.place is not None and not self.source.advance(self.place, tokens):
            self.place = None

    def propose(self, limit: int) -> list[int]:
        """The longest match's continuation; but while the context's end is new to the archive (its match
        is shorter than a long key), the continuation from the sequence's place, once the last token
        emitted was the one the place expected."""
        draft, matched, place = self.source.find(self.context, limit)
        self.matched = matched
        if self.structured and matched < MATCH_WINDOW and matched <= self.generated + ANSWER_HEADER_TOKENS:
            self.matched = min(matched, FORCED_MATCH_EVIDENCE)
        if self.place is not None and self.place.misses == 0 and matched < LONG:
            followed = self.source.follow(self.place, limit)
            if followed:
                return followed
        if place is not None:
            self.place = place
        return draft

    def close(self) -> None:
        if self.generated:
            self.source.record(self.context)


def vocabulary_hash(piece: Callable[[int], bytes], n_vocab: int) -> bytes:
    """What makes two models' tokens interchangeable: every token's text, in order."""
    digest = hashlib.sha256(n_vocab.to_bytes(4, "little"))
    for token in range(n_vocab):
        text = piece(token)
        digest.update(len(text).to_bytes(4, "little") + text)
    return digest.digest()
