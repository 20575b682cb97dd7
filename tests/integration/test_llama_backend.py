"""The real libllama through our binding, on SmolLM2-135M-Instruct."""

import threading

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams, TokenEvent
from reame.model.backend import DECODE_INTERRUPTED, DECODE_OK
from reame.model.llama import LlamaBackend
from reame.model.sampling import Step, chain_steps

from tests.waiting import wait_until

from .conftest import settings_for

GREEDY = SamplingParams(temperature=0)
PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def prefill(backend, tokens, seq_id=0) -> int:
    """Decode `tokens` into `seq_id`; return the greedy next token."""
    n = len(tokens)
    assert backend.decode(tokens, list(range(n)), [seq_id] * n, [False] * (n - 1) + [True]) == DECODE_OK
    sampler = backend.new_sampler(chain_steps(GREEDY))
    try:
        return backend.sample(sampler, n - 1)
    finally:
        backend.free_sampler(sampler)


def greedy_continue(backend, seq_ids, first_token, position, steps=16) -> dict[int, list[int]]:
    """From `first_token` at `position`, continue every sequence greedily, all in one batch per step."""
    samplers = {seq: backend.new_sampler(chain_steps(GREEDY)) for seq in seq_ids}
    out = {seq: [first_token] for seq in seq_ids}
    try:
        for step in range(steps):
            n = len(seq_ids)
            assert backend.decode([out[s][-1] for s in seq_ids], [position + step] * n, list(seq_ids),
                                  [True] * n) == DECODE_OK
            for index, seq in enumerate(seq_ids):
                out[seq].append(backend.sample(samplers[seq], index))
    finally:
        for sampler in samplers.values():
            backend.free_sampler(sampler)
    return out


@pytest.mark.parametrize("text", ["Hello, world!", "  leading spaces and\ttabs\n", "café 🙂 naïve — ünïcödé",
                                  "def f(x):\n    return x * 2\n"])
def test_tokenize_detokenize_round_trip(backend, text):
    tokens = backend.tokenize(text, add_special=False)
    assert tokens and backend.detokenize(tokens) == text
    assert b"".join(backend.token_piece(t) for t in tokens).decode() == text


def test_special_tokens_are_parsed_as_single_ids(backend):
    tokens = backend.tokenize("<|im_start|>user", add_special=False)
    assert len(tokens) == 2 and backend.token_piece(tokens[0]) == b""


def test_chat_template_is_the_models_own(backend):
    text = backend.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_end_of_turn_is_an_end_of_generation_token(backend):
    im_end = backend.tokenize("<|im_end|>", add_special=False)[0]
    assert backend.is_eog(im_end) and im_end in backend.eog_tokens()
    assert not backend.is_eog(backend.tokenize("hello", add_special=False)[0])


def test_greedy_generation_is_deterministic_run_to_run(backend):
    with Engine(backend) as engine:
        first = engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=24)))
        second = engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=24)))
    assert first.tokens == second.tokens and first.text.strip()


def test_seeded_sampling_is_reproducible(backend):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234)
    with Engine(backend) as engine:
        runs = [engine.generate(GenerationRequest(PROMPT, params)).tokens for _ in range(2)]
    assert runs[0] == runs[1]


def test_cloned_sequences_continue_identically_to_each_other_and_to_the_original(backend):
    tokens = backend.tokenize(PROMPT)
    first = prefill(backend, tokens, 0)
    reference = greedy_continue(backend, [0], first, len(tokens))[0]

    backend.clear()
    assert prefill(backend, tokens, 0) == first
    for clone in (1, 2, 3):
        backend.seq_cp(0, clone)
    assert greedy_continue(backend, [1], first, len(tokens))[1] == reference
    together = greedy_continue(backend, [0, 2, 3], first, len(tokens))
    assert together[0] == together[2] == together[3]


def test_state_restored_into_a_fresh_context_continues_identically(backend, smollm2_path):
    tokens = backend.tokenize(PROMPT)
    first = prefill(backend, tokens, 0)
    blob = backend.seq_state_get(0)
    assert blob
    reference = greedy_continue(backend, [0], first, len(tokens))[0]

    with LlamaBackend(settings_for(smollm2_path)) as fresh:
        assert fresh.seq_state_set(2, blob)
        assert fresh.seq_pos_max(2) == len(tokens) - 1
        restored = greedy_continue(fresh, [2], first, len(tokens))[2]
    assert restored == reference


def test_state_blob_into_a_different_kv_layout_is_refused_not_garbage(backend, smollm2_path):
    prefill(backend, backend.tokenize(PROMPT), 0)
    blob = backend.seq_state_get(0)
    with LlamaBackend(settings_for(smollm2_path, kv_type="q8_0")) as other:
        assert not other.seq_state_set(0, blob)
        assert other.seq_pos_max(0) == -1
    assert not backend.seq_state_set(1, blob[: len(blob) // 2])


def test_copies_of_one_prompt_in_one_batch_give_identical_greedy_outputs(backend):
    with Engine(backend) as engine:
        handles = [engine.submit(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=20)))
                   for _ in range(4)]
        outputs = [handle.result(timeout_s=120).tokens for handle in handles]
    assert all(output == outputs[0] for output in outputs)


def test_stop_string_ends_real_generation_without_leaking(backend):
    with Engine(backend) as engine:
        free = engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=30)))
        words = free.text.split()
        assert len(words) > 3
        stop = words[2]
        stopped = engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=30,
                                                                           stop=(stop,))))
    assert stopped.finish.reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)


def test_cancel_frees_the_sequence_kv(backend):
    with Engine(backend) as engine:
        handle = engine.submit(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=500,
                                                                        ignore_eos=True)))
        events = handle.events(timeout_s=60)
        assert isinstance(next(events), TokenEvent)
        handle.cancel()
        for _ in events:
            pass
    assert handle.finish.reason == "cancelled"
    assert all(backend.seq_pos_max(seq) == -1 for seq in range(4))


def test_ignore_eos_runs_to_max_tokens(backend):
    with Engine(backend) as engine:
        result = engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=64,
                                                                          ignore_eos=True)))
    assert len(result.tokens) == 64 and result.finish.reason == "length"


def test_a_top_k_chain_inside_the_graph_finds_the_best_logits(backend, smollm2_path):
    """What the draft model relies on: its candidates come out of the graph, no logits copied."""
    tokens = backend.tokenize(PROMPT)
    batch = (tokens, list(range(len(tokens))), [0] * len(tokens), [False] * (len(tokens) - 1) + [True])
    backend.seq_rm(0)
    assert backend.decode(*batch) == DECODE_OK
    logits = backend.logits(len(tokens) - 1)
    expected = sorted(range(len(logits)), key=lambda token: -logits[token])[:10]
    with LlamaBackend(settings_for(smollm2_path)) as graph_backend:
        graph_backend.new_sampler([Step("top_k", (10,))], 0)
        assert graph_backend.decode(*batch) == DECODE_OK
        found = graph_backend.top_tokens(len(tokens) - 1, 10)
    assert [token for token, _ in found] == expected
    assert [value for _, value in found] == pytest.approx([logits[token] for token in expected], rel=1e-4)


def test_four_concurrent_requests_complete_and_repeat_run_to_run(backend):
    prompts = [f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n" for question in
               ("Name a colour.", "What is 2 + 2?", "Say hello in French.", "Name a planet.")]

    def run_all() -> list[str]:
        backend.clear()
        engine = Engine(backend)
        handles = [engine.submit(GenerationRequest(p, SamplingParams(temperature=0, max_tokens=16))) for p in prompts]
        engine.start()  # the same arrival pattern each time: all four queued before the first step
        try:
            return [handle.result(timeout_s=120).text for handle in handles]
        finally:
            engine.close()

    first, second = run_all(), run_all()
    assert first == second
    assert all(text.strip() for text in first)
    assert len(set(first)) > 1  # four different prompts, not one answer copied


def test_a_repeated_prompt_reuses_the_slot_kv_on_the_real_model(backend):
    with Engine(backend) as engine:
        first = engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=12)))
        second = engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=12)))
    assert second.finish.usage.cached_tokens == first.finish.usage.prompt_tokens - 1
    # Token-for-token equality is asserted on FakeBackend: here the last prompt token is decoded
    # alone instead of inside the prompt's batch, and llama.cpp's kernels are not batch-invariant.
    assert second.text.strip()


def test_embeddings_pool_alone_as_in_a_batch_and_leave_the_generation_kv_alone(backend):
    from reame.engine.embeddings import unit_length
    texts = ["The cat sat on the mat.", "A cat is sitting on a rug.", "Stock markets fell sharply today."]
    tokens = [backend.tokenize(text) for text in texts]
    prompt = backend.tokenize("Once upon a time")
    backend.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
    held = backend.seq_pos_max(0)
    batched = [unit_length(vector) for vector in backend.embed(tokens)]
    alone = unit_length(backend.embed([tokens[1]])[0])
    assert backend.seq_pos_max(0) == held  # the generation context's KV is untouched
    assert len(batched[0]) == backend.n_embd and backend.embedding_pooling == "mean"
    cosine = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert cosine(batched[1], alone) > 0.9999
    assert cosine(batched[0], batched[1]) > cosine(batched[0], batched[2])


def test_an_interrupted_decode_keeps_nothing_of_its_batch_and_the_sequence_continues_as_if_never_run(backend):
    tokens = backend.tokenize(PROMPT)
    first = prefill(backend, tokens, 0)
    reference = greedy_continue(backend, [0], first, len(tokens))[0]
    backend.clear()
    head, rest = tokens[:8], tokens[8:]
    assert backend.decode(head, list(range(8)), [0] * 8, [False] * 8) == DECODE_OK
    backend.interrupt(True)
    try:
        assert backend.decode(rest, list(range(8, len(tokens))), [0] * len(rest),
                              [False] * (len(rest) - 1) + [True]) == DECODE_INTERRUPTED
    finally:
        backend.interrupt(False)
    assert backend.seq_pos_max(0) == 7  # the head stays, nothing of the stopped batch does
    assert backend.decode(rest, list(range(8, len(tokens))), [0] * len(rest),
                          [False] * (len(rest) - 1) + [True]) == DECODE_OK
    sampler = backend.new_sampler(chain_steps(GREEDY))
    try:
        assert backend.sample(sampler, len(rest) - 1) == first
    finally:
        backend.free_sampler(sampler)
    assert greedy_continue(backend, [0], first, len(tokens))[0] == reference


def test_a_decode_stopped_from_another_thread_between_micro_batches_keeps_none_of_them(smollm2_path):
    """n_ubatch 32: llama.cpp drops only the micro-batch it stopped in; the binding drops the earlier ones."""
    with LlamaBackend(settings_for(smollm2_path, n_ubatch=32)) as small_steps:
        tokens = (small_steps.tokenize(PROMPT) * 20)[:480]
        outcomes = set()
        for _ in range(3):
            small_steps.clear()
            stopper = threading.Thread(target=small_steps.interrupt, args=(True,))
            stopper.start()
            status = small_steps.decode(tokens, list(range(480)), [1] * 480, [False] * 479 + [True])
            stopper.join()
            small_steps.interrupt(False)
            outcomes.add(status)
            assert small_steps.seq_pos_max(1) == (479 if status == DECODE_OK else -1)
        assert outcomes <= {DECODE_OK, DECODE_INTERRUPTED}


def test_a_chat_during_a_batch_lines_long_prompt_interrupts_it_and_both_answer_as_alone(smollm2_path):
    """The chat asks for its first token only, so the line then runs alone again: its prompt resumes from a
    step boundary and splits into the same batches as alone. Each sequence has a KV stream of its own: in one
    unified stream the chat's cells would lie between the line's, and attention summed over cells in another
    order can flip a close greedy pick whether or not a decode was stopped (model/batch_numerics.py)."""
    line = "<|im_start|>system\n" + "Tickets are sorted by urgency and team. " * 150 + \
        "<|im_end|>\n<|im_start|>user\nThe printer is on fire.<|im_end|>\n<|im_start|>assistant\n"
    line_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    chat_params = SamplingParams(temperature=0, max_tokens=1)
    settings = settings_for(smollm2_path, kv_unified=False, n_ctx=4096, n_seq_max=2)
    with Engine(LlamaBackend(settings), owns_backend=True) as engine:
        alone_line = engine.generate(GenerationRequest(line, line_params)).text
        alone_chat = engine.generate(GenerationRequest(PROMPT, chat_params)).text
    settings = settings_for(smollm2_path, kv_unified=False, n_ctx=4096, n_seq_max=2)
    with Engine(LlamaBackend(settings), owns_backend=True) as engine:
        batch_line = engine.submit(GenerationRequest(line, line_params, background=True))
        wait_until(lambda: engine.status.running == 1, what="the line to start")
        chat = engine.submit(GenerationRequest(PROMPT, chat_params))
        assert chat.result(120).text == alone_chat
        assert batch_line.result(120).text == alone_line
        assert engine.status.kv.decodes_interrupted >= 1


def test_a_row_by_row_decode_leaves_the_next_embedding_and_plain_decode_as_they_were(backend):
    """Backend.decode's `rowwise` sets a flag of the decoding thread (Reame's patch to ggml): the embedding
    context and a plain decode on the same thread afterwards must compute as they do without it. Both are
    past the sizes where the kernels differ (a 64-row batch, a lone row after 256 cells)."""
    text = backend.tokenize("The cat sat on the mat and looked at the garden for a long while. " * 8)
    before = backend.embed([text])[0]
    prompt = backend.tokenize("Once upon a time there was a lighthouse keeper who kept a log. " * 24)
    n = len(prompt)
    assert n > 260 and len(text) > 64

    def last_row_logits(rowwise_before):
        backend.seq_rm(0)
        backend.decode(prompt[:-1], list(range(n - 1)), [0] * (n - 1), [False] * (n - 1))
        if rowwise_before:  # a row-by-row step of 4 rows, undone
            backend.decode(prompt[-4:], list(range(n - 1, n + 3)), [0] * 4, [True] * 4, rowwise=True)
            backend.seq_rm(0, n - 1, -1)
        backend.decode(prompt[-1:], [n - 1], [0], [True])
        return backend.logits(0)
    plain = last_row_logits(False)
    assert last_row_logits(True) == plain
    backend.decode(prompt[-4:], list(range(n, n + 4)), [0] * 4, [True] * 4, rowwise=True)  # the flag left on
    assert backend.embed([text])[0] == before
    backend.seq_rm(0)


def test_pooling_none_gives_each_tokens_vector_whose_mean_is_the_mean_pooled_one(native_libraries, model_path):
    import math

    path = model_path("all-minilm-l6-v2")
    texts = ["hello hello hello", "The cat sat on the mat."]
    with LlamaBackend(settings_for(path, n_ctx=512, n_seq_max=1, embedding_pooling="none")) as per_token:
        tokens = [per_token.tokenize(text) for text in texts]
        vectors = per_token.embed(tokens)
        assert not per_token.embeddings_pooled and len(tokens[0]) == 5  # [CLS] 3 words [SEP], as llama-server's test
    with LlamaBackend(settings_for(path, n_ctx=512, n_seq_max=1, embedding_pooling="mean")) as pooled:
        means = pooled.embed(tokens)
    assert len(vectors) == sum(map(len, tokens)) and all(len(vector) == len(means[0]) for vector in vectors)
    assert abs(math.fsum(value * value for value in vectors[0]) - 1) > 1e-3  # as computed, not unit length
    start = 0
    for token_ids, mean in zip(tokens, means):
        rows = vectors[start:start + len(token_ids)]
        start += len(token_ids)
        averaged = [math.fsum(column) / len(rows) for column in zip(*rows)]
        assert averaged == pytest.approx(mean, abs=1e-4)
