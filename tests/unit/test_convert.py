"""BERT sentence-embedding models made into GGUF (reame/convert.py): a tiny model of the real layout gives
llama.cpp's names, keys and vocabulary; a damaged or hostile input is one ModelError, fast and bounded.
(The real all-MiniLM-L6-v2 is converted, loaded and embedded in tests/integration/test_semantic_real.py.)"""

import json
import random
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from reame.convert import bert_to_gguf, padded
from reame.errors import ModelError
from reame.gguf import read_metadata

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "shop", "##s", "open", "?"]
CONFIG = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 4, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 8, "type_vocab_size": 2,
          "layer_norm_eps": 1e-12}


def shapes(layers: int = 1) -> dict[str, list[int]]:
    made = {"embeddings.word_embeddings.weight": [len(VOCAB), 4], "embeddings.position_embeddings.weight": [8, 4],
            "embeddings.token_type_embeddings.weight": [2, 4], "embeddings.LayerNorm.weight": [4],
            "embeddings.LayerNorm.bias": [4], "embeddings.position_ids": [1, 8], "pooler.dense.weight": [4, 4]}
    for layer in range(layers):
        for name, shape in (("attention.self.query", [4, 4]), ("attention.self.key", [4, 4]),
                            ("attention.self.value", [4, 4]), ("attention.output.dense", [4, 4]),
                            ("attention.output.LayerNorm", [4]), ("intermediate.dense", [8, 4]),
                            ("output.dense", [4, 8]), ("output.LayerNorm", [4])):
            made[f"encoder.layer.{layer}.{name}.weight"] = shape
            made[f"encoder.layer.{layer}.{name}.bias"] = [shape[0]]
    return made


def safetensors(tensors: dict[str, list[int]], dtype: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    data = b""
    for index, (name, shape) in enumerate(tensors.items()):
        count = 1
        for dimension in shape:
            count *= dimension
        values = struct.pack(f"<{count}f", *[index + n / 100 for n in range(count)])
        header[name] = {"dtype": (dtype or {}).get(name, "F32"), "shape": shape,
                        "data_offsets": [len(data), len(data) + len(values)]}
        data += values
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def model_dir(tmp_path: Path, weights: bytes | None = None, config: dict | None = None,
              tokenizer: dict | None = None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(VOCAB[:5])]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer or {
        "model": {"type": "WordPiece", "vocab": {t: i for i, t in enumerate(VOCAB)}}, "added_tokens": added}))
    (folder / "model.safetensors").write_bytes(weights if weights is not None else safetensors(shapes()))
    return folder


def test_a_bert_model_becomes_llama_cpps_bert_gguf(tmp_path):
    target = tmp_path / "tiny.gguf"
    bert_to_gguf(model_dir(tmp_path), target, "tiny")
    metadata = read_metadata(target)
    assert metadata["general.architecture"] == "bert" and metadata["general.name"] == "tiny"
    assert metadata["bert.embedding_length"] == 4 and metadata["bert.block_count"] == 1
    assert metadata["bert.feed_forward_length"] == 8 and metadata["bert.attention.head_count"] == 2
    assert metadata["bert.context_length"] == 8 and metadata["bert.attention.causal"] is False
    assert metadata["bert.pooling_type"] == 1 and metadata["tokenizer.ggml.model"] == "bert"
    assert metadata["tokenizer.ggml.tokens"] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "\u2581the",
                                                 "\u2581shop", "s", "\u2581open", "\u2581?"]
    assert metadata["tokenizer.ggml.token_type"] == [3] * 5 + [1] * 5
    assert metadata["GGUF.tensor_count"] == 5 + 16  # position ids and the pooler are left out
    data = target.read_bytes()
    word_embeddings = struct.pack("<40f", *[n / 100 for n in range(40)])  # the first tensor written above
    assert word_embeddings in data and len(data) % 32 == 0
    again = tmp_path / "again.gguf"
    bert_to_gguf(model_dir(tmp_path), again, "tiny")
    assert again.read_bytes() == data  # the catalog pins the result's sum


def without(name: str) -> dict[str, list[int]]:
    made = shapes()
    del made[name]
    return made


@pytest.mark.parametrize("weights", [
    b"", b"\x01" * 7, struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 4) + b"[1]x",
    struct.pack("<Q", 5) + b"{\"a\":", safetensors(shapes())[:-4],  # the last tensor cut short
    safetensors(without("encoder.layer.0.output.dense.bias")),
    safetensors({**shapes(), "encoder.layer.0.extra.weight": [4]}),
    safetensors(shapes(), {"encoder.layer.0.output.dense.bias": "F16"}),
    safetensors({**shapes(), "embeddings.word_embeddings.weight": [len(VOCAB) + 1, 4]}),
    safetensors({**shapes(), "embeddings.LayerNorm.bias": [1, 1, 4]}),
])
def test_damaged_weights_are_one_model_error(tmp_path, weights):
    with pytest.raises(ModelError):
        bert_to_gguf(model_dir(tmp_path, weights=weights), tmp_path / "out.gguf", "x")
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.part").exists()


@pytest.mark.parametrize("config,tokenizer", [
    ({**CONFIG, "architectures": ["LlamaForCausalLM"]}, None), ({**CONFIG, "hidden_size": "4"}, None),
    ({**CONFIG, "num_hidden_layers": 1 << 30}, None), ({**CONFIG, "hidden_size": True}, None),
    (None, {"model": {"type": "BPE", "vocab": {"a": 0}}}), (None, {"model": {"type": "WordPiece", "vocab": {}}}),
    (None, {"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 0}}}),
    (None, {"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 5}}}), (None, []),
])
def test_a_config_or_vocabulary_that_is_not_a_berts_is_one_model_error(tmp_path, config, tokenizer):
    folder = model_dir(tmp_path, config=config, tokenizer=tokenizer)
    if tokenizer == []:
        (folder / "tokenizer.json").write_text("[]")
    with pytest.raises(ModelError):
        bert_to_gguf(folder, tmp_path / "out.gguf", "x")


def test_random_damage_to_the_header_is_a_model_error_or_a_gguf_fast_and_bounded(tmp_path):
    original = safetensors(shapes())
    length = struct.unpack("<Q", original[:8])[0]
    generator = random.Random(11)
    started = time.perf_counter()
    tracemalloc.start()
    for attempt in range(150):
        damaged = bytearray(original)
        for _ in range(generator.randrange(1, 6)):
            damaged[generator.randrange(0, 8 + length)] = generator.randrange(256)
        target = tmp_path / f"out{attempt}.gguf"
        try:
            bert_to_gguf(model_dir(tmp_path, weights=bytes(damaged)), target, "x")
            assert target.stat().st_size > 0
        except ModelError:
            assert not target.exists()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - started < 20 and peak < 32 << 20


def test_padded_rounds_up_to_the_alignment():
    assert [padded(n) for n in (0, 1, 32, 33)] == [0, 32, 32, 64]


@pytest.mark.parametrize("layers", [200_000, (1 << 20) - 1])
def test_a_layer_count_the_weights_do_not_hold_is_refused_before_names_are_made(tmp_path, layers):
    """Issue 49, finding 8: num_hidden_layers up to 2^20 built the tensor-name table first (200k: +681 MiB, 10 s)."""
    folder = model_dir(tmp_path, config={**CONFIG, "num_hidden_layers": layers})
    started = time.perf_counter()
    tracemalloc.start()
    with pytest.raises(ModelError, match=f"config.json says {layers} layers"):
        bert_to_gguf(folder, tmp_path / "out.gguf", "x")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - started < 1 and peak < 4 << 20


@pytest.mark.parametrize("added", [5, "x", {"a": 1}, [{"content": ["unhashable"], "special": True}],
                                   [{"content": {"a": 1}, "special": True}], [None, 3]])
def test_malformed_added_tokens_are_a_model_error_or_ignored(tmp_path, added):
    """Finding 8: malformed added_tokens raised TypeError past `except ModelError` (a 500)."""
    tokenizer = {"model": {"type": "WordPiece", "vocab": {t: i for i, t in enumerate(VOCAB)}}, "added_tokens": added}
    folder = model_dir(tmp_path, tokenizer=tokenizer)
    try:
        bert_to_gguf(folder, tmp_path / "out.gguf", "x")
    except ModelError as error:
        assert "added_tokens" in str(error)
