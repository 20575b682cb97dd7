"""Sequence slots: what each slot of the shared KV holds, the request it serves, and where that request is.

Owned by the engine thread (sequences.py); nothing here is read by another
thread. Other threads see what they need of it through the `EngineStatus` the
engine publishes (scheduler.py).
"""

from __future__ import annotations

import codecs
import enum
import time

from reame.engine.request import Handle, ProgressEvent, SessionState
from reame.engine.textstream import TextStream
from reame.speculative import Drafting
from reame.structured.grammar import GrammarState


class Phase(enum.Enum):
    """Where a running request is (llama-server's slot_state, for one request): each step's plan reads it,
    the engine thread's transitions set it."""

    FOLLOWING = "following"  # waits for a twin to prefill the same prompt, then shares its cells
    PROMPT = "prompt"  # its prompt is being fed (a warm request stays here until it is snapshotted)
    GENERATING = "generating"  # `next_token` is sampled and goes into the next step
    FINISHED = "finished"  # answered; its slot is free


class Running:
    """One admitted request while it holds a slot: its prompt, what it generated, its sampler."""

    __slots__ = (
        "accepted_drafts",
        "admission",
        "admitted_at",
        "cached",
        "drafted",
        "draftings",
        "first_token_at",
        "followers",
        "generated_tokens",
        "grammar",
        "grammar_text",
        "handle",
        "head",
        "leader",
        "max_tokens",
        "n_fed",
        "next_token",
        "phase",
        "prompt",
        "sampler",
        "slot",
        "snapshot_at",
        "solo_last",
        "stream",
    )

    def __init__(self, handle: Handle, slot: Slot, sampler: object, max_tokens: int, admission: int) -> None:
        self.handle = handle
        self.slot = slot
        self.admission = admission  # admission order: breaks ties when the KV is full
        self.sampler = sampler
        self.prompt = handle.prompt_tokens
        self.phase = Phase.PROMPT
        self.n_fed = 0  # tokens of this sequence in the KV cache
        self.next_token: int | None = None  # sampled, not yet decoded (Phase.GENERATING)
        self.generated_tokens: list[int] = []  # emitted so far; with the prompt, what the slot will hold
        self.cached = 0  # prompt tokens found in the KV instead of prefilled
        self.head = 0  # its prompt's opening shared with other prompts, kept when its slot gives it up
        self.snapshot_at = -1  # KV length at which to snapshot the prompt into the prefix cache (-1: never)
        self.solo_last = False  # decode the last prompt token in a step of its own (SOLO_LAST_TOKEN_PREFILL)
        self.max_tokens = max_tokens
        self.stream = TextStream(handle.request.params.stop)
        # The request's grammar followed as the answer is written: it bounds what the grammar may cost
        # (grammar.py's limits hold for llama.cpp's sampler too, which follows the same states).
        self.grammar = GrammarState(handle.grammar) if handle.grammar is not None else None
        self.grammar_text = codecs.getincrementaldecoder("utf-8")("replace")
        self.admitted_at = time.perf_counter()
        self.first_token_at = 0.0
        self.draftings: list[Drafting] = []  # speculative decoding's sources, when the request allows it
        self.drafted = self.accepted_drafts = 0
        # Requests with the same prompt that arrived while this one prefilled it: they wait, and get a
        # copy of its KV and a draw from its last prompt token's logits (one prefill for all of them).
        self.followers: list[Running] = []
        self.leader: Running | None = None  # set while this one waits on another's prefill (Phase.FOLLOWING)

    @property
    def reproducible(self) -> bool:
        """Its answer must not depend on how its steps were batched (greedy, or seeded by the caller)."""
        return self.handle.request.params.reproducible

    @property
    def seq_id(self) -> int:
        return self.slot.seq_id

    def held(self) -> list[int]:
        """What the KV holds for it now: the prompt and the generated tokens already decoded."""
        return (self.prompt + self.generated_tokens)[:self.n_fed]

    def session_state(self, blob: bytes | memoryview) -> SessionState:
        return SessionState(tuple(self.held()), blob)

    def follow(self, leader: Running) -> None:
        """Wait for `leader`'s prefill of the same prompt."""
        self.phase, self.leader = Phase.FOLLOWING, leader
        leader.followers.append(self)

    def lead(self, fed: int, followers: list[Running]) -> None:
        """The first `fed` prompt tokens are in this sequence's KV (copied from its leader's): it feeds the
        rest itself, leading `followers`."""
        self.n_fed = self.cached = fed
        self.phase, self.leader, self.followers = Phase.PROMPT, None, followers
        for follower in followers:
            follower.leader = self

    def report_progress(self) -> None:
        """Tell a request that asked (GenerationRequest.progress) how far its prompt's prefill is."""
        if self.handle.request.progress:
            total = len(self.prompt)
            self.handle._put(ProgressEvent(total, min(self.cached, total), min(self.n_fed, total),
                                           time.perf_counter() - self.admitted_at))

    def generate(self, token: int) -> None:
        """`token` was emitted and goes into the next step."""
        self.phase, self.next_token = Phase.GENERATING, token


class Slot:
    """One sequence slot of the shared KV. Idle, it keeps the KV of its last request (`held`) for the
    next one that shares a prefix with it; busy, it serves `running`. `used` orders idle slots from
    least to most recently released; `private`: what it keeps is a session's, never snapshotted."""

    __slots__ = ("head", "held", "private", "running", "seq_id", "used")

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.held: list[int] = []
        self.head = 0  # how many of `held` are an opening other prompts share (cache.heads.ResidentHeads)
        self.running: Running | None = None
        self.used = 0
        self.private = False
