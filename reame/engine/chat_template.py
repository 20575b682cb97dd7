"""A model's own chat template (the GGUF's `tokenizer.chat_template`), rendered as Hugging Face does.

The template is Jinja, shipped with a downloaded model: untrusted code, so it
runs in jinja2's ImmutableSandboxedEnvironment with the options and helpers
Hugging Face's `apply_chat_template` gives it (`trim_blocks`, `lstrip_blocks`,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text, the `{% generation %}` tag) and the same variables (`messages`,
`tools`, `add_generation_prompt`, the special tokens' texts). So a prompt is
exactly what the model was trained on, including a default system prompt or
tool instructions that llama.cpp's built-in template detection would drop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from reame.errors import ModelError, RequestError


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


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """One compiled template. `special_tokens` are the texts of bos_token, eos_token, … as the
    template refers to them. Rendering is thread-safe (the compiled template is immutable)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(environment.parse(source))
        except jinja2.exceptions.TemplateError as error:
            raise ModelError(f"the model's chat template does not compile: {error}") from None
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.supports_tools = "tools" in variables  # it lays tools out itself, in the model's own words

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text; a template that refuses the conversation (roles out of order, a role
        it does not know) is a RequestError with its own message."""
        try:
            return self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as error:
            raise RequestError(f"the model's chat template refused these messages: {error}",
                               param="messages") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as error:
            raise RequestError(f"the model's chat template cannot render these messages ({error})",
                               param="messages") from None
