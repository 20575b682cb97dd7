"""Il Suggeritore (the prompter): drafts the text the form of an answer forces.

Two kinds of text need no model to guess:

- what the request's grammar forces from where the answer is: a JSON
  schema's keys, quotes and punctuation, an enum's only possible rest, a
  closing tag (structured/grammar.py follows the answer character by character);
- what structure predicts at the start of a line: the next number of a
  numbered list, the same bullet, a table's leading pipe, the indentation of
  the line before, and in code the closing bracket of a block once a line
  starts back at the indentation of the line that opened it.

The text is tokenized as the model's vocabulary would and proposed as a
draft. Drafts are verified, never forced: the model's own draw decides every
token, so its tokenization stays canonical and greedy output is identical with
and without Il Suggeritore (a tokenization the model would not choose is
simply rejected, and the controller learns how often that happens).
"""

from __future__ import annotations

import codecs
import collections
import re
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from reame.structured.grammar import Grammar, GrammarState, GrammarTooAmbiguous

K = TypeVar("K")
V = TypeVar("V")

REMEMBERED_GRAMMARS = 64  # grammars whose answers' whitespace is remembered
# Forced texts whose tokens are remembered: a schema's few keys and punctuation come back at every answer, and
# tokenizing one took 0.35 ms on SmolLM2-135M (a regex pre-tokenizer), 4% of its 9 ms decode step.
REMEMBERED_TEXTS = 1024
TAIL_TOKENS = 200  # prompt tokens read back for the text of the lines before the answer
CHARS_PER_TOKEN = 4  # forced text read ahead per drafted token
# A line start's pattern, what it predicts, and what usually follows that (see Suggeritore.tokens_of).
LINE_PATTERNS = (
    (re.compile(r"^([ \t]*)(\d{1,4})([.)])[ \t]"), lambda m: f"{m.group(1)}{int(m.group(2)) + 1}{m.group(3)}",
     " x"),
    (re.compile(r"^([ \t]*)([-*+•])[ \t]"), lambda m: f"{m.group(1)}{m.group(2)}", " x"),
    (re.compile(r"^([ \t]*)\|"), lambda m: f"{m.group(1)}|", " x"),
    (re.compile(r"^([ \t]+)\S"), lambda m: m.group(1), "x"),
)
CLOSERS = {"(": ")", "[": "]", "{": "}"}
NEXT_WORD = "x"  # what grammar-forced text is tokenized before: string content, mostly


class Suggeritore:
    """The draft source (`name` "suggeritore"); free: proposing is a few dictionary lookups."""

    name = "suggeritore"
    free = True

    def __init__(self, piece: Callable[[int], bytes], tokenize: Callable[[str], list[int]],
                 detokenize: Callable[[Sequence[int]], str]) -> None:
        """`piece`: a token's bytes; `tokenize`: text to tokens without BOS or special tokens;
        `detokenize`: tokens to text (the backend's, all thread-safe)."""
        self.piece, self.tokenize, self.detokenize = piece, tokenize, detokenize
        # Per grammar, the whitespace the latest answer wrote where the grammar left it open: the next
        # answer to the same schema starts from it (the same model lays the same JSON out the same way).
        self._layouts: collections.OrderedDict[bytes, dict[str, str]] = collections.OrderedDict()
        self._tokenized: collections.OrderedDict[tuple[str, str], tuple[int, ...]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def tokens_of(self, text: str, following: str = NEXT_WORD) -> list[int]:
        """`text` as the model would tokenize it inside the answer, as far as that is knowable.

        Tokenizers split text into words before they look up tokens, and where
        a draft ends, its last characters may belong with the next word: the
        model writes a line break, two spaces and `"name"` as the break, ` `,
        ` "` and `name`, while the break and two spaces alone would be the
        break and `  `, a draft it refuses at its last token. So the text is
        tokenized followed by what likely comes next (`following`: after a
        list number or a table pipe a space and a word, after indentation a
        word), and only the tokens that lie wholly inside the text are
        drafted (up to where the tokenizer changed the text, if it did).
        The latest REMEMBERED_TEXTS are remembered.
        """
        with self._lock:
            known = self._tokenized.get((text, following))
            if known is not None:
                self._tokenized.move_to_end((text, following))
                return list(known)
        encoded, written, kept = text.encode(), b"", []
        for token in self.tokenize(text + following):
            piece = self.piece(token)
            if not encoded.startswith(written + piece):
                break
            kept.append(token)
            written += piece
        with self._lock:
            keep_latest(self._tokenized, (text, following), tuple(kept), REMEMBERED_TEXTS)
        return kept

    def drafter(self, prompt: Sequence[int], grammar: Grammar | None = None) -> SuggeritoreDrafter:
        state = GrammarState(grammar) if grammar is not None else None
        if state is not None:
            with self._lock:
                state.habits.update(self._layouts.get(state.grammar.key, {}))
        return SuggeritoreDrafter(self, self.detokenize(prompt[-TAIL_TOKENS:]), state)

    def remember(self, grammar: Grammar, habits: dict[str, str]) -> None:
        """Keep an answer's whitespace habits for the next answer to `grammar` (the latest few grammars)."""
        with self._lock:
            keep_latest(self._layouts, grammar.key, dict(habits), REMEMBERED_GRAMMARS)

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class SuggeritoreDrafter:
    matched = 0  # not a copying source: one match class (Drafter.matched)

    def __init__(self, source: Suggeritore, text: str, grammar: GrammarState | None) -> None:
        self.source = source
        self.line = text.rsplit("\n", 1)[-1]  # the line being written
        self.previous = text.rsplit("\n", 2)[-2] if "\n" in text else ""  # the line before it
        self.grammar = grammar
        self.open_brackets: list[tuple[str, str]] = []  # (closer, indentation of its line), innermost last
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def observe(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            text = self._decoder.decode(self.source.piece(token))
            if not text:
                continue
            try:
                if self.grammar is not None and not self.grammar.feed(text):
                    self.grammar = None  # the answer left the grammar (cannot happen under the sampler): stop
            except GrammarTooAmbiguous:
                self.grammar = None  # the engine ends the request: nothing more to draft
            for char in text:
                self._follow(char)

    def _follow(self, char: str) -> None:
        if char == "\n":
            self.previous, self.line = self.line, ""
            return
        self.line += char
        if char in CLOSERS:
            self.open_brackets.append((CLOSERS[char], indentation(self.line)))
        elif self.open_brackets and char == self.open_brackets[-1][0]:
            self.open_brackets.pop()

    def propose(self, limit: int) -> list[int]:
        if limit <= 0:
            return []
        text = self.grammar.forced_text(limit * CHARS_PER_TOKEN) if self.grammar is not None else ""
        following = NEXT_WORD
        if not text and self.line == "":
            text, following = next(((make(match), after) for pattern, make, after in LINE_PATTERNS
                                    if (match := pattern.match(self.previous))), ("", ""))
        if not text and self.line and not self.line.strip():
            text, following = self._closer(), "\n"
        return self.source.tokens_of(text, following)[:limit] if text else []

    def _closer(self) -> str:
        """The innermost open bracket's closer, when this line's indentation went back to its opener's line
        from deeper: the shape of a block ending in C, JavaScript, Rust, JSON or a multi-line Python list."""
        if not self.open_brackets:
            return ""
        closer, opener_indentation = self.open_brackets[-1]
        returned = self.line == opener_indentation and len(indentation(self.previous)) > len(self.line)
        return closer if returned else ""

    def close(self) -> None:
        if self.grammar is not None and self.grammar.habits:
            self.source.remember(self.grammar.grammar, self.grammar.habits)


def keep_latest(entries: collections.OrderedDict[K, V], key: K, value: V, most: int) -> None:
    """Put `value` under `key` as the latest of `entries`, forgetting the oldest past `most`."""
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > most:
        entries.popitem(last=False)


def indentation(line: str) -> str:
    return line[:len(line) - len(line.lstrip(" \t"))]
