"""Settings from defaults < INI file < REAME_* environment < command-line flags.

The INI format is the original's (`[section]`, `key = value`, `#`/`;` comment
lines) plus inline comments (` # …` or ` ; …` after a value) and optional
double quotes around a value. Every key is declared once in `KEYS` with its
type, default and meaning; an unknown key is an error that names the closest
known key, and a bad value names its file and line.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from reame.errors import ConfigError

log = logging.getLogger("reame.config")
ENV_PREFIX = "REAME_"
# Environment variables that are not config keys (see docs/configuration.md).
NON_KEY_ENV = {"REAME_HOME", "REAME_CACHE", "REAME_LIBLLAMA", "REAME_LLAMA_VERBOSE", "REAME_CONFIG"}


# The chat formats libllama knows by name at the pin (src/llama-chat.cpp, LLM_CHAT_TEMPLATES): `model.chat_template`
# may name one instead of the model's own template, as llama-server's --chat-template does.
LLAMA_CHAT_TEMPLATES = (
    "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
    "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4", "falcon3", "zephyr", "monarch", "gemma",
    "orion", "openchat", "vicuna", "vicuna-orca", "deepseek", "deepseek2", "deepseek3", "deepseek-ocr", "command-r",
    "llama3", "chatglm3", "chatglm4", "glmedge", "minicpm", "exaone3", "exaone4", "exaone-moe", "rwkv-world",
    "granite", "granite-4.0", "granite-4.1", "gigachat", "megrez", "yandex", "bailing", "bailing-think", "bailing2",
    "llama4", "smolvlm", "hunyuan-moe", "gpt-oss", "hunyuan-dense", "hunyuan-vl", "kimi-k2", "seed_oss", "grok-2",
    "pangu-embedded", "solar-open")


@dataclass(frozen=True)
class Key:
    name: str  # section.key
    kind: str  # str | int | float | bool | choice
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.name.replace(".", "_").upper()


KEYS: tuple[Key, ...] = (
    Key("logging.level", "choice", "info", "log level of Reame's own lines on stderr",
        choices=("debug", "info", "warn", "error")),
    Key("model.path", "str", "", "catalog name or path of a .gguf file (relative to the working directory)"),
    Key("model.context_length", "int", 0, "context length in tokens; 0 = chosen for this host and model",
        minimum=0),
    Key("model.threads", "int", 0, "CPU threads; 0 = chosen for this host", minimum=0),
    Key("model.batch", "int", 0, "most tokens per llama_decode call; 0 = chosen for this host", minimum=0),
    Key("model.ubatch", "int", 0, "physical batch; 0 = chosen for this host", minimum=0),
    Key("model.chat_template", "choice", "jinja",
        "jinja = the model's own chat template (as Hugging Face renders it); builtin = llama.cpp's detection of "
        "well-known formats; or one of llama.cpp's formats by name (chatml, llama3, command-r, ...)",
        choices=("jinja", "builtin", *LLAMA_CHAT_TEMPLATES)),
    Key("memory.use_mmap", "bool", True, "map the model file instead of reading it"),
    Key("memory.use_mlock", "bool", False, "lock the model in RAM"),
    Key("memory.kv_cache_type", "choice", "auto", "KV cache element type; auto = chosen for this host",
        choices=("auto", "f16", "q8_0", "q4_0")),
    Key("server.host", "str", "127.0.0.1", "address to listen on (0.0.0.0 for every interface)"),
    Key("server.port", "int", 8080, "TCP port; 0 = any free port", minimum=0),
    Key("server.api_key", "str", "", "bearer key(s) clients must send, comma-separated; empty = no auth"),
    Key("server.api_key_file", "str", "", "file with one bearer key per line (added to server.api_key)"),
    Key("server.cors_origin", "str", "", "CORS: '' = off, '*' or an origin to allow browsers from"),
    Key("server.allowed_hosts", "str", "", "host names requests may address (the Host header), comma-separated; "
        "'*' = any; empty = loopback names on a server bound to loopback, any name otherwise"),
    Key("server.max_connections", "int", 256, "open connections at once (each costs a thread); past it the longest "
        "idle keep-alive connection is closed to make room, or the newcomer gets 503", minimum=1),
    Key("server.max_requests", "int", 64, "requests answered at once; more get 503 with Retry-After "
        "(GET /health is always answered)", minimum=1),
    Key("server.max_request_size_mb", "float", 10, "largest request body; larger gets 413", minimum=0.001),
    Key("server.idle_timeout_seconds", "float", 30, "close a connection idle (or sending) this long",
        minimum=0.1),
    Key("server.header_timeout_seconds", "float", 10, "a new connection must send its first byte, and a request "
        "its line and headers from its first byte, within this; slower gets 408 (or a quiet close)", minimum=0.1),
    Key("server.request_timeout_seconds", "float", 60,
        "a request (line, headers and body) must arrive this long after its first byte; slower gets 408",
        minimum=0.1),
    Key("server.shutdown_grace_seconds", "float", 30, "on SIGTERM/SIGINT, time left to requests in flight",
        minimum=0),
    Key("server.model_id", "str", "", "the first model's id in /v1/models and responses, then more names a request "
        "may use for it, separated by | (coder|qwen); empty = its name"),
    Key("server.model_tags", "str", "", "tags /v1/models lists for the first model, comma-separated (as "
        "llama-server's --tags)"),
    Key("server.node_name", "str", "", "this node's name in every response's X-Reame-Node header (which node of a "
        "fleet answered); empty = the host name"),
    Key("server.parallel", "int", 0, "sequences generated together in one batch when serving; 0 = chosen (4)",
        minimum=0),
    Key("server.prefill_chunk_tokens", "int", 128,
        "most prompt tokens fed per step while other streams decode (0 = a whole batch)", minimum=0),
    Key("server.max_queue", "int", 32, "generations waiting for a sequence slot (each of a request's n or "
        "best_of counts) and embedding requests not yet answered (one each); more get 429", minimum=1),
    Key("server.max_answer_tokens", "int", 4096, "the most tokens one answer gets, whatever its request asks "
        "(a larger max_tokens is clamped: finish_reason length); 0 = what the context leaves", minimum=0),
    Key("server.context_per_request", "int", 0, "the most tokens one request fills, prompt and answer together, as "
        "llama-server's context per slot (a longer prompt gets 400, an answer stops there); 0 = the whole context",
        minimum=0),
    Key("server.models", "str", "", "more models this server serves besides the one it starts with: "
        "comma-separated catalog names or .gguf paths, each optionally named first (NAME=SOURCE, and more "
        "names with |: coder|qwen=qwen2.5-coder-0.5b); a request's model picks one"),
    Key("server.max_loaded_models", "int", 3, "models loaded at once at most; a request for another waits "
        "until the least recently used idle one is unloaded", minimum=1),
    Key("server.models_ram_mb", "int", 0, "memory the loaded models may take together (weights, KV, buffers: "
        "estimated); 0 = 80% of the memory available at start", minimum=0),
    Key("server.keep_alive_seconds", "float", 300, "an idle model other than the first is unloaded after this "
        "long (Ollama's keep_alive, which a request may set); -1 = never", minimum=-1),
    Key("server.max_sessions", "int", 256, "sessions the server holds in all; creating more gets 429", minimum=1),
    Key("server.max_sessions_per_key", "int", 32, "sessions one API key may hold; creating more gets 429",
        minimum=1),
    Key("server.sessions_ram_mb", "float", 256, "most MiB of session KV kept in RAM; past it the least recently "
        "used idle sessions are written to disk and read back when next used", minimum=0),
    Key("server.session_idle_hours", "float", 168, "a session unused this long is deleted, in RAM and on disk; "
        "0 = never", minimum=0),
    Key("server.queue_timeout_seconds", "float", 300, "a request waiting longer for a slot gets 503",
        minimum=0.1),
    Key("server.request_logging", "bool", True, "log one line per HTTP request"),
    Key("server.metrics", "bool", True, "serve GET /metrics (Prometheus text); false = 501"),
    Key("server.slots", "bool", True, "serve GET /slots (llama-server's slot monitor); false = 501"),
    Key("server.cache_reuse", "int", 64, "llama-server's --cache-reuse for its routes (/completion, /infill) when a "
        "request sends no n_cache_reuse: after the common prefix, runs of at least this many tokens an idle slot "
        "holds are moved to where the new prompt has them instead of prefilled (an editor's moving window); the "
        "moved keys are re-rotated, not recomputed; 0 = off", minimum=0),
    Key("server.web_page", "bool", True, "serve the built-in web page at / (chat and dashboard); false = 404"),
    Key("server.allow_pull", "bool", False, "let clients fetch catalog models to this machine with Ollama's "
        "/api/pull (gigabytes of disk each); false = 403"),
    Key("server.batches", "bool", True, "serve OpenAI's Files and Batch APIs (/v1/files, /v1/batches): JSONL files "
        "of requests answered in the server's idle time, surviving a restart; false = 404"),
    Key("server.batch_dir", "str", "", "where batches and their files live; empty = $REAME_CACHE/batches"),
    Key("server.batch_storage_mb", "float", 1024, "most MiB all batch files may take together (inputs, outputs, "
        "error files); an upload past it gets 413", minimum=0),
    Key("server.batch_max_lines", "int", 50000, "most requests one batch's input file may hold; more gets 400",
        minimum=1),
    Key("server.batch_concurrency", "int", 1, "batch requests answered at once, each only while no interactive "
        "request waits and a slot is free; 0 = one less than the first model's slots (at least 1)", minimum=0),
    Key("cache.enabled", "bool", True,
        "keep prompts' KV in the persistent prefix cache (and one-shots' template heads) and restore it"),
    Key("cache.dir", "str", "", "prefix cache directory, shared by processes; empty = $REAME_CACHE/kv"),
    Key("cache.disk_mb", "float", 4096, "most MiB of snapshots in cache.dir (least recently used go first)",
        minimum=1),
    Key("cache.ram_mb", "float", 256, "most MiB of recent snapshots kept in RAM in front of the disk", minimum=0),
    Key("cache.min_new_tokens", "int", 64,
        "snapshot a prompt once at least this many of its tokens had to be prefilled", minimum=1),
    Key("cache.block_tokens", "int", 32, "tokens per block of the prefix index", minimum=1),
    Key("cache.compress", "bool", True, "zstd-compress snapshots when a sample shows that it pays"),
    Key("cache.remote", "bool", True, "with arca.remote: publish every new prefix-cache snapshot to that store and "
        "restore one another node published instead of prefilling (the fleet prefills a document once)"),
    Key("cache.remote_timeout_seconds", "float", 5, "a fetch from the shared store that takes longer is abandoned "
        "and the prompt prefilled", minimum=0.01),
    Key("cache.remote_publish_mb", "float", 512, "most MiB of snapshots waiting to be published; more are skipped",
        minimum=0),
    Key("cache.remote_ttl_hours", "float", 168, "how long the store keeps a published snapshot; 0 = until its "
        "memory policy evicts it", minimum=0),
    Key("cache.answers", "bool", True, "answer a deterministic request (greedy, or sampled with a seed) that "
        "was answered before from the kept answer, without the model"),
    Key("cache.answers_dir", "str", "", "directory of the kept answers, shared by processes; "
        "empty = $REAME_CACHE/answers"),
    Key("cache.answers_ram_mb", "float", 16, "most MiB of recent answers kept in RAM; 0 = none", minimum=0),
    Key("cache.answers_disk_mb", "float", 256, "most MiB of answers in cache.answers_dir (least recently used "
        "go first); 0 = none on disk", minimum=0),
    Key("cache.semantic", "bool", False, "answer a chat question from the kept answer of an earlier question of "
        "the same meaning (same conversation around it, same settings); needs cache.answers; off by default: "
        "docs/cache.md#semantic-answers-opt-in has the study"),
    Key("cache.semantic_threshold", "float", 0.98, "how similar (cosine) a question must be to a kept one to get its "
        "answer; the default is the lowest with no false hit in bench/semantic_cache.py", minimum=0, maximum=1),
    Key("cache.semantic_model", "str", "all-minilm-l6-v2", "the embedding model of the semantic cache (catalog "
        "name or GGUF path); 'served' = the served model's own embeddings (slower, and measured worse)"),
    Key("arca.host", "str", "127.0.0.1", "address `reame arca` listens on (0.0.0.0 exposes it: set a password)"),
    Key("arca.port", "int", 6420, "TCP port of `reame arca`", minimum=0, maximum=65535),
    Key("arca.dir", "str", "", "`reame arca`'s append-only file directory; empty = $REAME_CACHE/arca"),
    Key("arca.max_mb", "float", 256, "`reame arca`'s byte budget; least recently used keys are evicted past it; "
        "0 = no limit", minimum=0),
    Key("arca.requirepass", "str", "", "password clients must send (AUTH) to `reame arca`; empty = none"),
    Key("arca.max_clients", "int", 256, "`reame arca`'s open connections at most (Redis's maxclients)", minimum=1),
    Key("arca.timeout_seconds", "float", 300, "`reame arca` closes a client idle this long (Redis's timeout); "
        "0 = never", minimum=0),
    Key("arca.client_query_buffer_mb", "float", 32, "most MiB of one client's unparsed input to `reame arca` "
        "(Redis's client-query-buffer-limit); past it the client is refused and closed", minimum=0.01),
    Key("arca.remote", "str", "", "a serving node's shared store (ARCA or a real Redis/Valkey): host[:port] (port "
        "6420 when omitted), redis://[:password@]host[:port]/0 (port 6379) or redis+cluster://host1:port1,host2:port2"
        ": prefix-cache snapshots, exact answers (after this node's own), the Palimpsest's corpus; empty = none"),
    Key("arca.secret", "str", "", "with arca.remote: the fleet's shared secret; every value a node writes to the "
        "store is sealed with it (HMAC-SHA256) and only values sealed with it are used; empty = none, and whoever "
        "can write to the store decides what every node serves from it"),
    Key("arca.answer_ttl_hours", "float", 168, "how long the store keeps an exact answer; 0 = until evicted",
        minimum=0),
    Key("embeddings.context_length", "int", 2048,
        "tokens of the embedding context (the longest input, and the most tokens per embedding decode)", minimum=16),
    Key("embeddings.pooling", "choice", "auto", "how an embedding pools its tokens; auto = the model's own, else "
        "mean; none = a vector per token (llama-server's /embeddings only)",
        choices=("auto", "mean", "cls", "last", "none")),
    Key("speculative.enabled", "bool", True,
        "draft tokens and verify them in one step, where the controller measures a gain"),
    Key("speculative.lookup", "bool", True, "draft by prompt lookup (copying from the prompt and answer)"),
    Key("speculative.suggeritore", "bool", True,
        "draft what the answer's form forces: a grammar's fixed text, list numbers, bullets, indentation"),
    Key("speculative.palimpsest", "bool", True,
        "draft from the archive of earlier generations (kept on disk per tokenizer, shared by processes)"),
    Key("speculative.palimpsest_dir", "str", "", "the archive's directory; empty = $REAME_CACHE/palimpsest"),
    Key("speculative.palimpsest_mb", "float", 16,
        "most MiB of archived tokens (the oldest go first); the index takes about three times that in RAM",
        minimum=0.01),
    Key("speculative.draft_model", "str", "",
        "catalog name or path of a smaller model with the same vocabulary that drafts too; empty = none"),
    Key("speculative.draft_min_probability", "float", 0.75,
        "the draft model stops at a token it gives less than this probability", minimum=0, maximum=1),
    Key("speculative.max_draft_tokens", "int", 32, "most tokens drafted per step", minimum=1),
    Key("speculative.exact", "bool", True,
        "a greedy or seeded answer is byte-identical with speculation on or off: the steps beside it compute "
        "each row as a step of one row does, and its drafts are verified only in batches measured exact (once); "
        "false = ggml's batched kernels everywhere and drafts at any size"),
    Key("speculative.lookup_max_ngram", "int", 3, "longest n-gram prompt lookup matches", minimum=1),
    Key("speculative.lookup_min_ngram", "int", 2, "shortest n-gram prompt lookup matches", minimum=1),
    Key("generation.max_tokens", "int", 512, "default most tokens to generate", minimum=1),
    Key("generation.temperature", "float", 0.7, "default sampling temperature; 0 = greedy", minimum=0),
    Key("generation.seed", "int", 42, "default sampling seed", minimum=0),
    Key("generation.top_k", "int", 40, "sample among this many most likely tokens; 0 = all", minimum=0),
    Key("generation.top_p", "float", 0.95, "sample within this share of the probability mass; 1 = all",
        minimum=0.01, maximum=1),
    Key("generation.min_p", "float", 0.05, "drop tokens below this share of the most likely one's probability",
        minimum=0, maximum=1),
    Key("generation.repeat_penalty", "float", 1.0, "divide the scores of the last 64 tokens by this; 1 = off",
        minimum=0.01, maximum=10),
)
KEYS_BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}


@dataclass(frozen=True)
class Alias:
    """A key of the original Reame's config file (SPEC §2). `new`: the key it now is, with `translate`
    turning its value into that key's (None: the same text); None: the original read it and never
    used it, so it is accepted and does nothing."""

    old: str
    new: str | None
    translate: Callable[[str], str] | None = None
    note: str = ""


def _lookup_mode(raw: str) -> str:
    return "true" if raw.strip() == "lookup" else "false"  # exactly "lookup"; the original's "model" = draft model


def _cors(raw: str) -> str:
    return "*" if raw.strip().lower() in ("true", "yes", "on", "1") else ""


def _budget(raw: str) -> str:
    return str(UNLIMITED_MB) if raw.strip() == "0" else raw  # the original's 0 meant no limit


UNLIMITED_MB = 1 << 30
ALIASES: dict[str, Alias] = {alias.old: alias for alias in (
    Alias("server.max_concurrent_requests", "server.max_requests"),
    Alias("server.enable_cors", "server.cors_origin", _cors, "true = any origin (*)"),
    Alias("server.enable_metrics", "server.metrics"),
    Alias("server.enable_request_logging", "server.request_logging"),
    Alias("speculative.mode", "speculative.lookup", _lookup_mode, "mode = lookup turns prompt lookup on"),
    Alias("speculative.draft_model_path", "speculative.draft_model"),
    Alias("speculative.draft_tokens", "speculative.max_draft_tokens"),
    Alias("cache.directory", "cache.dir", None, "an empty value turns the cache off, as in the original"),
    Alias("cache.max_size_mb", "cache.disk_mb", _budget, "0 = no limit"),
    Alias("server.threads", None),
    Alias("server.timeout_seconds", None),
    Alias("speculative.min_acceptance", None),
    Alias("memory.max_ram_gib", None),
)}


@dataclass(frozen=True)
class Value:
    value: Any
    origin: str  # "default", "file.conf:12", "env REAME_MODEL_THREADS", "flag --threads"


def parse_ini(text: str, source: str) -> dict[str, tuple[str, int]]:
    """`section.key` -> (raw value, line number); syntax errors name the line."""
    entries: dict[str, tuple[str, int]] = {}
    section = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise ConfigError(f"{source}:{number}: unterminated section header: {line}")
            section = line[1:-1].strip()
            if not section:
                raise ConfigError(f"{source}:{number}: empty section name")
            continue
        if "=" not in line:
            raise ConfigError(f"{source}:{number}: expected 'key = value', got: {line}")
        key, value = (part.strip() for part in line.split("=", 1))
        if not key:
            raise ConfigError(f"{source}:{number}: empty key")
        entries[f"{section}.{key}" if section else key] = (_strip_comment(value, source, number), number)
    return entries


def _strip_comment(value: str, source: str, number: int) -> str:
    if value.startswith('"'):
        end = value.find('"', 1)
        if end < 0:
            raise ConfigError(f"{source}:{number}: unterminated quoted value")
        rest = value[end + 1:].strip()
        if rest and rest[0] not in "#;":
            raise ConfigError(f"{source}:{number}: unexpected text after quoted value: {rest}")
        return value[1:end]
    for index, char in enumerate(value):
        if char in "#;" and (index == 0 or value[index - 1] in " \t"):
            return value[:index].rstrip()
    return value


def convert(key: Key, raw: str, where: str) -> Any:
    """Turn a raw string into the key's type, or raise ConfigError naming `where`."""
    text = raw.strip()
    if key.kind == "str":
        return text
    if key.kind == "choice":
        if text.lower() not in key.choices:
            raise ConfigError(f"{where}: {key.name} must be one of {', '.join(key.choices)}, got '{raw}'")
        return text.lower()
    if key.kind == "bool":
        lowered = text.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"{where}: {key.name} must be true or false, got '{raw}'")
    parse: Callable[[str], Any] = int if key.kind == "int" else float
    try:
        value = parse(text)
    except ValueError:
        what = "a whole number" if key.kind == "int" else "a number"
        raise ConfigError(f"{where}: {key.name} must be {what}, got '{raw}'") from None
    if key.minimum is not None and not value >= key.minimum:
        raise ConfigError(f"{where}: {key.name} must be >= {key.minimum:g}, got {raw}")
    if key.maximum is not None and not value <= key.maximum:
        raise ConfigError(f"{where}: {key.name} must be <= {key.maximum:g}, got {raw}")
    return value


def _from_alias(alias: Alias, raw: str, where: str, values: dict[str, Value],
                entries: Mapping[str, tuple[str, int]]) -> tuple[str | None, str]:
    """The key and raw value an original key stands for (None: nothing to set), said once in a warning.
    A file that also sets the new key wins over the alias."""
    if alias.new is None:
        log.warning("%s: '%s' was never used by the original Reame and does nothing here; remove it", where,
                    alias.old)
        return None, raw
    if alias.old == "cache.directory" and not raw.strip():
        log.warning("%s: '%s' is the original Reame's name: use 'cache.enabled = false' for no cache", where,
                    alias.old)
        return ("cache.enabled", "false") if "cache.enabled" not in entries else (None, raw)
    translated = alias.translate(raw) if alias.translate else raw
    note = f" ({alias.note})" if alias.note else ""
    log.warning("%s: '%s' is the original Reame's name for '%s' (read as %s = %s%s); rename it", where,
                alias.old, alias.new, alias.new, translated, note)
    if alias.new in entries:
        return None, raw
    return alias.new, translated


def unknown_key_error(name: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(name, [*KEYS_BY_NAME, *ALIASES], n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see docs/configuration.md"
    return ConfigError(f"{where}: unknown key '{name}'{hint}")


def load(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> dict[str, Value]:
    """Every key's value and where it came from, in precedence order."""
    values = {key.name: Value(key.default, "default") for key in KEYS}
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {source}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read config file {source}: {error}") from None
        entries = parse_ini(text, source)
        for name, (raw, number) in entries.items():
            where = f"{source}:{number}"
            if name in ALIASES:
                aliased, raw = _from_alias(ALIASES[name], raw, where, values, entries)
                if aliased is None:
                    continue
                name = aliased
            key = KEYS_BY_NAME.get(name)
            if key is None:
                raise unknown_key_error(name, where)
            values[name] = Value(convert(key, raw, where), where)
    environment = os.environ if env is None else env
    env_keys = {key.env_name: key for key in KEYS}
    for variable, raw in environment.items():
        if not variable.startswith(ENV_PREFIX) or variable in NON_KEY_ENV:
            continue
        key = env_keys.get(variable)
        if key is None:
            close = difflib.get_close_matches(variable, list(env_keys) + sorted(NON_KEY_ENV), n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else ""
            log.warning("ignoring unknown environment variable %s%s", variable, hint)
            continue
        values[key.name] = Value(convert(key, raw, f"environment {variable}"), f"env {variable}")
    for name, value in (flags or {}).items():
        if value is not None:
            values[name] = Value(value, "flag")
    return values


@dataclass(frozen=True)
class ConfigChoice:
    """The config file a command reads (None: none) and how it was found, for the log and --print-config."""

    path: Path | None
    why: str


def config_locations(home: Path) -> tuple[Path, ...]:
    """Where `reame --serve` and `reame --prompt` look for a config file when none is named, in order:
    the original Reame's default (config/reame.conf in the working directory) first, then the usual
    per-directory, per-user and system-wide places."""
    return (Path("config/reame.conf"), Path("reame.conf"), home / ".config" / "reame" / "reame.conf",
            Path("/etc/reame/reame.conf"))


def choose_config(named: str | None, search: bool, env: Mapping[str, str] | None = None,
                  home: Path | None = None) -> ConfigChoice:
    """`--config` if given, else $REAME_CONFIG, else (`search`) the first of `config_locations` that exists.
    A file named by the flag or the variable must exist (load() says so); a searched one is skipped unless
    it is a regular file."""
    environment = os.environ if env is None else env
    if named:
        return ConfigChoice(Path(named), f"--config {named}")
    if environment.get("REAME_CONFIG"):
        return ConfigChoice(Path(environment["REAME_CONFIG"]), f"REAME_CONFIG={environment['REAME_CONFIG']}")
    if not search:
        return ConfigChoice(None, "no config file (none named by --config or REAME_CONFIG)")
    places = config_locations(Path.home() if home is None else home)
    shown = [str(place) if place.is_absolute() else f"./{place}" for place in places]
    for place, name in zip(places, shown):
        if place.is_file():
            return ConfigChoice(place, f"found {name}")
    return ConfigChoice(None, "no config file in " + ", ".join(shown))
