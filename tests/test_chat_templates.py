"""Every chat template the vendored llama.cpp ships (models/templates/ in the pinned llama-cpp-python
sdist) renders in localrun's sandbox exactly as transformers' own renderer renders it (or both refuse),
and a tool call a tool-declaring template renders into an assistant turn parses back into the same call."""

from __future__ import annotations

import copy
import json

import pytest

from localrun.templates.chat import TemplateRenderError, render_chat
from vlm_model import _sdist

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                     "days": {"type": "integer"}}, "required": ["city"]}}}]
CALL = {"id": "call0abcd", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CALL2 = {"id": "call1efgh", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "London", "days": 5}}}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}],
    "multi-turn": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": "How are you?"}],
    "tools": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call0abcd", "name": "get_weather", "content": '{"temp": 20}'},
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


def _model_output(template: str, call: dict | list[dict]) -> tuple[str, str] | None:
    """(prompt, output): what the template renders for an assistant turn making `call`, split where
    the model's own output starts (after the generation prompt), or None when the template writes no
    call into the turn."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        prompt = render_chat(template, user, tools=TOOLS, **SPECIAL)
    except TemplateRenderError:
        return None
    full = None
    calls = call if isinstance(call, list) else [call]
    for string in (False, True):  # arguments as an object, else as a JSON string
        turn = {"role": "assistant", "content": "", "tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"]) if string
                               else c["function"]["arguments"]}} for c in calls]}
        try:
            full = render_chat(template, user + [turn], add_generation_prompt=False, tools=TOOLS, **SPECIAL)
            break
        except TemplateRenderError:
            continue
    if full is None:
        return None
    i = 0
    while i < min(len(prompt), len(full)) and prompt[i] == full[i]:
        i += 1
    if i < len(prompt):  # the generation prompt opens a think block the call turn does not: back to a boundary
        while i > 0 and full[i - 1] not in "\n>":
            i -= 1
    out = full[i:]
    return (full[:i], out) if "get_weather" in out else None


@pytest.mark.slow
def test_a_tool_call_each_template_renders_parses_back_into_the_same_call(templates):
    import random

    from localrun.server.output import OutputParser
    from localrun.server.tool_formats import learn

    rng = random.Random(7)
    args = CALL["function"]["arguments"]
    passed, failed, no_call, refused, two_ok, two_failed = [], [], [], [], [], []
    for name, template in templates.items():
        if "tool" not in template:
            continue
        got = _model_output(template, CALL)
        if got is None:
            (refused if _refuses(template) else no_call).append(name)
            continue
        _, out = got
        fmt = learn(template)
        cuts = sorted(rng.sample(range(1, len(out)), min(len(out) - 1, 6)))
        pieces = [out[a:b] for a, b in zip([0] + cuts, cuts + [len(out)])]
        p = OutputParser(None, {"get_weather"}, tool_format=fmt, tools=TOOLS)
        streamed = "".join(p.feed(x)[1] for x in pieces)
        _, _, calls = p.finish()
        if [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)] \
                and "get_weather" not in streamed:  # the call itself never went out as content
            passed.append(name)
        else:
            failed.append(f"{name}: {fmt} -> {calls}, streamed {streamed!r}, output {out!r}")
            continue
        if '"Paris"' in out:  # a model that writes a raw newline inside an argument's string (code does)
            p = OutputParser(None, {"get_weather"}, tool_format=fmt, tools=TOOLS)
            p.feed(out.replace('"Paris"', '"Pa\nris"'))
            calls = p.finish()[2]
            if [json.loads(c["arguments"]).get("city") for c in calls] != ["Pa\nris"]:
                failed.append(f"{name}: a raw newline in the city -> {calls}")
        # two calls in one turn (parallel tool calls), where the template writes both
        got = _model_output(template, [CALL, CALL2])
        if got is not None and got[1].count("London") == 1:
            p = OutputParser(None, {"get_weather"}, tool_format=fmt, tools=TOOLS)
            streamed = p.feed(got[1])[1]
            _, _, calls = p.finish()
            ok = [(c["name"], json.loads(c["arguments"])) for c in calls] == [
                ("get_weather", args), ("get_weather", CALL2["function"]["arguments"])] and "London" not in streamed
            (two_ok if ok else two_failed).append(name)
    print(f"\n{len(passed)} of {len(passed) + len(failed)} templates that write tool calls round-trip them; "
          f"{len(no_call)} mention tools but write no call into the turn ({', '.join(no_call)}); "
          f"{len(refused)} refuse the tool conversation in transformers too ({', '.join(refused)})")
    print(f"two calls in one turn: {len(two_ok)} of {len(two_ok) + len(two_failed)} round-trip"
          f"{' (not: ' + ', '.join(two_failed) + ')' if two_failed else ''}")
    assert not failed, "\n".join(failed)
    assert len(passed) >= 50 and len(two_ok) >= 40


def _refuses(template: str) -> bool:
    try:
        _transformers(template, CONVERSATIONS["tools"], TOOLS)
    except Exception:  # noqa: BLE001
        return True
    return False


# -- through the daemon: a model carrying a vendored template, the fake backend answering in its syntax --
REPLIES = {  # what each model "writes": some text, then a call in its own template's syntax
    "Qwen3-Coder.jinja": "Let me look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "unsloth-mistral-Devstral-Small-2507.jinja": 'Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "GLM-4.6.jinja": "Let me look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "moonshotai-Kimi-K2.jinja": "Let me look that up.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                                '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
    "openai-gpt-oss-120b.jinja": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary"
                                 "<|message|>Let me look that up.<|end|><|start|>assistant<|channel|>commentary "
                                 'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}',
}


@pytest.fixture(scope="module")
def template_daemon(templates, tmp_path_factory):
    from fakes import FakeModel, InProcessDaemon, library_home

    models = {f"tpl{i}": f'FROM smollm2:135m\nTEMPLATE """{templates[name]}"""\n' for i, name in enumerate(REPLIES)}
    home = library_home(tmp_path_factory.mktemp("tpl_home"), models)
    fake = FakeModel(rules={"Weather in Paris": "unused"})
    fake.reply = lambda prompt: next(REPLIES[n] for i, n in enumerate(REPLIES) if f"[model tpl{i}]" in prompt)
    d = InProcessDaemon(home, fake, LOCALRUN_NUM_PARALLEL="1")
    yield d
    d.stop()


@pytest.mark.parametrize("index", range(len(REPLIES)), ids=list(REPLIES))
def test_a_model_calls_tools_in_its_own_templates_syntax_over_the_api(template_daemon, index):
    from openai import OpenAI

    client = OpenAI(base_url=template_daemon.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=f"tpl{index}", tools=TOOLS, extra_body={"num_ctx": 32768},  # the fake counts characters
              messages=[{"role": "user", "content": f"[model tpl{index}] Weather in Paris for 3 days?"}])
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.content.strip() == "Let me look that up."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces).strip() == "Let me look that up." and len(pieces) > 1  # the text streamed as it came
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    if "gpt-oss" in list(REPLIES)[index]:  # harmony: the analysis channel is the reasoning
        assert msg.model_extra.get("reasoning_content") == "Need the weather."


# -- special tokens a call is marked with reach the parser as text ------------------------------
def test_a_templates_call_markers_are_kept_by_the_backend(templates):
    from localrun.backends.base import GenerationRequest, SamplingOptions
    from localrun.backends.runner.wire import request_from_wire, request_to_wire
    from localrun.server.tool_formats import learn

    assert {"[TOOL_CALLS]", "[ARGS]"} <= set(learn(templates["unsloth-mistral-Devstral-Small-2507.jinja"]).specials)
    assert "<|tool_calls_section_begin|>" in learn(templates["moonshotai-Kimi-K2.jinja"]).specials
    r = GenerationRequest(prompt="p", options=SamplingOptions(), preserve=["[TOOL_CALLS]"])
    assert request_from_wire(request_to_wire(r)).preserve == ["[TOOL_CALLS]"]  # through the runner's wire


@pytest.fixture(scope="module")
def smol_backend():
    import asyncio

    pytest.importorskip("llama_cpp")
    from localrun.backends.base import LoadSpec
    from localrun.backends.llamacpp import LlamaCppBackend
    from localrun.library.catalog import bundled_gguf

    b = LlamaCppBackend(LoadSpec("smollm2:135m", bundled_gguf(), "gguf", num_ctx=512, num_parallel=1,
                                 extra={"n_threads": 2}))
    yield b
    asyncio.run(b.close())


def test_llamacpp_keeps_the_text_of_preserved_special_tokens(smol_backend):
    """A control token's piece is empty when detokenized (llama.cpp drops it); the tokens a request
    preserves (its tool-call markers) come out as their text, others still do not."""
    import asyncio

    from localrun.backends.base import GenerationRequest, SamplingOptions

    async def run(preserve):
        [im_start] = await smol_backend.tokenize("<|im_start|>")
        o = SamplingOptions(temperature=0.0, max_tokens=3, logit_bias={im_start: 100.0})  # the model must emit it
        req = GenerationRequest(prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", options=o,
                                preserve=preserve)
        return "".join([c.text async for c in smol_backend.generate(req)])

    assert asyncio.run(run(None)) == ""
    assert asyncio.run(run(["<|im_start|>"])) == "<|im_start|>" * 3
    assert asyncio.run(run(["<|im_end|>x", "not one token"])) == ""  # only single special tokens count
