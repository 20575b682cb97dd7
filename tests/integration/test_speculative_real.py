"""Speculative decoding on the real model: the same greedy answer, with drafts accepted."""

from reame.assembly import exact_rows_probe
from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.batch_numerics import exact_batch_rows
from reame.model.llama import LlamaBackend
from reame.speculative import CostModel, PromptLookup, Speculation
from reame.speculative.draft_model import CATCH_UP_TOKENS, DraftModel

from .conftest import settings_for
from .test_cli_real import reame

REWRITE = ("Rewrite the following code, renaming the variable `total` to `sum_of_values` everywhere, "
           """and change nothing else:

def average(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        return 0
    return total / count
""")


def answer(path, speculation, n_seq_max=1, prompts=(REWRITE,), rowwise=True, **settings):
    """Greedy answers to `prompts`, all at once; `speculation` may be a function of the backend. `rowwise`:
    generating steps beside a greedy sequence computed row by row, as Reame's engines make them by default."""
    with LlamaBackend(settings_for(path, n_seq_max=n_seq_max, **settings)) as backend:
        if callable(speculation):
            speculation = speculation(backend)
        engine = Engine(backend, speculation=speculation, rowwise=rowwise)
        chats = [backend.apply_chat_template([{"role": "user", "content": text}]) for text in prompts]
        handles = [engine.submit(GenerationRequest(chat, SamplingParams(temperature=0, max_tokens=100)))
                   for chat in chats]
        with engine:
            return [handle.result(timeout_s=300) for handle in handles]


class FreeDrafts(CostModel):
    """Tells the controller drafts cost nothing, so every lookup hit is verified: the most exposure. A step
    "costs" an hour, so that a draft model's real drafting time weighs nothing beside it either: its catch-up
    with the prompt is charged to its first drafts, and in a CI run on a slow 2-core machine (the target's
    109-token prompt took 0.94 s) that against a 1-second step kept it from drafting in a 19-token answer."""

    def measured(self, n_tokens):
        return True

    def curve(self, first, last, optimistic=False):
        return [3600.0] * (last - first + 1)


def test_greedy_answer_is_identical_with_prompt_lookup_and_drafts_are_accepted(native_libraries, smollm2_path):
    (plain,) = answer(smollm2_path, None)
    speculation = Speculation(PromptLookup(), max_draft=8, cost=FreeDrafts())
    (fast,) = answer(smollm2_path, speculation)
    assert fast.tokens == plain.tokens
    assert fast.finish.usage.draft_tokens > 20 and fast.finish.usage.accepted_draft_tokens > 5
    assert speculation.stats.snapshot().steps_speculative > 0


def test_sampled_speculation_runs_beside_other_sequences(native_libraries, smollm2_path):
    prompts = (REWRITE, "Write a haiku about the sea.", REWRITE.replace("total", "acc"))
    results = answer(smollm2_path, Speculation(PromptLookup(), max_draft=8), n_seq_max=3, prompts=prompts)
    assert all(r.finish.reason in ("stop", "length") and r.text.strip() for r in results)
    assert "def average" in results[0].text


def test_greedy_answer_is_identical_with_a_draft_model_that_drafts_for_it(native_libraries, smollm2_path):
    """SmolLM2 drafting for itself: every greedy draft should pass, and the answer must not change."""
    (plain,) = answer(smollm2_path, None)
    sources = {}

    def with_draft_model(target):
        draft = LlamaBackend(settings_for(smollm2_path, n_seq_max=1, n_batch=CATCH_UP_TOKENS,
                                          n_ubatch=CATCH_UP_TOKENS))
        sources["draft"] = DraftModel(draft, target, smollm2_path.name)
        return Speculation(sources["draft"], max_draft=6, cost=FreeDrafts())
    (fast,) = answer(smollm2_path, with_draft_model)
    assert fast.tokens == plain.tokens
    usage = fast.finish.usage
    assert usage.draft_tokens > 10 and usage.accepted_draft_tokens >= 0.9 * usage.draft_tokens
    assert sources["draft"].backend._ctx is None, "the engine closed the draft model with itself"


def test_the_cli_reports_accepted_drafts(native_libraries, smollm2_path):
    """Greedy drafts change nothing by default; `speculative.exact = false` drafts at any batch size and says so."""
    run = ("run", str(smollm2_path), "-", "--temp", "0", "--max-tokens", "80")
    computed = {"REAME_CACHE_ANSWERS": "0"}  # each run decodes; none is answered from the exact answer cache
    off = reame(*run, stdin=REWRITE, env={**computed, "REAME_SPECULATIVE_ENABLED": "0"})
    assert off.returncode == 0, off.stderr
    assert "drafts accepted" not in off.stderr
    exact = reame(*run, stdin=REWRITE, env=computed)
    assert exact.returncode == 0, exact.stderr
    assert exact.stdout == off.stdout and "decode each row exactly as one row alone" in exact.stderr
    unlimited = reame(*run, stdin=REWRITE, env={**computed, "REAME_SPECULATIVE_EXACT": "0"})
    assert unlimited.returncode == 0, unlimited.stderr
    assert "drafts accepted" in unlimited.stderr and "tokens per step)" in unlimited.stderr
    drafted = reame(*run, "--draft-model", str(smollm2_path), stdin=REWRITE, env=computed)
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == off.stdout and f"drafting with {smollm2_path.name}" in drafted.stderr


def test_the_cli_refuses_a_draft_model_it_cannot_use(native_libraries, smollm2_path, tmp_path):
    missing = reame("run", str(smollm2_path), "hi", "--draft-model", str(tmp_path / "none.gguf"))
    assert missing.returncode != 0 and "none.gguf" in missing.stderr and "Traceback" not in missing.stderr


def test_the_palimpsest_drafts_a_repeated_answer_after_a_restart_and_changes_nothing(native_libraries, smollm2_path,
                                                                                      tmp_path):
    from reame.speculative.palimpsest import Palimpsest, vocabulary_hash

    def archive(backend):
        source = Palimpsest(tmp_path, vocabulary_hash(backend.token_piece, backend.n_vocab), 1 << 20)
        assert source.loaded.wait(60)
        return Speculation(source, max_draft=16, cost=FreeDrafts())
    prompts = ("Write a haiku about the sea.",)
    (plain,) = answer(smollm2_path, None, prompts=prompts)
    (first,) = answer(smollm2_path, archive, prompts=prompts)
    (again,) = answer(smollm2_path, archive, prompts=prompts)  # a new backend and archive reader: a restart
    assert plain.tokens == first.tokens == again.tokens
    assert again.finish.usage.accepted_draft_tokens >= len(again.tokens) * 0.8
    assert list(tmp_path.glob("*.palimpsest"))


STORY = "Write a short story about a lighthouse keeper who finds a cat. " * 2
LONG_REWRITE = REWRITE + "\nKeep this note above the function: " + "the average of no values is zero; " * 30


def measured_answers(path, prompts, **settings):
    """Greedy answers, one engine per prompt, with speculation (every lookup hit weighed as free) kept within the
    batch sizes measured exact for these settings; and those sizes."""
    speculations = []

    def measured(backend):
        speculations.append(Speculation(PromptLookup(), max_draft=8, cost=FreeDrafts(),
                                        measure_exact_rows=exact_rows_probe(backend, 9)))
        return speculations[-1]
    results = [answer(path, measured, prompts=(prompt,), **settings)[0] for prompt in prompts]
    return results, [speculation.exact_rows for speculation in speculations]


def test_greedy_answers_stay_identical_where_batched_kernels_round_differently(native_libraries, model_path):
    """Qwen2.5-Coder-0.5B Q4_K_M with a q8_0 KV: on x86 its repacked Q4_K rows differ from one-row decode in
    batches of 4 or more, and verifying the story's drafts in such batches changed its answer here. Measured
    and kept within the exact size, drafts change nothing."""
    path = model_path("qwen2.5-coder-0.5b")
    prompts = (REWRITE, STORY)
    plain = [answer(path, None, prompts=(prompt,), kv_type="q8_0")[0] for prompt in prompts]
    fast, exact_rows = measured_answers(path, prompts, kv_type="q8_0")
    assert [r.text for r in fast] == [r.text for r in plain]
    assert all(r.finish.usage.accepted_draft_tokens > 5 for r in fast)
    assert all(1 <= rows <= 9 for rows in exact_rows)


def test_past_256_cells_of_an_f16_kv_only_rows_computed_alone_are_exact(native_libraries, smollm2_path):
    """At the pin, flash attention over an f16 KV takes a split-KV path for a lone row once the KV view
    reaches 512 cells, which no batch of 2 rows takes, so with ggml's batched kernels no batch is exact
    there. Computed row by row (Reame's patch, Backend.decode's `rowwise`) every batch is, and a long
    greedy answer drafts and decodes exactly as without speculation."""
    with LlamaBackend(settings_for(smollm2_path)) as backend:
        assert backend.supports_rowwise
        assert exact_batch_rows(backend, 9) == 1
        assert exact_batch_rows(backend, 9, rowwise=True) == 9
    (plain,) = answer(smollm2_path, None, prompts=(LONG_REWRITE,))
    (fast,), exact_rows = measured_answers(smollm2_path, (LONG_REWRITE,))
    assert exact_rows == [9]
    assert fast.text == plain.text and fast.finish.usage.accepted_draft_tokens > 5
