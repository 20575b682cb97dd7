"""A serving node from typed settings: the HTTP server's settings and the models it serves, each with its
planned settings, its sessions and its answer caches, loaded by the model pool (server/models.py).

Apart from assembly.py so that a one-shot prompt never imports the HTTP server.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypedDict, cast

from reame import autoconfig, catalog, gguf
from reame.assembly import new_engine, semantic_caches
from reame.answers import AnswerCache, answer_tiers
from reame.model_choice import Plan, model_settings, plan, progress_stream, resolve_model
from reame.engine import Engine
from reame.errors import ConfigError
from reame.model.backend import ModelSettings
from reame.model.fingerprint import remembered
from reame.model.llama import LlamaBackend
from reame.native import cache_root
from reame.server.settings import BatchLimits, ServerSettings
from reame.server.models import FOREVER, ModelFacts, ModelPool, ServedModel
from reame.server.run import serve
from reame.server.sessions import Sessions
from reame.settings import Settings

log = logging.getLogger("reame")

OVERHEAD_BYTES = 64 << 20  # what a loaded model takes beyond its weights and KV, at least: compute buffers


def server_settings(settings: Settings, first_model: str = "", slots: int = 1) -> ServerSettings:
    """The HTTP server's settings; `first_model`'s name makes the default batch directory (a server of another
    model does not run its batches), `slots` are its slots, of which batch_concurrency 0 leaves one free."""
    server = settings.server
    directory = server.batch_dir or cache_root() / "batches" / directory_name(first_model)
    batches = BatchLimits(directory if server.batches else None, server.batch_storage_bytes, server.batch_max_lines,
                          server.max_body_bytes, server.batch_concurrency or max(1, slots - 1))
    return ServerSettings(
        host=server.host, port=server.port, api_keys=server.api_keys, cors_origin=server.cors_origin,
        allowed_hosts=server.allowed_hosts,
        max_connections=server.max_connections, max_requests=server.max_requests, max_body_bytes=server.max_body_bytes,
        idle_timeout_s=server.idle_timeout_s, header_timeout_s=server.header_timeout_s,
        request_timeout_s=server.request_timeout_s, grace_s=server.shutdown_grace_s,
        node_name=header_safe(server.node_name or socket.gethostname()),
        request_log=server.request_logging, metrics=server.metrics, slots=server.slots, web_page=server.web_page,
        cache_reuse=server.cache_reuse,
        allow_pull=server.allow_pull, batches=batches,
        sampling=settings.generation)


def header_safe(text: str) -> str:
    """`text` as a header value can carry it: printable ASCII, at most 64 characters."""
    return "".join(c for c in text if " " <= c <= "~")[:64]


@dataclass
class Planned:
    """A model to serve, found (downloaded if need be) and planned at start-up."""

    names: list[str]  # its id, then its aliases
    path: Path
    chosen: Plan
    model: ModelSettings
    given: tuple[str, ...] = ()  # the names the configuration gave it (llama-server's `aliases`)


@dataclass
class Node:
    """What serving needs: the models (loaded on demand), the HTTP server's settings, and what closes the
    things the models share (the semantic cache's embedding model) once every model is unloaded."""

    models: ModelPool
    settings: ServerSettings
    close_shared: Callable[[], None]


def serve_model(settings: Settings, path: Path, entry: catalog.ModelEntry | None, chosen: Plan) -> int:
    """Listen, load the first model, serve it and the others server.models names until a signal."""
    node = node_of(settings, path, entry, chosen)
    return serve(node.settings, node.models, node.close_shared)


def node_of(settings: Settings, path: Path, entry: catalog.ModelEntry | None, chosen: Plan) -> Node:
    """The first model and the others server.models names, planned, with their caches and sessions; none loaded."""
    server = settings.server
    given = tuple(name.strip() for name in server.model_id.split("|") if name.strip())
    first = planned_model(settings, names_of(given[0] if given else "", path, entry, given[1:]), path, chosen)
    first.given = given
    planned = with_others(settings, [first])
    tiers = answer_tiers(settings, ram=True)
    fingerprints = [item.model.kv_fingerprint() for item in planned]
    answers = [AnswerCache(tiers, fingerprint) if tiers else None for fingerprint in fingerprints]
    semantic, embedder = semantic_caches(settings, fingerprints, answers_kept=bool(tiers))
    models = [ServedModel(item.names[0], tuple(item.names[1:]), file_facts(item.path, item.model.n_ctx),
                          memory_estimate(item),
                          Sessions(cache_root() / "sessions" / directory_name(item.names[0]), fingerprint,
                                   server.sessions),
                          answers=kept, semantic=similar, pinned=index == 0,
                          given_names=item.given, tags=server.model_tags if index == 0 else ())
              for index, (item, fingerprint, kept, similar) in enumerate(zip(planned, fingerprints, answers, semantic))]
    by_name = {item.names[0]: item for item in planned}

    def load(served: ServedModel) -> Engine:
        item = by_name[served.name]
        backend = LlamaBackend(item.model)
        facts = backend.describe()
        log.info("model %s: %s, %.0fM parameters, context %s tokens, %s threads, %s slot(s)", item.path.name,
                 facts["description"], facts["parameters"] / 1e6, facts["n_ctx"], facts["n_threads"],
                 item.model.n_seq_max)
        log.info("tools: %s", "the model's own template lays them out" if backend.template_supports_tools
                 else "described to the model in a message of Reame's (its template has no tools)")
        return new_engine(backend, settings, serving=True).start()

    budget = server.models_ram_bytes or \
        int(autoconfig.probe_host().ram_bytes.value * autoconfig.RAM_SHARE_FOR_MODEL)
    if len(models) > 1:
        log.info("%d models, at most %d loaded at once within %.0f MiB; an idle one stays loaded %s", len(models),
                 server.max_loaded_models, budget / 2**20,
                 "for ever" if server.keep_alive_s < 0 else f"{server.keep_alive_s:g} s")
    pool = ModelPool(models, load, server.max_loaded_models, budget,
                     FOREVER if server.keep_alive_s < 0 else server.keep_alive_s, server.queue_timeout_s)
    return Node(pool, server_settings(settings, planned[0].names[0], planned[0].model.n_seq_max),
                embedder.close if embedder is not None else lambda: None)


def planned_model(settings: Settings, names: list[str], path: Path, chosen: Plan) -> Planned:
    """A model to serve with what autoconfig chose for it, as many slots as it chose."""
    return Planned(names, path, chosen, model_settings(path, settings, chosen, chosen["server.parallel"].value))


def names_of(chosen_name: str, path: Path, entry: catalog.ModelEntry | None, more: tuple[str, ...] = ()) -> list[str]:
    """A model's id (`chosen_name`, else its catalog name, else its file's stem), then every other name a
    request may use for it: `more`, its catalog name, its file's name and stem."""
    names = [chosen_name or (entry.name if entry else path.stem), *more,
             *([entry.name] if entry else []), path.stem, path.name]
    return list(dict.fromkeys(name for name in names if name))


def with_others(settings: Settings, planned: list[Planned]) -> list[Planned]:
    """`planned` and the models server.models names, found (fetched on first use) and planned as if each were
    alone; a model listed twice is one model with every name it was given. ConfigError for a name two
    models claim."""
    for spec in settings.server.models:
        path, entry = resolve_model(spec.source, progress_stream())
        same = next((item for item in planned if item.path.resolve() == path.resolve()), None)
        if same is not None:
            same.names = list(dict.fromkeys([*same.names, *spec.names]))
            same.given = tuple(dict.fromkeys([*same.given, *spec.names]))
            continue
        other = planned_model(settings, names_of(spec.names[0] if spec.names else "", path, entry, spec.names[1:]),
                              path, plan(settings, path, entry))
        other.given = spec.names
        planned.append(other)
    claimed: dict[str, Planned] = {}
    for item in planned:
        for name in item.names:
            owner = claimed.setdefault(name.lower(), item)
            if owner is not item:
                raise ConfigError(f"server.models: the name '{name}' is given to two models ({owner.path} and "
                                  f"{item.path})")
    return planned


def memory_estimate(item: Planned) -> int:
    """What the model takes loaded, estimated before loading it: its file (mapped, read whole by the first
    step), its KV for the planned context, a tenth of its size and OVERHEAD_BYTES for buffers."""
    size = item.path.stat().st_size
    per_token = autoconfig.kv_bytes_per_token(autoconfig.architecture_facts(item.path), item.model.kv_type)
    return int(size * 1.1 + per_token * item.model.n_ctx + OVERHEAD_BYTES)


def file_facts(path: Path, context_length: int) -> ModelFacts:
    """A model's facts from its file, read once per file (its header is stepped over, vocabulary and all)."""
    summary = remembered(path, "model summary", lambda: json.dumps(gguf.model_summary(gguf.read_metadata(path))),
                         parse_summary)
    stat = path.stat()
    return ModelFacts(str(path), stat.st_size, stat.st_mtime, summary["architecture"], summary["quantization"],
                      summary["parameter_size"], summary["context_train"], context_length)


class ModelSummary(TypedDict):
    """gguf.model_summary's keys and types."""

    architecture: str
    quantization: str
    parameter_size: str
    context_train: int


def parse_summary(text: str) -> ModelSummary:
    """A remembered model summary read back, or ValueError."""
    summary = json.loads(text)
    kinds = {"architecture": str, "quantization": str, "parameter_size": str, "context_train": int}
    if not isinstance(summary, dict) or set(summary) != set(kinds) or \
            not all(type(summary[key]) is kind for key, kind in kinds.items()):
        raise ValueError("not a model summary")
    return cast(ModelSummary, summary)


def directory_name(name: str) -> str:
    """A model's name as one safe path component (names come from the config: "a/../b" stays inside)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100]
    return safe if safe.strip(".") else "_" + safe
