"""Make a GGUF of a BERT sentence-embedding model from its Hugging Face files (config.json, tokenizer.json,
model.safetensors), with no PyTorch: the semantic answer cache's embedding model (all-MiniLM-L6-v2)
reaches this machine only in that form.

The GGUF is the one llama.cpp's own converter makes for the architecture `bert` (its tensor names,
metadata keys and "phantom space" WordPiece vocabulary), kept in float32 as the safetensors have it, so
the same input always gives the same bytes: the catalog pins the result's sha256. The inputs are
untrusted until that sum is checked: sizes, offsets, shapes and dtypes are checked as they are read, and
nothing is loaded whole but one tensor at a time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from reame.errors import ModelError

MAX_HEADER_BYTES = 16 << 20  # a safetensors header of 105 tensors is 10 KB
MAX_JSON_BYTES = 32 << 20  # tokenizer.json of a 30k WordPiece vocabulary is 0.5 MB
ALIGNMENT = 32
GGUF_VERSION = 3
GGML_TYPE_F32 = 0
LLAMA_FTYPE_ALL_F32 = 0
POOLING_MEAN = 1
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3

# GGUF value types
UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9

EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
LAYER = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}
UNUSED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


@dataclass(frozen=True)
class Tensor:
    name: str  # the GGUF name
    shape: tuple[int, ...]  # as safetensors (and numpy) order it: slowest dimension first
    start: int  # byte range in the safetensors file
    end: int


def bert_to_gguf(model_dir: Path, target: Path, name: str) -> None:
    """Write the GGUF of the BERT model in `model_dir` to `target` (ModelError for files that are not one)."""
    config = read_json(model_dir / "config.json")
    if config.get("model_type") != "bert" or config.get("architectures") != ["BertModel"]:
        raise ModelError(f"{model_dir} is not a BertModel (config.json says {config.get('architectures')!r})")
    layers = positive(config, "num_hidden_layers")
    tokens, types = wordpiece_vocabulary(read_json(model_dir / "tokenizer.json"))
    weights = model_dir / "model.safetensors"
    tensors = safetensors_layout(weights, layers)
    width = positive(config, "hidden_size")
    if tensors[0].shape != (len(tokens), width):
        raise ModelError(f"token embeddings of shape {tensors[0].shape} do not match {len(tokens)} tokens "
                         f"of {width} dimensions")
    metadata: list[tuple[str, int, Any]] = [
        ("general.architecture", STRING, "bert"),
        ("general.name", STRING, name),
        ("general.file_type", UINT32, LLAMA_FTYPE_ALL_F32),
        ("bert.context_length", UINT32, positive(config, "max_position_embeddings")),
        ("bert.embedding_length", UINT32, width),
        ("bert.feed_forward_length", UINT32, positive(config, "intermediate_size")),
        ("bert.block_count", UINT32, layers),
        ("bert.attention.head_count", UINT32, positive(config, "num_attention_heads")),
        ("bert.attention.layer_norm_epsilon", FLOAT32, float(config.get("layer_norm_eps", 1e-12))),
        ("bert.attention.causal", BOOL, False),
        ("bert.pooling_type", UINT32, POOLING_MEAN),
        ("tokenizer.ggml.model", STRING, "bert"),
        ("tokenizer.ggml.token_type_count", UINT32, positive(config, "type_vocab_size")),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (INT32, types)),
    ]
    partial = target.with_name(target.name + ".part")
    try:
        with weights.open("rb") as source, partial.open("wb") as out:
            write_gguf(out, metadata, tensors, source)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def read_json(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ModelError(f"{path.name} is larger than {MAX_JSON_BYTES >> 20} MB")
        value = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as error:
        raise ModelError(f"cannot read {path.name}: {error}") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path.name} is not a JSON object")
    return value


def positive(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 20:
        raise ModelError(f"config.json: {key} = {value!r} is not a plausible size")
    return value


def wordpiece_vocabulary(tokenizer: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The vocabulary in id order as llama.cpp's WordPiece tokenizer reads it: a word-initial piece gets
    a leading U+2581, a continuation ("##ing") loses its ##, special tokens stay as they are."""
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) and model.get("type") == "WordPiece" else None
    if not isinstance(vocab, dict) or not vocab:
        raise ModelError("tokenizer.json has no WordPiece vocabulary")
    by_id: list[str | None] = [None] * len(vocab)
    for piece, index in vocab.items():
        if not isinstance(index, int) or not 0 <= index < len(vocab) or by_id[index] is not None:
            raise ModelError("tokenizer.json's vocabulary ids are not 0..n-1 each once")
        by_id[index] = piece
    added = tokenizer.get("added_tokens") or []
    if not isinstance(added, list):
        raise ModelError("tokenizer.json's added_tokens is not a list")
    special = {item["content"] for item in added
               if isinstance(item, dict) and item.get("special") and isinstance(item.get("content"), str)}
    tokens, types = [], []
    for piece in by_id:
        assert piece is not None
        if piece in special:
            tokens.append(piece)
            types.append(TOKEN_CONTROL)
        else:
            tokens.append(piece[2:] if piece.startswith("##") else "\u2581" + piece)
            types.append(TOKEN_NORMAL)
    return tokens, types


def safetensors_layout(path: Path, layers: int) -> list[Tensor]:
    """Every tensor llama.cpp's BERT takes, in the order its converter writes them, with its GGUF name;
    ModelError for a header that is damaged, points outside the file, or lacks or adds a tensor."""
    try:
        size = path.stat().st_size
        with path.open("rb") as stream:
            length = struct.unpack("<Q", read_exactly(stream, 8))[0]
            if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise ModelError(f"{path.name}: a header of {length} bytes")
            header = json.loads(read_exactly(stream, length))
    except (OSError, ValueError, RecursionError, struct.error) as error:
        raise ModelError(f"cannot read {path.name}: {error}") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path.name}: the header is not a JSON object")
    base = 8 + length
    if layers * len(LAYER) * 2 > len(header):  # before the names are made: their count follows `layers`
        raise ModelError(f"config.json says {layers} layers; {path.name} holds {len(header)} tensors")
    names = dict(EMBEDDINGS)
    for layer in range(layers):
        for hf, gguf in LAYER.items():
            for part in ("weight", "bias"):
                names[f"encoder.layer.{layer}.{hf}.{part}"] = f"blk.{layer}.{gguf}.{part}"
    extra = set(header) - set(names) - set(UNUSED) - {"__metadata__"}
    if extra:
        raise ModelError(f"{path.name} has tensors a BertModel does not: {sorted(extra)[:3]}")
    tensors = []
    for hf, gguf in names.items():
        entry = header.get(hf)
        if not isinstance(entry, dict):
            raise ModelError(f"{path.name} lacks {hf}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        valid = entry.get("dtype") == "F32" and isinstance(shape, list) and 1 <= len(shape) <= 2 and \
            all(isinstance(d, int) and 0 < d < 1 << 24 for d in shape) and isinstance(offsets, list) and \
            len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
        if not valid or not isinstance(shape, list) or not isinstance(offsets, list):
            raise ModelError(f"{path.name}: {hf} is not a float32 vector or matrix")
        count = shape[0] * (shape[1] if len(shape) == 2 else 1)
        start, end = base + offsets[0], base + offsets[1]
        if not base <= start <= end <= size or end - start != 4 * count:
            raise ModelError(f"{path.name}: {hf}'s bytes lie outside the file or do not match its shape")
        tensors.append(Tensor(gguf, tuple(shape), start, end))
    return tensors


def read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ModelError("the file ends early")
    return data


def write_gguf(out: BinaryIO, metadata: list[tuple[str, int, Any]], tensors: list[Tensor],
               source: BinaryIO) -> None:
    out.write(b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata)))
    for key, kind, value in metadata:
        out.write(gguf_string(key) + struct.pack("<I", kind) + gguf_value(kind, value))
    offset = 0
    for tensor in tensors:
        dims = tensor.shape[::-1]  # ggml's ne: fastest dimension first
        out.write(gguf_string(tensor.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGML_TYPE_F32,
                                                          offset))
        offset += padded(tensor.end - tensor.start)
    out.write(b"\0" * (padded(out.tell()) - out.tell()))
    for tensor in tensors:
        for block in tensor_bytes(source, tensor):
            out.write(block)
        out.write(b"\0" * (padded(tensor.end - tensor.start) - (tensor.end - tensor.start)))


def tensor_bytes(source: BinaryIO, tensor: Tensor, block: int = 1 << 20) -> Iterator[bytes]:
    source.seek(tensor.start)
    left = tensor.end - tensor.start
    while left:
        data = read_exactly(source, min(block, left))
        left -= len(data)
        yield data


def padded(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_value(kind: int, value: Any) -> bytes:
    if kind == STRING:
        return gguf_string(value)
    if kind == ARRAY:
        item_kind, items = value
        return struct.pack("<IQ", item_kind, len(items)) + b"".join(gguf_value(item_kind, item) for item in items)
    return struct.pack({UINT32: "<I", INT32: "<i", FLOAT32: "<f", BOOL: "<?"}[kind], value)
