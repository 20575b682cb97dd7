"""Requantizing a real GGUF through the binding (`reame pull --quantize`), and serving the copy."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reame import gguf
from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.llama import LlamaBackend
from reame.errors import ConfigError
from reame.quantize import QUANT_TYPES, quantized_path, requantize
from tests.integration.conftest import settings_for

ROOT = Path(__file__).resolve().parents[2]


def test_a_requantized_copy_has_the_type_asked_for_and_answers(native_libraries, smollm2_path, tmp_path):
    source = tmp_path / smollm2_path.name
    shutil.copyfile(smollm2_path, source)
    copy = requantize(source, "q4_0", threads=2)
    assert copy == quantized_path(source, "q4_0") == tmp_path / "SmolLM2-135M-Instruct.Q4_1.q4_0.gguf"
    assert gguf.read_metadata(copy)["general.file_type"] == QUANT_TYPES["q4_0"]
    assert not list(tmp_path.glob("*.part"))
    made = copy.stat().st_mtime_ns
    assert requantize(source, "q4_0") == copy and copy.stat().st_mtime_ns == made  # kept, not made again
    with LlamaBackend(settings_for(copy)) as backend, Engine(backend) as engine:
        result = engine.generate(GenerationRequest("The capital of France is", SamplingParams(temperature=0,
                                                                                               max_tokens=8)))
    assert result.text.strip()


def test_an_unknown_type_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="unknown quantization type 'q3_x'"):
        requantize(tmp_path / "model.gguf", "q3_x")
    assert not list(tmp_path.iterdir())


def test_pull_quantize_prints_the_copy(native_libraries, smollm2_path, tmp_path):
    from reame.native import cache_root
    home = tmp_path / "home"
    (home / ".reame" / "models").mkdir(parents=True)
    for name in (smollm2_path.name, smollm2_path.name + ".verified"):  # already downloaded and checked
        shutil.copyfile(smollm2_path.parent / name, home / ".reame" / "models" / name)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(home), REAME_CACHE=str(cache_root()))
    pulled = subprocess.run([sys.executable, "-m", "reame", "pull", "smollm2-135m", "--quantize", "q8_0"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert pulled.returncode == 0, pulled.stderr
    copy = Path(pulled.stdout.strip())
    assert copy == home / ".reame" / "models" / "SmolLM2-135M-Instruct.Q4_1.q8_0.gguf"
    assert gguf.read_metadata(copy)["general.file_type"] == QUANT_TYPES["q8_0"]
    refused = subprocess.run([sys.executable, "-m", "reame", "pull", "smollm2-135m", "--quantize", "q3"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2 and "invalid choice: 'q3'" in refused.stderr
