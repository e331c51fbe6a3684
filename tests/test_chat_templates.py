"""Every chat template the vendored llama.cpp ships (models/templates/ in the pinned llama-cpp-python
sdist) renders in localrun's sandbox exactly as transformers' own renderer renders it (or both refuse),
and a tool call a tool-declaring template renders into an assistant turn parses back into the same call."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from localrun.chat_template import TemplateRenderError, render_chat
from tests.vlm_model import _sdist

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                     "days": {"type": "integer"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}],
    "multi-turn": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": "How are you?"}],
    "tools": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 20}'},
              {"role": "user", "content": "Thanks"}],
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def templates(request, tmp_path_factory) -> dict[str, str]:
    try:
        cache = request.config.cache.mkdir("llama-sdist")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("llama-sdist")
    folder = _sdist(cache) / "vendor" / "llama.cpp" / "models" / "templates"
    found = {p.name: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.jinja"))}
    assert len(found) >= 70, f"expected llama.cpp's 70 vendored templates, found {len(found)} in {folder}"
    return found


def _transformers(template: str, messages: list[dict], tools: list | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([copy.deepcopy(messages)], tools=copy.deepcopy(tools), chat_template=template,
                                        add_generation_prompt=True, **SPECIAL)
    return rendered[0]


@pytest.mark.slow
def test_every_vendored_template_renders_as_transformers_renders_it(templates):
    pytest.importorskip("transformers")
    equal, refused_by_both, different = 0, 0, []
    for name, template in templates.items():
        same = True
        for conv, messages in CONVERSATIONS.items():
            if conv == "tools" and "tools" not in template:
                continue
            tools = TOOLS if conv == "tools" else None
            try:
                theirs = _transformers(template, messages, tools)
            except Exception as exc:  # noqa: BLE001 - any refusal; ours must refuse too
                theirs = exc
            try:
                ours = render_chat(template, copy.deepcopy(messages), tools=copy.deepcopy(tools), **SPECIAL)
            except TemplateRenderError as exc:
                ours = exc
            if isinstance(theirs, Exception) and isinstance(ours, Exception):
                refused_by_both += 1
                continue
            if theirs != ours:
                same = False
                different.append(f"{name} [{conv}]: transformers {str(theirs)[:160]!r} != ours {str(ours)[:160]!r}")
                break
        equal += same
    print(f"\n{equal} of {len(templates)} vendored templates render as transformers renders them "
          f"({refused_by_both} conversation(s) refused by both)")
    assert not different, "\n".join(different)


def test_loop_controls_and_the_generation_tag_render():
    t = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
         "{% generation %}[{{ m.content }}]{% endgeneration %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}")
    msgs = [{"role": "system", "content": "s"}] + [{"role": "user", "content": str(i)} for i in range(5)]
    assert render_chat(t, msgs) == "[0][1]"


def test_transformers_globals_and_tojson_arguments():
    t = ("{% set d = dict(a=1, b=[1, 2]) %}{{ d | tojson(separators=(',', ':'), sort_keys=True) }}|"
         "{{ {'é': 1} | tojson(ensure_ascii=True) }}|{{ {'x': 1} | tojson(indent=2) }}|"
         "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}")
    out = render_chat(t, [{"role": "user", "content": "hi"}] * 3)
    assert out == '{"a":1,"b":[1,2]}|{"\\u00e9": 1}|{\n  "x": 1\n}|3'


def test_the_bounds_still_hold_with_the_new_tags():
    with pytest.raises(TemplateRenderError, match="underscore"):
        render_chat("{% set ns = namespace(_x=1) %}{{ ns._x }}", [])
    with pytest.raises(TemplateRenderError, match="indent"):
        render_chat("{{ messages | tojson(indent=10000) }}", [])
    with pytest.raises(TemplateRenderError, match="longer than"):  # a loop that only `continue`s is still timed
        render_chat("{% for i in range(100000) %}{% for j in range(100000) %}{% continue %}{% endfor %}{% endfor %}", [])
    with pytest.raises(TemplateRenderError, match="over"):
        render_chat("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% generation %}{% set ns.s = ns.s ~ ns.s %}"
                    "{% endgeneration %}{% endfor %}{{ ns.s }}", [])


def test_reasoning_reaches_templates_under_each_name():
    t = "{% for m in messages %}{{ m.thinking }}/{{ m.reasoning_content }};{% endfor %}"
    assert render_chat(t, [{"role": "assistant", "content": "a", "reasoning": "r"}]) == "r/r;"
