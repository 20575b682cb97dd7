"""ResidentHeads, the server's template heads in RAM: what a head is learned as, which one a prompt gets, and
the byte budget (the engine's use of them: tests/unit/test_kv_residency.py)."""

from reame.cache.heads import ResidentHeads
from reame.cache.store import Snapshot

OPENING = list(range(100, 127))  # 27 tokens, as Qwen2.5-Coder's default system prompt makes


def head(tokens, size: int = 10) -> Snapshot:
    return Snapshot(tuple(tokens), b"x" * size)


def test_a_head_is_what_a_prompt_shares_with_a_recent_one_cut_at_a_multiple_of_eight():
    heads = ResidentHeads()
    assert heads.learn(OPENING + [1, 2, 3]) == 0, "the first prompt shares nothing yet"
    assert heads.learn([7] * 40) == 0
    assert heads.learn(OPENING + [4, 5]) == 24
    assert heads.learn(list(range(300))) == 0, "a prompt sharing a few tokens has no head"
    assert heads.learn(list(range(300))) == 64, "a head never exceeds what the prefix cache leaves to it"


def test_only_the_last_sixteen_openings_are_compared():
    heads = ResidentHeads()
    heads.learn(OPENING)
    for n in range(16):
        heads.learn([n] * 20)
    assert heads.learn(OPENING + [9]) == 0


def test_a_prompt_gets_the_longest_head_it_can_restore_whole_leaving_eight_tokens():
    heads = ResidentHeads()
    heads.keep(head(OPENING[:8]))
    heads.keep(head(OPENING[:24]))
    assert heads.find(OPENING + list(range(20))).tokens == tuple(OPENING[:24])
    assert heads.find(OPENING[:30]).tokens == tuple(OPENING[:8]), "24 would leave 6 to prefill"
    assert heads.find(OPENING[:15]) is None
    assert heads.find([5] + OPENING) is None


def test_past_the_budget_the_least_recently_used_head_goes_and_a_refused_one_is_forgotten():
    heads = ResidentHeads(budget_bytes=25)
    first, second, third = (head([n] * 8) for n in (1, 2, 3))
    heads.keep(first)
    heads.keep(second)
    assert heads.find([1] * 20) is first  # used: the second is now the oldest
    heads.keep(third)
    assert (heads.has([1] * 8), heads.has([2] * 8), heads.has([3] * 8)) == (True, False, True)
    assert heads.holds(first) and not heads.holds(head([1] * 8)), "a snapshot of the same tokens is not the head"
    heads.forget(first)
    assert not heads.has([1] * 8)
    heads.keep(head([4] * 8, size=26))
    assert not heads.has([4] * 8), "larger than the whole budget"
