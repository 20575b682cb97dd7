"""An embedding model loaded beside the served one, for the semantic answer cache.

Small (all-MiniLM-L6-v2: 91 MB, ~12 ms a question on one core here), so it runs in the request's own
thread, one question at a time, with one thread of its own: it never waits for the engine's next step,
and takes little from the decode running beside it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from reame.engine.embeddings import unit_length
from reame.model.backend import ModelSettings
from reame.model.fingerprint import model_content_hash
from reame.model.llama import LlamaBackend

CONTEXT_TOKENS = 512  # BERT-family models are trained on 512 positions
THREADS = 1


class ModelEmbedder:
    def __init__(self, path: Path) -> None:
        self.backend = LlamaBackend(ModelSettings(str(path), n_ctx=CONTEXT_TOKENS, n_threads=THREADS,
                                                  n_batch=CONTEXT_TOKENS, n_ubatch=CONTEXT_TOKENS,
                                                  embedding_ctx=CONTEXT_TOKENS))
        self.identity = f"{path.name}:{model_content_hash(path)}"
        self._lock = threading.Lock()

    def embed(self, text: str) -> list[float]:
        """`text`'s unit-length vector (cut to the model's context)."""
        tokens = self.backend.tokenize(text, add_special=True, parse_special=False)[:CONTEXT_TOKENS]
        with self._lock:
            return unit_length(self.backend.embed([tokens])[0])

    def close(self) -> None:
        with self._lock:
            self.backend.close()
