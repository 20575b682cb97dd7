"""The prefix cache alone and inside the engine, on FakeBackend: exact outputs, less prefill."""

import subprocess
import sys
import threading

import pytest

from reame.cache import PrefixCache, Snapshot
from reame.cache import store
from reame.cache.prefix import block_keys
from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import FakeBackend
from tests.waiting import wait_until

FINGERPRINT = b"m" * 32
GREEDY = SamplingParams(temperature=0, max_tokens=40)
DOCUMENT = "the manual says: " + "every step reads all the weights once. " * 6


def cache(tmp_path=None, **options) -> PrefixCache:
    options.setdefault("block_tokens", 4)
    options.setdefault("min_new_tokens", 8)
    return PrefixCache(FINGERPRINT, tmp_path, **options)


def blob(tokens) -> bytes:
    return bytes(t % 256 for t in tokens) * 10


def test_block_keys_chain_from_the_fingerprint():
    tokens = list(range(10))
    keys = block_keys(FINGERPRINT, tokens, 4)
    assert len(keys) == 2
    assert keys[0] == block_keys(FINGERPRINT, tokens[:4] + [99], 4)[0]
    assert keys[1] != block_keys(FINGERPRINT, [0, 1, 2, 9] + tokens[4:], 4)[1], "a key covers its whole prefix"
    assert keys[0] != block_keys(b"x" * 32, tokens, 4)[0], "the model is part of every key"


def test_lookup_returns_the_snapshot_with_the_longest_shared_prefix():
    prefix_cache = cache()
    short, long = tuple(range(12)), tuple(range(10)) + (50, 51, 52, 53, 54)
    other = tuple(range(6)) + (70,) * 10
    for tokens in (short, long, other):
        assert prefix_cache.offer(Snapshot(tokens, blob(tokens)))
    found = prefix_cache.lookup(list(range(12)) + [80, 81])
    assert found is not None and found.tokens == short
    found = prefix_cache.lookup(list(range(10)) + [50, 51, 99])
    assert found is not None and found.tokens == long
    assert prefix_cache.lookup([5, 4, 3, 2, 1, 0]) is None
    assert prefix_cache.lookup(list(range(12)), better_than=12) is None
    assert prefix_cache.stats()["hits"] == 2 and prefix_cache.stats()["misses"] == 1


def test_a_longer_snapshot_replaces_the_ones_it_covers_and_covered_ones_are_not_stored():
    prefix_cache = cache()
    first = tuple(range(12))
    assert prefix_cache.offer(Snapshot(first, blob(first)))
    longer = first + (40, 41, 42, 43, 44)
    assert prefix_cache.offer(Snapshot(longer, blob(longer)))
    assert prefix_cache.stats()["snapshots"] == 1
    assert not prefix_cache.offer(Snapshot(first[:9], blob(first[:9]))), "a prefix of a stored snapshot"
    assert prefix_cache.lookup(list(first) + [7]).tokens == longer


def test_the_ram_tier_keeps_its_budget_and_without_a_disk_forgets_the_oldest():
    tokens = [tuple(range(start, start + 12)) for start in (0, 100, 200)]
    prefix_cache = cache(ram_budget_bytes=2 * len(blob(tokens[0])))
    for each in tokens:
        prefix_cache.offer(Snapshot(each, blob(each)))
    assert prefix_cache.stats()["ram_bytes"] <= 2 * len(blob(tokens[0]))
    assert prefix_cache.lookup(list(tokens[0]) + [1]) is None
    assert prefix_cache.lookup(list(tokens[2]) + [1]) is not None


def test_a_snapshot_waiting_for_its_disk_write_stays_in_ram_past_the_budget(tmp_path):
    tokens = [tuple(range(start, start + 12)) for start in (0, 100, 200)]
    budget = 2 * len(blob(tokens[0]))
    prefix_cache = cache(tmp_path, ram_budget_bytes=budget)
    engine_idle = threading.Event()  # cleared: the engine decodes, so the writer waits
    prefix_cache.follow(engine_idle)
    for each in tokens:
        prefix_cache.offer(Snapshot(each, blob(each)))
    assert prefix_cache.stats()["ram_bytes"] == 3 * len(blob(tokens[0])) > budget
    assert all(prefix_cache.lookup(list(each) + [1]) is not None for each in tokens), "none lost before its write"
    engine_idle.set()
    wait_until(lambda: len(list(tmp_path.glob("*.kvs"))) == 3 and prefix_cache.stats()["ram_bytes"] <= budget,
               what="the writes, then the RAM tier back within its budget")
    assert all(prefix_cache.lookup(list(each) + [1]) is not None for each in tokens)
    prefix_cache.close()


def test_snapshots_survive_in_the_directory_for_a_new_cache(tmp_path):
    first = cache(tmp_path)
    tokens = tuple(range(20))
    first.offer(Snapshot(tokens, blob(tokens)))
    first.close()
    second = cache(tmp_path)
    found = second.lookup(list(tokens) + [3])
    assert found == Snapshot(tokens, blob(tokens))
    assert second.stats()["bytes_read"] > 0
    assert cache(tmp_path).stats()["snapshots"] == 1


def a_good_and_a_damaged_snapshot(tmp_path):
    """Two snapshot files written by a cache that closed, then one of them damaged: (good, bad tokens, its file)."""
    first = cache(tmp_path, compress=False)
    good, bad = tuple(range(20)), tuple(range(100, 120))
    first.offer(Snapshot(good, blob(good)))
    first.offer(Snapshot(bad, blob(bad)))
    first.close()
    damaged = next(path for path in tmp_path.glob("*.kvs") if bytes(blob(bad)[:40]) in path.read_bytes())
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 1
    damaged.write_bytes(bytes(data))
    return good, bad, damaged


def test_a_new_cache_verifies_its_newest_snapshots_and_forgets_damaged_ones(tmp_path, monkeypatch):
    good, bad, damaged = a_good_and_a_damaged_snapshot(tmp_path)
    second = cache(tmp_path, compress=False)
    assert second.wait_verified(10)
    assert not damaged.exists() and second.stats()["corrupt_dropped"] == 1
    checked = []
    monkeypatch.setattr(store.zlib, "crc32", lambda *args: checked.append(args) or 0)
    assert second.lookup(list(good) + [3]) == Snapshot(good, blob(good)) and checked == []
    assert second.lookup(list(bad) + [3]) is None
    assert cache().wait_verified(0), "without a disk tier there is nothing to verify"


def test_a_one_shots_cache_reads_no_file_at_start_and_checks_the_one_it_restores(tmp_path, monkeypatch):
    """A process that answers one prompt and exits does not read cache.ram_mb of files while it decodes, nor
    wait for that at its close; a damaged file is still caught when it is restored."""
    good, bad, damaged = a_good_and_a_damaged_snapshot(tmp_path)
    checked = []
    crc32 = store.zlib.crc32
    monkeypatch.setattr(store.zlib, "crc32", lambda *args: checked.append(args) or crc32(*args))
    one_shot = cache(tmp_path, compress=False, verify_newest=False)
    assert one_shot.wait_verified(0) and checked == []
    assert one_shot.lookup(list(bad) + [3]) is None and not damaged.exists()
    assert one_shot.lookup(list(good) + [3]) == Snapshot(good, blob(good)) and len(checked) == 2
    one_shot.close()


def test_a_snapshot_written_for_another_fingerprint_is_never_found(tmp_path):
    mine = cache(tmp_path)
    tokens = tuple(range(20))
    mine.offer(Snapshot(tokens, blob(tokens)))
    mine.close()
    theirs = PrefixCache(b"q" * 32, tmp_path, block_tokens=4, min_new_tokens=8)
    assert theirs.lookup(list(tokens) + [1]) is None


def test_a_running_cache_finds_what_another_process_stored(tmp_path):
    running = cache(tmp_path)
    tokens = tuple(range(30, 60))
    script = (f"from pathlib import Path\nfrom reame.cache import PrefixCache, Snapshot\n"
              f"c = PrefixCache({FINGERPRINT!r}, Path({str(tmp_path)!r}), block_tokens=4, min_new_tokens=8)\n"
              f"c.offer(Snapshot({tokens!r}, {blob(tokens)!r}))\nc.close()\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    found = running.lookup(list(tokens) + [1])
    assert found is not None and found.tokens == tokens


# --- inside the engine ------------------------------------------------------------------

def run(prompts, prefix_cache=None, **backend_args):
    backend = FakeBackend(n_ctx=2048, **backend_args)
    with Engine(backend, cache=prefix_cache) as engine:
        results = [engine.generate(GenerationRequest(prompt, GREEDY)) for prompt in prompts]
    return backend, results


def test_output_is_identical_with_and_without_the_cache_and_a_new_engine_restores(tmp_path):
    questions = [DOCUMENT + "question one?", DOCUMENT + "question two, longer?"]
    _, plain = run(questions)
    backend, first = run(questions, cache(tmp_path))
    assert [r.tokens for r in first] == [r.tokens for r in plain]
    fresh_backend, second = run(questions[::-1], cache(tmp_path))
    assert [r.tokens for r in second] == [r.tokens for r in plain][::-1]
    cached = second[0].finish.usage.cached_tokens
    assert cached >= len(FakeBackend().tokenize(DOCUMENT + "question "))
    assert len(fresh_backend.decode_calls[0]) == len(FakeBackend().tokenize(questions[1])) - cached, \
        "only the tail after the restored prefix is prefilled"


def test_an_exact_repeat_in_a_new_engine_decodes_only_the_last_prompt_token(tmp_path):
    prompt = DOCUMENT + "what is read once?"
    _, (first,) = run([prompt], cache(tmp_path))
    backend, (second,) = run([prompt], cache(tmp_path))
    assert second.tokens == first.tokens
    assert len(backend.decode_calls[0]) == 1
    assert second.finish.usage.cached_tokens == len(FakeBackend().tokenize(prompt)) - 1


def test_short_prompts_are_not_snapshotted(tmp_path):
    prefix_cache = cache(tmp_path, min_new_tokens=64)
    run(["short prompt"], prefix_cache)
    assert prefix_cache.stats()["snapshots_stored"] == 0


def test_a_snapshot_the_context_refuses_falls_back_to_prefill_with_the_same_output(tmp_path):
    prompt = DOCUMENT + "and then?"
    _, (expected,) = run([prompt])
    prefix_cache = cache(tmp_path)
    tokens = tuple(FakeBackend().tokenize(prompt))
    prefix_cache.offer(Snapshot(tokens, b"not a state"))
    _, (result,) = run([prompt], prefix_cache)
    assert result.tokens == expected.tokens
    assert result.finish.usage.cached_tokens == 0
    assert prefix_cache.stats()["restore_failed"] == 1


def test_a_cache_of_another_model_is_not_used_by_the_engine(tmp_path):
    prompt = DOCUMENT + "which model?"
    run([prompt], PrefixCache(b"a" * 32, tmp_path, block_tokens=4, min_new_tokens=8))
    _, (result,) = run([prompt], PrefixCache(b"b" * 32, tmp_path, block_tokens=4, min_new_tokens=8))
    assert result.finish.usage.cached_tokens == 0


def test_warm_prefills_without_generating_and_later_requests_restore(tmp_path):
    backend = FakeBackend(n_ctx=2048)
    prefix_cache = cache(tmp_path)
    with Engine(backend, cache=prefix_cache) as engine:
        warmed = engine.generate(GenerationRequest(DOCUMENT, GREEDY, warm=True))
    assert warmed.tokens == [] and warmed.finish.reason == "stop"
    assert prefix_cache.stats()["snapshots_stored"] == 1
    later_backend, (later,) = run([DOCUMENT + "a question"], cache(tmp_path))
    assert later.finish.usage.cached_tokens == len(FakeBackend().tokenize(DOCUMENT))
    _, (plain,) = run([DOCUMENT + "a question"])
    assert later.tokens == plain.tokens


@pytest.mark.parametrize("n_seq_max", [1, 3])
def test_concurrent_requests_with_a_shared_prefix_give_the_same_outputs(tmp_path, n_seq_max):
    prompts = [DOCUMENT + tail for tail in ("one", "two", "three", "four")]
    _, plain = run(prompts)
    backend = FakeBackend(n_ctx=4096, n_seq_max=n_seq_max)
    engine = Engine(backend, cache=cache(tmp_path))
    handles = [engine.submit(GenerationRequest(prompt, GREEDY)) for prompt in prompts]
    with engine:
        results = [handle.result(timeout_s=10) for handle in handles]
    assert [r.tokens for r in results] == [r.tokens for r in plain]
