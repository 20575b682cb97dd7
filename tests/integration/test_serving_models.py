"""What a server with several models plans at start-up from real files: each model's facts from its GGUF header,
its names (a model listed twice is one model), its memory estimate, and names two models claim refused."""

import pytest

from reame import config
from reame.model_choice import plan
from reame.errors import ConfigError
from reame.node import Planned, file_facts, memory_estimate, names_of, planned_model, with_others
from reame.settings import from_values


def first(settings, path) -> Planned:
    return planned_model(settings, names_of("", path, None), path, plan(settings, path, None))


def test_a_files_facts_come_from_its_header(smollm2_path, model_path):
    facts = file_facts(smollm2_path, 2048)
    assert (facts.architecture, facts.quantization, facts.parameter_size, facts.context_train) == \
        ("llama", "Q4_1", "135M", 8192)
    assert facts.size_bytes == smollm2_path.stat().st_size and facts.context_length == 2048
    coder = file_facts(model_path("qwen2.5-coder-0.5b"), 2048)
    assert (coder.architecture, coder.quantization, coder.parameter_size) == ("qwen2", "Q4_K_M", "0.5B")


def test_server_models_are_planned_named_and_merged(smollm2_path, model_path):
    coder = model_path("qwen2.5-coder-0.5b")
    settings = from_values(config.load(None, env={
        "REAME_SERVER_MODELS": f"tiny={smollm2_path}, coder|qwen={coder}", "REAME_MODEL_CONTEXT_LENGTH": "2048"}))
    planned = with_others(settings, [first(settings, smollm2_path)])
    assert [item.names[:2] for item in planned] == [[smollm2_path.stem, smollm2_path.name], ["coder", "qwen"]]
    assert "tiny" in planned[0].names and "qwen2.5-coder-0.5b" in planned[1].names
    size = coder.stat().st_size
    assert size < memory_estimate(planned[1]) < 2 * size  # the file, its 2048-token KV, buffers


def test_a_name_two_models_claim_is_refused(smollm2_path, model_path):
    settings = from_values(config.load(None, env={
        "REAME_SERVER_MODELS": f"{smollm2_path.stem}={model_path('qwen2.5-coder-0.5b')}"}))
    with pytest.raises(ConfigError, match="given to two models"):
        with_others(settings, [first(settings, smollm2_path)])
