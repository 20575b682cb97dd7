"""When speculation pays, measured on this machine: step costs, acceptance, draft length.

A verification step feeds a sequence's next token plus k drafts in one
decode. It yields E(k) = (1 - a^(k+1)) / (1 - a) tokens when each draft is
accepted with probability a (Leviathan et al.), and costs T(n + k) instead of
T(n), where T is the time of a step carrying n tokens. On a GPU, T is flat in
small n and drafting is nearly free; on two CPU cores it is not, so both are
measured:

- `CostModel` keeps the median of the engine's recent decode step times
  for each number of tokens per step, so it follows the machine as it gets
  busier or quieter, and one step slowed by a neighbour does not count.
- `DraftController` (one per sequence and source) keeps a forgetting estimate
  of that sequence's acceptance and picks the k that maximises the step's
  tokens per second, (Y - 1 + E(k)) / Y * T(n) / T(n + k), where the step
  would otherwise yield Y tokens (one per decoding sequence): a draft slows
  the whole batch down but speeds up only its own sequence, so beside three
  other streams it must be far better than alone. When no k beats plain
  decoding it drafts nothing, and later it tries a short draft again: one
  user's free prose does not switch speculation off for another's
  extraction, and a sequence whose text turns repetitive gets it back.

A source that computes its drafts (a draft model) also costs time before the
step: the engine measures it per drafted token, and the controller adds it to
the step's cost. A switched-off draft model is re-probed with a short draft,
spaced so that the probes cost at most PROBE_BUDGET of the time since the last
one, shared among the sequences of a batch, and never sooner than every
REPROBE_STEPS steps. A free source (prompt lookup) needs no probes: while it
is off, its guesses are checked against the tokens the model then emits
(Speculation.observe), which measures its acceptance exactly and for nothing.
"""

from __future__ import annotations

import collections
import math
import statistics
import threading
from dataclasses import dataclass

COST_SAMPLES = 5  # a step size's cost is the median of its last this many times
ACCEPTANCE_DECAY = 0.85  # weight kept by older verifications of one sequence
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.2, 0.8  # a 0.6 acceptance prior worth two verifications
MODELLED_TOKENS = 64  # steps up to this size feed the cost model
COST_MEMORY_STEPS = 1000  # a step size not measured for this many steps is estimated again
MAX_STEP_SECONDS = 60.0  # a remembered step time past this is not believed
PRIOR_SLOPE = 0.5  # before a bigger step was measured: each extra token costs half a one-token step
# A remembered step of n rows that took longer than this many times n one-row steps was slowed by a neighbour:
# no kernel computes rows that much slower together than one by one (a SmolLM2-135M server run beside a test
# suite kept 2 rows at 1.6 s and 13 at 3.0 s against 9 ms for one, and its successor never drafted).
UNBELIEVABLE_ROWS_FACTOR = 2.0
REPROBE_STEPS = 32
PROBE_DRAFT = 1
PROBE_BUDGET = 0.02  # share of the plain steps' time a re-probe may cost
# Below this expected speed-up, drafting is not worth its risk: a draft is verified when its acceptance estimate
# is high, so the estimate is more often too high than too low (replayed over Qwen2.5-Coder-1.5B's greedy answers
# with AMD EPYC step costs, 1.02 -> 1.1: the worst summary 3.2% -> 2.7% slower, rewrites unchanged).
MIN_GAIN = 1.1
EXPLORE_MARGIN = 1.15  # an unmeasured size is tried when, at its least possible cost, it would gain this much more
# ... and when it is at most this multiple of the largest size measured: exploring climbs 2, 4, 8, 16 rows, so a
# guess at a new source's acceptance is paid for with a short step, not a 16-row one (a fresh server's first
# rewrite on Qwen2.5-Coder-1.5B lost three 300 ms steps to 15-token drafts of a prior's optimism)
EXPLORE_REACH = 2


def believable_step(n_tokens: int, seconds: float) -> bool:
    """Whether a step size and time read from outside (a remembered curve) can be a modelled step's."""
    return 1 <= n_tokens <= MODELLED_TOKENS and math.isfinite(seconds) and 0 < seconds < MAX_STEP_SECONDS


class CostModel:
    """T(n): seconds of an engine step decoding n tokens, each with its logits, measured on this
    machine. Thread-safe. Steps that prefill prompts are not shown to it: prompt tokens need no
    logits, and their cheaper rows would make long drafts look affordable (on SmolLM2-135M, whose
    vocabulary projection is a fifth of its work per row, they did: 20% slower with drafts).

    Kept per n as the median of its last COST_SAMPLES times, because one step that another process
    slowed (on two cores a step whose second thread waits for the core takes 5-20x as long) must not
    set the curve: the moving average this replaced ended a benchmark of five servers on two cores with
    Qwen2.5-Coder-1.5B's one-row step at 316 ms (45-62 ms traced alone), two rows at 506 and four at
    138, and the next process started from them. And per n because on a CPU the curve is lumpy, not
    linear: here
    Qwen2.5-Coder-1.5B took 41 ms for one token, 61 for two, 76 for four and 163 for eight
    (`llama-bench -p 1,2,4,8`): matrix kernels work in tiles of rows. A size never measured is
    estimated from a line through the measured ones (with one size known, each extra token is
    assumed to cost PRIOR_SLOPE of it), so the controller reaches for longer drafts only as far
    as what it has seen justifies, and learns each size's real cost when it first uses it.

    A size's cost is only measured when drafts use it, so one too slow a measurement could
    keep the controller off that size, and the sizes past it, for good. Two things prevent
    it: a size's first step is not counted (llama.cpp builds the graph for a new batch shape
    then: 5-10% slower here), and a size not measured in the last COST_MEMORY_STEPS steps is
    forgotten and estimated again from the others, so it gets tried again.

    Sizes are tried only when a draft makes them worth trying, and trying one that does not pay
    costs a step's worth of rejected rows: a fresh Qwen2.5-Coder-1.5B server lost 3-20% on each of
    its first summaries finding out that no size pays on two AMD cores. So the times known when a
    server stops are seeded into the next one on this machine (`seed`, Speculation's cost memory).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[int, float] = {}  # size -> the median of its samples (kept: curve() reads it every step)
        self._samples: dict[int, collections.deque[float]] = {}  # size -> its last COST_SAMPLES times
        self._measured_at: dict[int, int] = {}  # size -> the step it was last measured (or seeded) at
        self._built: set[int] = set()  # sizes whose step this process has run (their graph built)
        self._steps = 0
        # The curves asked for since the times last changed: every source with a guess asks for the same one
        # or two each step, and fitting one took 40 us, 0.4% of SmolLM2-135M's step each time.
        self._curves: dict[tuple[int, int, bool], list[float]] = {}

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens > MODELLED_TOKENS or seconds <= 0:
            return  # a long prefill step says little about the small steps drafts make
        with self._lock:
            self._steps += 1
            for size, step in list(self._measured_at.items()):
                if self._steps - step > COST_MEMORY_STEPS and size != n_tokens:
                    del self._measured_at[size]
                    if self._seconds.pop(size, None) is not None:
                        self._curves.clear()
                    self._samples.pop(size, None)
            self._measured_at[n_tokens] = self._steps
            if n_tokens not in self._built:
                self._built.add(n_tokens)
                return  # the new shape's graph was built in this step
            samples = self._samples.setdefault(n_tokens, collections.deque(maxlen=COST_SAMPLES))
            samples.append(seconds)
            median = statistics.median(samples)
            if self._seconds.get(n_tokens) != median:
                self._seconds[n_tokens] = median
                self._curves.clear()

    def seed(self, seconds: dict[int, float], ages: dict[int, int] | None = None) -> None:
        """Step times measured before (earlier processes on this machine): each one sample of its size
        until this process's steps outvote it; a size whose time is unbelievable beside the remembered
        one-row step (UNBELIEVABLE_ROWS_FACTOR) is not seeded. `ages`: how many steps ago (theirs) each was
        last measured (0 when not given); a size not measured within COST_MEMORY_STEPS is forgotten whichever
        process ran those steps, so a time that looks too dear to try is not believed forever by processes
        that each run fewer steps than that."""
        one_row = seconds.get(1)
        with self._lock:
            for n_tokens, value in seconds.items():
                age = 0 if ages is None else ages.get(n_tokens, 0)
                if one_row is not None and value > UNBELIEVABLE_ROWS_FACTOR * n_tokens * one_row:
                    continue  # estimated from the believable sizes instead, and tried again when it pays
                if believable_step(n_tokens, value) and n_tokens not in self._seconds and 0 <= age <= COST_MEMORY_STEPS:
                    self._seconds[n_tokens] = value
                    self._samples[n_tokens] = collections.deque([value], maxlen=COST_SAMPLES)
                    self._curves.clear()
                    self._measured_at.setdefault(n_tokens, self._steps - age)

    def snapshot(self) -> dict[int, float]:
        """Every size's time as known now (measured or seeded)."""
        with self._lock:
            return dict(self._seconds)

    def ages(self) -> dict[int, int]:
        """How many steps ago each known size was last measured (a seeded one: by the process before, plus
        this process's steps since)."""
        with self._lock:
            return {size: self._steps - step for size, step in self._measured_at.items() if size in self._seconds}

    def measured(self, n_tokens: int) -> bool:
        with self._lock:
            return n_tokens in self._seconds

    def largest_measured(self) -> int:
        """The largest step size with a measured time (0: none yet)."""
        with self._lock:
            return max(self._seconds, default=0)

    def all_measured(self, first: int, last: int) -> bool:
        """Whether every size from `first` to `last` has a measured time."""
        with self._lock:
            return all(n in self._seconds for n in range(first, last + 1))

    def curve(self, first: int, last: int, optimistic: bool = False) -> list[float] | None:
        """T(n) for n = first..last, measured or estimated (one fit for all: the controller asks every
        step); None before any step was seen. `optimistic`: an unmeasured size costs what the largest
        smaller measured size costs, the least it can cost (matrix kernels switch to faster tiles at
        some sizes: on this machine 16 tokens cost 6x one token, 8 tokens 5x)."""
        with self._lock:
            known = self._curves.get((first, last, optimistic))
            if known is not None:
                return list(known)
            seconds = dict(self._seconds)
        if not seconds:
            return None
        times = self._fit(seconds, first, last, optimistic)
        with self._lock:
            if seconds == self._seconds:
                self._curves[(first, last, optimistic)] = times
        return list(times)

    @staticmethod
    def _fit(seconds: dict[int, float], first: int, last: int, optimistic: bool) -> list[float]:
        """`curve` from these measured times."""
        sizes = sorted(seconds)
        smallest = sizes[0]
        slope = PRIOR_SLOPE * seconds[smallest]
        line_n, line_t = float(smallest), seconds[smallest]
        if len(sizes) > 1:
            line_n = sum(sizes) / len(sizes)
            line_t = sum(seconds.values()) / len(sizes)
            slope = max(0.0, sum((n - line_n) * (seconds[n] - line_t) for n in sizes) /
                        sum((n - line_n) ** 2 for n in sizes))
        times = []
        below, next_measured = 0.0, 0  # the largest time measured for a smaller size; index into sizes
        for n in range(first, last + 1):
            while next_measured < len(sizes) and sizes[next_measured] < n:
                below = max(below, seconds[sizes[next_measured]])
                next_measured += 1
            if n in seconds:
                times.append(seconds[n])
            elif n < smallest:  # below everything measured: at least proportionally cheaper
                times.append(seconds[smallest] * n / smallest)
            elif optimistic:
                times.append(below)
            else:  # never cheaper than a smaller size already measured
                times.append(max(line_t + slope * (n - line_n), below))
        return times


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification of k drafts yields: the accepted run plus the target's own token."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def step_gain(acceptance: float, k: int, base: float, seconds: float, batch_yield: float = 1.0) -> float:
    """How many times a plain step's tokens per second a step with k drafts makes: the plain step takes
    `base` seconds and yields `batch_yield` tokens, this one takes `seconds` (drafting included)."""
    return (batch_yield - 1 + expected_tokens(acceptance, k)) / batch_yield * base / seconds


class AcceptanceEstimate:
    """The acceptance a of the geometric model from verifications, forgetting the older ones by `decay`:
    its maximum-likelihood estimate, accepted drafts over accepted drafts plus rejections (a verification
    whose every draft passed rejected none), from a prior worth two verifications."""

    def __init__(self, decay: float, prior: float | None = None) -> None:
        self.decay = decay
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
        self._accepted = prior * weight if prior is not None else PRIOR_ACCEPTED
        self._rejected = weight - self._accepted

    @property
    def value(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def verified(self, drafted: int, accepted: int) -> None:
        self._accepted = self._accepted * self.decay + accepted
        self._rejected = self._rejected * self.decay + (1 if accepted < drafted else 0)


class DraftController:
    """Draft length for one sequence and one source."""

    def __init__(self, max_draft: int, prior: float | None = None, probes: bool = True) -> None:
        """`prior`: the acceptance to start from; `probes`: whether to try a short draft now and then
        while drafting does not pay (a source whose guesses are checked for free needs none)."""
        self.max_draft = max_draft
        self.probes = probes
        self._acceptance = AcceptanceEstimate(ACCEPTANCE_DECAY, prior)
        self._plain_steps = 0

    @property
    def acceptance(self) -> float:
        return self._acceptance.value

    def draft_length(self, cost: CostModel, batch_tokens: int, seconds_per_draft: float = 0.0,
                     batch_yield: float = 1.0) -> int:
        """How many tokens to draft in a step that already carries `batch_tokens` and would yield
        `batch_yield` tokens (its sequences' next tokens), when drafting costs `seconds_per_draft`
        per token; 0 for a plain step."""
        return self.draft(cost, batch_tokens, seconds_per_draft, batch_yield)[0]

    def draft(self, cost: CostModel, batch_tokens: int, seconds_per_draft: float = 0.0,
              batch_yield: float = 1.0, longest: int | None = None) -> tuple[int, list[float]]:
        """`draft_length`'s length, at most `longest` (a guess already made: a longer plan would verify a
        shorter draft than the one weighed, and an exploration would never measure the size it was for), and
        the step times it weighed (times[i]: a step carrying `batch_tokens` + i; [] before any step was
        measured), so a caller weighing drafts does not fit the curve again."""
        times = cost.curve(batch_tokens, batch_tokens + self.max_draft)
        if times is None:
            return 0, []
        most = self.max_draft if longest is None else min(self.max_draft, longest)
        base = times[0]
        acceptance = self.acceptance
        best_k, best_gain = 0, MIN_GAIN
        for k in range(1, most + 1):
            gain = step_gain(acceptance, k, base, times[k] + k * seconds_per_draft, batch_yield)
            if gain > best_gain:
                best_k, best_gain = k, gain
        explored = self._explore(cost, batch_tokens, seconds_per_draft, batch_yield, max(best_gain, MIN_GAIN), most)
        if explored:
            return explored, times
        if best_k == 0 and self.probes:
            self._plain_steps += 1
            probe = min(PROBE_DRAFT, most)
            # Every sequence of the batch may probe: each gets its share of the budget.
            probe_cost = times[probe] - base + probe * seconds_per_draft
            if self._plain_steps >= max(REPROBE_STEPS, probe_cost * batch_yield / (PROBE_BUDGET * base)):
                self._plain_steps = 0
                best_k = probe
        return best_k, times

    def _explore(self, cost: CostModel, batch_tokens: int, seconds_per_draft: float, batch_yield: float,
                 to_beat: float, most: int) -> int:
        """A draft length up to `most` whose step size was never measured, at most EXPLORE_REACH times the
        largest measured one, and that would beat `to_beat` by EXPLORE_MARGIN even at the least such a step
        can cost; 0 when there is none. Trying it once measures it: without this, sizes past the measured
        ones are extrapolated from a line through them, and cheaper tiles further on are never found."""
        last = min(most, cost.largest_measured() * EXPLORE_REACH - batch_tokens)
        if last < 1 or cost.all_measured(batch_tokens + 1, batch_tokens + last):
            return 0
        times = cost.curve(batch_tokens, batch_tokens + self.max_draft, optimistic=True)
        if times is None:
            return 0
        acceptance, best_k, best_gain = self.acceptance, 0, to_beat * EXPLORE_MARGIN
        for k in range(1, last + 1):
            if cost.measured(batch_tokens + k):
                continue
            gain = step_gain(acceptance, k, times[0], times[k] + k * seconds_per_draft, batch_yield)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k

    def verified(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens accepted the first `accepted` of them (or would have:
        a guess checked against what the model emitted counts the same)."""
        self._acceptance.verified(drafted, accepted)
        self._plain_steps = 0


@dataclass
class SourceCounts:
    """Draft tokens one source proposed for verification, and how many the model accepted."""

    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class SpeculationSnapshot:
    """What `SpeculationStats` counted, copied at one moment (for /metrics and the stats line)."""

    sources: dict[str, SourceCounts]
    steps_plain: int
    steps_speculative: int
    drafted_at: tuple[int, ...]  # verifications that carried a draft token at position i (1-based)
    accepted_at: tuple[int, ...]  # of which the model accepted position i
    last_draft_length: int


class SpeculationStats:
    """Engine-wide counters for /metrics and the stats line. Written by the engine thread, read by any:
    the lock keeps a snapshot whole."""

    def __init__(self, max_draft: int) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, SourceCounts] = {}
        self._steps_plain = self._steps_speculative = 0
        self._accepted_at = [0] * (max_draft + 1)
        self._drafted_at = [0] * (max_draft + 1)
        self._last_draft_length = 0

    def verified(self, source: str, drafted: int, accepted: int) -> None:
        with self._lock:
            counts = self._sources.setdefault(source, SourceCounts())
            counts.drafted += drafted
            counts.accepted += accepted
            for position in range(1, drafted + 1):
                self._drafted_at[position] += 1
                if position <= accepted:
                    self._accepted_at[position] += 1
            self._last_draft_length = drafted

    def step(self, speculative: bool) -> None:
        with self._lock:
            if speculative:
                self._steps_speculative += 1
            else:
                self._steps_plain += 1

    def snapshot(self) -> SpeculationSnapshot:
        with self._lock:
            return SpeculationSnapshot({name: SourceCounts(c.drafted, c.accepted) for name, c in self._sources.items()},
                                       self._steps_plain, self._steps_speculative, tuple(self._drafted_at),
                                       tuple(self._accepted_at), self._last_draft_length)
