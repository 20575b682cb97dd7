"""Which model file a command runs, and what autoconfig plans for it on this host: the choices made before
anything of libllama is loaded (so a one-shot answered from the exact answer cache never loads it)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

from reame import autoconfig, catalog, fetch
from reame.errors import ConfigError, ModelFileError
from reame.model.backend import ModelSettings
from reame.settings import Settings

Plan = dict[str, autoconfig.Choice]


def resolve_model(name: str, progress: TextIO | None = None) -> tuple[Path, catalog.ModelEntry | None]:
    """A catalog name (fetched on first use) or an existing file."""
    if not name:
        raise ConfigError("no model given: name one (see `reame list`) or set model.path in the config file")
    entry = catalog.resolve(name)
    if entry is not None:
        return fetch.ensure_model(entry, progress=progress), entry
    path = Path(name).expanduser()
    if path.is_file():
        return path, catalog.by_filename(path.name)
    if path.exists():
        raise ModelFileError(f"model path is not a file: {name}")
    hint = ", ".join(catalog.suggestions(name))
    raise ConfigError(f"unknown model '{name}' and no such file (relative paths start from the working "
                      f"directory); catalog names: {hint}")


def plan(settings: Settings, path: Path, entry: catalog.ModelEntry | None) -> Plan:
    """What autoconfig chooses for the settings left at 0/auto, for this host and model (with reasons)."""
    model = settings.model
    return autoconfig.choose(
        path, autoconfig.probe_host(), threads=model.threads, context=model.context_length,
        kv_type=settings.memory.kv_cache_type, batch=model.batch, ubatch=model.ubatch,
        preferred_context=entry.default_ctx if entry else 0, parallel=settings.server.parallel)


def model_settings(path: Path, settings: Settings, chosen: Plan, n_seq: int = 1) -> ModelSettings:
    return ModelSettings(
        str(path), n_ctx=chosen["model.context_length"].value, n_threads=chosen["model.threads"].value,
        n_seq_max=n_seq, n_batch=chosen["model.batch"].value, n_ubatch=chosen["model.ubatch"].value,
        kv_type=chosen["memory.kv_cache_type"].value, use_mmap=settings.memory.use_mmap,
        use_mlock=settings.memory.use_mlock, chat_template=settings.model.chat_template,
        embedding_ctx=settings.embeddings.context_length, embedding_pooling=settings.embeddings.pooling)


def progress_stream() -> TextIO | None:
    """stderr for a download progress bar when it is a terminal and logs are on; else None."""
    quiet = logging.getLogger("reame").level > logging.INFO
    return sys.stderr if sys.stderr.isatty() and not quiet else None
