"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the last n tokens.

Rewrites, extractions and code edits repeat long stretches of their input;
when the last `n` tokens appeared before, what followed them then is a good
guess for what follows now. Longer n-grams win over more recent shorter ones;
among equals the most recent earlier occurrence wins. An index from n-gram to
its latest end position keeps each step O(max_ngram) however long the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reame.structured.grammar import Grammar


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
        self.history: list[int] = []
        # n-gram -> position just after its latest occurrence that ends before the last token
        self._next_after: dict[tuple[int, ...], int] = {}
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
                next_after[tuple(history[end - n:end])] = end
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
                return history[start:start + limit]
        return []

    def close(self) -> None:
        pass
