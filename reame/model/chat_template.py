"""A model's own chat template (the GGUF's `tokenizer.chat_template`), rendered as Hugging Face does.

The template is Jinja, shipped with a downloaded model: untrusted code, so it
runs in jinja2's ImmutableSandboxedEnvironment with the options and helpers
Hugging Face's `apply_chat_template` gives it (`trim_blocks`, `lstrip_blocks`,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text, the `{% generation %}` tag) and the same variables (`messages`,
`tools`, `add_generation_prompt`, the special tokens' texts). So a prompt is
exactly what the model was trained on, including a default system prompt or
tool instructions that llama.cpp's built-in template detection would drop.

The sandbox stops a template from reaching outside it, not from spending:
nested `range(100000)` loops or a string multiplied by a billion would hold a
core or the memory. So every render has a budget (`RenderBudget`): steps (each
attribute or item lookup, call, filter, operator and range item counts one),
a deadline, the size of what any operation makes and of the prompt, and
integers that would size a result (a width, a repeat count) are checked
before the operation runs. Past it the render stops with a clear error; a
template that cannot render a plain conversation within it is refused when the
model loads (the server then uses llama.cpp's own template detection).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from reame.errors import ModelError, RequestError


MAX_RENDER_STEPS = 1_000_000
MAX_RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 4 << 20  # the prompt, and anything one operation makes (characters, or items of a list)
MAX_SIZING_DIGITS = 7  # a width in a format string with more digits than this would make MAX_RENDER_CHARS or more
CLOCK_EVERY_STEPS = 1024  # the deadline is read once per this many steps
WIDE_FORMAT = re.compile(rf"[%:][^%{{}}]*?\d{{{MAX_SIZING_DIGITS},}}")  # "%9999999d", "{:>9999999}"
FORMATTING = ("format", "format_map")  # str methods whose string is a format
PROBE = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


class RenderBudgetExceeded(jinja2.exceptions.TemplateError):
    """A render spent more than its budget."""


class RenderBudget(threading.local):
    """The current thread's render: steps taken, and by when it must end."""

    steps = 0
    deadline = 0.0

    def start(self) -> None:
        self.steps, self.deadline = 0, time.monotonic() + MAX_RENDER_SECONDS

    def spend(self, steps: int = 1) -> None:
        before, self.steps = self.steps, self.steps + steps
        if self.steps > MAX_RENDER_STEPS:
            raise RenderBudgetExceeded(f"the chat template took more than {MAX_RENDER_STEPS} steps")
        if before // CLOCK_EVERY_STEPS != self.steps // CLOCK_EVERY_STEPS and time.monotonic() > self.deadline:
            raise RenderBudgetExceeded(f"the chat template took more than {MAX_RENDER_SECONDS:g} s")


def _sized(value: Any) -> Any:
    """`value`, unless it is larger than anything a render may make."""
    if isinstance(value, (str, bytes, list, tuple, dict)):
        _check_size(len(value))
    return value


def _check_size(size: int) -> None:
    if size > MAX_RENDER_CHARS:
        raise RenderBudgetExceeded(f"the chat template makes a value of {size} characters or items "
                                   f"(the most is {MAX_RENDER_CHARS})")


def _check_sizing(args: Sequence[Any], format_string: object = None) -> None:
    """Refuse, before the operation runs, arguments that would size its result past the budget: a width or
    a count (`center(10**9)`, `indent(...)`), or a format string with a huge width (`'{:>999999999}'`)."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_RENDER_CHARS:
            raise RenderBudgetExceeded(f"the chat template asked for a size of {arg}")
    if isinstance(format_string, str) and WIDE_FORMAT.search(format_string):
        raise RenderBudgetExceeded("the chat template formats with a width of millions")


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with every operation charged to the thread's RenderBudget and sized before and after."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def __init__(self, budget: RenderBudget, **options: Any) -> None:
        super().__init__(**options)
        self.budget = budget

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.budget.spend()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.budget.spend()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's)
        __self.budget.spend()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        formatted = getattr(method, "__self__", None) if getattr(method, "__name__", "") in FORMATTING else None
        _check_sizing([*args, *kwargs.values()], formatted)
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.budget.spend()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
                    _check_size(len(sequence) * max(count, 0))
        elif operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise RenderBudgetExceeded(f"the chat template raises to the power {right}")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            _check_size(len(left) + len(right))
        elif operator == "%":
            _check_sizing([], left)
        return _sized(super().call_binop(context, operator, left, right))


def _bounded_filter(budget: RenderBudget, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A filter charged to the render's budget, its sizing arguments checked before it runs, its result after."""
    passed = getattr(function, "jinja_pass_arg", None)  # a context or environment comes before the value
    first = 1 if passed is not None else 0

    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget.spend()
        _check_sizing([*args[first + 1:], *kwargs.values()], args[first] if name == "format" else None)
        return _sized(function(*args, **kwargs))
    if passed is not None:
        bounded.jinja_pass_arg = passed  # type: ignore[attr-defined]
    return bounded


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which no chat template wants.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render(caller: Any) -> str:
        return caller()


def _environment(budget: RenderBudget) -> _BoundedEnvironment:
    environment = _BoundedEnvironment(budget, trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    environment.filters["tojson"] = _tojson
    environment.filters = {name: _bounded_filter(budget, name, function)
                           for name, function in environment.filters.items()}
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now

    def bounded_range(*args: int) -> range:
        items = jinja2.sandbox.safe_range(*args)
        budget.spend(len(items))  # what the loop over it will take, paid up front
        return items
    environment.globals["range"] = bounded_range
    return environment


class ChatTemplate:
    """One compiled template. `special_tokens` are the texts of bos_token, eos_token, … as the
    template refers to them. Rendering is thread-safe (the compiled template is immutable)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self._budget = RenderBudget()
        environment = _environment(self._budget)
        try:
            self._template = environment.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(environment.parse(source))
        except (jinja2.exceptions.TemplateError, RecursionError) as error:
            raise ModelError(f"the model's chat template does not compile: {error}") from None
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.supports_tools = "tools" in variables  # it lays tools out itself, in the model's own words
        self.thinks = "</think>" in source  # the model thinks in <think>…</think> before it answers
        self.thinking_switch = "enable_thinking" in variables  # a request may turn the thinking off
        try:
            self.render(PROBE)
        except RequestError as error:
            if error.code == "template_budget_exceeded":  # refusing the probe's roles is its right; overspending is not
                raise ModelError(f"the model's chat template does not render a plain conversation within its "
                                 f"budget: {error}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool | None = None) -> str:
        """The prompt text; a template that refuses the conversation (roles out of order, a role
        it does not know) is a RequestError with its own message. `enable_thinking`: the template's own
        switch, passed when given (None: the template's default)."""
        self._budget.start()
        switch = {"enable_thinking": enable_thinking} if enable_thinking is not None else {}
        try:
            return self._joined(self._template.generate(
                messages=list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens, **switch))
        except RenderBudgetExceeded as error:
            raise RequestError(f"the model's chat template went past its budget: {error}", param="messages",
                               code="template_budget_exceeded") from None
        except (RecursionError, MemoryError) as error:
            raise RequestError(f"the model's chat template went past its budget ({type(error).__name__})",
                               param="messages", code="template_budget_exceeded") from None
        except jinja2.exceptions.TemplateError as error:
            raise RequestError(f"the model's chat template refused these messages: {error}",
                               param="messages") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as error:
            raise RequestError(f"the model's chat template cannot render these messages ({error})",
                               param="messages") from None

    def _joined(self, pieces: Iterator[str]) -> str:
        """The rendered pieces as one prompt, each charged to the budget and the whole bounded in size."""
        joined, size = [], 0
        for piece in pieces:
            self._budget.spend()
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise RenderBudgetExceeded(f"the chat template's prompt is over {MAX_RENDER_CHARS} characters")
            joined.append(piece)
        return "".join(joined)
