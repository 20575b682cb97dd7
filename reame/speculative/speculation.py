"""What the engine needs to speculate: draft sources, which draft a step verifies, the cost model, counters.

Each sequence gets one `Drafting` per source (its drafter and controllers).
A step asks every free source (their guesses cost next to nothing) and
verifies the draft worth most; a draft model fills in where they have
nothing. What each source achieves (acceptance) and costs (seconds per
drafted token) is learned across sequences, so a new sequence starts from
what the source did lately.

A free source's guess that is not verified (not worth it, or another worth more) is kept as a shadow and
compared with the tokens the model emits next: how far it would have been
accepted is exactly what a verification would have found (drafts are checked
by drawing from the model and comparing), so its acceptance is learned
without spending a step on it, and it drafts again when its guesses turn good.

A copying source's guess is as good as the context it was found after is
long: on Qwen2.5-Coder-1.5B's held-out rewrites, prompt lookup's next token
was right 0.6 of the times after a 2-3 token match, 0.8 after 4-7, 0.95
after 8-15 and 0.99 after 16 or more, and its runs grew from 7 to 40 tokens.
One acceptance for all its guesses drafts too little where the model copies
and too much where it does not, so each class of match (MATCH_CLASSES) has
its own controller and its own learned prior.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reame.speculative.controller import (AcceptanceEstimate, CostModel, DraftController, SpeculationStats,
                                          believable_step, step_gain)
from reame.speculative.source import Drafter, DraftSource

if TYPE_CHECKING:
    from reame.structured.grammar import Grammar

log = logging.getLogger("reame.speculative")

SOURCE_PRIOR_DECAY = 0.9  # weight kept by a source's older acceptance, per verification
DRAFT_COST_DECAY = 0.9  # weight kept by a source's older drafting time, per proposal
MATCH_CLASSES = (4, 8, 16)  # context matches at least this long start a class of guesses (Drafter.matched)
# What each class's guesses start from before the process saw any: how often prompt lookup's next token was right
# after such a match on Qwen2.5-Coder-1.5B's held-out rewrites. The longest class is a repeat's: after a restart
# the Palimpsest's copy of a repeated answer drafts at once, not after its guesses were checked for a few tokens.
CLASS_PRIORS = (0.6, 0.8, 0.95, 0.99)
COST_CURVES = ("batched", "rowwise")  # the names the cost memory keeps the curves under
SHADOW_TOKENS = 4  # a guess checked for free is learned from after this many tokens, not after all of it


def match_class(matched: int) -> int:
    """The class of a guess found after `matched` tokens of context (0: short, or a source that does not copy)."""
    return bisect.bisect_right(MATCH_CLASSES, matched)


@dataclass(frozen=True)
class CostMemory:
    """Where step costs outlive the process: `recall` gives the text kept last (unchecked input, None
    when there is none), `keep` keeps new text (best effort)."""

    recall: Callable[[], str | None]
    keep: Callable[[str], None]


@dataclass
class Drafting:
    """One sequence's drafter and controllers (one per match class) for one source."""

    source: str
    drafter: Drafter
    controllers: list[DraftController]
    free: bool  # the source's proposals cost next to nothing (DraftSource.free)
    drafted_class: int = 0  # the match class of the draft being verified
    shadow: list[int] = field(default_factory=list)  # an unverified guess, checked against emitted tokens
    shadow_matched: int = 0  # how many of its tokens the model has emitted so far
    shadow_class: int = 0


class _SourceRecord:
    """What one source achieved and cost lately, over every sequence."""

    def __init__(self) -> None:
        # Estimated as a sequence's controller does, forgetting more slowly: a new sequence starts from
        # what the source's guesses of its class achieved over the last tens of verifications.
        self.overall = AcceptanceEstimate(SOURCE_PRIOR_DECAY)
        self.by_class = [AcceptanceEstimate(SOURCE_PRIOR_DECAY, prior) for prior in CLASS_PRIORS]
        self._seconds = 0.0
        self._tokens = 0.0

    def verified(self, match: int, drafted: int, accepted: int) -> None:
        self.overall.verified(drafted, accepted)
        self.by_class[match].verified(drafted, accepted)

    def proposed(self, tokens: int, seconds: float) -> None:
        self._seconds = self._seconds * DRAFT_COST_DECAY + seconds
        self._tokens = self._tokens * DRAFT_COST_DECAY + tokens

    @property
    def seconds_per_draft(self) -> float:
        """Drafting time per drafted token; a proposal that drafted nothing still counts its time."""
        return self._seconds / max(self._tokens, 1.0)


class Speculation:
    """Engine-wide speculation settings and state. Owns its sources (closed with it).

    `exact_rows`: the most rows a step may carry and still compute each row exactly as a one-row decode
    (model/batch_numerics.py), so that drafts leave a greedy or seeded answer byte for byte unchanged.
    `measure_exact_rows` measures it at warm-up on the engine thread; without it (a backend whose
    numerics never depend on the batch) every size is exact (None).
    """

    def __init__(self, *sources: DraftSource, max_draft: int = 8, cost: CostModel | None = None,
                 measure_exact_rows: Callable[[], int] | None = None, cost_memory: CostMemory | None = None) -> None:
        if not sources:
            raise ValueError("speculation needs at least one draft source")
        self.sources = sources
        self.max_draft = max_draft
        self._measure_exact_rows = measure_exact_rows
        self.exact_rows: int | None = 1 if measure_exact_rows is not None else None
        self.cost = cost if cost is not None else CostModel()
        # Steps whose rows are each computed as a one-row step does (plan_step's `rowwise`) may cost more
        # than the tiled kernels' steps of the same size (the one-row kernel, for weights without a tiled
        # kernel in its order): their own curve (a given `cost` is both).
        self.rowwise_cost = CostModel() if cost is None else cost
        self._cost_memory = cost_memory
        self._recalled: dict[str, set[int]] = {}  # the sizes of each curve seeded from the memory at warm-up
        self.stats = SpeculationStats(max_draft)
        self._records = {source.name: _SourceRecord() for source in sources}
        self._lock = threading.Lock()

    def start(self, prompt: Sequence[int], grammar: Grammar | None = None) -> list[Drafting]:
        """A new sequence's draftings, each controller starting from what its source achieved lately;
        `grammar`: the grammar its output must match, if any."""
        with self._lock:
            priors = {name: [estimate.value for estimate in record.by_class] for name, record in self._records.items()}
        return [Drafting(source.name, source.drafter(prompt, grammar),
                         [DraftController(self.max_draft, prior, probes=not source.free)
                          for prior in priors[source.name]], source.free)
                for source in self.sources]

    def cost_of(self, rowwise: bool) -> CostModel:
        """The cost curve of steps computed row by row (`rowwise`) or with the batched kernels."""
        return self.rowwise_cost if rowwise else self.cost

    def propose(self, draftings: Sequence[Drafting], batch_tokens: int, batch_yield: int,
                room: int, rowwise: bool = False) -> tuple[Drafting | None, list[int]]:
        """The draft worth most in a step carrying `batch_tokens` for `batch_yield` sequences (computed row
        by row: `rowwise`), and its source: the free sources' drafts are weighed against each other (Il
        Suggeritore's few forced tokens must not displace the Palimpsest's copy of the whole answer that
        contains them); a costly source is asked only when no free one offers a draft."""
        cost = self.cost_of(rowwise)
        best: tuple[float, Drafting, list[int], int] | None = None
        offered: list[tuple[Drafting, list[int], int]] = []
        for drafting in draftings:
            if not drafting.free:
                continue
            guess = drafting.drafter.propose(min(self.max_draft, room))
            if not guess:
                continue
            match = match_class(drafting.drafter.matched)
            controller = drafting.controllers[match]
            offered.append((drafting, guess, match))
            k, times = controller.draft(cost, batch_tokens, 0.0, batch_yield, longest=len(guess))
            if k:
                drafts = guess[:k]
                gain = step_gain(controller.acceptance, len(drafts), times[0], times[len(drafts)], batch_yield)
                if best is None or gain > best[0]:
                    best = (gain, drafting, drafts, match)
        for drafting, guess, match in offered:  # a guess not verified is checked against what the model emits
            if (best is None or drafting is not best[1]) and not drafting.shadow:
                drafting.shadow, drafting.shadow_matched, drafting.shadow_class = guess[:SHADOW_TOKENS], 0, match
        if best is not None:
            _, drafting, drafts, match = best
            drafting.shadow, drafting.drafted_class = [], match  # the verification measures this stretch
            return drafting, drafts
        for drafting in draftings:  # weigh first: proposing is the expensive part (and its match unknown until then)
            if drafting.free:
                continue
            record = self._records[drafting.source]
            drafting.drafted_class = 0
            k = drafting.controllers[0].draft_length(cost, batch_tokens, record.seconds_per_draft, batch_yield)
            if not k:
                continue
            started = time.perf_counter()
            drafts = drafting.drafter.propose(min(k, room))
            with self._lock:
                record.proposed(len(drafts), time.perf_counter() - started)
            if drafts:
                return drafting, drafts
        return None, []

    def verified(self, drafting: Drafting, drafted: int, accepted: int) -> None:
        self._learn(drafting, drafting.drafted_class, drafted, accepted)
        self.stats.verified(drafting.source, drafted, accepted)

    def observe(self, draftings: Sequence[Drafting], tokens: Sequence[int]) -> None:
        """The sequence emitted `tokens`: its drafters see them, and pending guesses are checked."""
        for drafting in draftings:
            drafting.drafter.observe(tokens)
            for token in tokens:
                if not drafting.shadow:
                    break
                if token == drafting.shadow[drafting.shadow_matched]:
                    drafting.shadow_matched += 1
                    if drafting.shadow_matched < len(drafting.shadow):
                        continue
                self._learn(drafting, drafting.shadow_class, len(drafting.shadow), drafting.shadow_matched)
                drafting.shadow = []

    def _learn(self, drafting: Drafting, match: int, drafted: int, accepted: int) -> None:
        drafting.controllers[match].verified(drafted, accepted)
        with self._lock:
            self._records[drafting.source].verified(match, drafted, accepted)

    def acceptance(self) -> dict[str, float]:
        """Each source's recent acceptance per draft token, verified or guessed, over all sequences."""
        with self._lock:
            return {name: record.overall.value for name, record in self._records.items()}

    def seconds_per_draft(self) -> dict[str, float]:
        with self._lock:
            return {name: record.seconds_per_draft for name, record in self._records.items()}

    def warm_up(self) -> None:
        """On the engine thread, before the first request: the sources' one-time costs, and the batch
        sizes this machine computes exactly (until measured, or if measuring fails, a greedy or seeded
        sequence drafts nothing)."""
        for source in self.sources:
            source.warm_up()
        self._recall_costs()
        if self._measure_exact_rows is not None:
            self.exact_rows = max(1, self._measure_exact_rows())
            log.info("batches of up to %d rows decode each row exactly as one row alone", self.exact_rows)

    def close(self) -> None:
        self._keep_costs()
        for source in self.sources:
            source.close()

    def _curves(self) -> tuple[tuple[str, CostModel], ...]:
        """The cost curves by the names they are kept under (one model twice when a `cost` was given)."""
        return tuple(zip(COST_CURVES, (self.cost, self.rowwise_cost)))

    def _recall_costs(self) -> None:
        """Seeds the cost curves with the times processes on this machine measured last."""
        remembered, ages = self._remembered_costs()
        self._recalled = {name: set(times) for name, times in remembered.items()}
        for name, model in self._curves():
            model.seed(remembered.get(name, {}), ages.get(name, {}))

    def _keep_costs(self) -> None:
        """Adds this process's step times, and how many steps ago each was measured, to the memory, over
        what other processes (a server with other settings, a one-shot run) kept there. A size this process
        was seeded with and then forgot (no step of that size for COST_MEMORY_STEPS, counting the steps of
        the processes before) leaves the memory too: kept again, a time that looks too dear to be tried
        would outlive every process that never measures it."""
        if self._cost_memory is None:
            return
        curves, ages = self._remembered_costs()
        for name, model in self._curves():
            recalled = self._recalled.get(name, set())
            kept = {size: seconds for size, seconds in curves.get(name, {}).items() if size not in recalled}
            kept_ages = {size: steps for size, steps in ages.get(name, {}).items() if size in kept}
            kept.update(model.snapshot())
            kept_ages.update(model.ages())
            curves[name], ages[name] = kept, kept_ages
        try:
            self._cost_memory.keep(json.dumps({**curves, "ages": ages}))
        except OSError:
            log.warning("the step costs could not be kept for the next start", exc_info=True)

    def _remembered_costs(self) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, int]]]:
        """The kept curves, and how many steps ago each size was measured (a size kept by an older process,
        without one, counts as just measured), read as the unchecked input they are: only sizes and times a
        step can have, and counts of steps for those sizes ({} when there are none or they are unreadable),
        so what is kept again is well formed."""
        if self._cost_memory is None:
            return {}, {}
        try:
            text = self._cost_memory.recall()
            if text is None:
                return {}, {}
            kept = json.loads(text)
            kept_ages = kept.get("ages", {})
            curves: dict[str, dict[int, float]] = {}
            ages: dict[str, dict[int, int]] = {}
            for name in COST_CURVES:
                times = {int(size): float(seconds) for size, seconds in kept.get(name, {}).items()}
                curves[name] = {size: seconds for size, seconds in times.items() if believable_step(size, seconds)}
                steps = {int(size): int(count) for size, count in kept_ages[name].items()} if name in kept_ages else {}
                ages[name] = {size: count for size, count in steps.items() if size in curves[name] and count >= 0}
            return curves, ages
        except (OSError, ValueError, TypeError, AttributeError, RecursionError, OverflowError):
            log.warning("the remembered step costs are unreadable: measuring them again", exc_info=True)
            return {}, {}

    @staticmethod
    def release(draftings: Sequence[Drafting]) -> None:
        """The sequence ended: its drafters give back what they hold. A drafter that fails to is
        logged; the sequence still ends normally."""
        for drafting in draftings:
            try:
                drafting.drafter.close()
            except Exception:
                log.exception("the %s drafter failed to release its sequence", drafting.source)
