"""Grammars run one character at a time: what a text may be, and what the grammar forces next.

llama.cpp's grammar sampler constrains what the model samples; this module
does what that sampler does not offer: it follows a generation character by
character to tell which text the grammar forces next (Il Suggeritore drafts
it), and bounds what following it costs. Grammars come from GBNF text
(gbnf.py parses and checks it, and keeps the compiled ones).

The matcher is llama.cpp's algorithm: a set of stacks of positions in rules,
each stack's top a character class the next character must match; repetition
is rewritten into right-recursive rules, and a rule reference in tail position
replaces its caller, so stacks stay shallow.

A grammar is untrusted input, so following it is bounded: the parser states
one character may leave (a grammar can be ambiguous enough to need a state per
character read so far: `a ::= "x" a "y"? | "x"`), and the memory of each
grammar's memo tables. Past a bound the answer is GrammarTooAmbiguous, at its
start (when it is parsed) or while the text is read; the same bounds hold for
llama.cpp's matcher, which follows the same states.
"""

from __future__ import annotations

from dataclasses import dataclass

from reame.errors import RequestError

WHITESPACE = frozenset(map(ord, " \t\n\r"))
MAX_EXPANSION_DEPTH = 200  # rule references followed without reading a character: left recursion
# Parser states one character may leave: stacks, and positions summed over them. JSON schemas need tens;
# past this a grammar is ambiguous enough to cost more per character than the model's step.
MAX_STACKS = 512
MAX_POSITIONS = 16_384
MEMO_ENTRIES = 2048  # per memo table of a grammar (cleared when full: they only save time)
MAX_HABIT_CHARS = 64  # the longest whitespace remembered as a layout habit
# What a compiled grammar holds, in bytes, as tracemalloc measured it here: a slot per element, a rule's
# lists and name, a memo entry's stacks and key (gbnf.py's cache of compiled grammars is bounded by their sum).
ELEMENT_BYTES, RULE_BYTES, MEMO_ENTRY_BYTES = 8, 500, 400


class GrammarError(RequestError):
    """A grammar that cannot be used, with where and why."""

    def __init__(self, message: str, param: str = "grammar") -> None:
        super().__init__(message, param=param, code="invalid_grammar")


class GrammarTooAmbiguous(GrammarError):
    """The text read so far leaves more parser states than MAX_STACKS / MAX_POSITIONS."""


@dataclass(frozen=True)
class Chars:
    """One character from `ranges` (inclusive code point pairs), or any but those when `negated`."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def matches(self, code: int) -> bool:
        inside = any(low <= code <= high for low, high in self.ranges)
        return inside != self.negated


@dataclass(frozen=True)
class Ref:
    rule: int


@dataclass(frozen=True)
class TokenMatch:
    """A `<token>` or `<[id]>` match: opaque here (llama.cpp checks it against the vocabulary)."""

    text: str


Element = Chars | Ref | TokenMatch
Position = tuple[int, int, int]  # rule, alternative, index of the next element
Stack = tuple[Position, ...]


class Grammar:
    """Rules as alternatives of element sequences; `root` is where a text starts; `size` counts their
    elements; `key` names the text it was parsed from (its sha256). Its memo tables are shared by every
    reader of the grammar (any thread: a lookup or an insertion is atomic, a table cleared meanwhile
    only costs a recomputation)."""

    def __init__(self, names: list[str], rules: list[list[tuple[Element, ...]]], root: int, size: int = 0,
                 key: bytes = b"") -> None:
        self.names, self.rules, self.root, self.size, self.key = names, rules, root, size, key
        self._expanded: dict[Stack, frozenset[Stack]] = {}
        self._advanced: dict[tuple[frozenset[Stack], int], frozenset[Stack]] = {}
        self._forced: dict[tuple[frozenset[Stack], bool], int | None] = {}

    @property
    def bytes(self) -> int:
        """About what the grammar holds in memory now, memo tables included (see ELEMENT_BYTES)."""
        memo = len(self._expanded) + len(self._advanced) + len(self._forced)
        return ELEMENT_BYTES * self.size + RULE_BYTES * len(self.rules) + MEMO_ENTRY_BYTES * memo

    def start(self) -> frozenset[Stack]:
        stacks: set[Stack] = set()
        for alternative in range(len(self.rules[self.root])):
            stacks |= self._expand_read(((self.root, alternative, 0),), "at its start")
        return self._bounded(frozenset(stacks), "at its start")

    def _expand_read(self, stack: Stack, where: str) -> frozenset[Stack]:
        """`expand` while a text is read: the grammar was checked for left recursion when it was parsed,
        so following more than MAX_EXPANSION_DEPTH rules without reading a character is ambiguity
        (optional endings closing rule after rule), bounded like the rest."""
        try:
            return self.expand(stack)
        except GrammarTooAmbiguous:
            raise
        except GrammarError:
            raise GrammarTooAmbiguous(f"the grammar is too ambiguous: {where} it follows more than "
                                      f"{MAX_EXPANSION_DEPTH} rules at once without reading a character") from None

    @staticmethod
    def _bounded(stacks: frozenset[Stack], where: str) -> frozenset[Stack]:
        """`stacks`, or GrammarTooAmbiguous when they are more than the matcher keeps."""
        positions = sum(map(len, stacks))
        if len(stacks) > MAX_STACKS or positions > MAX_POSITIONS:
            raise GrammarTooAmbiguous(
                f"the grammar is too ambiguous: {where} it could be in {len(stacks)} places at once, "
                f"{positions} parser positions in all (the limits are {MAX_STACKS} and {MAX_POSITIONS})")
        return stacks

    @staticmethod
    def _remember(table: dict, key: object, value: object) -> None:
        if len(table) >= MEMO_ENTRIES:
            table.clear()
        table[key] = value

    def expand(self, stack: Stack, depth: int = 0) -> frozenset[Stack]:
        """The stacks `stack` stands for whose top is a character class (or a token), and () for a
        finished text: rule references are followed, finished alternatives popped."""
        known = self._expanded.get(stack)
        if known is not None:
            return known
        if depth > MAX_EXPANSION_DEPTH:
            raise GrammarError(f"rule '{self.names[stack[-1][0]]}' refers to itself before reading a character "
                               "(left recursion)")
        height = len(stack)
        while height and stack[height - 1][2] == len(self.rules[stack[height - 1][0]][stack[height - 1][1]]):
            height -= 1  # finished alternatives pop, as many as have finished
        result: frozenset[Stack]
        if height == 0:
            result = frozenset({()})
        elif height < len(stack):
            result = self.expand(stack[:height], depth)
        else:
            rule, alternative, index = stack[-1]
            sequence = self.rules[rule][alternative]
            element = sequence[index]
            if isinstance(element, Ref):
                callee = element.rule
                # In tail position the caller is done: pop it (right recursion stays one frame deep).
                base = stack[:-1] if index + 1 == len(sequence) else stack[:-1] + ((rule, alternative, index + 1),)
                found: set[Stack] = set()
                for option in range(len(self.rules[callee])):
                    found |= self.expand(base + ((callee, option, 0),), depth + 1)
                    if len(found) > MAX_STACKS:  # before the fan-out of nested alternatives multiplies on
                        self._bounded(frozenset(found), f"in rule '{self.names[callee]}'")
                result = frozenset(found)
            else:
                result = frozenset({stack})
        self._remember(self._expanded, stack, result)
        return result

    def advance(self, stacks: frozenset[Stack], code: int, read: int = 0) -> frozenset[Stack]:
        """The stacks after reading the character `code` (empty: the grammar refuses it); `read`: the
        characters read before it, for GrammarTooAmbiguous's message."""
        key = (stacks, code)
        known = self._advanced.get(key)
        if known is not None:
            return known
        result: set[Stack] = set()
        where = f"after {read + 1} characters"
        for stack in stacks:
            if not stack:
                continue
            rule, alternative, index = stack[-1]
            element = self.rules[rule][alternative][index]
            if isinstance(element, Chars) and element.matches(code):
                result |= self._expand_read(stack[:-1] + ((rule, alternative, index + 1),), where)
                if len(result) > MAX_STACKS:
                    self._bounded(frozenset(result), where)
        frozen = self._bounded(frozenset(result), where)
        self._remember(self._advanced, key, frozen)
        return frozen

    def forced(self, stacks: frozenset[Stack], besides_whitespace: bool = False) -> int | None:
        """The one character every way on allows, if there is exactly one (and the text cannot end here);
        `besides_whitespace`: the one character allowed other than whitespace, which may come first."""
        key = (stacks, besides_whitespace)
        if key in self._forced:
            return self._forced[key]
        found = self._find_forced(stacks, besides_whitespace)
        self._remember(self._forced, key, found)
        return found

    def _find_forced(self, stacks: frozenset[Stack], besides_whitespace: bool) -> int | None:
        allowed: set[int] = set()
        for stack in stacks:
            if not stack:
                return None
            rule, alternative, index = stack[-1]
            element = self.rules[rule][alternative][index]
            if not isinstance(element, Chars) or element.negated:
                return None
            for low, high in element.ranges:
                if besides_whitespace and all(code in WHITESPACE for code in range(low, min(high, low + 4) + 1)):
                    continue
                if high != low or len(allowed | {low}) > 1:
                    return None
                allowed.add(low)
        return next(iter(allowed)) if len(allowed) == 1 else None

    def accepts(self, text: str) -> bool:
        """Whether the whole of `text` is a sentence of the grammar."""
        stacks = self.start()
        for read, char in enumerate(text):
            stacks = self.advance(stacks, ord(char), read)
            if not stacks:
                return False
        return () in stacks


class GrammarState:
    """Where a generation is in its grammar, fed the text it emits; tells what text is forced next.

    Where the grammar lets whitespace come before its next character (JSON's
    `ws`), nothing is forced, yet a writer lays out its text the same way each
    time: between `{` and `"` a newline and two spaces, between `:` and `"` one
    space, between `"` and `}` a newline. So the state learns the whitespace
    written at each such place, keyed by the characters before and after it,
    and `forced_text` continues through such a place with the whitespace
    written there last time.
    """

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.stacks = grammar.start()
        self.habits: dict[str, str] = {}  # character before + character after -> the whitespace between
        self.read = 0  # characters fed so far
        self._previous = ""
        self._layout: tuple[str, str] | None = None  # (the habit's key, whitespace so far) being written

    def feed(self, text: str) -> bool:
        """Read emitted text; False once the grammar refuses it (then nothing more is forced).
        GrammarTooAmbiguous when the text leaves more parser states than the matcher keeps."""
        grammar = self.grammar
        for char in text:
            if not self.stacks:
                return False
            if self._layout is None and grammar.forced(self.stacks) is None:
                following = grammar.forced(self.stacks, besides_whitespace=True)
                if following is not None:
                    self._layout = (self._previous + chr(following), "")
            if self._layout is not None:
                if ord(char) in WHITESPACE:
                    self._layout = (self._layout[0], self._layout[1] + char)
                else:
                    if len(self._layout[1]) <= MAX_HABIT_CHARS:
                        self.habits[self._layout[0]] = self._layout[1]
                    self._layout = None
            self.stacks = grammar.advance(self.stacks, ord(char), self.read)
            self.read += 1
            self._previous = char
        return bool(self.stacks)

    def forced_text(self, limit: int) -> str:
        """Up to `limit` characters the grammar allows and nothing else from here, through optional
        whitespace laid out as before (only so far when reading on would be too ambiguous)."""
        try:
            return self._forced_text(limit)
        except GrammarTooAmbiguous:
            return ""

    def _forced_text(self, limit: int) -> str:
        grammar = self.grammar
        stacks, out = self.stacks, ""
        before, written = (self._layout[0][:-1], self._layout[1]) if self._layout is not None \
            else (self._previous, "")
        while stacks and len(out) < limit:
            code = grammar.forced(stacks)
            if code is None:
                code = grammar.forced(stacks, besides_whitespace=True)
                if code is None:
                    break
                habit = self.habits.get(before + chr(code))
                if habit is None or not habit.startswith(written):
                    break
                rest = habit[len(written):]
                for char in rest:
                    stacks = grammar.advance(stacks, ord(char))
                if not stacks:
                    break
                out += rest
            out += chr(code)
            stacks = grammar.advance(stacks, code)
            before, written = chr(code), ""
        return out[:limit]
