"""llama sampler chains for the steps of model/sampling.py, and grammar-constrained sampling at the price of
one token's check. Engine thread only (a chain is used by one sequence at a time)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library
from reame.errors import ModelError
from reame.model.library import last_llama_error
from reame.model.sampling import Step


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
    """

    def __init__(self, unconstrained: object, constrained: object, grammar: object) -> None:
        self.unconstrained, self.constrained, self.grammar = unconstrained, constrained, grammar
        self._candidate = t.llama_token_data()
        self._candidates = t.llama_token_data_array(ctypes.pointer(self._candidate), 1, -1, False)

    def allows(self, api: Any, token: int) -> bool:
        self._candidate.id, self._candidate.logit, self._candidate.p = token, 1.0, 0.0
        self._candidates.size, self._candidates.selected = 1, -1
        api.llama_sampler_apply(self.grammar, ctypes.byref(self._candidates))
        return self._candidate.logit != float("-inf")

    @classmethod
    def of(cls, api: Any, vocab: Any, n_vocab: int, steps: Sequence[Step]) -> GrammarOnRejection:
        """For `steps` that start with a grammar: an unconstrained chain of the rest, and a constrained one."""
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
        return cls(unconstrained, constrained, api.llama_sampler_chain_get(constrained, 0))

    def sample(self, api: Any, ctx: Any, index: int) -> int:
        token = api.llama_sampler_sample(self.unconstrained, ctx, index)
        if self.allows(api, token):
            api.llama_sampler_accept(self.constrained, token)  # the grammar (and the rest) read it
            return token
        return api.llama_sampler_sample(self.constrained, ctx, index)

    def free(self, api: Any) -> None:
        api.llama_sampler_free(self.unconstrained)
        api.llama_sampler_free(self.constrained)
