"""The model's KV cells, as the engine edits them: every decode, removal, copy and restore of the shared KV
goes through `KvCells`, which mirrors which cells each sequence holds, so whatever needs cells knows before
asking llama.cpp whether they are free (and `Sequences.make_room` frees exactly enough). Engine thread only.

What llama.cpp needs to place cells, read from the pin (0c1e57098, src/llama-kv-cache.cpp): a decode's
tokens (`prepare`) and a restored sequence state (`state_read_meta`) both go through
`find_slot(ubatch, cont=false)`, which takes free cells one at a time wherever they are. Placement never
needs contiguous cells, so fragmentation costs nothing and a count decides:

- a state of N tokens needs N free cells in its sequence's stream, once the destination's own cells are
  freed (llama.cpp frees them first), and needs all N even when the engine keeps only part of it;
- `seq_cp` shares cells rather than copying them, and a cell is free when no sequence holds it;
- a unified KV (several slots, the default) is one stream of `n_ctx` cells shared by every sequence;
  otherwise each sequence has a stream of `n_ctx_seq` cells of its own, which no other sequence can take.

A model with a sliding window (Gemma 3) keeps those layers in a second, smaller cache whose cells past the
window are reused in place: there the ledger counts the full cache and is not `exact`, so a restore
llama.cpp refuses beside other sequences may have lacked cells the ledger does not count
(`Sequences._restore` then keeps the snapshot). Elsewhere it is exact: a state refused once its cells are
free is a state this context cannot take.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reame.model.backend import DECODE_INTERRUPTED, DECODE_OK, Backend


@dataclass(frozen=True)
class KvStats:
    """What the KV's owner did with its cells, as other threads may see it (published in EngineStatus)."""

    cells: int = 0  # the KV's cells, every stream together
    cells_used: int = 0
    restores: tuple[tuple[str, str, int], ...] = ()  # (source, outcome, count): source "snapshot" or "session",
    # outcome "restored", "no_room" (running sequences hold the cells) or "rejected" (the context refused it)
    cells_given_up: int = 0  # cells idle slots freed (for room, or for a request taking their slot)
    idle_snapshots: int = 0  # idle slots' KV kept in the prefix cache as they gave it up
    decodes: int = 0  # decode calls: generations' batches and embeddings' (llama-server's n_decode_total)
    tokens_moved: int = 0  # prompt tokens whose KV cache reuse moved into place instead of a prefill
    decodes_interrupted: int = 0  # decodes of background rows stopped for a foreground request (interruption.py)


@dataclass(frozen=True)
class Run:
    """Positions `start`..`end` (excluded) of a sequence, in cells that placement `origin` (one decode or
    one restore) wrote: a cell is the pair (origin, position), so two sequences holding the same pair
    share that cell."""

    origin: int
    start: int
    end: int


class KvCells:
    """The engine's edits of the model's memory, and the ledger of the cells they leave each sequence."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.unified = backend.n_seq_max == 1 or backend.n_ctx_seq >= backend.n_ctx
        self.capacity = backend.n_ctx if self.unified else backend.n_ctx_seq  # cells in one stream
        self.exact = not backend.sliding_window  # see the module's docstring
        self._runs: dict[int, list[Run]] = {}
        self._holders: Counter[int] = Counter()  # origin -> runs that hold some of its cells
        self._origins = itertools.count()
        self._used: int | None = None  # cells held in the unified stream, counted when next asked
        self.decodes = 0  # decode calls made, for the status
        self.interrupted = 0  # of them, stopped by Backend.interrupt (nothing of their batch kept)

    # --- what is held -------------------------------------------------------------------------

    def length(self, seq_id: int) -> int:
        """Positions the sequence holds (0..length-1)."""
        runs = self._runs.get(seq_id)
        return runs[-1].end if runs else 0

    def free(self, seq_id: int) -> int:
        """Free cells in the sequence's stream."""
        return self.capacity - (self.used() if self.unified else self.length(seq_id))

    def used(self) -> int:
        """Cells held, in every stream together."""
        if not self.unified:
            return sum(self.length(seq_id) for seq_id in self._runs)
        if self._used is None:
            self._used = _distinct_cells(run for runs in self._runs.values() for run in runs)
        return self._used

    def same_stream(self, a: int, b: int) -> bool:
        """Whether freeing sequence `b`'s cells can make room for sequence `a`."""
        return self.unified or a == b

    def exclusive(self, seq_id: int) -> int:
        """Cells only this sequence holds: what removing it frees."""
        if not self.unified:
            return self.length(seq_id)
        others = [run for other, runs in self._runs.items() if other != seq_id for run in runs]
        return _distinct_cells([*others, *self._runs.get(seq_id, ())]) - _distinct_cells(others)

    # --- edits ----------------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool], rowwise: bool = False) -> int:
        """One `backend.decode`; on success each sequence's rows are placed, in new cells after what it held."""
        self.decodes += 1
        status = self.backend.decode(tokens, positions, seq_ids, outputs, rowwise)
        if status == DECODE_INTERRUPTED:
            self.interrupted += 1
        if status == DECODE_OK:
            ends: dict[int, int] = {}
            for seq_id, position in zip(seq_ids, positions):
                ends[seq_id] = max(ends.get(seq_id, 0), position + 1)
            for seq_id, end in ends.items():
                self._place(seq_id, end)
        return status

    def remove(self, seq_id: int, start: int = 0) -> bool:
        """Drop the sequence's positions from `start` on (all of them from 0); False, with nothing dropped,
        when the memory cannot cut a sequence there (a recurrent model's)."""
        if not self.backend.seq_rm(seq_id, start, -1):
            return False
        self._cut(seq_id, start)
        return True

    def copy(self, source: int, target: int, end: int) -> None:
        """`target`, holding nothing, shares the cells of `source`'s first `end` positions."""
        assert not self._runs.get(target), "a copy goes to an empty sequence"
        self.backend.seq_cp(source, target, 0, end)
        runs = [Run(run.origin, run.start, min(run.end, end)) for run in self._runs.get(source, ())
                if run.start < end]
        self._set(target, runs)

    def reuse(self, seq_id: int, chunks: Sequence[tuple[int, int, int]]) -> None:
        """Keep the runs `(old, new, n)` of the sequence (admission.reuse_runs), moved down; its cells past the
        first moved run must be its own (moving a cell moves it for every sequence holding it)."""
        self.backend.seq_reuse(seq_id, chunks)
        end = chunks[-1][1] + chunks[-1][2] if chunks else 0
        moved = next((new for old, new, _ in chunks if old != new), end)
        self._cut(seq_id, moved)
        if moved < end:
            self._set(seq_id, [*self._runs.get(seq_id, ()), Run(next(self._origins), moved, end)])

    def restore(self, seq_id: int, blob: bytes | memoryview, cells: int) -> bool:
        """Restore a state of `cells` tokens into the sequence (its own cells freed first); False, with the
        sequence left empty, when llama.cpp refuses the state or it does not hold the cells it said."""
        placed = self.backend.seq_state_set(seq_id, blob)
        held = self.backend.seq_pos_max(seq_id) + 1 if placed else 0
        if not placed or held != cells:
            self.backend.seq_rm(seq_id, 0, -1)
            self._set(seq_id, [])
            return False
        self._set(seq_id, [Run(next(self._origins), 0, cells)])
        return True

    def state(self, seq_id: int) -> bytes | memoryview:
        """The sequence's state, to restore later."""
        return self.backend.seq_state_get(seq_id)

    # --- the ledger -----------------------------------------------------------------------------------

    def _place(self, seq_id: int, end: int) -> None:
        """New cells for the sequence's positions from what it held up to `end`: its last run grows when
        no other sequence shares that run's cells, else a new run starts."""
        runs = list(self._runs.get(seq_id, ()))
        start = runs[-1].end if runs else 0
        if end <= start:
            return
        if runs and self._holders[runs[-1].origin] == 1:
            last = runs.pop()
            runs.append(Run(last.origin, last.start, end))
        else:
            runs.append(Run(next(self._origins), start, end))
        self._set(seq_id, runs)

    def _cut(self, seq_id: int, start: int) -> None:
        runs = [Run(run.origin, run.start, min(run.end, start)) for run in self._runs.get(seq_id, ())
                if run.start < start]
        self._set(seq_id, runs)

    def _set(self, seq_id: int, runs: list[Run]) -> None:
        """Swap in the sequence's runs, keeping the holder counts in step."""
        for run in self._runs.pop(seq_id, ()):
            self._holders[run.origin] -= 1
            if not self._holders[run.origin]:
                del self._holders[run.origin]
        if runs:
            self._runs[seq_id] = runs
            for run in runs:
                self._holders[run.origin] += 1
        self._used = None


def _distinct_cells(runs: Iterable[Run]) -> int:
    """How many cells the runs hold together: per origin, the union of their position ranges."""
    by_origin: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
    for run in runs:
        by_origin[run.origin].append((run.start, run.end))
    total = 0
    for ranges in by_origin.values():
        ranges.sort()
        covered_to = -1
        for start, end in ranges:
            if end > covered_to:
                total += end - max(start, covered_to)
                covered_to = end
    return total
