"""llama-server's prompt shapes, which its /completion and /infill take and its /v1/embeddings `input` too (a
superset of OpenAI's): a string; token ids; strings and ids mixed (one prompt); an object, `{"prompt_string":
…}` or `{"content": [{"type": "text", "text": …}, …]}`; or an array of those, several prompts. Each comes out
as text (tokenized later, with BOS) or as token ids; anything else, or media for a text model, is a 400."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reame.server.client import HttpError

MEDIA = ("image_url", "input_audio", "input_video")
Tokenize = Callable[[str, bool], list[int]]  # text, add_special -> token ids


def is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def llama_prompts(value: Any, tokenize: Tokenize, most: int, param: str = "prompt") -> list[str | list[int]]:
    """The prompts `value` holds, in llama-server's shapes (at most `most`, counted before any is read); a
    mixed one tokenized with `tokenize` (BOS before it when it starts with a string)."""
    if isinstance(value, (str, dict)) or (isinstance(value, list) and any(is_token(item) for item in value)):
        return [one_prompt(value, tokenize, param)]
    if not isinstance(value, list) or not value:
        raise HttpError(400, f'"{param}" must be a string, a list of tokens, a list of mixed strings & tokens, '
                        "an object or a list of prompts", param=param)
    if len(value) > most:
        raise HttpError(400, f"at most {most} {param}s per request", param=param)
    return [one_prompt(item, tokenize, param) for item in value]


def one_prompt(value: Any, tokenize: Tokenize, param: str) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return object_prompt(value, param)
    if not isinstance(value, list) or not value or not all(is_token(item) or isinstance(item, str) for item in value):
        raise HttpError(400, f"each {param} must be a string, a list of tokens, a list of mixed strings & tokens "
                        "or an object", param=param)
    if all(is_token(item) for item in value):
        return list(value)
    tokens: list[int] = []
    for index, item in enumerate(value):
        tokens += tokenize(item, index == 0) if isinstance(item, str) else [item]
    return tokens


def object_prompt(value: dict[str, Any], param: str) -> str:
    """`{"prompt_string": text}` or `{"content": [text parts]}`: the text; media is a 400 (a text model)."""
    if "prompt_string" in value:
        if not isinstance(value["prompt_string"], str):
            raise HttpError(400, '"prompt_string" must be a string', param=param)
        if value.get("multimodal_data"):
            raise HttpError(400, "multimodal_data given, but this model reads text only", param=param)
        return value["prompt_string"]
    content = value.get("content")
    if not isinstance(content, list) or not content:
        raise HttpError(400, f'an object {param} needs "prompt_string" or a "content" array of parts', param=param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in MEDIA:
            raise HttpError(400, f"a {kind} part, but this model reads text only", param=param)
        else:
            raise HttpError(400, f"unsupported content part {kind!r} (text parts only)", param=param)
    return "".join(texts)
