"""Template heads on the real library: a prompt whose head is restored at the cut `usable_length` allows gets the
logits of its whole prefill bit for bit, and a one-shot that restores one answers as one that does not."""

import re

import pytest

from reame.cache.heads import usable_length
from reame.cache.store import common_prefix
from reame.model.llama import LlamaBackend
from tests.integration.conftest import settings_for
from tests.integration.test_cli_real import reame

WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches near a "
         "river").split()


def chat_tokens(backend: LlamaBackend, content: str) -> list[int]:
    prompt = backend.apply_chat_template([{"role": "user", "content": content}], add_assistant=True)
    return backend.tokenize(prompt, add_special=True, parse_special=True)


def last_logits(backend: LlamaBackend, tokens: list[int], start: int) -> list[float]:
    """Prefill tokens[start:] in one batch, as the engine prefills a short prompt, after what seq 0 holds."""
    rest = tokens[start:]
    backend.decode(rest, range(start, len(tokens)), [0] * len(rest), [i == len(rest) - 1 for i in range(len(rest))])
    return list(backend.logits(len(rest) - 1))


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_a_head_restored_at_its_usable_cut_gives_the_whole_prefills_logits(native_libraries, model_path, model):
    with LlamaBackend(settings_for(model_path(model), n_ctx=512, n_seq_max=1)) as backend:
        opening = chat_tokens(backend, "")
        checked = 0
        for count in range(1, len(WORDS) + 1):
            tokens = chat_tokens(backend, " ".join(WORDS[:count]))
            cut = usable_length(common_prefix(tokens, opening), len(tokens))
            if not cut:
                continue
            backend.seq_rm(0)
            whole = last_logits(backend, tokens, 0)
            backend.seq_rm(0, cut)  # what a head file holds: the first run's own KV, cut
            head = bytes(backend.seq_state_get(0))
            backend.seq_rm(0)
            assert backend.seq_state_set(0, head)
            assert last_logits(backend, tokens, cut) == whole, (count, cut, len(tokens))
            checked += 1
        assert checked >= len(WORDS) - 2


def test_a_one_shot_restoring_its_head_answers_as_one_that_prefills_it(native_libraries, smollm2_path, tmp_path):
    env = {"REAME_CACHE_ANSWERS": "0", "REAME_CACHE_DIR": str(tmp_path / "kv")}
    for prompt in ("Hi", "Name three colors.", "What is 2+2?"):
        args = ("run", str(smollm2_path), prompt, "--temp", "0", "--max-tokens", "48")
        prefilled = reame(*args, env={**env, "REAME_CACHE_ENABLED": "0"})
        first, restored = reame(*args, env=env), reame(*args, env=env)
        assert prefilled.returncode == first.returncode == restored.returncode == 0, restored.stderr
        assert "from cache" not in prefilled.stderr
        reused = re.search(r"prompt (\d+) tokens \((\d+) from cache\)", restored.stderr)
        assert reused, restored.stderr[-800:]
        assert int(reused[2]) == usable_length(24, int(reused[1])) > 0  # SmolLM2's opening: 24 tokens
        assert prefilled.stdout == first.stdout == restored.stdout and len(restored.stdout) > 4, prompt
    assert len(list((tmp_path / "kv" / "heads").glob("*.kvs"))) == 2  # its first 16 tokens, its first 24
