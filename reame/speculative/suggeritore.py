"""Il Suggeritore (the prompter): drafts the text the form of an answer forces.

Two kinds of text need no model to guess:

- what the request's grammar forces from where the answer is: a JSON
  schema's keys, quotes and punctuation, an enum's only possible rest, a
  closing tag (engine/grammar.py follows the answer character by character);
- what structure predicts at the start of a line: the next number of a
  numbered list, the same bullet, a table's leading pipe, the indentation of
  the line before.

The text is tokenized as the model's vocabulary would and proposed as a
draft. Drafts are verified, never forced: the model's own draw decides every
token, so its tokenization stays canonical and greedy output is identical with
and without Il Suggeritore (a tokenization the model would not choose is
simply rejected, and the controller learns how often that happens).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Sequence

from reame.engine.grammar import GrammarState, compiled

TAIL_TOKENS = 200  # prompt tokens read back for the text of the lines before the answer
CHARS_PER_TOKEN = 4  # forced text read ahead per drafted token
LINE_PATTERNS = (
    (re.compile(r"^([ \t]*)(\d{1,4})([.)])[ \t]"), lambda m: f"{m.group(1)}{int(m.group(2)) + 1}{m.group(3)}"),
    (re.compile(r"^([ \t]*)([-*+•])[ \t]"), lambda m: f"{m.group(1)}{m.group(2)}"),
    (re.compile(r"^([ \t]*)\|"), lambda m: f"{m.group(1)}|"),
    (re.compile(r"^([ \t]+)\S"), lambda m: m.group(1)),
)


class Suggeritore:
    """The draft source (`name` "suggeritore"); free: proposing is a few dictionary lookups."""

    name = "suggeritore"
    free = True

    def __init__(self, piece: Callable[[int], bytes], tokenize: Callable[[str], list[int]],
                 detokenize: Callable[[Sequence[int]], str]) -> None:
        """`piece`: a token's bytes; `tokenize`: text to tokens without BOS or special tokens;
        `detokenize`: tokens to text (the backend's, all thread-safe)."""
        self.piece, self.tokenize, self.detokenize = piece, tokenize, detokenize

    def drafter(self, prompt: Sequence[int], grammar: str | None = None) -> SuggeritoreDrafter:
        state = GrammarState(compiled(grammar)) if grammar is not None else None
        return SuggeritoreDrafter(self, self.detokenize(prompt[-TAIL_TOKENS:]), state)

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class SuggeritoreDrafter:
    def __init__(self, source: Suggeritore, text: str, grammar: GrammarState | None) -> None:
        self.source = source
        self.line = text.rsplit("\n", 1)[-1]  # the line being written
        self.previous = text.rsplit("\n", 2)[-2] if "\n" in text else ""  # the line before it
        self.grammar = grammar
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def observe(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            text = self._decoder.decode(self.source.piece(token))
            if not text:
                continue
            if self.grammar is not None and not self.grammar.feed(text):
                self.grammar = None  # the answer left the grammar (cannot happen under the sampler): stop
            lines = text.split("\n")
            if len(lines) > 1:
                self.previous = lines[-2] if len(lines) > 2 else self.line + lines[0]
                self.line = lines[-1]
            else:
                self.line += text

    def propose(self, limit: int) -> list[int]:
        if limit <= 0:
            return []
        text = self.grammar.forced_text(limit * CHARS_PER_TOKEN) if self.grammar is not None else ""
        if not text and self.line == "":
            text = next((make(match) for pattern, make in LINE_PATTERNS if (match := pattern.match(self.previous))),
                        "")
        return self.source.tokenize(text)[:limit] if text else []

    def close(self) -> None:
        pass
