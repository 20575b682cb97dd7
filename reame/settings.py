"""Typed, frozen settings, built once from the loaded config values (config.py).

config.py reads and validates every key with its origin; this module turns
them into one immutable object per section, so the rest of the program reads
`settings.server.port`, never `values["server.port"].value`, and a setting
cannot change under a thread that read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reame.config import Value
from reame.model.sampling import SamplingParams
from reame.errors import ConfigError
from reame.native import cache_root


@dataclass(frozen=True)
class ModelOptions:
    path: str
    context_length: int  # 0: chosen
    threads: int  # 0: chosen
    batch: int  # 0: chosen
    ubatch: int  # 0: chosen
    chat_template: str


@dataclass(frozen=True)
class MemoryOptions:
    use_mmap: bool
    use_mlock: bool
    kv_cache_type: str  # auto: chosen


@dataclass(frozen=True)
class ModelSpec:
    """A model server.models names: where it comes from, and what requests call it ("" = its own name)."""

    source: str  # a catalog name or a .gguf path
    names: tuple[str, ...] = ()  # the first is its id; the others are aliases


@dataclass(frozen=True)
class SessionLimits:
    """What named sessions may cost (server/sessions.py)."""

    per_key: int = 32  # sessions one API key may hold
    total: int = 256  # sessions in all
    ram_bytes: int = 256 << 20  # their states in RAM; past it the least recently used idle ones go to disk
    idle_s: float = 7 * 86400.0  # a session unused this long is deleted (0: never)


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    api_keys: tuple[str, ...]
    cors_origin: str
    allowed_hosts: tuple[str, ...]
    max_connections: int
    max_requests: int
    max_body_bytes: int
    idle_timeout_s: float
    header_timeout_s: float
    request_timeout_s: float
    shutdown_grace_s: float
    model_id: str  # "": the model's name; more names after |
    model_tags: tuple[str, ...]
    node_name: str  # "": the host name
    parallel: int  # 0: chosen
    prefill_chunk_tokens: int
    max_queue: int
    queue_timeout_s: float
    max_answer_tokens: int  # 0: the context's room
    context_per_request: int  # 0: the whole context
    sessions: SessionLimits
    request_logging: bool
    metrics: bool
    slots: bool
    web_page: bool
    cache_reuse: int
    allow_pull: bool
    models: tuple[ModelSpec, ...]  # served besides the first (model.path)
    max_loaded_models: int
    models_ram_bytes: int  # 0: chosen at start
    keep_alive_s: float  # negative: never
    batches: bool  # the Files and Batch APIs
    batch_dir: Path | None  # None: the first model's under $REAME_CACHE/batches
    batch_storage_bytes: int
    batch_max_lines: int
    batch_concurrency: int  # 0: chosen at start


@dataclass(frozen=True)
class CacheOptions:
    enabled: bool
    directory: Path
    disk_budget_bytes: int
    ram_budget_bytes: int
    min_new_tokens: int
    block_tokens: int
    compress: bool
    remote: bool  # shared through arca.remote's store, when there is one
    remote_timeout_s: float
    remote_publish_bytes: int
    remote_ttl_ms: int


@dataclass(frozen=True)
class AnswerOptions:
    """The exact answer cache's tiers on this node (the shared store is `arca.remote`)."""
    enabled: bool
    directory: Path
    ram_budget_bytes: int
    disk_budget_bytes: int  # 0: no disk tier


@dataclass(frozen=True)
class SemanticOptions:
    """The semantic answer cache (reame/semantic.py); it keeps answers in the exact cache's tiers."""
    enabled: bool
    threshold: float
    model: str  # a catalog name or path, or "served"


@dataclass(frozen=True)
class SpeculativeOptions:
    enabled: bool
    lookup: bool
    suggeritore: bool
    palimpsest: bool
    palimpsest_directory: Path
    palimpsest_budget_bytes: int
    draft_model: str
    draft_min_probability: float
    max_draft_tokens: int
    exact: bool
    lookup_max_ngram: int
    lookup_min_ngram: int


@dataclass(frozen=True)
class EmbeddingOptions:
    context_length: int
    pooling: str


@dataclass(frozen=True)
class ArcaOptions:
    host: str
    port: int
    directory: Path
    max_bytes: int
    requirepass: str
    max_clients: int
    timeout_s: float
    max_query_bytes: int
    remote: str
    secret: str
    answer_ttl_ms: int


@dataclass(frozen=True)
class Settings:
    """Every section; `origins` says where each key's value came from (for --print-config)."""

    log_level: str
    model: ModelOptions
    memory: MemoryOptions
    server: ServerOptions
    cache: CacheOptions
    answers: AnswerOptions
    semantic: SemanticOptions
    speculative: SpeculativeOptions
    embeddings: EmbeddingOptions
    arca: ArcaOptions
    generation: SamplingParams  # the CLI's defaults; API requests carry their own
    origins: tuple[tuple[str, object, str], ...]  # (key, value, origin)


def from_values(values: dict[str, Value]) -> Settings:
    """The typed settings; ConfigError for what only makes sense together (an unreadable key file)."""
    def get(name: str):  # type: ignore[no-untyped-def]
        return values[name].value

    cache_dir = get("cache.dir")
    batch_dir = get("server.batch_dir")
    answers_dir = get("cache.answers_dir")
    palimpsest_dir = get("speculative.palimpsest_dir")
    return Settings(
        log_level=get("logging.level"),
        model=ModelOptions(get("model.path"), get("model.context_length"), get("model.threads"), get("model.batch"),
                           get("model.ubatch"), get("model.chat_template")),
        memory=MemoryOptions(get("memory.use_mmap"), get("memory.use_mlock"), get("memory.kv_cache_type")),
        server=ServerOptions(
            host=get("server.host"), port=get("server.port"),
            api_keys=api_keys(get("server.api_key"), get("server.api_key_file")),
            cors_origin=get("server.cors_origin"), allowed_hosts=comma_list(get("server.allowed_hosts")),
            max_connections=get("server.max_connections"),
            max_requests=get("server.max_requests"), max_body_bytes=int(get("server.max_request_size_mb") * 2**20),
            idle_timeout_s=get("server.idle_timeout_seconds"), header_timeout_s=get("server.header_timeout_seconds"),
            request_timeout_s=get("server.request_timeout_seconds"),
            shutdown_grace_s=get("server.shutdown_grace_seconds"), model_id=get("server.model_id"),
            model_tags=comma_list(get("server.model_tags")),
            node_name=get("server.node_name"),
            parallel=get("server.parallel"), prefill_chunk_tokens=get("server.prefill_chunk_tokens"),
            max_queue=get("server.max_queue"), queue_timeout_s=get("server.queue_timeout_seconds"),
            max_answer_tokens=get("server.max_answer_tokens"), context_per_request=get("server.context_per_request"),
            sessions=SessionLimits(get("server.max_sessions_per_key"), get("server.max_sessions"),
                                   int(get("server.sessions_ram_mb") * 2**20), get("server.session_idle_hours") * 3600),
            request_logging=get("server.request_logging"), metrics=get("server.metrics"),
            slots=get("server.slots"), web_page=get("server.web_page"), cache_reuse=get("server.cache_reuse"),
            allow_pull=get("server.allow_pull"),
            models=model_specs(get("server.models"), values["server.models"].origin),
            max_loaded_models=get("server.max_loaded_models"), models_ram_bytes=get("server.models_ram_mb") << 20,
            keep_alive_s=get("server.keep_alive_seconds"),
            batches=get("server.batches"), batch_dir=Path(batch_dir).expanduser() if batch_dir else None,
            batch_storage_bytes=int(get("server.batch_storage_mb") * 2**20),
            batch_max_lines=get("server.batch_max_lines"), batch_concurrency=get("server.batch_concurrency")),
        cache=CacheOptions(
            enabled=get("cache.enabled"),
            directory=Path(cache_dir).expanduser() if cache_dir else cache_root() / "kv",
            disk_budget_bytes=int(get("cache.disk_mb") * 2**20), ram_budget_bytes=int(get("cache.ram_mb") * 2**20),
            min_new_tokens=get("cache.min_new_tokens"), block_tokens=get("cache.block_tokens"),
            compress=get("cache.compress"), remote=get("cache.remote"),
            remote_timeout_s=get("cache.remote_timeout_seconds"),
            remote_publish_bytes=int(get("cache.remote_publish_mb") * 2**20),
            remote_ttl_ms=int(get("cache.remote_ttl_hours") * 3600 * 1000)),
        answers=AnswerOptions(
            enabled=get("cache.answers"),
            directory=Path(answers_dir).expanduser() if answers_dir else cache_root() / "answers",
            ram_budget_bytes=int(get("cache.answers_ram_mb") * 2**20),
            disk_budget_bytes=int(get("cache.answers_disk_mb") * 2**20)),
        semantic=SemanticOptions(get("cache.semantic"), get("cache.semantic_threshold"), get("cache.semantic_model")),
        speculative=SpeculativeOptions(
            enabled=get("speculative.enabled"), lookup=get("speculative.lookup"),
            suggeritore=get("speculative.suggeritore"), palimpsest=get("speculative.palimpsest"),
            palimpsest_directory=Path(palimpsest_dir).expanduser() if palimpsest_dir else cache_root() / "palimpsest",
            palimpsest_budget_bytes=int(get("speculative.palimpsest_mb") * 2**20),
            draft_model=get("speculative.draft_model"),
            draft_min_probability=get("speculative.draft_min_probability"),
            max_draft_tokens=get("speculative.max_draft_tokens"), exact=get("speculative.exact"),
            lookup_max_ngram=get("speculative.lookup_max_ngram"), lookup_min_ngram=get("speculative.lookup_min_ngram")),
        embeddings=EmbeddingOptions(get("embeddings.context_length"), get("embeddings.pooling")),
        arca=ArcaOptions(get("arca.host"), get("arca.port"),
                         Path(get("arca.dir")).expanduser() if get("arca.dir") else cache_root() / "arca",
                         int(get("arca.max_mb") * 2**20), get("arca.requirepass"), get("arca.max_clients"),
                         get("arca.timeout_seconds"), int(get("arca.client_query_buffer_mb") * 2**20),
                         get("arca.remote"), get("arca.secret"),
                         int(get("arca.answer_ttl_hours") * 3_600_000)),
        generation=SamplingParams(
            max_tokens=get("generation.max_tokens"), temperature=get("generation.temperature"),
            seed=get("generation.seed"), top_k=get("generation.top_k"), top_p=get("generation.top_p"),
            min_p=get("generation.min_p"), repeat_penalty=get("generation.repeat_penalty")),
        origins=tuple((name, value.value, value.origin) for name, value in values.items()))


def comma_list(listed: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in listed.split(",") if item.strip())


def api_keys(listed: str, key_file: str) -> tuple[str, ...]:
    """The bearer keys: comma-separated in server.api_key, plus one per line in server.api_key_file."""
    keys = list(comma_list(listed))
    if key_file:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read server.api_key_file {key_file}: {error}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return tuple(keys)


MAX_MODEL_NAME = 100


def model_specs(listed: str, origin: str) -> tuple[ModelSpec, ...]:
    """server.models: comma-separated SOURCE or NAME[|ALIAS…]=SOURCE; ConfigError naming the bad entry."""
    specs = []
    for entry in (part.strip() for part in listed.split(",")):
        if not entry:
            continue
        named, equals, source = entry.partition("=") if "=" in entry else ("", "", entry)
        names = tuple(name.strip() for name in named.split("|")) if equals else ()  # a path may hold "="
        source = source.strip()
        if not source or any(not name or len(name) > MAX_MODEL_NAME or not name.isprintable() for name in names):
            raise ConfigError(f"{origin}: server.models entry '{entry}' must be SOURCE or NAME[|ALIAS…]=SOURCE, "
                              f"names printable and at most {MAX_MODEL_NAME} characters")
        specs.append(ModelSpec(source, names))
    return tuple(specs)
