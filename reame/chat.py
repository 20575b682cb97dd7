"""The interactive chat: a conversation kept through the model's chat template.

`Conversation` holds the turns and drops the oldest ones when the next prompt
would not fit the context; `repl` reads lines, streams answers, and handles the
slash commands. Ctrl-C stops the current answer without leaving the chat.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, TextIO

from reame.engine import Engine, FinishEvent, GenerationRequest, SamplingParams, Session, TokenEvent

HELP = """commands:
  /reset   forget the conversation
  /exit    leave (Ctrl-D works too)
  /help    this text
A line ending with \\ continues on the next line; so does everything between two lines of \"\"\"."""


@dataclass
class Conversation:
    engine: Engine
    params: SamplingParams
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def prompt_for(self, user_text: str) -> tuple[str, int]:
        """The templated prompt with the new user turn, and how many old turns were dropped to fit."""
        self.turns.append({"role": "user", "content": user_text})
        limit = self.engine.context_per_request - (self.params.max_tokens or 0)
        dropped = 0
        while True:
            text = self.engine.chat_prompt(self.messages())
            if len(self.engine.backend.tokenize(text)) < limit or len(self.turns) <= 1:
                return text, dropped
            # Drop the oldest exchange (a user turn and the answer that followed it).
            del self.turns[:2 if len(self.turns) > 2 else 1]
            dropped += 1

    def answered(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def reset(self) -> None:
        self.turns.clear()


def line_reader(stream: TextIO = sys.stdin) -> Callable[[str], str]:
    """`input` on a terminal (with line editing); prompt-less reads from a pipe, so no prompts land in the output."""
    if stream.isatty():
        return input

    def read(_prompt: str) -> str:
        line = stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")
    return read


def read_message(read_line: Callable[[str], str]) -> str | None:
    """One user message (possibly multi-line); None at end of input."""
    try:
        line = read_line("> ")
    except EOFError:
        return None
    if line.strip() == '"""':
        lines = []
        while True:
            try:
                line = read_line("")
            except EOFError:
                break
            if line.strip() == '"""':
                break
            lines.append(line)
        return "\n".join(lines)
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        try:
            line = read_line("… ")
        except EOFError:
            break
    parts.append(line)
    return "\n".join(parts)


def repl(conversation: Conversation, read_line: Callable[[str], str], out: TextIO = sys.stdout,
         err: TextIO = sys.stderr, title: str = "") -> int:
    print(f"Chatting with {title}. /help for commands, /exit or Ctrl-D to quit.", file=err)
    while True:
        try:
            message = read_message(read_line)
        except KeyboardInterrupt:
            print("\n(use /exit or Ctrl-D to quit)", file=err)
            continue
        if message is None:
            print(file=err)
            return 0
        command = message.strip()
        if not command:
            continue
        if command == "/exit":
            return 0
        if command == "/help":
            print(HELP, file=err)
            continue
        if command == "/reset":
            conversation.reset()
            print("(conversation forgotten)", file=err)
            continue
        prompt, dropped = conversation.prompt_for(message)
        if dropped:
            print(f"(dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''} to fit the context)",
                  file=err)
        text, finish = stream_answer(conversation.engine, prompt, conversation.params, out, err)
        if finish.reason == "error":
            print(f"(error: {finish.message})", file=err)
        conversation.answered(text)


def stream_answer(engine: Engine, prompt: str, params: SamplingParams, out: TextIO,
                  err: TextIO, session: Session | None = None) -> tuple[str, FinishEvent]:
    """Stream one answer to `out` (continuing `session`'s KV, if any); Ctrl-C cancels it and keeps what was
    shown."""
    handle = engine.submit(GenerationRequest(prompt, params, streamed=True, session=session))
    shown: list[str] = []
    try:
        for event in handle:
            if isinstance(event, TokenEvent) and event.text:
                out.write(event.text)
                out.flush()
                shown.append(event.text)
            handle.delivered()
    except KeyboardInterrupt:
        handle.cancel()
        for _ in handle:
            pass
        print("\n(stopped)", file=err)
    finish = handle.finish
    assert finish is not None
    if finish.text:
        out.write(finish.text)
        shown.append(finish.text)
    out.write("\n")
    out.flush()
    return "".join(shown), finish
