"""llama-server's own API (/completion, /infill, /apply-template, /props) on a recording client over the
FakeBackend: its records field by field, its prompt shapes, its infill prompt token for token, its limits
(n_indent, t_max_predict_ms) and its errors in llama-server's shape."""

import pytest

from reame.engine import Engine
from reame.engine.prompt import SNIPPET_SEPARATOR, infill
from reame.server.apis.llamacpp import indent_cut, picked
from reame.server.app import App
from reame.server.client import HttpError
from reame.server.models import ModelPool, ServedModel
from reame.server.settings import ServerSettings
from tests.fakes.backend import BOS, EOS, FIM_MID, FIM_PRE, FIM_REP, FIM_SEP, FIM_SUF, N_VOCAB, FakeBackend
from tests.fakes.client import RecordingClient, run_route
from tests.unit.test_server import FAKE_FACTS

GREEDY = {"temperature": 0, "n_predict": 8}


def serving(backend: FakeBackend):
    engine = Engine(backend)
    app = App(ServerSettings(port=0, request_log=False),
              ModelPool([ServedModel("reame", facts=FAKE_FACTS, engine=engine, state="loaded")]))
    app.ready = True
    return engine, app


@pytest.fixture
def app():
    engine, service = serving(FakeBackend(n_ctx=1024, n_seq_max=2))
    with engine:
        yield service


def run(app: App, path: str, body: dict, command: str = "POST") -> RecordingClient:
    return run_route(app, path, body, command)


def whole(app: App, path: str, body: dict, command: str = "POST"):
    client = run(app, path, body, command)
    assert client.status == 200
    return client.frames[0][1]


def refused(app: App, path: str, body: dict) -> HttpError:
    with pytest.raises(HttpError) as raised:
        run(app, path, body)
    return raised.value


def test_a_completion_record_says_what_llama_servers_does(app):
    record = whole(app, "/completion", {"prompt": "hello there", **GREEDY, "return_tokens": True})
    assert record["stop"] is True and record["index"] == 0 and record["id_slot"] == -1
    assert record["stop_type"] in ("limit", "eos") and record["stopping_word"] == ""
    assert record["tokens_predicted"] == len(record["tokens"]) == record["timings"]["predicted_n"]
    assert bytes(record["tokens"]).decode("utf-8") == record["content"]  # the fake's tokens are bytes
    assert record["tokens_evaluated"] == len("hello there") + 1  # with BOS
    timings = record["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == record["tokens_evaluated"] == record["tokens_cached"] + \
        timings["prompt_n"]
    assert record["truncated"] is False and isinstance(record["has_new_line"], bool)
    assert record["generation_settings"]["n_predict"] == 8 and record["generation_settings"]["temperature"] == 0
    assert record["prompt"] == "<s>hello there" and record["model"] == "reame"
    without = whole(app, "/completions", {"prompt": "hello there", **GREEDY})
    assert without["tokens"] == [] and without["content"] == record["content"]


def test_streamed_records_carry_the_same_text_and_end_with_the_final_record(app):
    content = whole(app, "/completion", {"prompt": "hello there", **GREEDY})["content"]
    client = run(app, "/completion", {"prompt": "hello there", **GREEDY, "stream": True})
    records = [payload for kind, payload in client.frames]
    assert all(kind == "data" for kind, _ in client.frames) and records[-1]["stop"] is True
    partial = records[:-1]
    assert "".join(record["content"] for record in partial) == content and records[-1]["content"] == ""
    assert all(record["stop"] is False and record["tokens"] for record in partial)
    assert [record["tokens_predicted"] for record in partial] == sorted(record["tokens_predicted"]
                                                                        for record in partial)
    assert records[-1]["timings"]["predicted_n"] == partial[-1]["tokens_predicted"]


def test_several_prompts_answer_an_array_and_a_mixed_prompt_is_one(app):
    records = whole(app, "/completion", {"prompt": ["hello", [104, 105]], **GREEDY})
    assert [record["index"] for record in records] == [0, 1]
    assert records[0]["tokens_evaluated"] == 6 and records[1]["tokens_evaluated"] == 2
    mixed = whole(app, "/completion", {"prompt": [BOS, 104, "ey"], **GREEDY})
    assert mixed["tokens_evaluated"] == 4 and mixed["prompt"] == "<s>hey"
    assert whole(app, "/completion", {"prompt": "hey", **GREEDY, "n_cmpl": 2})[1]["index"] == 1


def test_n_probs_give_each_token_its_alternatives_with_ids(app):
    record = whole(app, "/completion", {"prompt": "hello", **GREEDY, "n_probs": 3})
    probs = record["completion_probabilities"]
    assert len(probs) == record["tokens_predicted"]
    for entry in probs:
        assert set(entry) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["id"] == entry["id"]
        assert 0 <= entry["id"] < N_VOCAB and entry["logprob"] <= 0


def test_post_sampling_probs_are_the_chains_probabilities_in_llama_servers_shape(app):
    record = whole(app, "/completion", {"prompt": "hello", "n_predict": 6, "n_probs": 3, "temperature": 1.0,
                                        "top_k": 2, "seed": 7, "post_sampling_probs": True})
    probs = record["completion_probabilities"]
    assert len(probs) == record["tokens_predicted"]
    for entry in probs:
        assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
        survivors = {alternative["id"]: alternative["prob"] for alternative in entry["top_probs"]}
        assert 1 <= len(survivors) <= 2 and sum(survivors.values()) == pytest.approx(1.0)  # top-k 2 left these
        assert entry["prob"] == pytest.approx(survivors[entry["id"]]) and all(0 < p <= 1 for p in survivors.values())
    greedy = whole(app, "/completion", {"prompt": "hello", **GREEDY, "n_probs": 3, "post_sampling_probs": True})
    assert all(entry["prob"] == 1.0 and [top["id"] for top in entry["top_probs"]] == [entry["id"]]
               for entry in greedy["completion_probabilities"])


def test_a_stop_word_ends_with_its_name(app):
    content = whole(app, "/completion", {"prompt": "hello there", **GREEDY})["content"]
    word = content[3:5]
    record = whole(app, "/completion", {"prompt": "hello there", **GREEDY, "stop": [word]})
    assert record["stop_type"] == "word" and record["stopping_word"] == word
    assert record["content"] == content[:content.index(word)]


def test_response_fields_keep_only_the_named_ones_a_nested_one_under_its_path(app):
    record = whole(app, "/completion", {"prompt": "hi", **GREEDY,
                                        "response_fields": ["content", "timings/prompt_n", "nothing/here"]})
    assert set(record) == {"content", "timings/prompt_n"}
    assert picked({"a": {"b": 1}, "c": 2}, ["a/b", "a/x", "c"]) == {"a/b": 1, "c": 2}


def fim_backend(reply: str, **settings) -> FakeBackend:
    """A code model that writes `reply` after the FIM middle token, then ends."""
    target = list(reply.encode())

    def rule(history):
        logits = [0.0] * N_VOCAB
        start = max(i for i, token in enumerate(history) if token == FIM_MID) + 1 if FIM_MID in history \
            else len(history)
        written = list(history[start:])
        logits[target[len(written)] if written == target[:len(written)] and len(written) < len(target)
               else EOS] = 10.0
        return logits
    return FakeBackend(n_ctx=1024, rule=rule, **settings)


def test_the_infill_prompt_is_llama_servers_token_for_token():
    backend = FakeBackend(n_ctx=1024, n_batch=64)
    tokens = infill(backend, "a" * 100, "b" * 100, [("x.py", "xx"), ("y.py", "yy")], [ord("m")], -1, 1024)
    context = [FIM_REP, *b"myproject\n", FIM_SEP, *b"x.py\n", *b"xx", FIM_SEP, *b"y.py\n", *b"yy",
               FIM_SEP, *b"filename\n"]
    # The prefix's last 3/4 of a batch, the middle, the suffix's first quarter batch less 2 and the middle.
    assert tokens == context + [BOS, FIM_PRE, *b"a" * 48, ord("m"), FIM_SUF, *b"b" * 13, FIM_MID]
    backend.has_fim_repo = False
    plain = infill(backend, "p", "s", [("x.py", "xx")], [], -1, 1024)
    assert plain == [*SNIPPET_SEPARATOR.encode(), *b"xx", BOS, FIM_PRE, ord("p"), FIM_SUF, ord("s"), FIM_MID]
    # The extra context keeps its last tokens: what the context leaves past a batch and n_predict twice.
    assert infill(backend, "p", "s", [("x.py", "x" * 50)], [], 10, 64 + 20 + 5)[:5] == [*b"xxxxx"]


def test_infill_completes_between_prefix_and_suffix_as_an_editor_asks():
    engine, app = serving(fim_backend("return a + b\n"))
    with engine:
        record = whole(app, "/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n",
                                        "input_extra": [{"filename": "m.py", "text": "import os\n"}],
                                        "temperature": 0, "n_predict": 32})
    assert record["content"] == "return a + b\n" and record["stop_type"] == "eos"
    assert "<|file_sep|>m.py\nimport os\n" in record["prompt"]


def test_an_editors_window_moving_down_reuses_the_slots_lines_by_default_and_not_without_cache_prompt():
    lines = [f"value_{i} = value_{i - 1} + {i}\n" for i in range(40)]
    engine, app = serving(fim_backend("return a + b\n", n_batch=512))  # the prefix's last 384 tokens

    def ask(first: int, **fields) -> dict:
        return whole(app, "/infill", {"input_prefix": "".join(lines[first:first + 30]), "input_suffix": "\n",
                                      "temperature": 0, "n_predict": 16, **fields})
    with engine:
        ask(0)
        moved = ask(2)  # two lines left the window at its top, one came in at its bottom
        # Of the prefix's last 384 tokens, all but the two new lines' (about 50) moved.
        assert engine.backend.reuses and moved["tokens_cached"] > 384 - 2 * 25
        assert moved["content"] == ask(2, cache_prompt=False)["content"] == "return a + b\n"
        count = len(engine.backend.reuses)
        ask(4, cache_prompt=False)
        ask(6, n_cache_reuse=0)
        assert len(engine.backend.reuses) == count  # neither asked for it


def test_n_indent_cuts_before_a_line_indented_less():
    engine, app = serving(fim_backend("x = 1\n    y = 2\n  z\nw"))
    with engine:
        record = whole(app, "/infill", {"input_prefix": "", "input_suffix": "", "temperature": 0, "n_indent": 4})
        streamed = run(app, "/infill", {"input_prefix": "", "input_suffix": "", "temperature": 0, "n_indent": 4,
                                        "stream": True}).frames
    assert record["content"] == "x = 1\n    y = 2\n  " and record["stop_type"] == "limit"
    assert "".join(payload["content"] for _, payload in streamed) == record["content"]
    assert indent_cut("a\n  b\nc", 0, 2) == 6 and indent_cut("a\n  b\n", 0, 2) is None
    assert indent_cut("a\n\nb", 0, 1) == 2  # an empty line is indented less too, as llama-server counts


def test_infill_refusals_in_llama_servers_shape(app):
    assert refused(app, "/infill", {"input_suffix": ""}).message == '"input_prefix" is required'
    assert refused(app, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": {}}).status == 400
    bad_chunk = refused(app, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{"file": 1}]})
    assert bad_chunk.status == 400 and "text" in bad_chunk.message
    engine, no_fim = serving(FakeBackend(n_ctx=1024))
    engine.backend.has_fim = False
    with engine:
        error = refused(no_fim, "/infill", {"input_prefix": "", "input_suffix": ""})
    assert error.status == 501
    from reame.server.apis.llamacpp import error_body
    assert error_body(error)["error"]["type"] == "not_supported_error"


@pytest.mark.parametrize("body,param", [
    ({"prompt": {}}, "prompt"),
    ({"prompt": [[1, "a"], {}]}, "prompt"),
    ({"prompt": "x", "samplers": ["nope"]}, "samplers"),
    ({"prompt": "x", "n_probs": 21}, "n_probs"),
    ({"prompt": "x", "post_sampling_probs": True, "n_probs": 2, "grammar": "root ::= \"a\""}, "post_sampling_probs"),
    ({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}, "grammar"),
    ({"prompt": "x", "response_fields": "content"}, "response_fields"),
    ({"prompt": "x", "n_predict": -2}, "n_predict"),
    ({"prompt": "x", "n_cache_reuse": -1}, "n_cache_reuse"),
    ({"prompt": "x", "n_cache_reuse": "64"}, "n_cache_reuse"),
])
def test_bad_completion_fields_are_a_400_naming_them(app, body, param):
    error = refused(app, "/completion", body)
    assert error.status == 400 and error.param == param


def test_llama_servers_samplers_and_sampling_defaults_are_taken(app):
    record = whole(app, "/completion", {"prompt": "hi", "n_predict": 4, "seed": 3,
                                        "samplers": ["top_k", "top_p", "infill"], "top_k": -1, "temperature": -1})
    settings = record["generation_settings"]
    assert settings["temperature"] == 0 and settings["top_k"] == 0 and settings["seed"] == 3
    defaults = whole(app, "/props", {}, "GET")["default_generation_settings"]["params"]
    assert (defaults["temperature"], defaults["top_k"], defaults["top_p"], defaults["min_p"]) == (0.8, 40, 0.95, 0.05)


def test_apply_template_and_props(app):
    prompt = whole(app, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "hi" in prompt
    props = whole(app, "/props", {}, "GET")
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512  # 1024 over 2 slots
    with pytest.raises(HttpError) as raised:
        run(app, "/props", {}, command="POST")
    assert raised.value.status == 403


def test_tokenize_with_pieces_and_mixed_content_as_llama_server(app):
    assert whole(app, "/tokenize", {"content": "hé"})["tokens"] == [104, 0xC3, 0xA9]
    pieces = whole(app, "/tokenize", {"content": "hé", "with_pieces": True})["tokens"]
    assert pieces == [{"id": 104, "piece": "h"}, {"id": 0xC3, "piece": [0xC3]}, {"id": 0xA9, "piece": [0xA9]}]
    assert whole(app, "/tokenize", {"content": ["a", 5, "<s>"], "add_special": True})["tokens"] == \
        [BOS, 97, 5, BOS]
    assert whole(app, "/tokenize", {"content": "<s>", "parse_special": False})["tokens"] == list(b"<s>")
    assert whole(app, "/detokenize", {"tokens": [104, 105]}) == {"content": "hi"}
    assert whole(app, "/detokenize", {}) == {"content": ""}
    assert refused(app, "/detokenize", {"tokens": [N_VOCAB]}).status == 400


@pytest.mark.parametrize("shape", ["pairs of ids", "object of ids", "pairs of texts", "object of texts"])
def test_logit_bias_in_each_of_llama_servers_shapes_bans_a_token(app, shape):
    ask = {"prompt": "hello there", "temperature": 0, "n_predict": 12}
    plain = whole(app, "/completion", ask)["content"]
    first = plain[0]
    bias = {"pairs of ids": [[ord(first), False]], "object of ids": {str(ord(first)): False},
            "pairs of texts": [[first, False]], "object of texts": {first: False}}[shape]
    banned = whole(app, "/completion", {**ask, "logit_bias": bias})["content"]
    assert first not in banned
    unreadable = [[1], "x", [10**9, 1], [first, "x"], [first, True]]
    assert whole(app, "/completion", {**ask, "logit_bias": unreadable})["content"] == plain


LLAMA_VIM_WARM = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0,
                  "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
                  "t_max_predict_ms": 1, "response_fields": [""]}


def test_llama_vims_warm_up_evaluates_the_extra_chunks_and_generates_nothing():
    """llama.vim's request shape (autoload/llama.vim) for warming its ring of chunks: n_predict 0, an empty
    response; the chunks' prompt is then in the prefix cache."""
    backend = FakeBackend(n_ctx=1024)
    from reame.cache.prefix import PrefixCache
    engine = Engine(backend, cache=PrefixCache(b"fake", block_tokens=8, min_new_tokens=8))
    app = App(ServerSettings(port=0, request_log=False),
              ModelPool([ServedModel("reame", facts=FAKE_FACTS, engine=engine, state="loaded")]))
    app.ready = True
    extra = [{"filename": "a.py", "text": "def a():\n    return 1\n" * 4}]
    with engine:
        assert whole(app, "/infill", {**LLAMA_VIM_WARM, "input_extra": extra}) == {}
        record = whole(app, "/infill", {**LLAMA_VIM_WARM, "input_extra": extra, "response_fields": []})
    assert record["tokens_predicted"] == 0 and record["content"] == "" and record["stop_type"] == "limit"
    assert record["tokens_cached"] > 0  # the second warm-up found the first one's prefix


def test_llama_servers_metric_names_count_what_its_records_say(app):
    first = whole(app, "/completion", {"prompt": "the quick brown fox", **GREEDY})
    second = whole(app, "/completion", {"prompt": "the quick brown fox", **GREEDY})
    run(app, "/v1/embeddings", {"input": ["hello", "world"]})
    values = {sample.name: sample.value for sample in app.metrics.samples() if sample.name.startswith("llamacpp:")}
    processed = first["timings"]["prompt_n"] + second["timings"]["prompt_n"]
    assert values["llamacpp:prompt_tokens_total"] == processed + len("hello") + len("world") + 2  # BOS each
    assert values["llamacpp:prompt_tokens_cached_total"] == first["timings"]["cache_n"] + \
        second["timings"]["cache_n"]
    assert values["llamacpp:tokens_predicted_total"] == first["tokens_predicted"] + second["tokens_predicted"]
    assert values["llamacpp:n_decode_total"] > 0 and values["llamacpp:requests_processing"] == 0
    text = app.metrics.render()
    assert "# TYPE llamacpp:prompt_tokens_total counter" in text and "# HELP llamacpp:n_decode_total " in text


def test_the_first_token_is_left_out_of_the_generation_rate(app):
    one = whole(app, "/completion", {"prompt": "hi", "temperature": 0, "n_predict": 1, "ignore_eos": True})
    assert one["timings"]["predicted_n"] == 1 and one["timings"]["predicted_per_second"] == 0.0
    many = whole(app, "/completion", {"prompt": "hi", "temperature": 0, "n_predict": 8, "ignore_eos": True})
    timings = many["timings"]
    assert timings["predicted_per_second"] == pytest.approx(1000 * 7 / timings["predicted_ms"])


def test_slots_list_each_sequence_slot_and_refuse_when_off(app):
    slots = whole(app, "/slots", {}, "GET")
    assert [slot["id"] for slot in slots] == [0, 1] and not any(slot["is_processing"] for slot in slots)
    assert all("params" not in slot and slot["n_ctx"] == 512 for slot in slots)
    engine, off = serving(FakeBackend(n_ctx=1024))
    off.settings = ServerSettings(port=0, request_log=False, slots=False)
    with engine, pytest.raises(HttpError) as raised:
        run(off, "/slots", {}, "GET")
    assert raised.value.status == 501


@pytest.mark.parametrize("value", ["", "string", [12, 34, 56], [12, 34, "string", 56, 78], ["string1", "string2"],
                                   ["string1", [12, 34, 56]], [[12, 34, 56], [12, "string", 34, 56]],
                                   {"prompt_string": "string"}, {"content": [{"type": "text", "text": "string"}]},
                                   ["s", {"prompt_string": "t"}, {"content": [{"type": "text", "text": "u"}]}]])
def test_embeddings_take_llama_servers_input_shapes(app, value):
    data = whole(app, "/v1/embeddings", {"input": value})["data"]
    assert len(data) == (len(value) if isinstance(value, list) and not any(isinstance(v, int) for v in value)
                         else 1)
    text = whole(app, "/v1/embeddings", {"input": ["hello world", {"content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]})["data"]
    assert text[0]["embedding"] == text[1]["embedding"]


@pytest.mark.parametrize("value", [[], {"content": "string"}, {"content": [{"type": "unknown"}]},
                                   {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
                                   {"prompt_string": "x", "multimodal_data": ["AAAA"]}, [[]], [{}], 5])
def test_bad_input_shapes_are_a_400(app, value):
    assert refused(app, "/v1/embeddings", {"input": value}).status == 400
    assert refused(app, "/completion", {"prompt": value}).status == 400


def test_a_chat_requests_input_tokens_are_counted_as_its_prompt_would_be(app):
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    counted = whole(app, "/chat/completions/input_tokens", {"messages": messages})["input_tokens"]
    asked = whole(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert counted == asked["usage"]["prompt_tokens"] > 5


def test_the_web_page_can_be_turned_off_as_llama_servers_no_ui():
    engine, app = serving(FakeBackend(n_ctx=1024))
    with engine:
        page = run(app, "/", {}, "GET")
        assert page.status == 200 and page.content_type.startswith("text/html")
        app.settings = ServerSettings(port=0, request_log=False, web_page=False)
        with pytest.raises(HttpError) as raised:
            run(app, "/", {}, "GET")
    assert raised.value.status == 404


def test_many_extra_chunks_or_bias_entries_are_a_400_before_any_is_tokenized(app):
    import time
    started = time.perf_counter()
    many = refused(app, "/infill", {"input_prefix": "", "input_suffix": "",
                                    "input_extra": [{"text": "x"}] * 50_000})
    bias = refused(app, "/completion", {"prompt": "x", "logit_bias": [["some text", 1]] * 50_000})
    assert (many.param, bias.param) == ("input_extra", "logit_bias") and time.perf_counter() - started < 1.0
