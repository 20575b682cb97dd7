"""llama sampler chains for the steps of model/sampling.py, and grammar-constrained sampling at the price of
one token's check. Engine thread only (a chain is used by one sequence at a time)."""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence
from typing import Any

from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library
from reame.errors import ModelError
from reame.model.library import last_llama_error
from reame.model.sampling import NEG_INF, Step


def new_chain(api: Any, vocab: Any, n_vocab: int, steps: Sequence[Step]) -> object:
    """A llama sampler chain for `steps` (the caller frees it)."""
    chain = api.llama_sampler_chain_init(api.llama_sampler_chain_default_params())
    for step in steps:
        kind, args = step.kind, step.args
        if kind == "logit_bias":
            pairs = args[0]
            biases = (t.llama_logit_bias * len(pairs))(*[t.llama_logit_bias(tok, bias) for tok, bias in pairs])
            sampler = api.llama_sampler_init_logit_bias(n_vocab, len(pairs), biases)
        elif kind == "grammar":
            sampler = api.llama_sampler_init_grammar(vocab, args[0].encode("utf-8"), b"root")
            if not sampler:
                api.llama_sampler_free(chain)
                raise ModelError(f"llama.cpp refused the grammar{last_llama_error()}")
        elif kind == "penalties":
            last_n, repeat, frequency, presence, window = args
            sampler = api.llama_sampler_init_penalties(n_vocab, last_n, repeat, frequency, presence)
            for token in window:  # the prompt counts for the penalties (and only for them)
                api.llama_sampler_accept(sampler, token)
        elif kind == "greedy":
            sampler = api.llama_sampler_init_greedy()
        elif kind == "top_k":
            sampler = api.llama_sampler_init_top_k(args[0])
        elif kind == "top_p":
            sampler = api.llama_sampler_init_top_p(args[0], 1)
        elif kind == "min_p":
            sampler = api.llama_sampler_init_min_p(args[0], 1)
        elif kind == "temp":
            sampler = api.llama_sampler_init_temp(args[0])
        elif kind == "dist":
            sampler = api.llama_sampler_init_dist(args[0])
        else:
            api.llama_sampler_free(chain)
            raise ModelError(f"unknown sampler step {kind}")
        api.llama_sampler_chain_add(chain, sampler)
    return chain


# A greedy draw the grammar refuses is replaced by the best of this many tokens (by logit) that it allows, when
# one of them is. Over JSON triage (bench/grammar_fallback.py) 1,024 settled 82-92% of refusals, 32 only 45-60%;
# a refusal then cost 3.5 ms instead of 6.4 on SmolLM2-135M and 6.8 instead of 18.6 on Qwen2.5-Coder-1.5B, whose
# 151,936 tokens took 40-57 ms to walk through the grammar inside a server.
RANKED_CANDIDATES = 1024


class Candidates:
    """A vocabulary-sized candidate array (llama_token_data) refilled from one row's logits, which llama's
    samplers can rank in C: the scratch of GrammarOnRejection's greedy fallback. One per backend (1.8 MB
    for a 151,936-token vocabulary), engine thread only."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.data = (t.llama_token_data * n_vocab)()
        self.array = t.llama_token_data_array(self.data, n_vocab, -1, False)
        self._ids = array.array("i", range(n_vocab))
        # The struct is (int32 id, float logit, float p): every third 4-byte word from 0 is an id, from 1 a logit.
        words = memoryview(self.data).cast("B")
        self._id_column = words.cast("i")[0::3]
        self._logit_column = words.cast("f")[1::3]

    def logits(self, n: int) -> Sequence[float]:
        """The first `n` candidates' logits, in the array's order."""
        return self._logit_column[:n].tolist()

    def token(self, i: int) -> int:
        return self._id_column[i]

    def fill(self, logits: Any) -> t.llama_token_data_array:
        """The array holding every token with its logit from `logits` (a float pointer), in id order."""
        row = (ctypes.c_float * self.n_vocab).from_address(ctypes.addressof(logits.contents))
        self._id_column[:] = memoryview(self._ids)
        self._logit_column[:] = memoryview(row).cast("B").cast("f")
        self.array.size, self.array.selected, self.array.sorted = self.n_vocab, -1, False
        return self.array


class GrammarOnRejection:
    """Grammar-constrained sampling at the price of one token's check, as llama-server samples.

    Applying a grammar means walking every vocabulary token's text through it:
    milliseconds per token with a 150k-token vocabulary, per drafted position
    too. So the token is drawn without the grammar first (`unconstrained`),
    the grammar checks just that token, and only when it refuses is the token
    drawn again from `constrained` (the grammar, then the same steps).
    Greedy, the result is the grammar-masked argmax either way; with a
    temperature it is the masked distribution too (a draw from p kept when
    allowed, else one from p restricted to what is allowed, sums to p
    restricted); top-k/top-p/min-p then cut the whole vocabulary on the first
    draw and the allowed part on the second, as in llama-server. Only chains
    without penalties qualify: the unconstrained chain already counted the
    refused token, and penalties would remember it.

    Greedy, a refusal does not walk the vocabulary either when it need not
    (`ranking`, given `Candidates`): the grammar is asked about the
    RANKED_CANDIDATES best tokens (the logit bias applied), best first, and
    the first it allows is the token, as the grammar-masked argmax is. The
    whole vocabulary is still walked when it allows none of them, or when
    the one it allows ties the next by logit (llama's greedy pick between
    equals follows the order of its own array).
    """

    def __init__(self, unconstrained: object, constrained: object, grammar: object, ranking: object | None = None,
                 candidates: Candidates | None = None) -> None:
        self.unconstrained, self.constrained, self.grammar = unconstrained, constrained, grammar
        self._ranking, self._ranked = ranking, candidates
        self._candidate = t.llama_token_data()
        self._candidates = t.llama_token_data_array(ctypes.pointer(self._candidate), 1, -1, False)

    def allows(self, api: Any, token: int) -> bool:
        self._candidate.id, self._candidate.logit, self._candidate.p = token, 1.0, 0.0
        self._candidates.size, self._candidates.selected = 1, -1
        api.llama_sampler_apply(self.grammar, ctypes.byref(self._candidates))
        return self._candidate.logit != NEG_INF

    @classmethod
    def of(cls, api: Any, vocab: Any, n_vocab: int, steps: Sequence[Step],
           candidates: Candidates | None = None) -> GrammarOnRejection:
        """For `steps` that start with a grammar: an unconstrained chain of the rest, and a constrained one;
        given `candidates` and a greedy chain (nothing but a logit bias before the pick), a ranking chain."""
        rest = list(steps[1:])
        unconstrained = new_chain(api, vocab, n_vocab, rest)
        # The fallback draws with its own seed: a resample is a new draw, not the refused one again.
        fallback_steps = [Step("dist", ((step.args[0] + 1) % (2**32 - 1),)) if step.kind == "dist" else step
                          for step in rest]
        try:
            constrained = new_chain(api, vocab, n_vocab, [steps[0], *fallback_steps])
        except ModelError:
            api.llama_sampler_free(unconstrained)
            raise
        kinds = [step.kind for step in rest]
        ranking = None
        if candidates is not None and kinds[-1:] == ["greedy"] and set(kinds) <= {"logit_bias", "greedy"}:
            ranking = new_chain(api, vocab, n_vocab, [*(step for step in rest if step.kind == "logit_bias"),
                                                      Step("top_k", (RANKED_CANDIDATES,))])
        return cls(unconstrained, constrained, api.llama_sampler_chain_get(constrained, 0), ranking, candidates)

    def sample(self, api: Any, ctx: Any, index: int) -> int:
        token = api.llama_sampler_sample(self.unconstrained, ctx, index)
        if not self.allows(api, token):
            best = self._best_allowed(api, ctx, index) if self._ranking is not None else None
            if best is None:
                return api.llama_sampler_sample(self.constrained, ctx, index)
            token = best
        api.llama_sampler_accept(self.constrained, token)  # the grammar (and the rest) read it
        return token

    def _best_allowed(self, api: Any, ctx: Any, index: int) -> int | None:
        """Greedy: the best-ranked token the grammar allows among the RANKED_CANDIDATES best, when it is the
        only allowed token with its logit; else None."""
        assert self._ranked is not None
        ranked = self._ranked.fill(api.llama_get_logits_ith(ctx, index))
        api.llama_sampler_apply(self._ranking, ctypes.byref(ranked))  # the best first, the rest cut off
        size = ranked.size
        logits = self._ranked.logits(size)
        api.llama_sampler_apply(self.grammar, ctypes.byref(ranked))  # what it refuses becomes -inf
        allowed = self._ranked.logits(size)
        for i in range(size - 1):  # the last one's equals may lie past the cut
            if allowed[i] != NEG_INF:
                return self._ranked.token(i) if logits[i + 1] < logits[i] else None
        return None

    def free(self, api: Any) -> None:
        api.llama_sampler_free(self.unconstrained)
        api.llama_sampler_free(self.constrained)
        if self._ranking is not None:
            api.llama_sampler_free(self._ranking)
