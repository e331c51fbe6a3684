"""The sandbox renders every chat template that the vendored llama.cpp ships (its
models/templates/, from the pinned llama-cpp-python sdist) exactly as transformers'
`render_jinja_template` does, or refuses it as transformers does: a plain conversation, and one
with tools, a tool call and its result. Loop controls ({% break %}, {% continue %}) and the
`generation` tag are what transformers' environment adds to plain Jinja."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localrun.templates.chat import TemplateRenderError, render_chat

transformers_utils = pytest.importorskip("transformers.utils.chat_template_utils")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PLAIN = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]
WITH_TOOLS = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny"},
              {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks"}]


@pytest.fixture(scope="module")
def templates(request) -> list[Path]:
    from vlm_model import _sdist

    root = _sdist(request.config.cache.mkdir("tiny-vlm")) / "vendor" / "llama.cpp" / "models" / "templates"
    found = sorted(root.glob("*.jinja"))
    assert len(found) >= 70, root
    return found


def _render(fn, *args, **kw):
    try:
        return fn(*args, **kw), None
    except Exception as exc:  # noqa: BLE001 - refusals are compared as refusals
        return None, exc


@pytest.mark.parametrize("messages,tools", [(PLAIN, None), (WITH_TOOLS, TOOLS)], ids=["plain", "tools"])
def test_every_vendored_template_renders_as_transformers_does(templates, messages, tools):
    kw = dict(add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    same, refused, differ = 0, 0, []
    for path in templates:
        text = path.read_text(encoding="utf-8")
        want, w_err = _render(lambda: transformers_utils.render_jinja_template([messages], tools=tools,
                                                                               chat_template=text, **kw)[0][0])
        got, g_err = _render(render_chat, text, messages, tools=tools, **kw)
        if g_err is not None:
            assert isinstance(g_err, TemplateRenderError), (path.name, g_err)  # a 400, never a crash
        if w_err is None and g_err is None and got == want:
            same += 1
        elif w_err is not None and g_err is not None:
            refused += 1
        else:
            differ.append((path.name, w_err, g_err))
    print(f"{len(templates)} templates: {same} render as transformers does, {refused} refused by both")
    assert not differ, differ
    assert same >= 60


def test_loop_controls_and_generation_tag():
    t = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
         "{% generation %}[{{ m.content }}]{% endgeneration %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}")
    msgs = [{"role": "system", "content": "s"}] + [{"role": "user", "content": str(i)} for i in range(5)]
    assert render_chat(t, msgs) == "[0][1]"


# the text that ends a turn: the model's end-of-generation token, which never reaches the output
_END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "</s>", "<|end|>", "<end_of_turn>", "<|end_of_text|>",
                "<|call|>", "<turn|>", "<|message_sep|>", "<｜end▁of▁sentence｜>", "<|endoftext|>", "<|return|>",
                "<|END_OF_TURN_TOKEN|>", "<SPECIAL_12>", "<|tool_response>", "<|end_of_role|>")


# The tool-call round trip over the vendored templates (a call each template renders, parsed back)
# is tests/test_chat_templates.py's: every tool-declaring template, with the syntax learned from it.
