"""GBNF grammars in Python: parsed, checked, and run one character at a time.

llama.cpp's grammar sampler constrains what the model samples; this module
does what that sampler does not offer: it checks a grammar before a request is
queued (a mistake is a 400 naming its line, never a failed request later), and
it follows a generation character by character to tell which text the grammar
forces next (Il Suggeritore drafts it). It parses llama.cpp's GBNF: rules
`name ::= …`, literals, character classes (negated too), `.`, groups,
alternatives, `* + ? {m} {m,} {m,n}`, comments; token matches (`<…>`) are
accepted and treated as opaque (nothing is forced across them).

The matcher is llama.cpp's algorithm: a set of stacks of positions in rules,
each stack's top a character class the next character must match; repetition
is rewritten into right-recursive rules, and a rule reference in tail position
replaces its caller, so stacks stay shallow.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from reame.errors import RequestError

WHITESPACE = frozenset(map(ord, " \t\n\r"))
MAX_EXPANSION_DEPTH = 200  # rule references followed without reading a character: left recursion


class GrammarError(RequestError):
    """A grammar that cannot be used, with where and why."""

    def __init__(self, message: str, param: str = "grammar") -> None:
        super().__init__(message, param=param, code="invalid_grammar")


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
    """Rules as alternatives of element sequences; `root` is where a text starts."""

    def __init__(self, names: list[str], rules: list[list[tuple[Element, ...]]], root: int) -> None:
        self.names, self.rules, self.root = names, rules, root
        self._expanded: dict[Stack, frozenset[Stack]] = {}
        self._advanced: dict[tuple[frozenset[Stack], int], frozenset[Stack]] = {}
        self._forced: dict[tuple[frozenset[Stack], bool], int | None] = {}

    def start(self) -> frozenset[Stack]:
        stacks: set[Stack] = set()
        for alternative in range(len(self.rules[self.root])):
            stacks |= self.expand(((self.root, alternative, 0),))
        return frozenset(stacks)

    def expand(self, stack: Stack, depth: int = 0) -> frozenset[Stack]:
        """The stacks `stack` stands for whose top is a character class (or a token), and () for a
        finished text: rule references are followed, finished alternatives popped."""
        known = self._expanded.get(stack)
        if known is not None:
            return known
        if depth > MAX_EXPANSION_DEPTH:
            raise GrammarError(f"rule '{self.names[stack[-1][0]]}' refers to itself before reading a character "
                               "(left recursion)")
        if not stack:
            result = frozenset({()})
        else:
            rule, alternative, index = stack[-1]
            sequence = self.rules[rule][alternative]
            if index == len(sequence):
                result = self.expand(stack[:-1], depth + 1)
            elif isinstance(sequence[index], Ref):
                callee = sequence[index].rule
                # In tail position the caller is done: pop it (right recursion stays one frame deep).
                base = stack[:-1] if index + 1 == len(sequence) else stack[:-1] + ((rule, alternative, index + 1),)
                found: set[Stack] = set()
                for option in range(len(self.rules[callee])):
                    found |= self.expand(base + ((callee, option, 0),), depth + 1)
                result = frozenset(found)
            else:
                result = frozenset({stack})
        self._expanded[stack] = result
        return result

    def advance(self, stacks: frozenset[Stack], code: int) -> frozenset[Stack]:
        """The stacks after reading the character `code` (empty: the grammar refuses it)."""
        key = (stacks, code)
        known = self._advanced.get(key)
        if known is not None:
            return known
        result: set[Stack] = set()
        for stack in stacks:
            if not stack:
                continue
            rule, alternative, index = stack[-1]
            element = self.rules[rule][alternative][index]
            if isinstance(element, Chars) and element.matches(code):
                result |= self.expand(stack[:-1] + ((rule, alternative, index + 1),))
        frozen = frozenset(result)
        if len(self._advanced) < 100_000:
            self._advanced[key] = frozen
        return frozen

    def forced(self, stacks: frozenset[Stack], besides_whitespace: bool = False) -> int | None:
        """The one character every way on allows, if there is exactly one (and the text cannot end here);
        `besides_whitespace`: the one character allowed other than whitespace, which may come first."""
        key = (stacks, besides_whitespace)
        if key not in self._forced:
            self._forced[key] = self._find_forced(stacks, besides_whitespace)
        return self._forced[key]

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
        for char in text:
            stacks = self.advance(stacks, ord(char))
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
        self._previous = ""
        self._layout: tuple[str, str] | None = None  # (the habit's key, whitespace so far) being written

    def feed(self, text: str) -> bool:
        """Read emitted text; False once the grammar refuses it (then nothing more is forced)."""
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
                    self.habits[self._layout[0]] = self._layout[1]
                    self._layout = None
            self.stacks = grammar.advance(self.stacks, ord(char))
            self._previous = char
        return bool(self.stacks)

    def forced_text(self, limit: int) -> str:
        """Up to `limit` characters the grammar allows and nothing else from here, through optional
        whitespace laid out as before."""
        grammar = self.grammar
        stacks, out = self.stacks, ""
        before, written = (self._layout[0][:-1], self._layout[1]) if self._layout is not None \
            else (self._previous, "")
        while stacks and len(out) < limit:
            code = grammar.forced(stacks)
            if code is None:
                code = grammar.forced(stacks, besides_whitespace=True)
                habit = self.habits.get(before + chr(code)) if code is not None else None
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


# --- the GBNF parser --------------------------------------------------------------------------

NAME = re.compile(r"[a-zA-Z0-9_-]+")
ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^"}


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        self.rules: list[list[tuple[Element, ...]] | None] = []
        self.used_at: dict[str, int] = {}

    def fail(self, at: int, why: str) -> GrammarError:
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return GrammarError(f"grammar line {line}, column {column}: {why}")

    def rule_id(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = len(self.names)
            self.names.append(name)
            self.rules.append(None)
        return self.ids[name]

    def new_rule(self, base: str, alternatives: list[tuple[Element, ...]]) -> Ref:
        name = f"{base}-{len(self.names)}"
        rule = self.rule_id(name)
        self.rules[rule] = alternatives
        return Ref(rule)

    def space(self, at: int, newlines: bool) -> int:
        while at < len(self.text):
            char = self.text[at]
            if char == "#":
                while at < len(self.text) and self.text[at] != "\n":
                    at += 1
            elif char in " \t\r" or (newlines and char == "\n"):
                at += 1
            else:
                break
        return at

    def parse(self) -> Grammar:
        at = self.space(0, True)
        while at < len(self.text):
            match = NAME.match(self.text, at)
            if not match:
                raise self.fail(at, "expected a rule name")
            name = match.group()
            at = self.space(match.end(), False)
            if not self.text.startswith("::=", at):
                raise self.fail(at, f"expected '::=' after '{name}'")
            rule = self.rule_id(name)
            if self.rules[rule] is not None:
                raise self.fail(match.start(), f"rule '{name}' is defined twice")
            alternatives, at = self.alternatives(self.space(at + 3, False), name, nested=False)
            self.rules[rule] = alternatives
            if at < len(self.text) and self.text[at] not in "\n":
                raise self.fail(at, f"unexpected '{self.text[at]}'")
            at = self.space(at, True)
        for name, rule in self.ids.items():
            if self.rules[rule] is None:
                raise self.fail(self.used_at.get(name, 0), f"rule '{name}' is used but never defined")
        if "root" not in self.ids:
            raise GrammarError("the grammar has no 'root' rule")
        rules = [rule for rule in self.rules if rule is not None]
        grammar = Grammar(self.names, rules, self.ids["root"])
        for rule in range(len(rules)):  # left recursion anywhere, not only from root
            for alternative in range(len(rules[rule])):
                grammar.expand(((rule, alternative, 0),))
        return grammar

    def alternatives(self, at: int, name: str, nested: bool) -> tuple[list[tuple[Element, ...]], int]:
        result = []
        sequence, at = self.sequence(at, name, nested)
        result.append(sequence)
        while at < len(self.text) and self.text[at] == "|":
            sequence, at = self.sequence(self.space(at + 1, True), name, nested)
            result.append(sequence)
        return result, at

    def sequence(self, at: int, name: str, nested: bool) -> tuple[tuple[Element, ...], int]:
        elements: list[Element] = []
        last_start = 0  # where the last symbol's elements begin (a repetition applies to them)
        while at < len(self.text):
            char = self.text[at]
            if char == '"':
                last_start = len(elements)
                at += 1
                while True:
                    if at >= len(self.text):
                        raise self.fail(at, "unterminated string literal")
                    if self.text[at] == '"':
                        at += 1
                        break
                    code, at = self.char(at)
                    elements.append(Chars(((code, code),)))
                if last_start == len(elements):  # "" matches nothing: an empty group
                    elements.append(self.new_rule(name, [()]))
            elif char == "[":
                last_start = len(elements)
                element, at = self.char_class(at + 1)
                elements.append(element)
            elif char == ".":
                last_start = len(elements)
                elements.append(Chars((), negated=True))
                at += 1
            elif char == "(":
                last_start = len(elements)
                alternatives, at = self.alternatives(self.space(at + 1, True), name, nested=True)
                if at >= len(self.text) or self.text[at] != ")":
                    raise self.fail(at, "expected ')'")
                at += 1
                elements.append(self.new_rule(name, alternatives))
            elif char == "<" or (char == "!" and self.text.startswith("<", at + 1)):
                last_start = len(elements)
                end = self.text.find(">", at)
                if end < 0:
                    raise self.fail(at, "unterminated token match")
                elements.append(TokenMatch(self.text[at:end + 1]))
                at = end + 1
            elif char in "*+?{":
                if last_start == len(elements):
                    raise self.fail(at, f"'{char}' repeats nothing")
                low, high, at = self.repetition(at)
                repeated = tuple(elements[last_start:])
                del elements[last_start:]
                elements.extend(self.repeat(name, repeated, low, high))
                last_start = len(elements)  # a second repetition in a row applies to nothing
            elif NAME.match(char):
                match = NAME.match(self.text, at)
                assert match is not None
                after = self.space(match.end(), False)
                if self.text.startswith("::=", after):
                    break  # the next rule (its name is at the start of a line)
                last_start = len(elements)
                self.used_at.setdefault(match.group(), at)
                elements.append(Ref(self.rule_id(match.group())))
                at = match.end()
            else:
                break
            at = self.space(at, nested)
        return tuple(elements), at

    def repeat(self, name: str, repeated: tuple[Element, ...], low: int, high: int | None) -> list[Element]:
        """`repeated` between `low` and `high` times (None: no upper bound), as right-recursive rules."""
        out: list[Element] = list(repeated) * low
        if high is None:
            star = self.new_rule(name, [])
            self.rules[star.rule] = [repeated + (star,), ()]
            out.append(star)
        elif high > low:
            optional: Ref | None = None
            for _ in range(high - low):
                optional = self.new_rule(name, [repeated + ((optional,) if optional else ()), ()])
            assert optional is not None
            out.append(optional)
        return out

    def repetition(self, at: int) -> tuple[int, int | None, int]:
        char = self.text[at]
        if char == "*":
            return 0, None, at + 1
        if char == "+":
            return 1, None, at + 1
        if char == "?":
            return 0, 1, at + 1
        match = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(self.text, at)
        if not match:
            raise self.fail(at, "expected {m}, {m,} or {m,n}")
        low = int(match.group(1))
        high = low if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
        if high is not None and high < low:
            raise self.fail(at, f"{{{low},{high}}}: the most is below the least")
        return low, high, match.end()

    def char_class(self, at: int) -> tuple[Chars, int]:
        negated = self.text.startswith("^", at)
        at += negated
        ranges = []
        while True:
            if at >= len(self.text):
                raise self.fail(at, "unterminated character class")
            if self.text[at] == "]":
                return Chars(tuple(ranges), negated), at + 1
            low, at = self.char(at)
            high = low
            if self.text.startswith("-", at) and at + 1 < len(self.text) and self.text[at + 1] != "]":
                high, at = self.char(at + 1)
                if high < low:
                    raise self.fail(at, "a character range runs backwards")
            ranges.append((low, high))

    def char(self, at: int) -> tuple[int, int]:
        char = self.text[at]
        if char != "\\":
            return ord(char), at + 1
        if at + 1 >= len(self.text):
            raise self.fail(at, "a '\\' ends the grammar")
        kind = self.text[at + 1]
        if kind in ESCAPES:
            return ord(ESCAPES[kind]), at + 2
        digits = {"x": 2, "u": 4, "U": 8}.get(kind)
        if digits is None:
            raise self.fail(at, f"unknown escape '\\{kind}'")
        hex_digits = self.text[at + 2:at + 2 + digits]
        if len(hex_digits) != digits or not all(c in "0123456789abcdefABCDEF" for c in hex_digits):
            raise self.fail(at, f"'\\{kind}' needs {digits} hexadecimal digits")
        return int(hex_digits, 16), at + 2 + digits


def parse_gbnf(text: str) -> Grammar:
    """The grammar of a GBNF text; GrammarError naming the line and column of a mistake."""
    return _Parser(text).parse()


@functools.lru_cache(maxsize=64)
def compiled(text: str) -> Grammar:
    """`parse_gbnf`, once per text: requests with the same schema share one grammar and its caches."""
    return parse_gbnf(text)
