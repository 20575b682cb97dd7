"""JSON Schema -> GBNF, so that the model can only write JSON the schema accepts.

The JSON may be compact or indented (a space, or a newline and indentation, may follow any
punctuation and value), never with whitespace around the whole.

Supported: objects (properties, required, additionalProperties), arrays
(items, minItems, maxItems), strings (minLength, maxLength, the formats date,
time, date-time, uuid), numbers, integers (with minimum, maximum,
exclusiveMinimum, exclusiveMaximum), booleans, null, enum, const, anyOf,
oneOf, a list of types, and $ref into $defs / definitions (recursion
allowed). Annotations (title, description, examples, default, $schema, …) are
ignored. Anything else is refused with a GrammarError naming the keyword and
where it is, rather than silently generating JSON the schema rejects.

Properties come in the order the schema lists them, required ones always,
optional ones may be left out; properties a schema does not declare are not
generated unless additionalProperties allows them (the output is valid either
way, and an extraction wants the declared ones).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from reame.structured.grammar import GrammarError
from reame.structured.gbnf import MAX_REPETITION

ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$anchor", "strict", "name"}
FORMATS = {
    "date": r'[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )',
    "time": r'( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
            r'( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )?',
    "uuid": r'[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}',
}
MAX_SCHEMA_DEPTH = 64  # schemas inside schemas (through $ref too): the converter recurses for each
MAX_BOUND_DIGITS = 18  # integer bounds within ±10^18: a bound's digits become nested grammar rules
FORMATS["date-time"] = f'{FORMATS["date"]} "T" {FORMATS["time"]}'
PRIMITIVES = {
    "ws": '| " " | "\\n" [ \\t]{0,20}',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" ws ( string ":" ws value ws ( "," ws string ":" ws value ws )* )? "}"',
    "array": '"[" ws ( value ws ( "," ws value ws )* )? "]"',
    "char": '[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] ( ["\\\\/bfnrt] | "u" [0-9a-fA-F]{4} )',
    "string": '"\\"" char* "\\""',
    "integral-part": '[0] | [1-9] [0-9]{0,15}',
    "number": '"-"? integral-part ( "." [0-9]{1,16} )? ( [eE] [-+]? integral-part )?',
    "integer": '"-"? integral-part',
    "boolean": '"true" | "false"',
    "null": '"null"',
}
DEPENDS = {"value": ("object", "array", "string", "number", "boolean", "null"), "object": ("ws", "string", "value"),
           "array": ("ws", "value"), "string": ("char",), "number": ("integral-part",), "integer": ("integral-part",)}


def literal(text: str) -> str:
    """A GBNF string literal for `text`."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") \
        .replace("\t", "\\t")
    return f'"{escaped}"'


class _Converter:
    def __init__(self, schema: Mapping[str, Any], param: str, top: str) -> None:
        self.schema = schema
        self.param = param
        self.top = top  # the top rule's name, also the prefix of every rule made for this schema
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}  # $ref -> rule name
        self.depth = 0  # schemas being converted around the current one (MAX_SCHEMA_DEPTH)

    def fail(self, where: str, why: str) -> GrammarError:
        return GrammarError(f"{self.param}: {why} at {where}", param=self.param)

    def primitive(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = PRIMITIVES[name]
            for dependency in DEPENDS.get(name, ()):
                self.primitive(dependency)
        return name

    def add(self, hint: str, body: str) -> str:
        """A rule with `body`, named after `hint`; an identical body already named is reused."""
        for name, existing in self.rules.items():
            if existing == body and name not in PRIMITIVES:
                return name
        base = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-") or "part"
        name, number = base, 1
        while name in self.rules or name in PRIMITIVES:
            number += 1
            name = f"{base}-{number}"
        self.rules[name] = body
        return name

    def convert(self, schema: Any, where: str, hint: str) -> str:
        """The rule name matching `schema`."""
        self.depth += 1
        try:
            if self.depth > MAX_SCHEMA_DEPTH:
                raise self.fail(where, f"schemas nested more than {MAX_SCHEMA_DEPTH} deep")
            return self._convert(schema, where, hint)
        finally:
            self.depth -= 1

    def _convert(self, schema: Any, where: str, hint: str) -> str:
        if schema is True or schema == {}:
            return self.primitive("value")
        if not isinstance(schema, dict):
            raise self.fail(where, "a schema must be an object or true")
        unknown = set(schema) - ANNOTATIONS - KNOWN
        if unknown:
            raise self.fail(where, f"'{sorted(unknown)[0]}' is not supported")
        if "$ref" in schema:
            return self.reference(schema["$ref"], where)
        if "const" in schema:
            return self.add(hint, literal(json.dumps(schema["const"], ensure_ascii=False)))
        if "enum" in schema:
            options = schema["enum"]
            if not isinstance(options, list) or not options:
                raise self.fail(where, "'enum' must be a non-empty array")
            return self.add(hint, " | ".join(literal(json.dumps(option, ensure_ascii=False)) for option in options))
        for combiner in ("anyOf", "oneOf"):
            if combiner in schema:
                options = schema[combiner]
                if not isinstance(options, list) or not options:
                    raise self.fail(where, f"'{combiner}' must be a non-empty array")
                names = [self.convert(option, f"{where}.{combiner}[{index}]", f"{hint}-{index}")
                         for index, option in enumerate(options)]
                return self.add(hint, " | ".join(names))
        kind = schema.get("type")
        if isinstance(kind, list):
            names = [self.convert(dict(schema, type=one), where, f"{hint}-{one}") for one in kind]
            return self.add(hint, " | ".join(names))
        if kind is None:
            kind = "object" if "properties" in schema else \
                "array" if "items" in schema or "prefixItems" in schema else None
        handler = TYPES.get(kind) if isinstance(kind, str) else None
        if kind is None:
            return self.primitive("value")
        if handler is None:
            raise self.fail(where, f"type {kind!r} is not a JSON type")
        return handler(self, schema, where, hint)

    def reference(self, ref: Any, where: str) -> str:
        if not isinstance(ref, str) or not re.fullmatch(r"#/(\$defs|definitions)/[^/]+", ref):
            raise self.fail(where, f"'$ref' {ref!r} is not supported (only #/$defs/NAME and #/definitions/NAME)")
        if ref in self.refs:
            return self.refs[ref]
        section, name = ref[2:].split("/", 1)
        target = self.schema.get(section, {}).get(name) if isinstance(self.schema.get(section), dict) else None
        if target is None:
            raise self.fail(where, f"'$ref' {ref} points at nothing")
        rule = self.add(f"{self.top}-{name}", "")  # reserved first: the definition may refer to itself
        self.refs[ref] = rule
        self.rules[rule] = self.convert(target, ref, f"{name}-body")
        return rule

    def object(self, schema: dict, where: str, hint: str) -> str:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise self.fail(where, "'properties' must be an object and 'required' an array")
        missing = [name for name in required if name not in properties]
        if missing:
            raise self.fail(where, f"required property {missing[0]!r} is not in 'properties'")
        extra = schema.get("additionalProperties", False)
        pairs = [(f'{literal(json.dumps(name, ensure_ascii=False))} ":" ws '
                  f'{self.convert(sub, f"{where}.properties.{name}", f"{hint}-{name}")} ws', name in required)
                 for name, sub in properties.items()]
        extra_pair = None
        if extra is not False:
            value = self.convert(extra, f"{where}.additionalProperties", f"{hint}-additional")
            key = self.key_except(list(properties), hint) if properties else self.primitive("string")
            extra_pair = f"{key} \":\" ws {value} ws"
        self.primitive("ws")
        # From the last property back: after[i] follows something already written (so a comma comes
        # first), first[i] is where nothing was written yet; an optional property may be skipped.
        after = f'( "," ws {extra_pair} )*' if extra_pair else ""
        first = f"( {extra_pair} ( \",\" ws {extra_pair} )* )?" if extra_pair else ""
        for index in range(len(pairs) - 1, -1, -1):
            pair, needed = pairs[index]
            after_body = f'"," ws {pair} {after}'.strip()
            first_body = f"{pair} {after}".strip()
            after = self.add(f"{hint}-after-{index}", after_body if needed else _either(after_body, after))
            first = self.add(f"{hint}-from-{index}", first_body if needed else _either(first_body, first))
        return self.add(hint, f'"{{" ws {first} "}}"')

    def key_except(self, names: list[str], hint: str) -> str:
        """A JSON string that is none of `names`: extra keys must not repeat a declared property. One rule
        per prefix of the names; a character that leaves every name frees the rest."""
        self.primitive("char")
        free = self.add(f"{hint}-key-free", 'char* "\\""')
        prefixes = sorted({name[:end] for name in names for end in range(len(name) + 1)})

        def node(prefix: str) -> str:
            return f"{hint}-key-{prefixes.index(prefix)}"
        for prefix in prefixes:
            longer = [name for name in names if name.startswith(prefix) and len(name) > len(prefix)]
            children = sorted({name[len(prefix)] for name in longer})
            options = [] if prefix in names else ['"\\""']
            options += [f"{literal(child)} {node(prefix + child)}" for child in children]
            excluded = "".join(_class_char(child) for child in children)
            options.append(f'[^"\\\\\\x7F\\x00-\\x1F{excluded}] {free}')
            options.append(f'[\\\\] ( ["\\\\/bfnrt] | "u" [0-9a-fA-F]{{4}} ) {free}')
            self.rules[node(prefix)] = " | ".join(options)
        return self.add(f"{hint}-key", f'"\\"" {node("")}')

    def array(self, schema: dict, where: str, hint: str) -> str:
        low, high = _bounds(schema, "minItems", "maxItems", where, self)
        self.primitive("ws")
        if "prefixItems" in schema or isinstance(schema.get("items"), list):
            return self.tuple(schema, low, high, where, hint)
        item = self.convert(schema.get("items", True), f"{where}.items", f"{hint}-item")
        if high == 0:
            return self.add(hint, '"[" ws "]"')
        more = f'( "," ws {item} ws )' + (f"{{{max(low - 1, 0)},{high - 1}}}" if high is not None
                                      else f"{{{max(low - 1, 0)},}}")
        body = f"{item} ws {more}"
        return self.add(hint, f'"[" ws {body} "]"' if low > 0 else f'"[" ws ( {body} )? "]"')

    def tuple(self, schema: dict, low: int, high: int | None, where: str, hint: str) -> str:
        """A tuple (`prefixItems`, or `items` as a list in drafts before 2020-12) as exactly its items, as
        llama.cpp's converter writes it: every schema draft accepts such an array (items past the tuple are
        allowed, never required), so the answer validates whatever `items` or `additionalItems` say."""
        key = "prefixItems" if "prefixItems" in schema else "items"
        items = schema[key]
        if not isinstance(items, list) or not items:
            raise self.fail(where, f"'{key}' must be a non-empty array of schemas")
        if len(items) < low or (high is not None and len(items) > high):
            raise self.fail(where, f"a tuple of {len(items)} items is outside 'minItems'..'maxItems'")
        if key == "prefixItems" and "items" in schema:
            self.convert(schema["items"], f"{where}.items", f"{hint}-rest")  # checked, never written
        names = [self.convert(item, f"{where}.{key}[{index}]", f"{hint}-{index}") for index, item in enumerate(items)]
        body = ' "," ws '.join(f"{name} ws" for name in names)
        return self.add(hint, f'"[" ws {body} "]"')

    def string(self, schema: dict, where: str, hint: str) -> str:
        low, high = _bounds(schema, "minLength", "maxLength", where, self)
        form = schema.get("format")
        if form is not None:
            if form not in FORMATS:
                raise self.fail(where, f"format {form!r} is not supported ({', '.join(sorted(FORMATS))} are)")
            return self.add(hint, f'"\\"" {FORMATS[form]} "\\""')
        self.primitive("char")
        if (low, high) == (0, None):
            return self.primitive("string")
        count = f"{{{low},{high}}}" if high is not None else f"{{{low},}}"
        return self.add(hint, f'"\\"" char{count} "\\""')

    def number(self, schema: dict, where: str, hint: str) -> str:
        if any(key in schema for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            raise self.fail(where, "bounds on a non-integer number are not supported (use type integer)")
        return self.primitive("number")

    def integer(self, schema: dict, where: str, hint: str) -> str:
        low, high = _integer_bounds(schema, where, self)
        if low is None and high is None:
            return self.primitive("integer")
        return self.add(hint, integer_range(low, high))

    def boolean(self, schema: dict, where: str, hint: str) -> str:
        return self.primitive("boolean")

    def null(self, schema: dict, where: str, hint: str) -> str:
        return self.primitive("null")


TYPES = {"object": _Converter.object, "array": _Converter.array, "string": _Converter.string,
         "number": _Converter.number, "integer": _Converter.integer, "boolean": _Converter.boolean,
         "null": _Converter.null}
KNOWN = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
         "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum",
         "const", "anyOf", "oneOf", "$ref", "$defs", "definitions"}


def _bounds(schema: dict, low_key: str, high_key: str, where: str, converter: _Converter) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise converter.fail(where, f"'{key}' must be a non-negative integer")
        if value is not None and value > MAX_REPETITION:
            raise converter.fail(where, f"'{key}' of {value} is over the {MAX_REPETITION} a grammar can count to "
                                 "(llama.cpp's limit)")
    if high is not None and high < low:
        raise converter.fail(where, f"'{high_key}' is below '{low_key}'")
    return low, high


def _integer_bounds(schema: dict, where: str, converter: _Converter) -> tuple[int | None, int | None]:
    """The smallest and largest integer the bounds allow (None: unbounded)."""
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise converter.fail(where, f"'{key}' must be a number")
        if value is not None and not abs(value) < 10 ** MAX_BOUND_DIGITS:  # also refuses inf and nan
            raise converter.fail(where, f"'{key}' must be a number within ±10^{MAX_BOUND_DIGITS}")
    lows = [math.ceil(schema["minimum"])] if "minimum" in schema else []
    lows += [math.floor(schema["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in schema else []
    highs = [math.floor(schema["maximum"])] if "maximum" in schema else []
    highs += [math.ceil(schema["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in schema else []
    low, high = max(lows, default=None), min(highs, default=None)
    if low is not None and high is not None and high < low:
        raise converter.fail(where, "no integer lies between the bounds")
    return low, high


def _class_char(char: str) -> str:
    """`char` written inside a GBNF character class."""
    return "\\" + char if char in "]\\^-" else char


def _either(option: str, rest: str) -> str:
    """`option`, or else `rest`; an empty `rest` is written as an optional group (GBNF cannot end a
    rule with an empty alternative)."""
    return f"{option} | {rest}" if rest else f"( {option} )?"


def integer_range(low: int | None, high: int | None) -> str:
    """GBNF for the decimal integers from `low` to `high` (None: unbounded on that side)."""
    parts = []
    if low is None or low < 0:
        negative_high = -1 if high is None or high >= 0 else high  # -x for x in [-negative_high .. -low]
        magnitude_low = -negative_high
        magnitude_high = None if low is None else -low
        parts.append(f'"-" ( {_natural_range(magnitude_low, magnitude_high)} )')
    if high is None or high >= 0:
        parts.append(_natural_range(max(low or 0, 0), high))
    return " | ".join(parts)


def _natural_range(low: int, high: int | None) -> str:
    """GBNF for the natural numbers from `low` to `high`, without leading zeros.

    No upper bound (None) means at most 16 digits, as for any integer here: a small model that starts
    repeating a digit would otherwise fill max_tokens with it instead of closing the object.
    """
    if high is None:
        high = max(10 ** 16 - 1, 10 ** len(str(low)) - 1)
    options = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        start = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        end = min(high, 10 ** digits - 1)
        if start <= end:
            options.append(_digits(str(start).zfill(digits), str(end).zfill(digits)))
    return " | ".join(options)


def _digits(a: str, b: str) -> str:
    """GBNF for the digit strings from `a` to `b`, both of the same length."""
    if len(a) == 1:
        return f"[{a}-{b}]" if a != b else f'"{a}"'
    if a[0] == b[0]:
        return f'"{a[0]}" ( {_digits(a[1:], b[1:])} )'
    rest = len(a) - 1
    options = []
    first, last = int(a[0]), int(b[0])
    if a[1:] != "0" * rest:  # the first leading digit covers only part of its span
        options.append(f'"{a[0]}" ( {_digits(a[1:], "9" * rest)} )')
        first += 1
    if b[1:] != "9" * rest:
        last -= 1
    if first <= last:
        options.append(f"[{first}-{last}] [0-9]{{{rest}}}")
    if b[1:] != "9" * rest:
        options.append(f'"{b[0]}" ( {_digits("0" * rest, b[1:])} )')
    return " | ".join(options)


def schema_rules(schema: Any, param: str = "response_format", top: str = "root") -> dict[str, str]:
    """The GBNF rules (name -> body) of JSON texts `schema` accepts, the text itself being rule `top`
    (every other rule is shared JSON or named after `top`, so several schemas' rules can be merged);
    GrammarError naming the first part it cannot express."""
    if schema is not True and not isinstance(schema, dict):
        raise GrammarError(f"{param}: a JSON schema must be an object", param=param)
    converter = _Converter(schema if isinstance(schema, dict) else {}, param, top)
    name = converter.convert(schema, "$", top)
    rules = converter.rules if name == top else {top: name, **converter.rules}
    reachable, todo = set(), [top]
    while todo:  # rules written on the way and not used in the end are left out
        rule = todo.pop()
        if rule not in reachable:
            reachable.add(rule)
            todo.extend(word for word in re.findall(r"[a-z0-9-]+", _outside_literals(rules[rule])) if word in rules)
    return {rule: body for rule, body in rules.items() if rule in reachable}


def render(rules: Mapping[str, str]) -> str:
    return "".join(f"{name} ::= {body}\n" for name, body in rules.items())


def schema_to_gbnf(schema: Any, param: str = "response_format") -> str:
    """The GBNF grammar of JSON texts `schema` accepts (whitespace allowed after punctuation and values,
    none around the whole)."""
    return render(schema_rules(schema, param))


def _outside_literals(body: str) -> str:
    """A rule body without its string literals and character classes (what is left names rules)."""
    return re.sub(r'"(\\.|[^"\\])*"|\[(\\.|[^\]\\])*\]', " ", body)


JSON_OBJECT_GBNF = schema_to_gbnf({"type": "object", "additionalProperties": True})
