"""A one-shot prompt, as shell scripts call it (`reame run MODEL "prompt"`, config mode's `--prompt`).

A script pays a run's whole start every time, so a one-shot does only what its answer needs:

1. A deterministic prompt (greedy, or seeded as by default) that this machine (or the fleet's store)
   answered before is found by its text, before any of libllama is loaded: the prompt as typed, the
   model's fingerprint, Reame's version and every setting name the answer's key (`AnswerCache.by_prompt`).
2. Otherwise the model is loaded without a context (`LoadedModel`), the prompt rendered and tokenized,
   and the answer looked up by its tokens: the key a server uses for the same request, so a server and a
   script find each other's answers (the prompt's name is kept for the next run either way).
3. A miss makes a context sized to the job: the prompt's tokens plus max_tokens, rounded up to
   CONTEXT_STEP, never more than autoconfig's serving context. A KV is allocated and cleared whole, and
   the serving context of 8,192 tokens cost SmolLM2-135M 139 ms to make against 13 ms for 512. The
   answer does not change with it: the context bounds the cells in use, not the arithmetic over them
   (tests/integration/test_one_shot_real.py compares a sized run with a full-context one, byte for byte).
4. A short chat prompt, which the prefix cache does not keep, restores its template's opening from the
   template heads (cache/heads.py) and prefills the rest; the first run without one writes it.

An explicit context (--ctx, model.context_length) is kept, and so is the planned one for --best-of,
whose attempts each need their own cells.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from reame import __version__
from reame.autoconfig import Choice

if TYPE_CHECKING:
    from reame.answers import AnswerCache, CachedAnswer
    from reame.cache.heads import TemplateHeads
    from reame.engine import Engine, FinishEvent, SamplingParams
    from reame.model.backend import ModelSettings
    from reame.model.llama import LlamaBackend
    from reame.model.loaded_model import LoadedModel
    from reame.settings import Settings

CONTEXT_STEP = 256  # a one-shot's context is a multiple of this (llama.cpp pads a KV to 256 cells anyway)


class Startup:
    """Where a one-shot run's start goes, phase by phase, logged at debug level (bench/startup.py reads
    it): a shell script waits for all of it before it sees the answer."""

    def __init__(self, began: float) -> None:
        self.marks = [("", began)]

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.perf_counter()))

    def line(self) -> str:
        """The phases, then when the first began on the system's monotonic clock (time.perf_counter), so
        that a parent process can tell the interpreter's start before it and the exit after the last."""
        phases = ", ".join(f"{phase} {(at - before) * 1000:.0f} ms"
                           for (_, before), (phase, at) in zip(self.marks, self.marks[1:]))
        return f"startup: {phases} (began at {self.marks[0][1]:.6f})"


@dataclass(frozen=True)
class OneShot:
    """What the command line asked: `prompt` as typed, the system message, `raw` (no chat template: --raw,
    and config mode's --prompt), how many attempts elect the answer (--best-of)."""

    prompt: str
    system: str | None = None
    raw: bool = False
    best_of: int = 1
    quiet: bool = False

    def messages(self, content: str) -> list[dict[str, str]]:
        """The chat messages of the prompt, asking `content`."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": content}]

    def described(self, chat_template: str) -> dict[str, object]:
        """Everything of the request, besides the sampling settings, that decides the prompt's tokens."""
        return {"prompt": self.prompt, "system": self.system, "raw": self.raw, "chat_template": chat_template,
                "reame": __version__}


def context_for(prompt_tokens: int, max_tokens: int | None, serving: int) -> int:
    """The context a one-shot needs: its prompt and its answer, rounded up to CONTEXT_STEP, at most
    `serving` (the context autoconfig plans for the model; without max_tokens, all of it)."""
    if not max_tokens:
        return serving
    needed = -(-(prompt_tokens + max_tokens) // CONTEXT_STEP) * CONTEXT_STEP
    return min(needed, serving)


def sized(settings: Settings, one_shot: OneShot) -> bool:
    """Whether the one-shot's context is sized to its job (not set explicitly, one attempt)."""
    return not settings.model.context_length and one_shot.best_of == 1


def context_choice(planned: Choice, prompt_tokens: int, max_tokens: int | None) -> Choice:
    """--print-config's line for a one-shot's context: the value it gets and why."""
    value = context_for(prompt_tokens, max_tokens, planned.value)
    if value == planned.value:
        return Choice(value, f"a one-shot prompt of {prompt_tokens} tokens and max_tokens {max_tokens} needs the "
                             f"whole serving context ({planned.why})")
    return Choice(value, f"a one-shot: its {prompt_tokens} prompt tokens + max_tokens {max_tokens}, rounded up to "
                         f"{CONTEXT_STEP} (serving would get {planned.value}: {planned.why})")


@dataclass
class Answering:
    """The parts a one-shot answers with; tests give their own (a FakeBackend) instead of libllama's."""

    load: Callable[[ModelSettings], LoadedModel]
    open_context: Callable[[ModelSettings, LoadedModel], LlamaBackend]
    new_engine: Callable[[LlamaBackend], Engine]  # the engine frees the backend unless the process exits next
    frees_model: bool = True  # False: the process exits right after the answer and the system takes it back


def libllama(settings: Settings, raw: bool) -> Answering:
    """libllama's parts for a process that exits once it answered (the command line), each imported when first
    called: a prompt answered by its name imports none. While the model loads (C code, which lets Python
    run), another thread imports what comes next: the chat template's jinja2 (46 ms here) unless the prompt
    is `raw`, and the engine. The model is never freed: the exit gives its memory back faster
    (llama_model_free of Qwen2.5-Coder-1.5B took 89 ms, SmolLM2-135M's 11)."""
    def load(model: ModelSettings) -> LoadedModel:
        from reame.model.loaded_model import LoadedModel
        upcoming = ["reame.assembly", "reame.chat"]
        if not raw and settings.model.chat_template == "jinja":
            upcoming.insert(0, "reame.model.chat_template")
        threading.Thread(target=import_all, args=(upcoming,), name="reame-imports", daemon=True).start()
        return LoadedModel(model)

    def open_context(model: ModelSettings, loaded: LoadedModel) -> LlamaBackend:
        from reame.model.llama import LlamaBackend
        return LlamaBackend(model, loaded)

    def new_engine(backend: LlamaBackend) -> Engine:
        from reame import assembly
        return assembly.new_engine(backend, settings, warm_up=False, frees_backend=False)
    return Answering(load, open_context, new_engine, frees_model=False)


def import_all(modules: list[str]) -> None:
    for module in modules:
        importlib.import_module(module)


def answer(one_shot: OneShot, settings: Settings, model: ModelSettings, startup: Startup,
           answers: AnswerCache | None, answering: Answering, out: TextIO = sys.stdout,
           err: TextIO = sys.stderr) -> int:
    """Print the answer to `one_shot` on `out` (a stats line on `err` unless quiet), from the exact answer
    cache when it holds it (`answers`: None when it is off), else computed."""
    from reame.errors import ModelError
    params = settings.generation
    cacheable = answers is not None and one_shot.best_of == 1 and answers.deterministic(params)
    named = answers.prompt_key(one_shot.described(settings.model.chat_template), params) \
        if answers is not None and cacheable else None
    if answers is not None and named is not None:
        cached = answers.by_prompt(named)
        if cached is not None:
            startup.mark("answered from the cache, no model loaded")
            return print_cached(cached, one_shot.quiet, out, err)
    loaded = answering.load(model)
    try:
        startup.mark("model loaded")
        templated = loaded.has_chat_template and not one_shot.raw
        prompt = one_shot.prompt
        if templated:
            prompt = loaded.apply_chat_template(one_shot.messages(prompt), add_assistant=True)
        key = None
        from reame.engine import GenerationRequest
        from reame.engine.prompt import prompt_tokens
        tokens = prompt_tokens(loaded, GenerationRequest(prompt, params))
        startup.mark("prompt rendered and tokenized")
        if answers is not None and named is not None:
            key = answers.key(tokens, params, "chat" if templated else "completion")
            cached = answers.get(key)
            if cached is not None:
                answers.name_prompt(named, key, templated and loaded.template_reads_clock)
                startup.mark("answered from the cache")
                if answering.frees_model:
                    loaded.close()
                return print_cached(cached, one_shot.quiet, out, err)
        if sized(settings, one_shot):
            n_ctx = context_for(len(tokens), params.max_tokens, model.n_ctx)
            model = dataclasses.replace(model, n_ctx=n_ctx, n_batch=min(model.n_batch, n_ctx),
                                        n_ubatch=min(model.n_ubatch, n_ctx))
        head = head_length(loaded, one_shot, params, tokens) \
            if templated and heads_apply(settings, one_shot, len(tokens)) else 0
        backend = answering.open_context(model, loaded)
    except BaseException:
        loaded.close()
        raise
    heads, restored = None, None
    if head:
        from reame.cache.heads import TemplateHeads
        heads = TemplateHeads(settings.cache.directory, backend.kv_fingerprint())
        restored = heads.find(tokens[:head])
    startup.mark(f"context of {backend.n_ctx} made")
    with answering.new_engine(backend) as engine:
        startup.mark("engine ready")
        if one_shot.best_of > 1:
            return elect_answer(engine, prompt, params, one_shot.quiet, one_shot.best_of, out, err)
        from reame.chat import stream_answer
        from reame.engine import Session, SessionState
        session = Session(SessionState(restored.tokens, restored.blob)) if restored is not None else None
        text, finish = stream_answer(engine, prompt, params, out, err, session)
        if finish.reason == "error":
            raise ModelError(finish.message)
        if answers is not None and key is not None and named is not None and answers.put(key, text, finish):
            answers.name_prompt(named, key, templated and backend.template_reads_clock)
        startup.mark("answered")
        if not one_shot.quiet:
            print(stats_line(finish), file=err)
    if heads is not None and restored is None:
        keep_head(heads, backend, tokens[:head])
    return 0


def heads_apply(settings: Settings, one_shot: OneShot, prompt_tokens: int) -> bool:
    """Whether a one-shot restores its template's opening from a template head: with the KV cache on, one
    attempt, and a prompt the prefix cache would not keep (at most cache.min_new_tokens tokens: a request that
    carries a head is not looked up there)."""
    options = settings.cache
    return options.enabled and one_shot.best_of == 1 and prompt_tokens <= options.min_new_tokens


def head_length(loaded: LoadedModel, one_shot: OneShot, params: SamplingParams, tokens: list[int]) -> int:
    """How many of the prompt's `tokens` to restore from a template head: of those the chat template's opening
    makes (the tokens it shares with the same messages asking nothing), as many as leave the answer unchanged
    (`usable_length`); 0 if the template refuses the empty question."""
    from reame.cache.heads import usable_length
    from reame.cache.store import common_prefix
    from reame.engine import GenerationRequest
    from reame.engine.prompt import prompt_tokens
    from reame.errors import ReameError
    try:
        opening = loaded.apply_chat_template(one_shot.messages(""), add_assistant=True)
        shared = common_prefix(tokens, prompt_tokens(loaded, GenerationRequest(opening, params)))
    except ReameError:
        return 0
    return usable_length(shared, len(tokens))


def keep_head(heads: TemplateHeads, backend: LlamaBackend, head: list[int]) -> None:
    """Write the prompt's head from the KV the answer left in sequence 0 (the one-shot's only request ran
    there, or the sequence is empty and nothing is written)."""
    from reame.cache.store import Snapshot
    if backend.seq_pos_max(0) >= len(head) - 1 and backend.seq_rm(0, len(head)):
        heads.keep(Snapshot(tuple(head), backend.seq_state_get(0)))


def print_cached(cached: CachedAnswer, quiet: bool, out: TextIO, err: TextIO) -> int:
    print(cached.text, file=out)
    if not quiet:
        print(f"answered from the exact answer cache: {cached.completion_tokens} tokens, "
              f"finish {cached.finish_reason}", file=err)
    return 0


def elect_answer(engine: Engine, prompt: str, params: SamplingParams, quiet: bool, best_of: int, out: TextIO,
                 err: TextIO) -> int:
    """The Conclave: the elected answer on stdout, `CONCLAVE consensus=k/N` on stderr (even with
    --quiet: a script escalates on it)."""
    import logging
    from reame.conclave import convene
    from reame.engine import GenerationRequest
    from reame.errors import ModelError
    outcome = convene(engine, GenerationRequest(prompt, params), best_of)
    errors = [c.finish.message for c in outcome.completions if c.finish.reason == "error"]
    if errors:
        raise ModelError(errors[0])
    winner = outcome.winner
    print(winner.text, file=out)
    verdict = outcome.verdict
    if not quiet:
        answers = ", ".join(f"{c.key!r}" if c.key is not None else c.finish_reason for c in verdict.candidates)
        logging.getLogger("reame").info("attempt %d elected%s; answers: %s", verdict.winner,
                                        " early, the others stopped" if verdict.early else "", answers)
        print(stats_line(winner.finish), file=err)
    print(f"CONCLAVE consensus={verdict.consensus}/{verdict.n}", file=err)
    return 0


def stats_line(finish: FinishEvent) -> str:
    usage = finish.usage
    note = f" ({finish.message})" if finish.message else ""
    cached = f" ({usage.cached_tokens} from cache)" if usage.cached_tokens else ""
    drafts = f" ({usage.accepted_draft_tokens}/{usage.draft_tokens} drafts accepted, " \
        f"{usage.tokens_per_step:.2f} tokens per step)" if usage.draft_tokens else ""
    return (f"prompt {usage.prompt_tokens} tokens{cached}, {usage.prompt_tokens_per_second:.1f} tok/s · "
            f"generated {usage.completion_tokens} tokens{drafts}, {usage.decode_tokens_per_second:.1f} tok/s · "
            f"finish {finish.reason}{note}")
