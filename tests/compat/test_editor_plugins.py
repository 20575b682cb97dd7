"""llama-server's own API as the editor plugins call it, on Qwen2.5-Coder-0.5B (a FIM model): the request
shapes of llama.vim (autoload/llama.vim: the ring's warm-up with n_predict 0, then a completion with
response_fields) and llama.vscode (src/llama-server.ts: n_cmpl completions, /props' n_ctx, /tokenize,
/apply-template), and /completion streamed as llama-server streams it."""

import json
import urllib.request

import pytest

from tests.live_server import model_server as serve, post_json

PREFIX = "def fibonacci(n):\n    "
SUFFIX = "\n\nprint(fibonacci(10))\n"
UTIL = "".join(f"def {name}(a, b):\n    \"\"\"{name.title()} two numbers.\"\"\"\n    return a {sign} b\n\n\n"
               for name, sign in (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"),
                                  ("power", "**"), ("floordiv", "//")))
RING = [{"filename": "util.py", "text": UTIL},
        {"filename": "main.py", "text": "from util import add, sub\n\nprint(add(1, 2), sub(3, 1))\n"}]
TIMINGS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
           "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
           "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


@pytest.fixture(scope="module")
def base(native_libraries, model_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("kv")
    with serve(model_path("qwen2.5-coder-0.5b"), env={"REAME_CACHE_DIR": str(cache)}) as live:
        yield live.base


def test_llama_vim_warms_its_ring_then_completes_with_its_response_fields(base):
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": RING, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}
    assert post_json(base, "/infill", warm)[1] == {}
    ask = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": RING, "prompt": "",
           "n_predict": 64, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
           "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
           "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "response_fields": TIMINGS}
    _, answer = post_json(base, "/infill", ask)
    assert set(answer) == set(TIMINGS) and answer["content"].strip()
    assert answer["timings/predicted_n"] > 0 and answer["truncated"] is False
    # The ring was warmed: its tokens came from the prefix cache, not prefilled again.
    assert answer["tokens_cached"] > 0 and answer["timings/prompt_n"] < answer["tokens_cached"]
    for line in answer["content"].split("\n")[1:]:
        assert line == "" or line.startswith("    ")  # n_indent: a line indented less ends it


def test_a_window_moving_down_a_file_moves_its_kv_instead_of_prefilling_it(base):
    """Cache reuse on the real library: llama_memory_seq_add moves the lines still in the window."""
    lines = [f"def step_{i}(state):\n    return state + {i}\n\n" for i in range(120)]

    def ask(first: int) -> dict:
        return post_json(base, "/infill", {"input_prefix": "".join(lines[first:first + 100]), "input_suffix": "\n",
                                           "prompt": "def", "n_predict": 8, "temperature": 0})[1]

    def moved() -> float:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
            return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                       if line.startswith("reame_kv_tokens_moved_total"))
    ask(0)
    before = moved()
    record = ask(3)
    assert moved() - before > 300 and record["tokens_cached"] > 300
    assert record["timings"]["prompt_n"] < 100 and record["content"].strip()


def test_the_infill_prompt_uses_the_models_repo_level_tokens(base):
    _, record = post_json(base, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": RING,
                                             "n_predict": 4, "temperature": 0})
    assert record["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>util.py\ndef add(a, b):")
    assert "<|file_sep|>filename\n<|fim_prefix|>def fibonacci(n):\n    <|fim_suffix|>" in record["prompt"]
    assert record["prompt"].endswith("<|fim_middle|>")


def test_llama_vscode_asks_for_several_completions_and_reads_props_tokenize_and_templates(base):
    ask = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": RING, "prompt": "",
           "n_predict": 24, "n_cmpl": 2, "top_k": 40, "top_p": 0.99, "stream": False,
           "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
           "t_max_predict_ms": 2500, "n_indent": 4}
    _, records = post_json(base, "/infill", ask)
    assert [record["index"] for record in records] == [0, 1] and all("content" in record for record in records)
    with urllib.request.urlopen(base + "/props", timeout=30) as response:
        props = json.loads(response.read())
    assert props["default_generation_settings"]["n_ctx"] == 2048 // props["total_slots"]
    assert len(post_json(base, "/tokenize", {"content": PREFIX})[1]["tokens"]) > 3
    prompt = post_json(base, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})[1]["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n")


def test_completion_streams_records_and_ends_with_timings(base):
    body = json.dumps({"prompt": "# a function that adds two numbers\ndef", "n_predict": 16, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(base + "/completion", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        records = [json.loads(line[len(b"data: "):]) for line in response.read().splitlines()
                   if line.startswith(b"data: ")]
    *partial, final = records
    assert all(not record["stop"] and record["tokens"] for record in partial) and final["stop"] is True
    _, whole = post_json(base, "/completion", {"prompt": "# a function that adds two numbers\ndef",
                                               "n_predict": 16, "temperature": 0})
    assert "".join(record["content"] for record in partial) == whole["content"]
    assert final["timings"]["predicted_n"] == whole["timings"]["predicted_n"] == 16
    assert final["stop_type"] == whole["stop_type"] == "limit"
