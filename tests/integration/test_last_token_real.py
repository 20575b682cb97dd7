"""A long prompt's first token on the real library: the prompt is prefilled whole, its last token's cell
dropped and that token decoded alone (engine/step.py, plan_step), so the KV before it is what a batch of the
whole prompt computes. That is what llama-server's repeat of a prompt reads (its first request prefilled the
whole prompt; the repeat decodes the last token alone), so the two greedy answers agree; holding the last
token back from the batch instead gives other numbers for some prompt lengths (ggml groups a batch's rows,
and the last rows' group depends on the batch's size)."""

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.llama import LlamaBackend
from reame.model.sampling import log_softmax_of

from .conftest import settings_for

TEXT = ("The committee met on Tuesday to review the budget for the coming year, and after a long discussion "
        "about the costs of the new library, the roads and the school, it agreed to postpone the vote. ") * 3


def first_token_logits(backend: LlamaBackend, tokens: list[int], with_last: bool) -> list[float]:
    """The last token's logits, decoded alone after the others (prefilled with it, its cell then dropped, or
    without it)."""
    n = len(tokens)
    backend.seq_rm(0, 0, -1)
    fed = tokens if with_last else tokens[:-1]
    backend.decode(fed, list(range(len(fed))), [0] * len(fed), [False] * len(fed))
    backend.seq_rm(0, n - 1, -1)
    backend.decode([tokens[-1]], [n - 1], [0], [True])
    return list(backend.logits(0))


def test_a_long_prompts_first_token_reads_the_kv_a_whole_prompt_batch_computed(native_libraries, model_path):
    # A Q4_K_M model: its Q4_K matrices go through ggml's repacked kernels, which group a batch's rows.
    settings = settings_for(model_path("qwen2.5-coder-0.5b"), n_ctx=1024, n_seq_max=1)
    with LlamaBackend(settings) as backend:
        all_tokens = backend.tokenize(TEXT, add_special=True)
        cases = []
        for length in range(70, 78):
            tokens = all_tokens[:length]
            whole = first_token_logits(backend, tokens, with_last=True)
            held_back = first_token_logits(backend, tokens, with_last=False)
            cases.append((tokens, whole, held_back))
    differing = [case for case in cases if case[1] != case[2]]
    assert differing, "no prompt length here where the two ways differ: the test would prove nothing"
    tokens, whole, _ = differing[0]
    with Engine(LlamaBackend(settings)) as engine:
        event = next(iter(engine.submit(GenerationRequest(tokens, SamplingParams(temperature=0, max_tokens=1),
                                                          add_special=False, logprobs=5))))
    expected_token = max(range(len(whole)), key=whole.__getitem__)
    assert event.token == expected_token
    assert (event.logprob, event.top) == log_softmax_of(whole, expected_token, 5)
