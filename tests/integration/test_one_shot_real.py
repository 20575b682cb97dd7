"""A one-shot prompt on the real model: its context sized to its prompt and max_tokens changes no answer, and
--print-config says which context it gets; a repeated prompt is answered from the cache."""

import re

from tests.integration.test_cli_real import reame

PROMPTS = ["Write a haiku about the sea.", "List the planets of the solar system, one per line.",
           "def fibonacci(n):"]


def test_a_sized_context_gives_the_full_contexts_answer_byte_for_byte(native_libraries, smollm2_path):
    for prompt in PROMPTS:
        args = ("run", str(smollm2_path), prompt, "--temp", "0", "--max-tokens", "96", "-q")
        sized = reame(*args, env={"REAME_CACHE_ANSWERS": "0"})
        full = reame(*args, "--ctx", "8192", env={"REAME_CACHE_ANSWERS": "0"})
        assert sized.returncode == full.returncode == 0, sized.stderr + full.stderr
        assert sized.stdout == full.stdout and len(sized.stdout) > 40, prompt


def test_print_config_says_which_context_a_one_shot_gets_and_why(native_libraries, smollm2_path):
    printed = reame("run", str(smollm2_path), "Hi", "--max-tokens", "300", "--print-config").stdout
    found = re.search(r"^model\.context_length = (\d+)  # a one-shot: its (\d+) prompt tokens \+ max_tokens 300, "
                      r"rounded up to 256 \(serving would get (\d+): .*\)$", printed, re.M)
    assert found, printed
    context, prompt, serving = map(int, found.groups())
    assert context == -(-(prompt + 300) // 256) * 256 == 512 and serving == 8192
    explicit = reame("run", str(smollm2_path), "Hi", "--print-config", "--ctx", "1024").stdout
    assert "model.context_length = 1024  # set explicitly" in explicit


def test_a_repeated_prompt_is_answered_from_the_cache(native_libraries, smollm2_path, tmp_path):
    env = {"REAME_CACHE_ANSWERS_DIR": str(tmp_path / "answers"), "REAME_LOGGING_LEVEL": "debug"}
    args = ("run", str(smollm2_path), "Name three colors.", "--temp", "0", "--max-tokens", "24")
    first, second = reame(*args, env=env), reame(*args, env=env)
    assert first.returncode == second.returncode == 0 and first.stdout == second.stdout
    assert "answered from the exact answer cache" in second.stderr
    assert "answered from the cache, no model loaded" in second.stderr and "model loaded" not in \
        second.stderr.replace("no model loaded", "")
