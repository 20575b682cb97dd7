"""OpenAI's response shapes: whole answers, stream chunks, usage and logprobs objects (a token's logprob entry
Ollama's answers share)."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reame import __version__
from reame.engine import FinishEvent, TokenEvent
from reame.structured.thinking import ThinkingSplitter
from reame.structured.tools import ToolCall, ToolCallParser


@dataclass
class Choice:
    pieces: list[str] = field(default_factory=list)  # joined once, at the end (non-streamed answers)
    finish: FinishEvent | None = None
    tokens: list[TokenEvent] = field(default_factory=list)  # kept only when logprobs were asked for
    ids: list[int] = field(default_factory=list)  # the generated tokens not yet sent on (llama-server's `tokens`)
    parser: ToolCallParser | None = None  # set when the request offered tools
    computed: bool = True  # False for an answer from the exact answer cache: no token was generated for it
    thinker: ThinkingSplitter | None = None  # set for a model that thinks in <think>…</think>
    thinking: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def split(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking, content) of a piece of the raw answer (`final`: its last)."""
        if self.thinker is None:
            return "", text
        parts = self.thinker.feed(text) + (self.thinker.finish() if final else [])
        thinking = "".join(part for kind, part in parts if kind == "thinking")
        if thinking:
            self.thinking.append(thinking)
        return thinking, "".join(part for kind, part in parts if kind == "content")

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    def finish_reason(self) -> str:
        assert self.finish is not None
        return "tool_calls" if self.calls else finish_reason(self.finish)


def logprob_entries(token_piece: Callable[[int], bytes], tokens: list[TokenEvent], ids: bool = False,
                    probabilities: bool = False) -> list[dict[str, Any]]:
    """Each token as OpenAI's chat answers and Ollama's give its logprob: its text, logprob and bytes, and
    its most likely alternatives likewise; with `ids`, each with its token id too (llama-server's); with
    `probabilities`, each as a `prob` with its `top_probs` (llama-server's post-sampling shape: those of
    probability 0 left out)."""
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        raw = token_piece(token)
        shaped: dict[str, Any] = {"id": token} if ids else {}
        shaped.update(token=raw.decode("utf-8", "replace"), bytes=list(raw))
        if probabilities:
            shaped["prob"] = math.exp(logprob) if logprob is not None else None
        else:
            shaped["logprob"] = logprob
        return shaped
    if probabilities:
        return [dict(entry(event.token, event.logprob),
                     top_probs=[entry(t, lp) for t, lp in event.top if math.exp(lp) > 0.0]) for event in tokens]
    return [dict(entry(event.token, event.logprob), top_logprobs=[entry(t, lp) for t, lp in event.top])
            for event in tokens]


def finish_reason(event: FinishEvent) -> str:
    return "length" if event.reason == "length" else "stop"


class Response:
    """OpenAI shapes for one request: the whole answer, or its stream chunks."""

    def __init__(self, chat: bool, model: str, token_piece: Any = None, per_prompt: int = 1) -> None:
        """`per_prompt`: choices (or Conclave attempts) per prompt, next to each other; they share the
        prompt, computed once."""
        self.chat = chat
        self.per_prompt = per_prompt
        self.model = model
        self.token_piece = token_piece  # set when logprobs were asked for
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        # The hot path of a stream is one text chunk per token: its JSON is this prefix, the
        # index, the text and a fixed suffix, so only the text is serialised per token.
        head = self._envelope("chat.completion.chunk" if chat else "text_completion", [])
        self._chunk_head = json.dumps(head, ensure_ascii=False, separators=(",", ":"))[:-2] + '{"index":'
        self._chunk_text = ',"delta":{"content":' if chat else ',"text":'
        self._chunk_tail = '},"logprobs":null,"finish_reason":null}]}' if chat else \
            ',"logprobs":null,"finish_reason":null}]}'

    def text_chunk(self, index: int, text: str) -> str:
        """A stream chunk carrying `text` and nothing else, serialised (equal to `chunk(index, text)`)."""
        return f"{self._chunk_head}{index}{self._chunk_text}{json.dumps(text, ensure_ascii=False)}{self._chunk_tail}"

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": f"reame-{__version__}", "choices": choices}

    def whole(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        shaped = []
        for index, choice in enumerate(choices):
            assert choice.finish is not None
            item: dict[str, Any] = {"index": index, "logprobs": self.logprobs(choice.tokens),
                                    "finish_reason": choice.finish_reason()}
            if self.chat:
                item["message"] = {"role": "assistant", "content": choice.text}
                if "".join(choice.thinking):
                    item["message"]["reasoning_content"] = "".join(choice.thinking)
                if choice.calls:
                    item["message"]["content"] = choice.text or None
                    item["message"]["tool_calls"] = [call.shaped() for call in choice.calls]
            else:
                item["text"] = choice.text
            shaped.append(item)
        body = self._envelope(self.object, shaped)
        body["usage"] = self.usage(choices, prompt_tokens)
        return body

    def first_chunk(self, index: int, echo: str) -> dict[str, Any] | None:
        if self.chat:
            # content null, as llama-server's and OpenAI's own tool-call chunks carry it: a role, no text yet.
            delta = {"role": "assistant", "content": None}
            return self._envelope("chat.completion.chunk", [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
        return self.chunk(index, echo) if echo else None

    def chunk(self, index: int, text: str, finish: str | None = None,
              tokens: list[TokenEvent] | None = None) -> dict[str, Any]:
        logprobs = self.logprobs(tokens or [])
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            item: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [item])
        item = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope("text_completion", [item])

    def progress_chunk(self, index: int, progress: dict[str, Any]) -> dict[str, Any]:
        """A stream chunk saying how far the prompt's prefill is (llama-server's `prompt_progress`): a chat's
        carries the role, as llama-server's does, and no text yet."""
        if self.chat:
            chunk = self._envelope("chat.completion.chunk", [
                {"index": index, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                 "finish_reason": None}])
        else:
            chunk = self._envelope("text_completion", [
                {"index": index, "text": "", "logprobs": None, "finish_reason": None}])
        chunk["prompt_progress"] = progress
        return chunk

    def reasoning_chunk(self, index: int, text: str) -> dict[str, Any]:
        """A chat stream chunk carrying thinking, as `reasoning_content` (the field OpenAI-compatible servers
        and clients use for it)."""
        return self._envelope("chat.completion.chunk", [
            {"index": index, "delta": {"reasoning_content": text}, "logprobs": None, "finish_reason": None}])

    def tool_call_chunk(self, index: int, position: int, call: ToolCall) -> dict[str, Any]:
        """A stream chunk carrying a whole tool call (its arguments in one piece), the `position`-th of the choice."""
        delta = {"tool_calls": [dict(call.shaped(), index=position)]}
        return self._envelope("chat.completion.chunk", [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])

    def logprobs(self, tokens: list[TokenEvent]) -> dict[str, Any] | None:
        """OpenAI's logprobs object: `content` entries for chat, parallel arrays for completions."""
        if self.token_piece is None:
            return None
        piece = self.token_piece
        if self.chat:
            return {"content": logprob_entries(piece, tokens), "refusal": None}
        texts = [piece(e.token).decode("utf-8", "replace") for e in tokens]
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in tokens],
                "top_logprobs": [{piece(t).decode("utf-8", "replace"): lp for t, lp in e.top} for e in tokens],
                "text_offset": offsets}

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(choices, prompt_tokens)
        return body

    def usage(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.finish.usage.completion_tokens for c in choices if c.finish is not None)
        shaped: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                  "total_tokens": prompt_tokens + completion}
        # A prompt is counted once for its choices: so are its cached tokens (those of the choice that
        # computed it; the others shared its KV and say all of it was cached).
        groups = [choices[i:i + self.per_prompt] for i in range(0, len(choices), self.per_prompt)]
        cached = sum(min((c.finish.usage.cached_tokens for c in group if c.finish is not None), default=0)
                     for group in groups)
        shaped["prompt_tokens_details"] = {"cached_tokens": cached}
        drafted = sum(c.finish.usage.draft_tokens for c in choices if c.finish is not None)
        accepted = sum(c.finish.usage.accepted_draft_tokens for c in choices if c.finish is not None)
        # OpenAI's names for predicted-output tokens fit speculative drafts: proposed, then confirmed or not.
        shaped["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                               "rejected_prediction_tokens": drafted - accepted}
        return shaped
