"""The Conclave and shared prompts on the real model: a clone is the prefill it copies."""

import re

from reame.engine import Engine, GenerationRequest, SamplingParams

from .test_cli_real import reame

QUESTION = "List three colours of the rainbow."


def first_events(backend, count):
    """`count` identical greedy requests submitted together: each one's first token event (with its top
    log-probabilities) and its finish."""
    prompt = backend.apply_chat_template([{"role": "user", "content": QUESTION}])
    params = SamplingParams(temperature=0, max_tokens=6)
    engine = Engine(backend)
    handles = [engine.submit(GenerationRequest(prompt, params, logprobs=5)) for _ in range(count)]
    with engine:
        events = [list(handle.events(timeout_s=120)) for handle in handles]
    return [(trail[0], handle.finish, len(handle.prompt_tokens)) for trail, handle in zip(events, handles)]


def test_a_clone_gives_the_first_token_distribution_of_a_fresh_prefill(backend):
    [(alone, _, _)] = first_events(backend, 1)
    backend.clear()
    together = first_events(backend, 3)
    prompt_length = together[0][2]
    assert [finish.usage.cached_tokens for _, finish, _ in together] == [0, prompt_length, prompt_length]
    for first, _, _ in together:
        assert (first.token, first.logprob, first.top) == (alone.token, alone.logprob, alone.top)


def test_best_of_from_the_command_line(native_libraries, smollm2_path):
    result = reame("run", str(smollm2_path), "What is 12 plus 30? Answer with just the number.", "--best-of", "3",
                   "--temp", "0", "--max-tokens", "24", "--threads", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert re.search(r"^CONCLAVE consensus=[123]/3$", result.stderr, re.MULTILINE), result.stderr
    quiet = reame("run", str(smollm2_path), "Say yes.", "--best-of", "2", "--quiet", "--max-tokens", "8",
                  "--threads", "2")
    assert quiet.returncode == 0 and quiet.stderr.strip().startswith("CONCLAVE consensus="), quiet.stderr
    refused = reame("run", str(smollm2_path), "--best-of", "2")
    assert refused.returncode == 2 and "give a prompt" in refused.stderr
    too_many = reame("run", str(smollm2_path), "hi", "--best-of", "17")
    assert too_many.returncode == 2 and "at most 16" in too_many.stderr
