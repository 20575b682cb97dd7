"""Sampler chains: the one description of how a request picks tokens.

`chain_steps` turns SamplingParams into an ordered list of steps (the order of
llama.cpp's common sampler). LlamaBackend builds a native llama sampler chain
from it, so sampling runs in C; FakeBackend interprets the same steps in Python.
Speculative verification will compute its probabilities from the same chain.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reame.engine.request import SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Step:
    kind: str  # grammar | logit_bias | penalties | top_k | top_p | min_p | temp | dist | greedy
    args: tuple


def chain_steps(params: SamplingParams, eog_tokens: Iterable[int] = (), seed: int | None = None,
                history: Sequence[int] = ()) -> list[Step]:
    """Ordered steps for `params`; `eog_tokens` are banned when params.ignore_eos; `history`: the tokens
    before the first sampled one (the prompt), which the penalties count but the grammar never sees."""
    steps: list[Step] = []
    if params.grammar is not None:
        steps.append(Step("grammar", (params.grammar,)))
    bias = dict(params.logit_bias)
    if params.ignore_eos:
        bias.update({token: NEG_INF for token in eog_tokens})
    if bias:
        steps.append(Step("logit_bias", (tuple(sorted(bias.items())),)))
    if params.penalised:
        window = history if params.repeat_last_n < 0 else history[-params.repeat_last_n:]
        steps.append(Step("penalties", (params.repeat_last_n, params.repeat_penalty,
                                        params.frequency_penalty, params.presence_penalty, tuple(window))))
    if params.greedy:
        steps.append(Step("greedy", ()))
        return steps
    if params.top_k > 0:
        steps.append(Step("top_k", (params.top_k,)))
    if params.top_p < 1.0:
        steps.append(Step("top_p", (params.top_p,)))
    if params.min_p > 0.0:
        steps.append(Step("min_p", (params.min_p,)))
    steps.append(Step("temp", (params.temperature,)))
    steps.append(Step("dist", (resolve_seed(params.seed if seed is None else seed),)))
    return steps


def resolve_seed(seed: int | None) -> int:
    """A concrete seed: the request's, or a fresh random one (never llama's 'random' marker)."""
    return seed if seed is not None else random.randrange(0, 2**32 - 1)


LOGPROB_WINDOW = 30.0  # alternatives more than this below the best (e^-30) cannot make a top list


def log_softmax_of(logits: Sequence[float], token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` and the `top` most likely tokens, from raw logits.

    Written so the per-element work runs in C (map over the array): about 10 ms for a
    150k vocabulary, paid only by requests that ask for logprobs.
    """
    peak = max(logits)
    total = sum(map(math.exp, map(operator.sub, logits, itertools.repeat(peak))))
    norm = peak + math.log(total)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        floor = peak - LOGPROB_WINDOW
        close = [i for i, value in enumerate(logits) if value >= floor]
        best = tuple((i, logits[i] - norm) for i in heapq.nlargest(top, close, key=logits.__getitem__))
    return logits[token] - norm, best
