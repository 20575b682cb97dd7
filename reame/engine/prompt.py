"""A request's prompt as tokens, in the caller's thread (tokenizing is read-only): text, token ids, or a
fill-in-the-middle prompt. Anything the model cannot take is a RequestError before any work."""

from __future__ import annotations

from collections.abc import Sequence

from reame.engine.request import GenerationRequest
from reame.errors import RequestError
from reame.model.backend import Backend


def prompt_tokens(backend: Backend, request: GenerationRequest) -> list[int]:
    """Text tokenized with BOS (never twice), a fill-in-the-middle prompt built from the model's FIM tokens,
    or token ids checked against the vocabulary."""
    if request.suffix is not None:
        return fill_in_the_middle(backend, request.prompt, request.suffix)
    if isinstance(request.prompt, str):
        tokens = backend.tokenize(request.prompt, add_special=request.add_special, parse_special=True)
        # A chat template may already start with the BOS text: never feed BOS twice.
        if len(tokens) > 1 and tokens[0] == tokens[1] == backend.bos_token:
            del tokens[0]
        if not tokens:
            raise RequestError("the prompt tokenized to zero tokens", param="prompt")
        return tokens
    return checked_tokens(backend, request.prompt)


def checked_tokens(backend: Backend, tokens: Sequence[int]) -> list[int]:
    for token in tokens:
        if not 0 <= token < backend.n_vocab:
            raise RequestError(f"token id {token} is outside the vocabulary (0..{backend.n_vocab - 1})",
                               param="prompt")
    return list(tokens)


def fill_in_the_middle(backend: Backend, prefix: str | Sequence[int], suffix: str) -> list[int]:
    """Prefix-suffix-middle tokens, as code editors send `prompt` + `suffix`: the model writes the middle.
    User text is tokenized without parsing special tokens, so it cannot forge FIM markers."""
    fim = backend.fim_tokens()
    if fim is None:
        raise RequestError("this model has no fill-in-the-middle tokens; 'suffix' needs a code model such as "
                           "qwen2.5-coder", param="suffix", code="unsupported_parameter")
    pre, suf, mid = fim
    before = backend.tokenize(prefix, add_special=False, parse_special=False) if isinstance(prefix, str) \
        else checked_tokens(backend, prefix)
    bos = [backend.bos_token] if backend.add_bos and backend.bos_token >= 0 else []
    return bos + [pre] + before + [suf] + backend.tokenize(suffix, add_special=False, parse_special=False) + [mid]
