"""llama-server's cache reuse (`n_cache_reuse`), on FakeBackend (whose output depends only on the tokens a
sequence holds, so a moved run gives exactly a cold prefill's answer): the runs chosen as llama-server
chooses them, moved in the model's memory, the ledger and the counters in step, and nothing moved where it
must not be (a warm-up, cells another sequence shares, a request that does not ask)."""

from reame.cache import common_prefix
from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.engine.admission import reuse_runs
from reame.engine.kv import KvCells
from tests.fakes.backend import FakeBackend
from tests.waiting import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=4)
RING = "".join(f"chunk {i}: the ring of extra context the plugin sends first.\n" for i in range(4))
LINES = [f"line {i:03d} = compute(line {i - 1:03d}) + {i}\n" for i in range(60)]


def window(first: int, last: int, middle: str = "") -> str:
    """An editor's prompt: the ring, then the lines in the window, then what is typed on the cursor's line."""
    return RING + "".join(LINES[first:last]) + middle


def cold(prompt: str) -> list[int]:
    with Engine(FakeBackend(n_ctx=4096)) as engine:
        return engine.generate(GenerationRequest(prompt, GREEDY)).tokens


def idle(engine: Engine) -> None:
    wait_until(lambda: engine.status.running == 0 and engine.status.waiting == 0, what="the engine to be idle")


def test_runs_are_the_common_prefix_then_each_long_enough_match_moved_down():
    held = [1, 2, 3, 10, 11, 4, 5, 6, 7, 8, 20, 21, 9, 9]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 30]
    assert reuse_runs(held, prompt, 3) == [(0, 0, 3), (5, 3, 5)]  # [9, 9] is shorter than 3
    assert reuse_runs(held, prompt, 2) == [(0, 0, 3), (5, 3, 5), (12, 8, 2)]
    assert reuse_runs(held, prompt, 6) == []  # nothing moves: the common prefix is the slot's own business
    assert reuse_runs(held, prompt, 0) == []


def test_the_last_prompt_token_is_never_covered_and_a_new_token_ends_the_scan():
    held = [1, 2, 5, 6, 7, 8]
    assert reuse_runs(held, [1, 2, 6, 7, 8], 2) == [(0, 0, 2), (3, 2, 2)]  # 8, the last, is decoded
    # 99 was not held: keys moved past it would come before computed ones, so nothing after it moves.
    assert reuse_runs(held, [1, 2, 6, 7, 99, 8, 0], 2) == [(0, 0, 2), (3, 2, 2)]
    assert reuse_runs([], [1, 2, 3], 1) == []


def test_a_window_moving_down_a_file_moves_its_lines_and_answers_as_a_cold_prefill():
    backend = FakeBackend(n_ctx=4096)
    with Engine(backend) as engine:
        engine.generate(GenerationRequest(window(0, 40), GREEDY, cache_reuse=16))
        decoded = sum(len(call) for call in backend.decode_calls)
        moved = GenerationRequest(window(3, 41), GREEDY, cache_reuse=16)
        result = engine.generate(moved)
        computed = sum(len(call) for call in backend.decode_calls) - decoded
        assert result.tokens == cold(window(3, 41))
        assert len(backend.reuses) == 1
        common, shifted = backend.reuses[0]
        before, after = backend.tokenize(window(0, 40)), backend.tokenize(window(3, 41))
        assert common == (0, 0, common_prefix(before, after))
        # Lines 3..39 moved down by the three lines that left the window…
        assert shifted[1] == common[2] and shifted[0] - shifted[1] == len("".join(LINES[0:3]))
        assert shifted[2] == len("".join(LINES[3:40])) - (common[2] - len(backend.tokenize(RING)))
        # …and only the new line (and the answer) was computed.
        assert result.finish.usage.cached_tokens == common[2] + shifted[2]
        assert computed == len(after) - common[2] - shifted[2] + len(result.tokens) - 1
        idle(engine)
        assert engine.status.kv.tokens_moved == shifted[2]
        assert engine.status.kv.cells_used == backend.cells_in_use()


def test_without_cache_reuse_or_for_a_warm_up_nothing_moves():
    backend = FakeBackend(n_ctx=4096)
    with Engine(backend) as engine:
        engine.generate(GenerationRequest(window(0, 40), GREEDY))
        assert engine.generate(GenerationRequest(window(3, 41), GREEDY)).tokens == cold(window(3, 41))
        engine.generate(GenerationRequest(window(6, 44), warm=True, cache_reuse=16))
        assert backend.reuses == []


def test_cells_another_sequence_shares_are_never_moved():
    backend = FakeBackend(n_ctx=4096, n_seq_max=2)
    kv = KvCells(backend)
    kv.decode(list(range(20)), list(range(20)), [0] * 20, [False] * 20)
    kv.copy(0, 1, 20)
    assert kv.exclusive(0) == 0 < kv.length(0)  # what the engine checks before a move
    kv.remove(1)
    assert kv.exclusive(0) == kv.length(0) == 20
    kv.reuse(0, [(0, 0, 5), (8, 5, 10)])
    assert kv.length(0) == 15 and kv.used() == 15 == backend.cells_in_use()
    assert backend.seq_pos_max(0) == 14
