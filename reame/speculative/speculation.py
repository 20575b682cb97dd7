"""What the engine needs to speculate: a draft source, limits, the shared cost model and counters."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from reame.speculative.controller import CostModel, DraftController, SpeculationStats
from reame.speculative.source import DraftSource

SOURCE_PRIOR_DECAY = 0.9


@dataclass
class Speculation:
    """Engine-wide speculation settings and state; each sequence gets its own drafter and controller."""

    source: DraftSource
    max_draft: int = 8
    cost: CostModel = field(default_factory=CostModel)
    stats: SpeculationStats = field(init=False)
    _acceptance: float | None = field(default=None, init=False)  # the source's recent acceptance, all sequences
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.stats = SpeculationStats(self.max_draft)

    def controller(self) -> DraftController:
        """A new sequence's controller, starting from what this source achieved lately."""
        with self._lock:
            return DraftController(self.max_draft, self._acceptance)

    def verified(self, drafted: int, accepted: int) -> None:
        self.stats.verified(self.source.name, drafted, accepted)
        with self._lock:
            rate = accepted / drafted
            self._acceptance = rate if self._acceptance is None else \
                self._acceptance * SOURCE_PRIOR_DECAY + rate * (1 - SOURCE_PRIOR_DECAY)
