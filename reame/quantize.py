"""Requantize a GGUF file into another llama.cpp type, through the binding (`reame pull MODEL --quantize TYPE`).

On a CPU the file's quantization type decides which matrix kernels a decode step
runs, so it decides how much batching (several users, speculative drafts) can
gain: docs/models.md has what each type measured here, in speed and in
agreement with the original file. The copy is written beside the original
(`<name>.<type>.gguf`), under a temporary name first, so a half-written file is
never taken for a model.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from reame.ctypes_llama import types as t
from reame.model.library import init_native, last_llama_error
from reame.errors import ConfigError, ModelError

QUANT_TYPES = {
    "q4_0": t.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_1": t.LLAMA_FTYPE_MOSTLY_Q4_1, "q8_0": t.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_k_s": t.LLAMA_FTYPE_MOSTLY_Q4_K_S, "q4_k_m": t.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q5_k_m": t.LLAMA_FTYPE_MOSTLY_Q5_K_M, "q6_k": t.LLAMA_FTYPE_MOSTLY_Q6_K,
}


def quantized_path(source: Path, kind: str) -> Path:
    return source.with_name(f"{source.stem}.{kind}.gguf")


def requantize(source: Path, kind: str, threads: int = 0, target: Path | None = None) -> Path:
    """The model at `source` written as `kind` (a QUANT_TYPES name) to `target` (default: beside it);
    an existing copy newer than its source is kept. Requantizing an already quantized file loses a
    little more than quantizing the original weights would: docs/models.md measures how much."""
    if kind not in QUANT_TYPES:
        raise ConfigError(f"unknown quantization type '{kind}'; choose from {', '.join(QUANT_TYPES)}")
    target = target or quantized_path(source, kind)
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    init_native()
    from reame.ctypes_llama import api
    params = api.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = QUANT_TYPES[kind]
    params.allow_requantize = True
    temporary = target.with_name(target.name + ".part")
    try:
        status = api.llama_model_quantize(os.fsencode(source), os.fsencode(temporary), ctypes.byref(params))
        if status != 0:
            raise ModelError(f"llama.cpp could not requantize {source.name} to {kind}{last_llama_error()}")
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target
