"""A thinking model's answer split into its thinking and its content as the text streams: the text between
`<think>` and `</think>` is thinking (OpenAI's reasoning_content, Ollama's thinking, Anthropic's thinking
block), the rest is the answer. A tag split across two pieces of text is held back until it is whole.

Templates differ in who writes the opening tag: Qwen3's lets the model write `<think>` itself, others end
the prompt with it (then the answer starts inside the thinking), and with the thinking turned off Qwen3's
closes an empty one in the prompt. `ThinkingSplitter.for_prompt` reads which from the prompt's end. The
opening tag is only read before any content: later, `<think>` in an answer is the answer's text.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ThinkingSplitter:
    def __init__(self, inside: bool = False) -> None:
        """`inside`: the prompt opened the thinking (the answer starts in it)."""
        self.inside = inside
        self.may_open = not inside  # an opening tag is read only before any content
        self.trim = True  # whitespace right after a tag (and at the start) belongs to neither part
        self._held = ""

    @classmethod
    def for_prompt(cls, prompt: str) -> ThinkingSplitter:
        tail = prompt.rstrip()
        return cls(inside=tail.endswith(OPEN))

    def feed(self, text: str) -> list[tuple[str, str]]:
        """("thinking" | "content", text) pieces of `text`, in order."""
        said: list[tuple[str, str]] = []
        text = self._held + text
        self._held = ""
        while text:
            marker = CLOSE if self.inside else OPEN
            if not self.inside and not self.may_open:
                self._say(said, text)
                return said
            at = text.find(marker)
            if at >= 0 and (self.inside or not text[:at].strip()):
                self._say(said, text[:at])
                text = text[at + len(marker):]
                self.inside, self.may_open, self.trim = not self.inside, False, True
                continue
            keep = 0 if at >= 0 else _partial(text, marker)
            self._say(said, text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return said

    def finish(self) -> list[tuple[str, str]]:
        """What is still held back (an unfinished tag is text after all)."""
        said: list[tuple[str, str]] = []
        self._say(said, self._held)
        self._held = ""
        return said

    def _say(self, said: list[tuple[str, str]], text: str) -> None:
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        if not text:
            return
        if not self.inside:
            self.may_open = False
        kind = "thinking" if self.inside else "content"
        if said and said[-1][0] == kind:
            said[-1] = (kind, said[-1][1] + text)
        else:
            said.append((kind, text))


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
