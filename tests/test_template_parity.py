"""The sandbox renders every chat template that the vendored llama.cpp ships (its
models/templates/, from the pinned llama-cpp-python sdist) exactly as transformers'
`render_jinja_template` does, or refuses it as transformers does: a plain conversation, and one
with tools, a tool call and its result. Loop controls ({% break %}, {% continue %}) and the
`generation` tag are what transformers' environment adds to plain Jinja."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localrun.chat_template import TemplateRenderError, render_chat

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


def _model_output(template: str) -> tuple[str, str] | None:
    """(the prompt, what the model would write) for a known tool call rendered by the template."""
    user = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    try:
        pre = render_chat(template, user, add_generation_prompt=True, tools=TOOLS, bos_token="<s>", eos_token="</s>")
        full = render_chat(template, user + [call], add_generation_prompt=False, tools=TOOLS, bos_token="<s>",
                           eos_token="</s>")
    except TemplateRenderError:
        return None
    i = 0
    while i < min(len(pre), len(full)) and pre[i] == full[i]:
        i += 1
    while i > 0 and full[i - 1] not in ">\n ":  # the generation prompt can differ (an opened think block)
        i -= 1
    out = full[i:].rstrip()
    while any(out.endswith(e) for e in _END_OF_TURN):
        out = out[:-len(next(e for e in _END_OF_TURN if out.endswith(e)))].rstrip()
    return pre, out


def test_tool_call_round_trip_over_the_vendored_templates(templates):
    """Every template that declares tools: a call it renders into an assistant turn, handed back as
    model output (streamed in small pieces), parses into the same call. Reports how many do."""
    from localrun.chat_template import template_supports_tools
    from localrun.server.output import OutputParser, call_markers, reasoning_for

    passed, failed, unrenderable = [], [], []
    for path in templates:
        text = path.read_text(encoding="utf-8")
        if not template_supports_tools(text):
            continue
        got = _model_output(text)
        if got is None:
            unrenderable.append(path.name)
            continue
        pre, out = got
        p = OutputParser(reasoning_for(text, pre), {"get_weather"}, markers=call_markers(text))
        streamed = "".join(p.feed(out[k:k + 7])[1] for k in range(0, len(out), 7))
        _, rest, calls = p.finish()
        ok = (len(calls) == 1 and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
              and "get_weather" not in streamed + rest)  # the call did not also stream out as text
        (passed if ok else failed).append(path.name)
    print(f"tool-call round trip: {len(passed)} of {len(passed) + len(failed)} templates that render a call "
          f"({len(unrenderable)} cannot render one here); failing: {', '.join(failed)}")
    assert len(passed) >= 37, failed
