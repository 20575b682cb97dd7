"""Token bytes -> streamed text: UTF-8 safe, stop strings matched across tokens.

A token may end in the middle of a UTF-8 character: its bytes are held until the
character is complete. Text that could be the start of a stop string is held
until it is clear either way, so a stop string never leaks into the output,
even when it spans several tokens.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._held = ""  # decoded text not yet emitted: a possible stop-string prefix
        self.stopped = False
        self.matched = ""  # the stop string that ended the text (Anthropic's clients are told which)

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit."""
        text = self._decoder.decode(piece)
        if not self._stop:
            return text
        held = self._held + text
        if not held:
            return ""
        cut = self._first_stop(held)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return held[:cut]
        keep = self._longest_stop_prefix_suffix(held)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]

    def flush(self) -> str:
        """At the end of generation: everything still held (incomplete bytes become U+FFFD)."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text

    def _first_stop(self, text: str) -> int:
        found = -1
        for stop in self._stop:
            index = text.find(stop)
            if index >= 0 and (found < 0 or index < found):
                found, self.matched = index, stop
        return found

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:length]):
                    best = length
                    break
        return best
