"""One `reame run --serve` answering for two real models in turn with one loaded at a time: SmolLM2 (the first)
and Qwen2.5-Coder-0.5B (server.models, named "coder") under a RAM budget that holds one, asked through the
`ollama` and `openai` clients; each answers as it does served alone, a swap frees the other's memory, and
Ollama's keep_alive unloads."""

import os
import sys
from pathlib import Path

import ollama
import openai
import pytest

from tests.live_server import live_server

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "Name one colour of the rainbow."}]
GREEDY = {"temperature": 0, "num_predict": 16}


def command(model: Path) -> list[str]:
    return [sys.executable, "-m", "reame", "run", str(model), "--serve", "--port", "0", "--ctx", "2048",
            "--threads", "2"]


def rss_bytes(pid: int) -> int:
    """The server process's resident memory."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


@pytest.fixture(scope="module")
def alone(native_libraries, smollm2_path, model_path):
    """Each model's greedy answer, served alone."""
    answers = {}
    for name, path in (("smollm2-135m", smollm2_path), ("coder", model_path("qwen2.5-coder-0.5b"))):
        with live_server(command(path), env=dict(os.environ, PYTHONPATH=str(ROOT))) as live:
            answers[name] = ollama.Client(host=live.base).chat(model=name, messages=QUESTION,
                                                               options=GREEDY).message.content
    return answers


@pytest.fixture(scope="module")
def two(native_libraries, smollm2_path, model_path, tmp_path_factory):
    coder = model_path("qwen2.5-coder-0.5b")
    # A RAM budget for one model: SmolLM2's ~220 MB or Qwen's ~630 MB (estimated), not both.
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_SERVER_MODELS=f"coder|qwen={coder}",
               REAME_SERVER_MODELS_RAM_MB="700", REAME_CACHE_ANSWERS="false")
    with live_server(command(smollm2_path), env=env) as live:
        yield live


def test_two_models_answer_in_turn_with_one_loaded_at_a_time(two, alone):
    client = ollama.Client(host=two.base)
    assert [model.model for model in client.list().models] == ["smollm2-135m", "coder"]
    assert [model.model for model in client.ps().models] == ["smollm2-135m"]
    small_rss = rss_bytes(two.process.pid)
    parts = list(client.chat(model="coder", messages=QUESTION, options=GREEDY, stream=True))
    assert "".join(part.message.content for part in parts) == alone["coder"]
    assert parts[-1].load_duration > 0 and [model.model for model in client.ps().models] == ["coder"]
    coder_rss = rss_bytes(two.process.pid)
    sdk = openai.OpenAI(base_url=two.base + "/v1", api_key="none", max_retries=0)
    answer = sdk.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=16,
                                         extra_body={"top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1})
    assert answer.model == "smollm2-135m" and answer.choices[0].message.content == alone["smollm2-135m"]
    assert [model.model for model in client.ps().models] == ["smollm2-135m"]
    # Qwen's 491 MB file and its KV left with it: the server is back near SmolLM2's size.
    assert coder_rss - small_rss > 200 << 20 and rss_bytes(two.process.pid) < coder_rss - (200 << 20)
    again = sdk.chat.completions.create(model="qwen", messages=QUESTION, temperature=0, max_tokens=16,
                                        extra_body={"top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1})
    assert again.model == "coder" and again.choices[0].message.content == alone["coder"]


def test_an_unknown_model_is_refused_by_both_clients(two):
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=two.base).chat(model="llama3", messages=QUESTION)
    assert refused.value.status_code == 404 and "llama3" in refused.value.error
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=two.base + "/v1", api_key="none", max_retries=0).chat.completions.create(
            model="gpt-4o", messages=QUESTION, max_tokens=4)


def test_ollamas_keep_alive_zero_unloads_the_model(two):
    client = ollama.Client(host=two.base)
    client.generate(model="coder", prompt="", keep_alive="5m")
    assert [model.model for model in client.ps().models] == ["coder"]
    client.generate(model="coder", prompt="", keep_alive=0)
    assert client.ps().models == []
