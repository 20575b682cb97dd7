"""Typed settings -> the running parts: engine, prefix cache, speculation, semantic caches (the model file and
autoconfig's plan are model_choice.py's; the exact answer cache's tiers, answers.py's).

The one place that knows how the parts fit together, so the CLI only parses
arguments and prints, and each part only takes what it needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reame.cache import PrefixCache
from reame.engine import Engine
from reame.ctypes_llama._lib import loaded_libraries
from reame.model.batch_numerics import exact_batch_rows
from reame.model.fingerprint import recall, remember, remembered
from reame.model.llama import LlamaBackend
from reame.model_choice import progress_stream, resolve_model
from reame.errors import ReameError
from reame.native import cpu_identity
from reame.settings import Settings
from reame.speculative import DraftSource, PromptLookup, Speculation
from reame.speculative.draft_model import CATCH_UP_TOKENS, DraftModel
from reame.speculative.palimpsest import Palimpsest, vocabulary_hash
from reame.speculative.speculation import CostMemory
from reame.speculative.suggeritore import Suggeritore

if TYPE_CHECKING:
    from reame.embedder import ModelEmbedder
    from reame.semantic import SemanticCache

log = logging.getLogger("reame")

SERVED_EMBEDDINGS = "served"  # cache.semantic_model: the served model embeds questions itself


def new_engine(backend: LlamaBackend, settings: Settings, speculate: bool = True, serving: bool = False,
               warm_up: bool = True, frees_backend: bool = True) -> Engine:
    """An engine over `backend` with the prefix cache and speculation the settings ask for; `serving`: with the
    server's queue limits; `warm_up`: see Engine; `frees_backend`: the engine closes the backend once its thread
    has ended (False: the process is about to exit, which frees it faster)."""
    server = settings.server
    limits: dict[str, Any] = dict(max_queue=server.max_queue, queue_timeout_s=server.queue_timeout_s,
                                  prefill_chunk_tokens=server.prefill_chunk_tokens,
                                  max_answer_tokens=server.max_answer_tokens,
                                  context_per_request=server.context_per_request) if serving else {}
    try:
        speculation = new_speculation(backend, settings, serving) if speculate else None
        return Engine(backend, cache=prefix_cache(settings, backend.kv_fingerprint(), serving),
                      speculation=speculation, owns_backend=frees_backend, warm_up=warm_up,
                      rowwise=settings.speculative.exact, **limits)
    except BaseException:
        backend.close()
        raise


def new_speculation(backend: LlamaBackend, settings: Settings, serving: bool = False) -> Speculation | None:
    """The draft sources the settings ask for, cheapest and surest first; None when there are none.
    A serving node with a shared store (arca.remote) shares its Palimpsest's generations through it."""
    options = settings.speculative
    if not options.enabled:
        return None
    sources: list[DraftSource] = []
    if options.suggeritore:
        sources.append(Suggeritore(backend.token_piece,
                                   lambda text: backend.tokenize(text, add_special=False, parse_special=False),
                                   backend.detokenize))
    if options.palimpsest:
        vocabulary = remembered(backend.settings.path, "vocabulary hash",
                                lambda: vocabulary_hash(backend.token_piece, backend.n_vocab).hex(), digest_bytes)
        palimpsest = Palimpsest(options.palimpsest_directory, vocabulary, options.palimpsest_budget_bytes)
        if serving and settings.arca.remote:
            from reame.arca.stores import shared_store  # only a node with a store loads the store's client
            from reame.speculative.corpus import Corpus
            palimpsest.attach(Corpus(lambda: shared_store(settings.arca.remote, settings.arca.secret), vocabulary,
                                     palimpsest))
        sources.append(palimpsest)
    if options.lookup:
        sources.append(PromptLookup(options.lookup_max_ngram, options.lookup_min_ngram))
    if options.draft_model:
        try:
            sources.append(load_draft_model(options.draft_model, backend, options.draft_min_probability))
        except BaseException:  # the sources built so far run threads that read the backend: stop them first
            for source in sources:
                source.close()
            raise
    if not sources:
        return None
    # probed up to a step with a row for every sequence and one of them drafting all it may
    return Speculation(*sources, max_draft=options.max_draft_tokens,
                       measure_exact_rows=exact_rows_probe(backend, options.max_draft_tokens + backend.n_seq_max)
                       if options.exact else None, cost_memory=step_cost_memory(backend))


def exact_rows_probe(backend: LlamaBackend, limit: int) -> Callable[[], int]:
    """Measures the batch sizes (up to `limit` rows) that decode each row exactly as a one-row step
    (model/batch_numerics.py), row by row where the backend can (the engine's exact steps are made so):
    once per model content, llama.cpp build, CPU, thread count and KV settings, then remembered, so a
    start costs a file read. Call the result on the engine thread."""
    settings, rowwise = backend.settings, backend.supports_rowwise
    fact = machine_fact(backend, "exact batch rows", str(limit))

    def parse(text: str) -> int:
        rows = int(text)
        if not 1 <= rows <= limit:
            raise ValueError(f"{rows} rows is outside 1..{limit}")
        return rows

    return lambda: remembered(settings.path, fact, lambda: str(exact_batch_rows(backend, limit, rowwise=rowwise)),
                              parse)


def step_cost_memory(backend: LlamaBackend) -> CostMemory:
    """Where this model's step costs on this machine (build, CPU, threads, KV settings) are kept between
    processes: the model facts file."""
    fact = machine_fact(backend, "step costs")
    return CostMemory(lambda: recall(backend.settings.path, fact),
                      lambda text: remember(backend.settings.path, fact, text))


def machine_fact(backend: LlamaBackend, *what: str) -> str:
    """The name of a fact about running `backend`'s model that holds for this llama.cpp build, CPU,
    thread count and KV settings only."""
    settings, libraries = backend.settings, loaded_libraries()
    cpu = hashlib.sha256(cpu_identity().encode()).hexdigest()[:16]
    build = "" if libraries is None else libraries.build_name
    return "|".join((*what, f"{backend.n_threads} threads", settings.kv_type, settings.flash_attn, build, cpu,
                     *(["rowwise"] if backend.supports_rowwise else [])))


def digest_bytes(text: str) -> bytes:
    """A remembered sha256 read back: exactly 32 bytes of hex, or ValueError."""
    digest = bytes.fromhex(text)
    if len(digest) != 32:
        raise ValueError("not a sha256")
    return digest


def load_draft_model(name: str, target: LlamaBackend, min_probability: float) -> DraftModel:
    """The draft model in a context shaped like the target's (threads, length, slots), with batches
    as large as its catch-up steps."""
    path, _ = resolve_model(name)
    settings = dataclasses.replace(target.settings, path=str(path), n_batch=CATCH_UP_TOKENS,
                                   n_ubatch=CATCH_UP_TOKENS)
    draft = LlamaBackend(settings)
    try:
        source = DraftModel(draft, target, path.name, min_probability)
    except BaseException:
        draft.close()
        raise
    log.info("drafting with %s as well", path.name)
    return source


def prefix_cache(settings: Settings, fingerprint: bytes, serving: bool) -> PrefixCache | None:
    """The prefix cache the settings ask for; `serving`: it verifies its newest files at start (PrefixCache)."""
    options = settings.cache
    if not options.enabled:
        return None
    remote = None
    if settings.arca.remote and options.remote:
        from reame.arca.stores import shared_store, store_description  # only a node with a store loads them
        from reame.cache.remote import RemoteKV
        remote = RemoteKV(lambda: shared_store(settings.arca.remote, settings.arca.secret), fingerprint,
                          options.remote_timeout_s, options.remote_publish_bytes, options.remote_ttl_ms,
                          options.compress)
        log.info("KV snapshots are shared through %s",
                 store_description(settings.arca.remote, settings.arca.secret))
    try:
        return PrefixCache(fingerprint, options.directory, disk_budget_bytes=options.disk_budget_bytes,
                           ram_budget_bytes=options.ram_budget_bytes, block_tokens=options.block_tokens,
                           min_new_tokens=options.min_new_tokens, compress=options.compress, remote=remote,
                           verify_newest=serving)
    except OSError as error:  # a cache is a speed-up: without its directory, serve on without it
        log.warning("the prefix cache is off: cannot use its directory %s (%s); set cache.dir to a writable "
                    "directory", options.directory, error.strerror or error)
        if remote is not None:
            remote.close()
        return None


def semantic_caches(settings: Settings, fingerprints: list[bytes],
                    answers_kept: bool) -> tuple[list[SemanticCache | None], ModelEmbedder | None]:
    """Each model's semantic answer cache (one per fingerprint) if cache.semantic is on, and the one embedding
    model they share, loaded here (None: the models embed questions themselves, `served`). No caches, with a
    warning, without the exact answer cache they keep answers in (`answers_kept`) or when the embedding model
    does not load: a cache is a speed-up."""
    options = settings.semantic
    none: list[SemanticCache | None] = [None] * len(fingerprints)
    if not options.enabled:
        return none, None
    from reame.arca.stores import shared_store  # only a server with the cache on loads them
    from reame.semantic import SemanticCache, SemanticIndex
    if not answers_kept:
        log.warning("the semantic cache is off: it keeps its answers in the exact answer cache, which is off")
        return none, None
    embedder = None
    if options.model == SERVED_EMBEDDINGS:
        log.warning("semantic cache: the served model's own embeddings gave wrong answers at every threshold in "
                    "bench/semantic_cache.py; an embedding model (cache.semantic_model) is safer")
    else:
        from reame.embedder import ModelEmbedder
        try:
            embedder = ModelEmbedder(resolve_model(options.model, progress_stream())[0])
        except ReameError as error:
            log.warning("the semantic cache is off: cannot load its embedding model %s (%s)", options.model, error)
            return none, None
    log.info("semantic cache: questions within cosine %.2f of an answered one, embedded by %s%s",
             options.threshold, options.model, ", shared through the store" if settings.arca.remote else "")
    return [SemanticCache(SemanticIndex(fingerprint, embedder.identity if embedder else fingerprint.hex(),
                                        options.threshold,
                                        shared_store(settings.arca.remote, settings.arca.secret)
                                        if settings.arca.remote else None,
                                        settings.arca.answer_ttl_ms), embedder)
            for fingerprint in fingerprints], embedder
