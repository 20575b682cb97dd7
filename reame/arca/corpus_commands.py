"""The original Reame's corpus commands, for its clients: ARCA.OBSERVE and ARCA.DRAFT (its "L4"), over the
corpus the nodes share.

Tokens travel packed as little-endian u32s. ARCA.OBSERVE adds one stream of tokens to the corpus stream
`reame:corpus:original` as an XADD would (kept in the append-only file, trimmed like the nodes' own
streams), so `redis-cli XRANGE` shows it. ARCA.DRAFT continues a tail from every `reame:corpus:*` stream,
the nodes' generations included, as the original's corpus did: the last 3 tokens of the tail are looked
for in the generations newest first (and, within one, its last occurrence), and up to k tokens that
followed them are returned, never past the end of that generation; nil when nothing matches. Tokens are
compared as the 4 bytes they travel as, so nothing is decoded and no model is needed. Instead of an index
(memory a small box cannot spare), a draft searches the newest MAX_SEARCHED_BYTES of the corpus: a few
milliseconds of the daemon's one thread at most, however large the corpus grows.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from reame.arca.resp import OK, Error, Reply
from reame.arca.state import CORPUS_PREFIX, ArcaState
from reame.arca.stream_commands import cmd_xadd
from reame.arca.types import Client

ORIGINAL_STREAM = CORPUS_PREFIX + b"original"
ORIGINAL_ENTRIES = b"10000"  # the most generations the stream keeps, as the nodes' corpus streams
NGRAM = 3
TOKEN = 4  # bytes
MAX_SEARCHED_BYTES = 8 << 20  # of the newest generations a draft looks through (2M tokens)
WHOLE_U32S = "ERR token payload must be whole u32s"


def cmd_arca_observe(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    tokens = args[0]
    if len(tokens) % TOKEN:
        return Error(WHOLE_U32S)
    if not tokens:
        return OK  # accepted and ignored, as the original's corpus did
    reply = cmd_xadd(state, client, [ORIGINAL_STREAM, b"MAXLEN", ORIGINAL_ENTRIES, b"*", b"node", b"original",
                                     b"tokens", tokens])
    return reply if isinstance(reply, Error) else OK


def cmd_arca_draft(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    tail, length = args
    try:
        k = int(length)
    except ValueError:
        return Error("ERR draft length is not an integer")
    if k <= 0:
        return Error("ERR draft length must be positive")
    if len(tail) % TOKEN:
        return Error(WHOLE_U32S)
    if len(tail) < NGRAM * TOKEN:
        return None
    wanted, searched = tail[-NGRAM * TOKEN:], 0
    for tokens in newest_generations(state):
        found = last_aligned(tokens, wanted)
        if found >= 0:
            start = found + len(wanted)
            return tokens[start:start + min(k, len(tokens)) * TOKEN]
        searched += len(tokens)
        if searched >= MAX_SEARCHED_BYTES:
            break
    return None


def newest_generations(state: ArcaState) -> Iterator[bytes]:
    """The packed tokens of every corpus stream's entries, newest first across the streams."""
    streams = []
    for key in sorted(state.corpus_keys):
        stream = state.keyspace.stream(key, create=False)
        if stream is None:
            state.corpus_keys.discard(key)  # deleted, expired or evicted
            continue
        streams.append(zip(reversed(stream.ids), reversed(stream.fields)))
    for _, pairs in heapq.merge(*streams, key=lambda entry: entry[0], reverse=True):
        yield packed_tokens(pairs)


def packed_tokens(pairs: list[bytes]) -> bytes:
    """A corpus entry's tokens (`… tokens <packed>`), whole tokens only."""
    for name, value in zip(pairs[::2], pairs[1::2]):
        if name == b"tokens":
            return value[:len(value) - len(value) % TOKEN]
    return b""


def last_aligned(tokens: bytes, wanted: bytes) -> int:
    """The byte offset of the last occurrence of `wanted` at a token boundary of `tokens` that some token
    follows, or -1."""
    end = len(tokens) - TOKEN  # a match must leave a token after it
    while True:
        found = tokens.rfind(wanted, 0, end)
        if found < 0 or found % TOKEN == 0:
            return found
        end = found + len(wanted) - 1
