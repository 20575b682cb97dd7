"""The protocol every draft source implements.

A source makes one `Drafter` per sequence; the drafter sees every token the
sequence holds (prompt, then each emitted token) and proposes the tokens it
expects next. Deterministic sources (prompt lookup, the Palimpsest, Il
Suggeritore, a greedy draft model) put all their probability on each proposed
token, which is what makes verification exact with a plain draw from the
target (see `verify` in engine/step.py).

Drafters are made, asked and released on the engine thread, so a source that
computes (a draft model) decodes on the same thread as the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from reame.structured.grammar import Grammar


class Drafter(Protocol):
    # How many tokens of context the last proposal's continuation was found after: a copying source's
    # guess is as good as that match is long (speculation.py's match classes). 0 for a source that does not
    # copy, and for a draft model, whose proposal is weighed before it is made.
    matched: int

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence, in order."""

    def propose(self, limit: int) -> list[int]:
        """At most `limit` tokens expected to follow what was observed; [] when it has no idea."""

    def close(self) -> None:
        """The sequence ended: give back what the drafter holds."""


class DraftSource(Protocol):
    name: str
    # Proposing costs next to nothing (an index lookup): the engine asks the drafter before the
    # controller, which then only weighs steps that have a draft, and a guess not worth verifying
    # is checked against the tokens emitted next instead of re-probing. Otherwise the controller
    # decides first and the proposal's time is measured and charged to the source.
    free: bool

    def drafter(self, prompt: Sequence[int], grammar: Grammar | None = None) -> Drafter:
        """A drafter for one sequence: its prompt, and the grammar its output must match, if any."""
        ...

    def warm_up(self) -> None:
        """One-time costs, paid on the engine thread before the first request."""

    def close(self) -> None:
        """The engine stopped: free what the source holds."""
