"""The models' own chat templates render exactly what Hugging Face renders (fixtures), sandboxed."""

import json
from pathlib import Path

import pytest

from reame.model.chat_template import ChatTemplate
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


def bounded(work):
    """Run `work()`: (what it raised, CPU seconds, peak bytes allocated)."""
    import tracemalloc
    from tests.cpu import cpu_clock
    tracemalloc.start()
    raised = None
    with cpu_clock(pause_collector=False) as clock:
        try:
            work()
        except (RequestError, ModelError) as error:
            raised = error
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return raised, clock.seconds, peak


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("source", [
    NESTED_LOOPS,
    "{{ 'x' * 1000000000 }}",
    "{% set s = 'x' %}{{ s * 1000000000 }}",
    "{{ 'x'.center(1000000000) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ 'x' | center(1000000000) }}",
    "{{ 'x' | indent(1000000000, true) }}",
    "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s | replace('a', 'aaaa') %}"
    "{% endfor %}",
    "{{ 2 ** 10000000 }}",
    "{% for m in messages %}{% for i in range(99999) %}{{ m.role }}{% endfor %}{% endfor %}",
])
def test_a_template_that_would_spend_without_bound_is_refused_when_the_model_loads(source):
    raised, seconds, peak = bounded(lambda: ChatTemplate(source, {}))
    assert isinstance(raised, ModelError) and "within its budget" in str(raised), raised
    assert seconds < 3 and peak < 64 << 20, (seconds, peak >> 20)


def test_a_template_that_spends_only_on_some_messages_is_a_clear_error_for_them_alone():
    template = ChatTemplate("{% for m in messages %}{% if m.content == 'boom' %}" + NESTED_LOOPS +
                            "{% endif %}[{{ m.content }}]{% endfor %}", {})
    assert template.render([{"role": "user", "content": "fine"}]) == "[fine]"
    raised, seconds, peak = bounded(lambda: template.render([{"role": "user", "content": "boom"}]))
    assert isinstance(raised, RequestError) and raised.code == "template_budget_exceeded"
    assert seconds < 3 and peak < 64 << 20
    assert template.render([{"role": "user", "content": "fine again"}]) == "[fine again]"


def test_user_text_that_looks_like_a_format_is_only_text():
    template = ChatTemplate("{% for m in messages %}{{ m.content | trim }}|{{ m.content.replace('a', 'b') }}"
                            "{% endfor %}", {})
    text = "order {:>99999999} and %99999999d"
    assert template.render([{"role": "user", "content": text}]) == text + "|" + text.replace("a", "b")
