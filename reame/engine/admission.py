"""Admission: which slot a request takes, where its prompt's KV comes from, and whether the shared context holds
it beside the running sequences. Pure functions over slots, sequences and handles: no backend. The engine
thread carries out what they decide (`Sequences.start`, sequences.py).

An idle slot keeps the KV of its last request: a new request goes to the idle slot whose cached tokens share
the longest prefix with its prompt. Better still, a request can wait for a running twin that is prefilling
the same prompt (one prefill for both), share the cells of a running sequence that holds the start of its
prompt, or restore a saved state (its session, or a prefix-cache snapshot) that covers more.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from reame.cache import Snapshot, common_prefix
from reame.engine.request import Handle, SessionState
from reame.engine.slots import Phase, Running, Slot

# A cached prefix is worth taking a slot for when it covers this much of the new prompt.
MIN_REUSED_TOKENS = 2
MIN_REUSED_SHARE = 0.1


@dataclass(frozen=True)
class ContextLimits:
    """What the KV reservations are measured against."""

    n_ctx: int  # the shared context, in cells
    n_ctx_seq: int  # one request's most (Engine.context_per_request)
    n_seq_max: int  # slots
    reserve_tokens: int  # reserved for the answer of a request without max_tokens


def answer_reservation(handle: Handle, limits: ContextLimits) -> int:
    """KV cells reserved for a request's answer: its max_tokens (or `reserve_tokens` without one), at most an
    equal share of the context per slot. A request asking the whole context (max_tokens 2^31, say) would
    otherwise hold everyone behind it out of their slots until its minutes of generation end; past its share
    it runs on, and if the context fills it is the one cut (`Sequences.relieve_full_kv`)."""
    room = limits.n_ctx_seq - len(handle.prompt_tokens)
    share = limits.n_ctx // limits.n_seq_max
    return min(room, share, handle.request.params.max_tokens or limits.reserve_tokens)


def reservation(handle: Handle, limits: ContextLimits) -> int:
    """KV cells a request may fill: its prompt and its answer."""
    return len(handle.prompt_tokens) + answer_reservation(handle, limits)


def reserved_with(running: Sequence[Running], handle: Handle, limits: ContextLimits) -> int:
    """KV cells the running sequences and `handle` may fill together: sequences with one prompt share its
    cells (a clone's KV is the same cells, not a copy), so it counts once. Only prompts of equal length are
    compared (this runs every step a request waits for room)."""
    by_length: dict[int, list[list[int]]] = collections.defaultdict(list)
    for prompt in [sequence.prompt for sequence in running] + [handle.prompt_tokens]:
        by_length[len(prompt)].append(prompt)
    prompt_cells = sum(length * (len({tuple(prompt) for prompt in same}) if len(same) > 1 else 1)
                       for length, same in by_length.items())
    return prompt_cells + answer_reservation(handle, limits) + \
        sum(answer_reservation(sequence.handle, limits) for sequence in running)


def reuse_runs(held: list[int], prompt: Sequence[int], min_run: int) -> list[tuple[int, int, int]]:
    """llama-server's cache reuse (server-context.cpp at the pin), over what a slot holds: the common prefix,
    then, scanning the held tokens on, every run of at least `min_run` of them that matches the prompt's next
    tokens, as `(old, new, n)`: held[old:old+n] is prompt[new:new+n]. Tokens the prompt has that the slot did
    not end the scan for the prompt (moved keys must not come before computed ones); the last prompt token
    is never covered. Empty when no run moves."""
    limit = len(prompt) - 1
    shared = min(common_prefix(held, prompt), limit)
    runs = [(0, 0, shared)] if shared else []
    head_c = head_p = shared
    while head_c < len(held) and head_p < limit and min_run > 0:
        want = prompt[head_p]
        try:
            head_c = held.index(want, head_c)
        except ValueError:
            break
        n = 0
        while head_c + n < len(held) and head_p + n < limit and held[head_c + n] == prompt[head_p + n]:
            n += 1
        if n >= min_run:
            runs.append((head_c, head_p, n))
            head_p += n
        head_c += max(n, 1) if n >= min_run else 1
    return runs if any(old != new for old, new, _ in runs) else []


def pick_slot(slots: Sequence[Slot], prompt: list[int], reuse: int = 0) -> tuple[Slot, int, list[tuple[int, int, int]]]:
    """The idle slot sharing the longest prefix with `prompt`, how many of its cached tokens can be kept
    (never the whole prompt: the last prompt token is always decoded, for its logits), and, with `reuse`
    (a request's cache reuse), the runs to move (`reuse_runs`: then the slot covering the most with them, and
    the count is what they cover). When no slot shares a useful prefix (a BOS is not one), an empty slot or
    else the least recently used one is taken, so other slots keep their caches, and none of what it holds
    is kept: a few shared tokens (a chat template's system prompt) would save nothing measurable, and would
    move where the rest of the prompt is cut into batches, which changes llama.cpp's arithmetic
    (docs/engine.md: a prompt computed as the first time)."""
    idle = sorted((slot for slot in slots if slot.running is None), key=lambda slot: slot.used)
    best, best_shared, best_runs = idle[0], 0, []
    for slot in idle:
        runs = reuse_runs(slot.held, prompt, reuse) if reuse and slot.held else []
        shared = runs[-1][1] + runs[-1][2] if runs else common_prefix(slot.held, prompt)
        if shared > best_shared:
            best, best_shared, best_runs = slot, shared, runs
    if best_shared < max(MIN_REUSED_TOKENS, len(prompt) * MIN_REUSED_SHARE):
        return next((slot for slot in idle if not slot.held), idle[0]), 0, []
    return best, min(best_shared, len(prompt) - 1), best_runs


def prefilling_twin(running: Sequence[Running], handle: Handle) -> Running | None:
    """A running sequence prefilling the same prompt, that this request can wait for instead of computing it
    again (OpenAI `n`, the Conclave's attempts, identical requests arriving together)."""
    request = handle.request
    if request.warm or request.session is not None:
        return None
    return next((sequence for sequence in running if sequence.phase is Phase.PROMPT and
                 not sequence.handle.request.warm and sequence.prompt == handle.prompt_tokens), None)


def donor(running: Sequence[Running], prompt: list[int], rollback: bool) -> tuple[Running | None, int]:
    """The running sequence whose KV holds the longest start of `prompt` (a document several users ask about at
    once), and how much of it can be shared (never the last prompt token). Not without `rollback` (a recurrent
    model's memory holds a sequence's state as a whole, with no start to share)."""
    best, best_shared = None, 0
    if not rollback:
        return best, best_shared
    for sequence in running:
        shared = min(common_prefix(sequence.held(), prompt), len(prompt) - 1)
        if shared > best_shared:
            best, best_shared = sequence, shared
    return best, best_shared


def best_saved_state(handle: Handle) -> SessionState | Snapshot | None:
    """The request's session or its prefix-cache snapshot, whichever covers more of the prompt."""
    session = handle.request.session
    saved = [state for state in (session.state if session is not None else None, handle.snapshot)
             if state is not None and state.blob]
    return max(saved, key=lambda state: common_prefix(state.tokens, handle.prompt_tokens), default=None)


@dataclass(frozen=True)
class Start:
    """Where a request's prompt KV comes from, and how many of its prompt tokens that covers: "leader" (a twin
    prefills it for both), "donor" (cells shared from a running sequence), "saved" (a session or snapshot
    restored), "slot" (what its slot already holds) or "fresh" (nothing)."""

    source: str
    shared: int
    leader: Running | None = None
    donor: Running | None = None
    saved: SessionState | Snapshot | None = None


def plan_start(handle: Handle, in_slot: int, running: Sequence[Running], rollback: bool) -> Start:
    """Where the request's KV should come from, given `in_slot` prompt tokens its slot already holds: whatever
    covers the most of the prompt, a waiting twin first."""
    prompt = handle.prompt_tokens
    leader = prefilling_twin(running, handle)
    if leader is not None:
        return Start("leader", 0, leader=leader)
    saved = best_saved_state(handle)
    from_saved = min(common_prefix(saved.tokens, prompt), len(prompt) - 1) if saved is not None else 0
    lender, from_donor = donor(running, prompt, rollback)
    if lender is not None and from_donor > max(in_slot, from_saved):
        return Start("donor", from_donor, donor=lender)
    if from_saved > in_slot:
        return Start("saved", from_saved, saved=saved)
    return Start("slot", in_slot) if in_slot else Start("fresh", 0)
