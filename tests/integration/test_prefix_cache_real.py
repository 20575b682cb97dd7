"""The prefix cache on the real model: same greedy output, restores across processes and layouts."""

import json

import pytest

from reame.cache import PrefixCache, Snapshot
from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.llama import LlamaBackend

from .conftest import settings_for
from .test_cli_real import reame

GREEDY = SamplingParams(temperature=0, max_tokens=24)
DOCUMENT = ("Reame keeps the KV of every prompt it has seen on disk, so the second request that starts with "
            "the same document only prefills its question. ") * 8


def chat(question: str) -> str:
    return (f"<|im_start|>system\n{DOCUMENT}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def answers(path, prompts, directory=None, **settings):
    """Greedy answers and usages from a fresh backend (a new process, as far as the KV knows)."""
    with LlamaBackend(settings_for(path, **settings)) as backend:
        cache = PrefixCache(backend.kv_fingerprint(), directory) if directory is not None else None
        with Engine(backend, cache=cache) as engine:
            results = [engine.generate(GenerationRequest(prompt, GREEDY)) for prompt in prompts]
    return [r.tokens for r in results], [r.finish.usage for r in results]


def test_greedy_output_is_identical_with_the_cache_off_cold_and_warm(native_libraries, smollm2_path, tmp_path):
    """One slot: with several, where a sequence's cells land in the shared KV buffer changes llama.cpp's
    float sums a little, with or without the cache (see docs/cache.md)."""
    prompts = [chat("What is kept on disk?"), chat("What does the second request prefill?")]
    plain, _ = answers(smollm2_path, prompts, n_seq_max=1)
    cold, cold_usage = answers(smollm2_path, prompts, tmp_path, n_seq_max=1)
    warm, warm_usage = answers(smollm2_path, prompts[::-1], tmp_path, n_seq_max=1)
    assert cold == plain
    assert warm == plain[::-1]
    assert cold_usage[0].cached_tokens == 0
    assert all(usage.cached_tokens > 150 for usage in warm_usage)


def test_a_unified_multi_slot_snapshot_serves_a_one_slot_context_and_back(native_libraries, smollm2_path, tmp_path):
    prompts = [chat("Which layout is this?")]
    parallel, _ = answers(smollm2_path, prompts, tmp_path, n_seq_max=4)
    single, usage = answers(smollm2_path, prompts, tmp_path, n_seq_max=1)
    assert single == parallel
    assert usage[0].cached_tokens == usage[0].prompt_tokens - 1


def test_another_kv_type_never_uses_the_snapshot(native_libraries, smollm2_path, tmp_path):
    prompts = [chat("Which KV type?")]
    answers(smollm2_path, prompts, tmp_path, kv_type="f16")
    _, usage = answers(smollm2_path, prompts, tmp_path, kv_type="q8_0")
    assert usage[0].cached_tokens == 0


def test_a_state_from_another_layout_is_refused_not_restored(native_libraries, smollm2_path):
    with LlamaBackend(settings_for(smollm2_path, n_seq_max=2, kv_unified=False)) as split:
        tokens = split.tokenize(DOCUMENT)
        split.decode(tokens, list(range(len(tokens))), [1] * len(tokens), [False] * len(tokens))
        blob = split.seq_state_get(1)
    with LlamaBackend(settings_for(smollm2_path, n_seq_max=1)) as single:
        assert single.seq_state_set(0, blob) is False
        assert single.seq_pos_max(0) == -1
        # The engine turns that into a full prefill with the right answer.
        cache = PrefixCache(single.kv_fingerprint())
        cache.offer(Snapshot(tuple(single.tokenize(chat("x"))), blob))
        with Engine(single, cache=cache) as engine:
            result = engine.generate(GenerationRequest(chat("x"), GREEDY))
        assert result.finish.usage.cached_tokens == 0 and cache.stats()["restore_failed"] == 1


def test_a_second_process_restores_what_the_first_wrote(native_libraries, smollm2_path, tmp_path):
    # The second run computes (no kept answer to print): what it reuses is the first one's prefix.
    env = {"REAME_CACHE_DIR": str(tmp_path), "REAME_CACHE_ANSWERS": "0"}
    question = f"{DOCUMENT}\nIn one sentence, what does Reame keep on disk?"
    args = ("run", str(smollm2_path), question, "--temp", "0", "--max-tokens", "20", "--threads", "2")
    first = reame(*args, env=env)
    second = reame(*args, env=env)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert second.stdout == first.stdout
    assert "from cache" not in first.stderr and "from cache)" in second.stderr
    assert list(tmp_path.glob("*.kvs"))


def test_reame_warm_prefills_a_file_that_a_later_chat_reuses(native_libraries, smollm2_path, tmp_path):
    document = tmp_path / "manual.txt"
    document.write_text(DOCUMENT)
    env = {"REAME_CACHE_DIR": str(tmp_path / "kv")}
    warmed = reame("warm", str(smollm2_path), str(document), "--json", env=env)
    assert warmed.returncode == 0, warmed.stderr
    line = json.loads(warmed.stdout)
    assert line["file"] == str(document) and line["tokens"] > 150 and line["cached_tokens"] == 0
    asked = reame("run", str(smollm2_path), "What is kept?", "--system", DOCUMENT, "--temp", "0", "--max-tokens",
                  "8", env=env)
    assert asked.returncode == 0, asked.stderr
    assert f"({line['tokens']} from cache)" in asked.stderr


@pytest.mark.parametrize("bad", ["missing.txt", "empty.txt"])
def test_reame_warm_refuses_unreadable_files_before_loading_the_model(tmp_path, bad):
    (tmp_path / "empty.txt").write_text("  \n")
    result = reame("warm", "no-such-model.gguf", str(tmp_path / bad), env={"REAME_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2 and "reame: error:" in result.stderr and bad in result.stderr
