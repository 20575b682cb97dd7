#!/usr/bin/env python3
"""A greedy draw the grammar refuses: the best-ranked allowed token vs the whole vocabulary walked again.

    python bench/grammar_fallback.py                                  # SmolLM2-135M, then Qwen2.5-Coder-1.5B
    python bench/grammar_fallback.py --model qwen2.5-coder-1.5b --texts 4

Greedy JSON extraction under a schema (held_out.py's support tickets and triage schema, texts not written
for this), decoded one token at a time in this process. At every step three samplers draw from the same
logits, in rotating order: Reame's (the grammar asked about the unconstrained draw; when it refuses, about
the best-ranked tokens, sampler_chain.RANKED_CANDIDATES of them), the same without the ranking (a refusal
walks the whole vocabulary through the grammar, as llama-server's sampler does), and llama's plain chain
(the grammar applied to the whole vocabulary at every token). Their tokens must agree (the run stops if one
does not). Prints how often the model's own draw was refused, how many refusals the ranking settled, the
sampling milliseconds per refusal and per token of each, and a decode step's milliseconds for scale.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common import bench_parser, machine, model_path, print_table, rotated
from held_out import TICKET_SCHEMA, requests

from reame.engine.request import SamplingParams
from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.model.sampler_chain import RANKED_CANDIDATES, GrammarOnRejection
from reame.model.sampling import chain_steps
from reame.native import LLAMA_COMMIT
from reame.structured.json_schema import schema_to_gbnf

SAMPLERS = ("ranked", "whole vocabulary on refusal", "grammar on every token")


@dataclass
class Tally:
    """What one run of `measure` counted: each sampler's seconds, and the answers' tokens, refusals and steps."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SAMPLERS, 0.0))
    tokens: int = 0
    refusals: int = 0
    settled: int = 0  # refusals the ranking answered
    steps: int = 0
    decode: float = 0.0  # seconds of those steps


def timed(sample: Callable[[], int]) -> tuple[int, float]:
    started = time.perf_counter()
    token = sample()
    return token, time.perf_counter() - started


def measure(backend: LlamaBackend, prompts: list[str], tokens: int) -> Tally:
    """Decodes each prompt's greedy answer, drawing every token with the three samplers."""
    steps = chain_steps(SamplingParams(temperature=0, grammar=schema_to_gbnf(TICKET_SCHEMA)), backend.eog_tokens())
    tally = Tally()
    for prompt_text in prompts:
        backend.seq_rm(0)
        samplers = {SAMPLERS[0]: backend.new_sampler(steps),
                    SAMPLERS[1]: GrammarOnRejection.of(backend._api, backend._vocab, backend.n_vocab, steps),
                    SAMPLERS[2]: backend._chain(steps)}
        ranked = samplers[SAMPLERS[0]]
        allows, best_allowed = ranked.allows, ranked._best_allowed

        def counted_allows(api: object, token: int) -> bool:
            allowed = allows(api, token)
            tally.refusals += not allowed
            return allowed

        def counted_best(api: object, ctx: object, index: int) -> int | None:
            best = best_allowed(api, ctx, index)
            tally.settled += best is not None
            return best

        ranked.allows, ranked._best_allowed = counted_allows, counted_best
        try:
            prompt = backend.tokenize(backend.apply_chat_template([{"role": "user", "content": prompt_text}]))
            backend.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
            index, position = len(prompt) - 1, len(prompt)
            for step in range(tokens):
                drawn = {}
                for name in rotated(SAMPLERS, step):
                    drawn[name], spent = timed(lambda: backend.sample(samplers[name], index))
                    tally.seconds[name] += spent
                if len(set(drawn.values())) != 1:
                    raise SystemExit(f"the samplers disagree at token {step}: {drawn}")
                token = drawn[SAMPLERS[0]]
                tally.tokens += 1
                if backend.is_eog(token):
                    break
                started = time.perf_counter()
                backend.decode([token], [position], [0], [True])
                tally.decode += time.perf_counter() - started
                tally.steps += 1
                index, position = 0, position + 1
        finally:
            for sampler in samplers.values():
                backend.free_sampler(sampler)
    return tally


def main() -> None:
    parser = bench_parser(__doc__, None, tokens=96, reps=1, tokens_help="most tokens an answer")
    parser.add_argument("--texts", type=int, default=10, help="tickets answered")
    args = parser.parse_args()
    prompts = [body["messages"][0]["content"] for _, body in requests(args.texts, {"structured"})]
    rows = []
    for model in args.model or ["smollm2-135m", "qwen2.5-coder-1.5b"]:
        with LlamaBackend(ModelSettings(str(model_path(model)), n_ctx=2048, n_threads=args.threads)) as backend:
            measure(backend, prompts[:1], 8)  # warm up
            got = measure(backend, prompts, args.tokens)
        refusals, tokens, seconds = max(got.refusals, 1), got.tokens, got.seconds
        rows.append([model, str(backend.n_vocab), str(tokens), f"{got.refusals / tokens:.0%}",
                     f"{got.settled / refusals:.0%}",
                     *(f"{seconds[name] / refusals * 1000:.2f}" for name in SAMPLERS[:2]),
                     *(f"{seconds[name] / tokens * 1000:.2f}" for name in SAMPLERS),
                     f"{got.decode / max(got.steps, 1) * 1000:.1f}",
                     f"{(got.decode + seconds[SAMPLERS[1]]) / (got.decode + seconds[SAMPLERS[0]]):.2f}x"])
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {args.threads} threads · {len(prompts)} tickets, "
          f"greedy under a JSON schema, at most {args.tokens} tokens · ranked: the best {RANKED_CANDIDATES}\n")
    print_table(["model", "vocabulary", "tokens", "draws refused", "refusals ranked",
                 "ranked ms/refusal", "whole vocabulary ms/refusal",
                 *(f"{name} ms/token" for name in SAMPLERS), "decode ms/step",
                 "decode + sampling: whole vocabulary / ranked"], rows)
    print("\nEvery token agreed between the three samplers. ms/refusal: all of a sampler's time over the refusals "
          "(its allowed draws included).")


if __name__ == "__main__":
    main()
