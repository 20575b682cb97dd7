"""The models' own chat templates render exactly what Hugging Face renders (fixtures), sandboxed."""

import json
from pathlib import Path

import pytest

from reame.engine.chat_template import ChatTemplate
from reame.errors import ModelError, RequestError

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates").glob("*.json"))
JINJA_FIXTURES = [path for path in FIXTURES if json.loads(path.read_text())["template"]]


def cases(paths):
    for path in paths:
        fixture = json.loads(path.read_text())
        for index, case in enumerate(fixture["cases"]):
            yield pytest.param(fixture, case, id=f"{fixture['model']}-{index}")


@pytest.mark.parametrize("fixture, case", list(cases(JINJA_FIXTURES)))
def test_a_models_template_renders_what_hugging_face_renders(fixture, case):
    template = ChatTemplate(fixture["template"], fixture["special_tokens"])
    assert template.render(case["messages"], case["add_generation_prompt"], case.get("tools")) == case["expected"]


def test_templates_that_lay_out_tools_are_told_apart():
    by_model = {json.loads(p.read_text())["model"]: json.loads(p.read_text()) for p in JINJA_FIXTURES}
    assert ChatTemplate(by_model["qwen2.5-coder-1.5b"]["template"], {}).supports_tools
    assert not ChatTemplate(by_model["smollm2-135m"]["template"], {}).supports_tools


def test_the_helpers_templates_use_are_there():
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content | tojson }}|{{ strftime_now('%Y') | length }}"
                            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                            "{% generation %}[{{ m.role }}]{% endgeneration %}{% endfor %}", {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "Zürich <b>"}, {"role": "x", "content": ""}]) == \
        '<s>"Zürich <b>"|4[user]'


def test_a_template_that_refuses_the_conversation_is_a_request_error_with_its_message():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must "
                            "alternate user/assistant') }}{% endif %}ok", {})
    assert template.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(RequestError, match="roles must alternate") as raised:
        template.render([{"role": "assistant", "content": ""}])
    assert raised.value.param == "messages"


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}{{ cycler.__init__.__globals__ }}",
    "{% set x = messages.append(1) %}",
    "{{ messages[0].content.format_map }}{{ (messages[0].content.format_map)({}) }}",
])
def test_the_sandbox_stops_a_hostile_template(escape):
    template = ChatTemplate(escape, {})
    with pytest.raises(RequestError):
        template.render([{"role": "user", "content": "{x}"}])


def test_a_template_that_does_not_compile_is_a_model_error():
    with pytest.raises(ModelError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", {})
