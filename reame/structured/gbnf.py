"""GBNF text to grammars: parsed, checked, and kept once compiled.

It parses llama.cpp's GBNF: rules `name ::= …`, literals, character classes
(negated too), `.`, groups, alternatives, `* + ? {m} {m,} {m,n}`, comments;
token matches (`<…>`) are accepted and treated as opaque (nothing is forced
across them). A grammar is checked before a request is queued: a mistake is a
400 naming its line, never a failed request later.

A grammar is untrusted input (22 bytes can ask for 200,000 rules), so what
parsing it costs is bounded: repetition counts as llama.cpp bounds them (and
what it would refuse is refused here first, naming the rule), the rules' total
size once repetitions are written out, the nesting of groups, and what the
compiled grammars kept for reuse hold (`compiled`).
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading

from reame.structured.grammar import Chars, Element, Grammar, GrammarError, Ref, TokenMatch

# llama.cpp's MAX_REPETITION_THRESHOLD: the most a {m,n} may say, and the most rules one repetition may
# write out (the rules of the repeated group times the count), as its parser counts them.
MAX_REPETITION = 2000
MAX_ELEMENTS = 200_000  # every rule's elements once repetitions are written out (~40 bytes each)
MAX_NESTING = 64  # groups inside groups (the parser recurses for each)
CACHE_BYTES = 64 << 20  # what the compiled grammars kept for reuse may hold (Grammar.bytes)

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
        ranges: list[tuple[int, int]] = []
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
