"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the last n tokens.

Rewrites, extractions and code edits repeat long stretches of their input;
when the last `n` tokens appeared before, what followed them then is a good
guess for what follows now. Longer n-grams win over more recent shorter ones.
Among the earlier occurrences of the longest n-gram, the one whose context
matches furthest back wins, and among equals the most recent: a JSON record
rewritten field by field repeats `"status": "` in every record, and the
record being copied is the one whose earlier fields match too (as
llama.cpp's ngram-simple finds it by matching 12 tokens). An index from
n-gram to its latest end position, and a chain of every earlier occurrence
of the longest ones, keep each step O(max_ngram + MAX_CANDIDATES x
MATCH_WINDOW) however long the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reame.structured.grammar import Grammar

MAX_CANDIDATES = 16  # earlier occurrences of the longest n-gram weighed per draft, newest first
MATCH_WINDOW = 64  # how far back an occurrence's match with the context is measured


class PromptLookup:
    """The prompt-lookup draft source (`name` "lookup")."""

    name = "lookup"
    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        self.max_ngram = max(1, max_ngram)
        self.min_ngram = min(max(1, min_ngram), self.max_ngram)

    def drafter(self, prompt: Sequence[int], grammar: Grammar | None = None) -> LookupDrafter:
        drafter = LookupDrafter(self.max_ngram, self.min_ngram)
        drafter.observe(prompt)
        return drafter

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class LookupDrafter:
    def __init__(self, max_ngram: int, min_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.matched = 0
        self.history: list[int] = []
        # n-gram -> position just after its latest occurrence that ends before the last token
        self._next_after: dict[tuple[int, ...], int] = {}
        # position just after an occurrence of a max_ngram-gram -> just after its previous one (-1: none)
        self._earlier: dict[int, int] = {}
        # Tokens seen but not indexed yet: a long prompt is indexed when the first draft is asked for
        # (2.6 ms for 3,900 tokens here), after its first token went out, not before.
        self._unindexed: list[int] = []

    def observe(self, tokens: Sequence[int]) -> None:
        self._unindexed.extend(tokens)

    def _index(self) -> None:
        history, next_after, max_ngram = self.history, self._next_after, self.max_ngram
        for token in self._unindexed:
            # The n-grams ending at the previous last token become searchable: an occurrence that
            # ends at the very last token would only match itself.
            end = len(history)
            for n in range(1, min(max_ngram, end) + 1):
                key = tuple(history[end - n:end])
                if n == max_ngram:
                    self._earlier[end] = next_after.get(key, -1)
                next_after[key] = end
            history.append(token)
        self._unindexed = []

    def propose(self, limit: int) -> list[int]:
        if limit <= 0:
            return []
        if self._unindexed:
            self._index()
        history = self.history
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            start = self._next_after.get(tuple(history[-n:]))
            if start is not None:
                self.matched = n
                if n == self.max_ngram:
                    start, self.matched = self._furthest_match(start, n)
                return history[start:start + limit]
        self.matched = 0
        return []

    def _furthest_match(self, start: int, n: int) -> tuple[int, int]:
        """Among `start` and the earlier occurrences chained to it, the one whose context matches the
        history's end furthest back (the most recent among equals), and how far (up to MATCH_WINDOW)."""
        history, last = self.history, len(self.history) - 1
        best, best_length = start, -1
        for _ in range(MAX_CANDIDATES):
            if start < 0:
                break
            length = n
            while length < MATCH_WINDOW and start - length - 1 >= 0 and \
                    history[start - length - 1] == history[last - length]:
                length += 1
            if length > best_length:
                best, best_length = start, length
            start = self._earlier.get(start, -1)
        return best, best_length

    def close(self) -> None:
        pass
