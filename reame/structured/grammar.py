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

A grammar is untrusted input (22 bytes can ask for 200,000 rules), so every
cost is bounded: repetition counts as llama.cpp bounds them (and what it would
refuse is refused here first, naming the rule), the rules' total size once
repetitions are written out, the nesting of groups, the parser states one
character may leave (a grammar can be ambiguous enough to need a state per
character read so far: `a ::= "x" a "y"? | "x"`), and the memory of each
grammar's memo tables. Past a bound the answer is a GrammarError, at parse time
or, for ambiguity that only text reveals, while the text is read
(GrammarTooAmbiguous); the same bounds hold for llama.cpp's matcher, which
follows the same states.
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from dataclasses import dataclass

from reame.errors import RequestError

WHITESPACE = frozenset(map(ord, " \t\n\r"))
MAX_EXPANSION_DEPTH = 200  # rule references followed without reading a character: left recursion
# llama.cpp's MAX_REPETITION_THRESHOLD: the most a {m,n} may say, and the most rules one repetition may
# write out (the rules of the repeated group times the count), as its parser counts them.
MAX_REPETITION = 2000
MAX_ELEMENTS = 200_000  # every rule's elements once repetitions are written out (~40 bytes each)
MAX_NESTING = 64  # groups inside groups (the parser recurses for each)
# Parser states one character may leave: stacks, and positions summed over them. JSON schemas need tens;
# past this a grammar is ambiguous enough to cost more per character than the model's step.
MAX_STACKS = 512
MAX_POSITIONS = 16_384
MEMO_ENTRIES = 2048  # per memo table of a grammar (cleared when full: they only save time)
MAX_HABIT_CHARS = 64  # the longest whitespace remembered as a layout habit
# What a compiled grammar holds, in bytes, as tracemalloc measured it here: a slot per element, a rule's
# lists and name, a memo entry's stacks and key. The cache of compiled grammars is bounded by their sum.
ELEMENT_BYTES, RULE_BYTES, MEMO_ENTRY_BYTES = 8, 500, 400
CACHE_BYTES = 64 << 20


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
        if height == 0:
            result = frozenset({()})
        elif height < len(stack):
            result = self.expand(stack[:height], depth)
        else:
            rule, alternative, index = stack[-1]
            sequence = self.rules[rule][alternative]
            if isinstance(sequence[index], Ref):
                callee = sequence[index].rule
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
        self.size = 0  # elements in every rule so far (MAX_ELEMENTS)
        self.nesting = 0  # groups open around the parser's position (MAX_NESTING)

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

    def grow(self, at: int, name: str, elements: int) -> None:
        """Count `elements` more, before they are made: past MAX_ELEMENTS the grammar is refused."""
        self.size += elements
        if self.size > MAX_ELEMENTS:
            raise self.fail(at, f"rule '{name}': the grammar grows past {MAX_ELEMENTS} elements once its "
                            "repetitions are written out; repeat less, or less at a time")

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
        grammar = Grammar(self.names, rules, self.ids["root"], self.size, hashlib.sha256(self.text.encode()).digest())
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
        self.grow(at, name, len(result))
        return result, at

    def sequence(self, at: int, name: str, nested: bool) -> tuple[tuple[Element, ...], int]:
        elements: list[Element] = []
        last_start = 0  # where the last symbol's elements begin (a repetition applies to them)
        last_rules = 1  # rules the last symbol stands for (a group's), as llama.cpp counts them
        while at < len(self.text):
            char = self.text[at]
            counted = len(elements)  # elements past this are counted at the end of the round (repetitions: before)
            if char not in "*+?{":
                last_rules = 1
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
                self.nesting += 1
                if self.nesting > MAX_NESTING:
                    raise self.fail(at, f"rule '{name}': groups nested more than {MAX_NESTING} deep")
                rules_before = len(self.names)
                group = self.new_rule(name, [])
                alternatives, at = self.alternatives(self.space(at + 1, True), name, nested=True)
                self.nesting -= 1
                if at >= len(self.text) or self.text[at] != ")":
                    raise self.fail(at, "expected ')'")
                at += 1
                self.rules[group.rule] = alternatives
                elements.append(group)
                last_rules = max(1, len(self.names) - rules_before)
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
                low, high, end = self.repetition(at, name)
                written_out = high if high else low or 1  # rules the repetition writes, as llama.cpp counts
                if last_rules * written_out > MAX_REPETITION:
                    raise self.fail(at, f"rule '{name}': repeating a group of {last_rules} rules {written_out} "
                                    f"times writes more than {MAX_REPETITION} rules (llama.cpp's limit)")
                repeated = tuple(elements[last_start:])
                new_rules = 1 if high is None else high - low
                self.grow(at, name, len(repeated) * (low - 1) + new_rules * (len(repeated) + 3))
                del elements[last_start:]
                elements.extend(self.repeat(name, repeated, low, high))
                last_start = counted = len(elements)  # a second repetition in a row applies to nothing
                last_rules *= written_out
                at = end
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
            self.grow(at, name, len(elements) - counted)
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

    def repetition(self, at: int, name: str) -> tuple[int, int | None, int]:
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
        if any(len(digits) > 9 for digits in match.group(1, 3) if digits) or \
                max(int(digits) for digits in match.group(1, 3) if digits) > MAX_REPETITION:
            raise self.fail(at, f"rule '{name}': {match.group()} repeats more than {MAX_REPETITION} times "
                            "(llama.cpp's limit)")
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


class _CompiledGrammars:
    """Parsed grammars by text, least recently used first out, at most CACHE_BYTES in all as `Grammar.bytes`
    counts them now (their memo tables grow as they are used: each call looks again). Any thread."""

    def __init__(self) -> None:
        self._grammars: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, text: str) -> Grammar:
        with self._lock:
            grammar = self._grammars.get(text)
            if grammar is not None:
                self._grammars.move_to_end(text)
                self._evict()
                return grammar
        grammar = parse_gbnf(text)  # outside the lock: one request's heavy grammar never waits on another's
        with self._lock:
            self._grammars.setdefault(text, grammar)
            self._evict()
        return grammar

    def _evict(self) -> None:
        """Least recently used grammars out until the rest fit CACHE_BYTES (lock held)."""
        held = sum(cached.bytes for cached in self._grammars.values())
        while held > CACHE_BYTES and len(self._grammars) > 1:
            held -= self._grammars.popitem(last=False)[1].bytes

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(grammar.bytes for grammar in self._grammars.values())

    def clear(self) -> None:
        with self._lock:
            self._grammars.clear()


compiled = _CompiledGrammars()
"""`parse_gbnf`, once per text: requests with the same schema share one grammar and its memo tables."""
