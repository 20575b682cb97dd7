"""A one-shot prompt (`reame run MODEL "prompt"`, config mode's --prompt): answered by its text before the model
loads, else by its tokens (a server's answer too), else in a context sized to its prompt and max_tokens."""

import dataclasses
import io
import json
import re

import pytest

from reame import config, oneshot
from reame.answers import AnswerCache, named_key
from reame.cache.heads import HEAD_ALIGN, usable_length
from reame.cache.store import decode
from reame.cache.answers import DiskAnswers
from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.engine.prompt import prompt_tokens
from reame.model.backend import ModelSettings
from reame.oneshot import OneShot, Startup, context_for
from reame.settings import from_values
from tests.fakes.backend import FakeBackend

FINGERPRINT = b"fake-model"
SERVING = ModelSettings("fake.gguf", n_ctx=8192, n_batch=512, n_ubatch=512)


class Parts:
    """oneshot.Answering over FakeBackends, counting what was loaded and made."""

    def __init__(self) -> None:
        self.loads = 0
        self.contexts: list[ModelSettings] = []
        self.decodes = 0

    def answering(self) -> oneshot.Answering:
        def load(model: ModelSettings) -> FakeBackend:
            self.loads += 1
            return FakeBackend(n_ctx=model.n_ctx)

        def open_context(model: ModelSettings, loaded: FakeBackend) -> FakeBackend:
            self.contexts.append(model)
            return FakeBackend(n_ctx=model.n_ctx)

        def new_engine(backend: FakeBackend) -> Engine:
            self.backend = backend
            return Engine(backend)
        return oneshot.Answering(load, open_context, new_engine)


CACHE = {"dir": ""}  # this test's KV cache directory (template heads): never the user's


@pytest.fixture(autouse=True)
def kv_directory(tmp_path):
    CACHE["dir"] = str(tmp_path / "kv")
    return tmp_path / "kv"


def settings_with(**env: str):
    return from_values(config.load(None, env={"REAME_CACHE_DIR": CACHE["dir"], **env}))


def ask(one_shot: OneShot, parts: Parts, answers: AnswerCache | None, settings=None, model=SERVING):
    out, err = io.StringIO(), io.StringIO()
    status = oneshot.answer(one_shot, settings or settings_with(REAME_GENERATION_TEMPERATURE="0",
                                                                  REAME_GENERATION_MAX_TOKENS="12"),
                            model, Startup(0.0), answers, parts.answering(), out, err)
    assert status == 0
    return out.getvalue(), err.getvalue()


@pytest.fixture
def answers(tmp_path):
    return AnswerCache([DiskAnswers(tmp_path / "answers", 1 << 20)], FINGERPRINT)


def test_the_context_holds_the_prompt_and_the_answer_rounded_up_never_more_than_serving():
    assert context_for(31, 1, 8192) == 256
    assert context_for(31, 512, 8192) == 768
    assert context_for(200, 56, 8192) == 256
    assert context_for(200, 57, 8192) == 512
    assert context_for(7000, 2000, 8192) == 8192
    assert context_for(31, None, 8192) == 8192


def test_a_repeated_prompt_is_answered_by_its_text_without_loading_the_model(answers):
    parts = Parts()
    computed_out, computed_err = ask(OneShot("hello there"), parts, answers)
    assert parts.loads == 1 and computed_out.strip()
    tokens, finish = re.search(r"generated (\d+) tokens.* finish (\w+)", computed_err).groups()
    repeated_out, repeated_err = ask(OneShot("hello there"), parts, answers)
    assert parts.loads == 1 and len(parts.contexts) == 1, "neither the model nor a context a second time"
    assert repeated_out == computed_out
    assert repeated_err == f"answered from the exact answer cache: {tokens} tokens, finish {finish}\n"


def test_another_text_system_or_setting_is_another_prompt(answers):
    parts = Parts()
    ask(OneShot("hello there"), parts, answers)
    for other, settings in ((OneShot("hello there!"), None), (OneShot("hello there", system="Be brief."), None),
                            (OneShot("hello there", raw=True), None),
                            (OneShot("hello there"), settings_with(REAME_GENERATION_TEMPERATURE="0",
                                                                   REAME_GENERATION_MAX_TOKENS="11"))):
        loads = parts.loads
        ask(other, parts, answers, settings)
        assert parts.loads == loads + 1, other


def test_a_servers_answer_is_found_by_its_tokens_and_the_prompt_named_for_next_time(answers):
    """A server kept the answer under its token key (the same request through /v1/chat/completions): the
    one-shot loads the vocabulary to tokenize, makes no context, and names the prompt; the next loads nothing."""
    settings = settings_with(REAME_GENERATION_TEMPERATURE="0", REAME_GENERATION_MAX_TOKENS="12")
    vocabulary = FakeBackend()
    prompt = vocabulary.apply_chat_template([{"role": "user", "content": "hello there"}])
    key = answers.key(prompt_tokens(vocabulary, GenerationRequest(prompt, settings.generation)),
                      settings.generation, "chat")
    with Engine(FakeBackend()) as engine:
        finish = engine.generate(GenerationRequest(prompt, settings.generation)).finish
    assert answers.put(key, "the server's answer", finish)
    parts = Parts()
    assert ask(OneShot("hello there"), parts, answers, settings)[0] == "the server's answer\n"
    assert parts.loads == 1 and parts.contexts == []
    assert ask(OneShot("hello there"), parts, answers, settings)[0] == "the server's answer\n"
    assert parts.loads == 1


def test_a_miss_gets_a_context_of_its_prompt_and_max_tokens(answers):
    parts = Parts()
    ask(OneShot("hello there"), parts, answers)
    (made,) = parts.contexts
    prompt = FakeBackend().apply_chat_template([{"role": "user", "content": "hello there"}])
    tokens = len(FakeBackend().tokenize(prompt))
    assert made.n_ctx == context_for(tokens, 12, SERVING.n_ctx) == 256
    assert made.n_batch == made.n_ubatch == 256 and dataclasses.replace(made, n_ctx=8192, n_batch=512,
                                                                       n_ubatch=512) == SERVING


def test_an_explicit_context_and_best_of_keep_the_planned_one():
    parts = Parts()
    ask(OneShot("hello there"), parts, None, settings_with(REAME_GENERATION_TEMPERATURE="0",
                                                           REAME_GENERATION_MAX_TOKENS="12",
                                                           REAME_MODEL_CONTEXT_LENGTH="8192"))
    assert parts.contexts[-1].n_ctx == 8192
    out, err = ask(OneShot("hello there", best_of=3), parts, None)
    assert parts.contexts[-1].n_ctx == 8192 and "CONCLAVE consensus=" in err


def test_an_unseeded_sampled_prompt_is_never_looked_up_nor_kept(answers):
    parts = Parts()
    settings = settings_with(REAME_GENERATION_TEMPERATURE="0.7", REAME_GENERATION_MAX_TOKENS="12")
    settings = dataclasses.replace(settings, generation=dataclasses.replace(settings.generation, seed=None))
    for _ in range(2):
        ask(OneShot("hello there"), parts, answers, settings)
    assert parts.loads == 2


def test_a_prompt_named_by_a_template_that_reads_the_clock_holds_only_that_day(answers):
    named = answers.prompt_key({"prompt": "hi"}, SamplingParams(temperature=0))
    key = answers.key([1, 2, 3], SamplingParams(temperature=0), "chat")
    answers.name_prompt(named, key, dated=True)
    stored = answers.tiers[0].get(named)
    assert named_key(named, stored) == key
    yesterday = json.dumps({**json.loads(stored), "day": "2000-01-01"}).encode()
    assert named_key(named, yesterday) is None
    assert named_key(named, json.dumps({**json.loads(stored), "day": None}).encode()) == key


@pytest.mark.parametrize("value", [b"", b"{}", b"[1]", b'{"named": "x", "key": "reame:answer:ab", "day": null}',
                                   b'{"named": NAMED, "key": "not-an-answer-key", "day": null}', b"\xff" * 64])
def test_a_damaged_or_foreign_name_is_a_miss(value):
    named = b"reame:prompt:" + b"a" * 64
    assert named_key(named, value.replace(b"NAMED", b'"' + named + b'"')) is None


def test_a_head_is_cut_at_a_multiple_of_eight_leaving_eight_tokens_to_prefill():
    assert usable_length(24, 31) == 16
    assert usable_length(24, 40) == 24
    assert usable_length(30, 31) == 16
    assert usable_length(7, 31) == 0
    assert usable_length(24, 15) == 0
    assert usable_length(0, 31) == 0


def heads_in(directory):
    return sorted((directory / "heads").glob("*.kvs")) if (directory / "heads").exists() else []


SYSTEM = "You are terse."  # with it, the fake template's opening is 31 tokens


def test_a_short_chat_prompt_restores_its_templates_opening_from_the_second_run_on(kv_directory):
    parts = Parts()
    first_out, first_err = ask(OneShot("hi", system=SYSTEM), parts, None)
    assert "from cache" not in first_err
    [head] = heads_in(kv_directory)
    kept = decode(head.read_bytes(), parts.backend.kv_fingerprint())
    assert len(kept.tokens) % HEAD_ALIGN == 0 and len(kept.tokens) >= HEAD_ALIGN
    again_out, again_err = ask(OneShot("hi", system=SYSTEM), parts, None)
    assert again_out == first_out
    assert f"({len(kept.tokens)} from cache)" in again_err
    other_out, other_err = ask(OneShot("what now?", system=SYSTEM), parts, None)
    assert f"({len(kept.tokens)} from cache)" in other_err
    assert other_out == ask(OneShot("what now?", system=SYSTEM), parts, None, settings_with(
        REAME_GENERATION_TEMPERATURE="0", REAME_GENERATION_MAX_TOKENS="12", REAME_CACHE_ENABLED="0"))[0]
    assert heads_in(kv_directory) == [head]


def test_a_damaged_or_planted_head_is_removed_and_written_again(kv_directory):
    parts = Parts()
    clean_out, _ = ask(OneShot("hi", system=SYSTEM), parts, None)
    [head] = heads_in(kv_directory)
    good = head.read_bytes()
    for planted in (b"", b"junk" * 100, good[:-1] + bytes([good[-1] ^ 1]), good[:len(good) // 2]):
        head.write_bytes(planted)
        out, err = ask(OneShot("hi", system=SYSTEM), parts, None)
        assert out == clean_out and "from cache" not in err
        assert head.read_bytes() == good


def test_no_head_with_the_kv_cache_off_for_a_long_prompt_a_raw_one_or_best_of(kv_directory):
    parts = Parts()
    ask(OneShot("hi", system=SYSTEM), parts, None, settings_with(REAME_GENERATION_TEMPERATURE="0",
                                                  REAME_GENERATION_MAX_TOKENS="12", REAME_CACHE_ENABLED="0"))
    ask(OneShot("a long question " * 8, system=SYSTEM), parts, None)
    ask(OneShot("hi", system=SYSTEM, raw=True), parts, None)
    ask(OneShot("hi", system=SYSTEM, best_of=2), parts, None)
    assert heads_in(kv_directory) == []


def test_a_planted_head_larger_than_all_heads_may_be_is_removed_unread(tmp_path, monkeypatch):
    from reame.cache import store
    from reame.cache.heads import HEADS_BUDGET_BYTES, TemplateHeads
    heads = TemplateHeads(tmp_path, b"f" * 32)
    tokens = list(range(16))
    heads.keep(store.Snapshot(tuple(tokens), b"state"))
    [path] = heads_in(tmp_path)
    with path.open("r+b") as planted:
        planted.truncate(HEADS_BUDGET_BYTES + 1)  # sparse: nothing is written
    checksummed = []
    monkeypatch.setattr(store.zlib, "crc32", lambda *args: checksummed.append(args) or 0)
    assert heads.find(tokens) is None and not path.exists() and checksummed == []
