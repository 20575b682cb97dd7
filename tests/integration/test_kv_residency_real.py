"""The KV residency findings on the real library (SmolLM2-135M): with another document resident, a revisited
document is restored, not prefilled again; on one node, on a second node of a fleet whose KV holds other
work, and with the cells of several slots interleaved. llama.cpp must never log a failed restore."""

import logging
from pathlib import Path

import pytest

from reame.arca.client import StoreAddress, StoreClient
from reame.cache import PrefixCache, common_prefix
from reame.cache.remote import RemoteKV
from reame.engine import Engine, EngineStatus, GenerationRequest, SamplingParams
from reame.model.llama import LlamaBackend
from tests.arca_thread import arca_thread
from tests.integration.conftest import settings_for
from tests.waiting import wait_until

DOCUMENTS = Path(__file__).resolve().parents[2] / "bench" / "data" / "documents"
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
SHORT = SamplingParams(temperature=0, max_tokens=8)
TWELVE = SamplingParams(temperature=0, max_tokens=12)


def text(*names: str, characters: int) -> str:
    """Reference documentation not written for this test, about `characters` long."""
    return "".join((DOCUMENTS / f"{name}.txt").read_text() for name in names)[:characters]


def ask(engine: Engine, document: str, question: str, params: SamplingParams):
    prompt = engine.chat_prompt([{"role": "user", "content": f"{document}\n\n{question}"}])
    return engine.generate(GenerationRequest(prompt, params), timeout_s=600)


def idle_status(engine: Engine) -> EngineStatus:
    wait_until(lambda: engine.status.running == 0, what="the engine to be idle")
    return engine.status


def no_failed_restore(caplog) -> None:
    lines = [record.getMessage() for record in caplog.records if record.name == "reame.llama"]
    assert not [line for line in lines if "failed to" in line or "available cells" in line], lines


def test_one_node_two_documents_in_turn_each_revisit_restored(native_libraries, smollm2_path, tmp_path, caplog):
    """The first finding as written: a 4,096-token context, two ~2,900-token documents, one-token answers."""
    caplog.set_level(logging.ERROR, logger="reame.llama")
    first, second = text("execmodel", "import", characters=12300), text("assignment", "strings", characters=12300)
    with LlamaBackend(settings_for(smollm2_path, n_ctx=4096)) as backend:
        assert min(len(backend.tokenize(first)), len(backend.tokenize(second))) > 2800
        cache = PrefixCache(backend.kv_fingerprint(), tmp_path)
        with Engine(backend, cache=cache) as engine:
            cold = [ask(engine, document, "What is this about?", ONE_TOKEN) for document in (first, second)]
            again = [ask(engine, document, "What is this about?", ONE_TOKEN) for document in (first, second)]
            assert [result.text for result in again] == [result.text for result in cold]
            for before, after in zip(cold, again):
                assert after.finish.usage.cached_tokens == before.finish.usage.prompt_tokens - 1
            assert idle_status(engine).kv.restores == (("snapshot", "restored", 2),)
    assert cache.stats()["restore_failed"] == 0
    no_failed_restore(caplog)


def test_a_second_node_that_served_other_work_restores_a_document_from_the_store(native_libraries, smollm2_path,
                                                                                 tmp_path, caplog):
    """The second finding, smaller: node B first reads another document, then A's, which it fetches."""
    caplog.set_level(logging.ERROR, logger="reame.llama")
    read, other = text("try", "comparisons", characters=5600), text("import", "execmodel", characters=5600)
    with arca_thread(tmp_path / "arca") as port, \
            LlamaBackend(settings_for(smollm2_path, n_ctx=2048)) as backend:
        def node(name: str) -> PrefixCache:
            shared = RemoteKV(lambda: StoreClient(StoreAddress("127.0.0.1", port, "", 0)), backend.kv_fingerprint(),
                              10.0, 256 << 20)
            return PrefixCache(backend.kv_fingerprint(), tmp_path / name, remote=shared)
        with Engine(backend, cache=node("a")) as engine:  # node A: closing it publishes its snapshot
            a_answer = ask(engine, read, "Summarise it.", SHORT)
        backend.clear()
        cache = node("b")
        with Engine(backend, cache=cache) as engine:  # node B: the same library and model, its own caches
            ask(engine, other, "Summarise it.", SHORT)
            resident = idle_status(engine).kv.cells_used
            b_answer = ask(engine, read, "Summarise it.", SHORT)
            assert resident + b_answer.finish.usage.prompt_tokens > backend.n_ctx, "the other document was in the way"
            assert b_answer.text == a_answer.text
            assert b_answer.finish.usage.cached_tokens == b_answer.finish.usage.prompt_tokens - 1
            assert idle_status(engine).kv.restores == (("snapshot", "restored", 1),)
            assert cache.remote_stats()["hits"] == 1
    no_failed_restore(caplog)


@pytest.mark.parametrize("slots", [4, 8])
def test_a_restore_finds_its_cells_among_those_interleaved_slots_gave_up(native_libraries, smollm2_path, tmp_path,
                                                                         caplog, slots):
    """Slots that decoded side by side hold cells interleaved all over the KV; a document restored after they
    give theirs up lands in those scattered cells (llama.cpp places a state cell by cell at this pin)."""
    caplog.set_level(logging.ERROR, logger="reame.llama")
    document = text("try", characters=5000)
    chatty = SamplingParams(temperature=0, max_tokens=1100 // (slots - 1), ignore_eos=True)  # 1,100 cells in all
    with LlamaBackend(settings_for(smollm2_path, n_ctx=2048, n_seq_max=slots)) as backend:
        cache = PrefixCache(backend.kv_fingerprint(), tmp_path)
        with Engine(backend, cache=cache) as engine:
            cold = ask(engine, document, "Which keywords does it name?", SHORT)
            prompts = [engine.chat_prompt([{"role": "user", "content": f"Tell story number {i}."}])
                       for i in range(slots - 1)]
            handles = engine.submit_together([GenerationRequest(prompt, chatty) for prompt in prompts])
            for handle in handles:  # their cells, step by step side by side, interleave over the KV
                handle.result(600)
            assert idle_status(engine).kv.cells_used + cold.finish.usage.prompt_tokens > backend.n_ctx
            again = ask(engine, document, "Which keywords does it name?", SHORT)
            assert again.text == cold.text
            assert again.finish.usage.cached_tokens == cold.finish.usage.prompt_tokens - 1
            assert idle_status(engine).kv.restores == (("snapshot", "restored", 1),)
            assert 0 < engine.status.kv.cells_given_up
    no_failed_restore(caplog)


def test_a_cold_answer_does_not_depend_on_what_the_kv_held_before(native_libraries, smollm2_path, tmp_path):
    """Behind a prefix cache, a request starts on an empty KV (the other idle slots give up theirs): its prompt
    lies on the cells it had the first time, and llama.cpp's attention gives the same greedy answer. These two
    documents, asked in this order without that rule, gave another one (different cells, other rounding)."""
    first, second = text("try", characters=9000), text("comparisons", characters=9000)  # whole files
    question = "Question: Which Python keyword or statement does it discuss most?"
    answers = {}
    for slots, cache in ((1, None), (4, PrefixCache)):
        with LlamaBackend(settings_for(smollm2_path, n_ctx=4096, n_seq_max=slots)) as backend:
            prefix_cache = cache(backend.kv_fingerprint(), tmp_path / str(slots)) if cache else None
            with Engine(backend, cache=prefix_cache) as engine:
                ask(engine, first, "Question: What is this section about? Answer in one sentence.", TWELVE)
                answers[slots] = ask(engine, second, question, TWELVE).text
    assert answers[4] == answers[1]


def test_a_chat_whose_slot_a_background_line_took_restores_its_template_head(native_libraries, smollm2_path,
                                                                              tmp_path):
    """A chat between a batch's lines: each line's start makes the chat's idle slot give up its KV, and the
    template's opening (SmolLM2's system prompt and the start of the user's turn) is too short for the prefix
    cache; it comes back from the resident template heads, cut where the answer stays a whole prefill's."""
    questions = ["What is a CPU?", "Name a prime number.", "Why is the sky blue?"]
    tickets = [f"Ticket {n}: {text('try', characters=400)[n * 40:]}\nClassify this ticket." for n in range(3)]

    def line(engine: Engine, ticket: str):
        prompt = engine.chat_prompt([{"role": "system", "content": "You triage support tickets."},
                                     {"role": "user", "content": ticket}])
        return engine.generate(GenerationRequest(prompt, TWELVE, background=True), timeout_s=600)

    with LlamaBackend(settings_for(smollm2_path, n_ctx=2048)) as backend:
        with Engine(backend, cache=PrefixCache(backend.kv_fingerprint(), tmp_path)) as engine:
            for question, ticket in zip(questions, tickets):
                chat = ask(engine, question, "", TWELVE)
                line(engine, ticket)
            status = idle_status(engine)
        backend.clear()
        with Engine(backend) as engine:  # the same chat on an empty KV, with nothing cached
            cold = ask(engine, questions[-1], "", TWELVE)
            opening = [engine.chat_prompt([{"role": "user", "content": content}])
                       for content in ("", f"{questions[-1]}\n\n")]
        shared = common_prefix(*(backend.tokenize(prompt) for prompt in opening))
    assert chat.finish.usage.cached_tokens == shared // 8 * 8 > 16
    assert chat.text == cold.text
    # The third chat, and the third ticket: its system prompt's start, learned from the two lines before it.
    assert status.kv.restores == (("head", "restored", 2),)
