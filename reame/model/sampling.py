"""Sampler chains: the one description of how a request picks tokens.

`chain_steps` turns SamplingParams into an ordered list of steps (the order of
llama.cpp's common sampler). LlamaBackend builds a native llama sampler chain
from it, so sampling runs in C; FakeBackend interprets the same steps in Python.
Speculative verification will compute its probabilities from the same chain.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
import operator
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reame.errors import RequestError

NEG_INF = float("-inf")

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the longest stop string: text that may begin one is held back and rescanned every token
MAX_LOGIT_BIAS = 1024  # biased tokens: each is applied to every token's draw
MAX_SEED = 2**32 - 2  # 0xFFFFFFFF means "random" to llama.cpp


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy (argmax)."""

    max_tokens: int | None = None  # None: until end of generation or the context is full
    temperature: float = 0.7
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64  # window of the three penalties; -1 = whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: a random seed per request
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str | None = None  # GBNF the output must match (checked by the caller: structured/grammar.py)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1, optional=True)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, minimum=0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise RequestError("top_p must be greater than 0", param="top_p")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repeat_penalty", self.repeat_penalty, 0.0, 10.0)
        if self.repeat_penalty == 0.0:
            raise RequestError("repeat_penalty must be greater than 0", param="repeat_penalty")
        _check_int("repeat_last_n", self.repeat_last_n, minimum=-1)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED, optional=True)
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, tuple):
            raise RequestError("stop must be a tuple of strings", param="stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise RequestError("every stop string must be a non-empty string", param="stop")
            if len(stop) > MAX_STOP_CHARS:
                raise RequestError(f"a stop string is at most {MAX_STOP_CHARS} characters", param="stop")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError("ignore_eos must be a boolean", param="ignore_eos")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias key {token!r} is not a token id", param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise RequestError(f"logit_bias value for token {token} is not a number",
                                   param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reproducible(self) -> bool:
        """The same request gives the same answer: greedy, or sampled from a seed the caller chose."""
        return self.greedy or self.seed is not None

    @property
    def penalised(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0) and self.repeat_last_n != 0


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None,
               optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise RequestError(f"{name} must be {bound}, got {value}", param=name)


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", param=name)
    if not (low <= value <= high):  # also rejects NaN
        raise RequestError(f"{name} must be between {low:g} and {high:g}, got {value}", param=name)


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


def post_sampling_of(logits: Sequence[float], token: int, top: int, params: SamplingParams,
                     history: Sequence[int], banned: Iterable[int] = ()) -> tuple[float, tuple[tuple[int, float], ...]]:
    """llama-server's `post_sampling_probs`: the log-probability of `token` and of the `top` most likely
    tokens (at most as many as are left) under the distribution `params`' chain draws from, as llama.cpp's
    samplers compute it: the logit bias, the penalties over `history` (the prompt's window and the tokens
    drawn since), then top-k, top-p and min-p over the logits, the temperature, and the softmax over what is
    left (`banned`: the end-of-generation tokens an ignore_eos request bans). A greedy chain draws its token
    for certain. (A grammar's sampler is not replayed: the engine
    refuses post-sampling probabilities beside one.)

    Only tokens within LOGPROB_WINDOW of the best (times the temperature, which flattens them) are looked
    at: the rest cannot survive top-p or min-p, nor weigh on the softmax (e^-30 each). The scans of the whole
    vocabulary run in C (max, map, compress), and a top-k takes its k best without sorting the rest: it runs on
    the engine thread, beside the other streams' steps."""
    if params.greedy:
        return 0.0, ((token, 0.0),)[:top]
    edited: dict[int, float] = {}
    for biased, bias in [*params.logit_bias.items(), *((eog, NEG_INF) for eog in banned)]:
        if 0 <= biased < len(logits):
            edited[biased] = edited.get(biased, logits[biased]) + bias
    if params.penalised and params.repeat_last_n != 0:
        window = history if params.repeat_last_n < 0 else history[-params.repeat_last_n:]
        for seen, count in collections.Counter(window).items():
            if not 0 <= seen < len(logits):
                continue
            value = edited.get(seen, logits[seen])
            value = value * params.repeat_penalty if value <= 0 else value / params.repeat_penalty
            edited[seen] = value - count * params.frequency_penalty - params.presence_penalty
    peak = max(max(logits), *edited.values()) if edited else max(logits)
    floor = peak - LOGPROB_WINDOW * max(1.0, params.temperature)
    close = list(itertools.compress(range(len(logits)), map(operator.ge, logits, itertools.repeat(floor))))
    candidates = dict(zip(close, map(logits.__getitem__, close)))
    for i, value in edited.items():
        if value >= floor:
            candidates[i] = value
        else:
            candidates.pop(i, None)
    # llama.cpp's order: best first (equals in index order: both are stable)
    order = heapq.nlargest(params.top_k, candidates, key=candidates.__getitem__) if params.top_k > 0 else \
        sorted(candidates, key=candidates.__getitem__, reverse=True)
    values = list(map(candidates.__getitem__, order))
    if params.top_p < 1.0:  # the shortest head whose probabilities, added up in order, reach top_p
        weights = list(map(math.exp, map(operator.sub, values, itertools.repeat(values[0]))))
        reached = list(itertools.accumulate(map(operator.truediv, weights, itertools.repeat(sum(weights)))))
        kept = bisect.bisect_left(reached, params.top_p) + 1
        del order[kept:], values[kept:]
    if params.min_p > 0.0:  # (values fall, so what is left is a head)
        least = values[0] + math.log(params.min_p)
        kept = max(1, len(values) - bisect.bisect_left(values[::-1], least))
        del order[kept:], values[kept:]
    scaled = list(map(operator.truediv, values, itertools.repeat(params.temperature)))
    norm = scaled[0] + math.log(sum(map(math.exp, map(operator.sub, scaled, itertools.repeat(scaled[0])))))
    try:
        drawn = scaled[order.index(token)]
    except ValueError:  # left out: then nearly 0
        drawn = edited.get(token, logits[token]) / params.temperature
    return drawn - norm, tuple(zip(order[:top], map(operator.sub, scaled[:top], itertools.repeat(norm))))
