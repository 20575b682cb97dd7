"""Each model of MODELS.md, loaded for real: its GGUF carries the template of its fixture, and the
backend renders the fixture's prompts (the model's own Jinja template, or llama.cpp's built-in format
for a GGUF without one)."""

import hashlib
import json
from pathlib import Path

import pytest

from reame.model.llama import LlamaBackend

from .conftest import settings_for

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates").glob("*.json"))


@pytest.mark.parametrize("fixture_path", FIXTURES, ids=lambda path: path.stem)
def test_the_real_backend_renders_the_models_own_template(native_libraries, model_path, fixture_path):
    fixture = json.loads(fixture_path.read_text())
    with LlamaBackend(settings_for(model_path(fixture["model"]), n_ctx=512, n_seq_max=1)) as backend:
        source = backend._jinja.source if backend._jinja is not None else None
        assert (hashlib.sha256(source.encode()).hexdigest() if source else None) == fixture["template_sha256"]
        for case in fixture["cases"]:
            rendered = backend.apply_chat_template(case["messages"], case["add_generation_prompt"], case.get("tools"))
            assert rendered == case["expected"]
        assert backend.template_supports_tools == any("tools" in case for case in fixture["cases"])


def test_builtin_mode_keeps_llama_cpps_detection(native_libraries, smollm2_path):
    fixture = json.loads((FIXTURES[0].parent / "smollm2-135m.json").read_text())
    case = fixture["cases"][0]
    with LlamaBackend(settings_for(smollm2_path, n_ctx=512, n_seq_max=1, chat_template="builtin")) as backend:
        rendered = backend.apply_chat_template(case["messages"], True)
    # llama.cpp's ChatML drops the default system prompt SmolLM2's own template adds.
    assert rendered == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert rendered != case["expected"]


def test_a_format_named_replaces_the_models_template_as_llama_servers_chat_template_flag(native_libraries,
                                                                                        smollm2_path):
    messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    with LlamaBackend(settings_for(smollm2_path, n_ctx=512, n_seq_max=1, chat_template="command-r")) as backend:
        # llama.cpp's own test of the format (tools/server/tests: test_apply_chat_template), word for word.
        assert backend.apply_chat_template(messages, True) == (
            "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
            "<|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    with LlamaBackend(settings_for(smollm2_path, n_ctx=512, n_seq_max=1, chat_template="llama3")) as backend:
        assert backend.apply_chat_template(messages[1:], True) == ("<|start_header_id|>user<|end_header_id|>\n\n"
                                                                   "Hi there<|eot_id|><|start_header_id|>assistant"
                                                                   "<|end_header_id|>\n\n")


def test_the_formats_a_request_may_name_are_the_librarys(native_libraries):
    import ctypes

    from reame.config import LLAMA_CHAT_TEMPLATES
    from reame.ctypes_llama import api
    from reame.model.library import init_native
    init_native()
    names = (ctypes.c_char_p * 256)()
    count = api.llama_chat_builtin_templates(names, 256)
    assert sorted(name.decode() for name in names[:count]) == sorted(LLAMA_CHAT_TEMPLATES)
