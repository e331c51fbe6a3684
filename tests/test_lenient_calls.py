"""Tool calls outside the template's markers (server/lenient_calls.py), through OutputParser as the
daemon uses it: the same calls and content however the text is split, and never a piece of a
call's JSON in a content delta. The texts marked "recorded" are what Qwen2.5-Coder-0.5B/1.5B-Instruct
wrote (temperature 0) when asked with tools; tests/test_tool_calls_real.py asks the real models."""

from __future__ import annotations

import json
import random

import pytest

from localrun.config import settings
from localrun.server.lenient_calls import HOLD_MAX, LenientCalls, calls_in, coerce, fits
from localrun.server.output import OutputParser, reasoning_for
from localrun.server.tool_formats import learn

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SHELL = {"type": "function", "function": {"name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "required": ["command"],
                        "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}}
TOOLS = [WEATHER, SHELL]
NAMES = {"get_weather", "shell"}
QWEN_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{ tool | tojson }}"
                 "{%- endfor %}{{- '</tools>\\nFor each function call, return a json object within <tool_call></tool_call>"
                 "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role == 'assistant' and "
                 "message.tool_calls %}{{- '<|im_start|>assistant' }}{%- for tool_call in message.tool_calls %}"
                 "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.function.name }}{{- '\", \"arguments\": ' }}"
                 "{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
                 "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
                 "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _parser(lenient=True, template=QWEN_TEMPLATE, forced=False):
    return OutputParser(reasoning_for(template, ""), NAMES, tool_format=learn(template), tools=TOOLS,
                        lenient=lenient, forced=forced)


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _run(text: str, pieces: list[str], **kw):
    p = _parser(**kw)
    parts = [p.feed(x)[1] for x in pieces]
    _, rest, calls = p.finish()
    return "".join(parts) + rest, [(c["name"], json.loads(c["arguments"])) for c in calls], parts


PARIS = ("get_weather", {"city": "Paris"})
CASES = [  # (text, content, calls)
    # recorded, 0.5B: "What is the weather in Paris?"
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```', "", [PARIS]),
    # recorded, 0.5B: a JSON list of two calls in one fence
    ('```json\n[\n  {\n    "name": "get_weather",\n    "arguments": {\n      "city": "Paris"\n    }\n  },\n  {\n    '
     '"name": "get_weather",\n    "arguments": {\n      "city": "Tokyo"\n    }\n  }\n]\n```',
     "", [PARIS, ("get_weather", {"city": "Tokyo"})]),
    # the observed 1.5B answer
    ('```json\n{"name": "shell", "arguments": {"command": ["cat", "notes.txt"]}}\n```', "",
     [("shell", {"command": ["cat", "notes.txt"]})]),
    # text before and after; arguments as a JSON string
    ('Let me look that up.\n```json\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n```\nOne moment.',
     "Let me look that up.\n\nOne moment.", [PARIS]),
    # "parameters" for "arguments", bare JSON, a bare list
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "shell", "arguments": {"command": ["ls"]}}]',
     "", [PARIS, ("shell", {"command": ["ls"]})]),
    # OpenAI's own shape; two objects in one fence; two fences; a plain ``` fence
    ('{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}', "", [PARIS]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}\n```', "", [PARIS, ("get_weather", {"city": "Oslo"})]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n\n```\n{"name": "shell", "arguments": '
     '{"command": ["ls"]}}\n```\n', "", [PARIS, ("shell", {"command": ["ls"]})]),
    # Qwen's own markers, with a fenced call after them
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [PARIS]),
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n```json\n'
     '{"name": "shell", "arguments": {"command": ["ls"]}}\n```', "Sure.", [PARIS, ("shell", {"command": ["ls"]})]),
    # a fence the model did not close before it stopped
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "", [PARIS]),
]
TEXTS = [  # stays text, exactly as written
    # recorded, 0.5B: a name no tool has ("Write a Python function that adds two numbers", "Show me notes.txt")
    '```json\n{\n  "name": "add_numbers",\n  "arguments": {\n    "a": 5,\n    "b": 3\n  }\n}\n```',
    '```json\n{\n  "name": "notes.txt",\n  "arguments": {\n    "command": ["cat", "notes.txt"]\n  }\n}\n```',
    # recorded, 0.5B: arguments that do not fit the schema ("Run ls in the current directory": a list)
    '```json\n{\n  "name": "shell",\n  "arguments": [\n    ["ls"]\n  ]\n}\n```',
    # recorded, 0.5B: cut by max_tokens (broken JSON)
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city',
    '{"name": "get_weather", "arguments": {"city": "Paris"',  # unclosed bare JSON
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}\n```',  # one brace short
    '{"name": "get_weather", "arguments": "{city: Paris}"}',  # arguments a string that is not JSON
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # a required key missing
    '{"name": "shell", "arguments": {"command": "ls"}}',  # a string where the schema wants an array
    '{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object"}}',  # a definition echoed
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}}]',  # not all calls
    'Here is code:\n```python\nd = {"name": "get_weather", "arguments": {"city": 1}}\nprint(d)\n```\n',
    'An answer with [1, 2], {braces} and `code` in it.\n\n```\nplain fence\n```\n',
    "4",
    '{"not": "a tool"}',
]


def test_every_shape_is_the_same_calls_and_content_however_it_is_split():
    rng = random.Random(5)
    for text, want_content, want_calls in CASES:
        for _ in range(150):
            content, calls, parts = _run(text, _splits(text, rng))
            assert (content, calls) == (want_content, want_calls), (text, content, calls)
            for piece in parts:  # no piece of a call's JSON ever went out as content
                assert '"name"' not in piece and "```" not in piece and "{" not in piece, (text, parts)


def test_what_is_no_call_stays_text_exactly():
    rng = random.Random(6)
    for text in TEXTS:
        for _ in range(150):
            content, calls, _ = _run(text, _splits(text, rng))
            assert (content, calls) == (text, []), (text, content, calls)


def test_template_setting_keeps_only_the_templates_markers():
    for text, _, _ in CASES[:4]:
        content, calls, _ = _run(text, [text], lenient=False)
        assert (content, calls) == (text, []), text
    text = CASES[9][0]  # Qwen's own markers still parse
    assert _run(text, [text], lenient=False)[1] == [PARIS]
    assert settings({}).tool_call_shapes == "lenient"
    assert settings({"LOCALRUN_TOOL_CALL_SHAPES": "Template"}).tool_call_shapes == "template"
    with pytest.raises(ValueError, match="LOCALRUN_TOOL_CALL_SHAPES"):
        settings({"LOCALRUN_TOOL_CALL_SHAPES": "loose"})


def test_plain_answers_stream_as_they_come():
    text = "The answer is 4.\nNothing to call here, and a list [a, b] too."
    _, _, parts = _run(text, list(text))
    joined = "".join(parts)
    assert joined == text.rstrip() or joined == text  # at most the trailing whitespace waits
    assert sum(1 for p in parts if p) > len(text) // 2  # character by character, not held


def test_text_before_a_call_streams_before_it_is_decided():
    text = 'Checking the weather now.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    p = _parser()
    first = p.feed(text[:40])[1]
    assert first == "Checking the weather now."
    assert p.feed(text[40:])[1] == ""
    _, rest, calls = p.finish()
    assert rest == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [PARIS]


def test_a_huge_non_call_is_released_without_waiting_for_its_end():
    big = '{"data": "' + "x" * (HOLD_MAX + 100)
    p = LenientCalls({"get_weather": WEATHER["function"]})
    out = p.feed(big[:HOLD_MAX // 2]) + p.feed(big[HOLD_MAX // 2:])
    assert out == big  # released before the JSON ends
    assert p.feed('", "more": {"k": 1}} after') == '", "more": {"k": 1}} after'
    fence = "```\n" + "y\n" * HOLD_MAX
    p = LenientCalls({"get_weather": WEATHER["function"]})
    out = p.feed(fence)
    assert fence.startswith(out) and len(out) >= len(fence) - 3  # all but what may start the closing ```
    assert out + p.feed("z\n```\nend") + p.finish()[0] == fence + "z\n```\nend"


def test_a_forced_call_stays_forced_and_a_cut_one_is_no_text():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert _run(text, list(text), forced=True)[:2] == ("", [PARIS])
    assert _run(text[:30], [text[:30]], forced=True)[:2] == ("", [])


def test_reasoning_then_a_fenced_call():
    tpl = QWEN_TEMPLATE + "{# <think> #}"
    p = OutputParser(reasoning_for(tpl, ""), NAMES, tool_format=learn(tpl), tools=TOOLS, lenient=True)
    r, c = p.feed('<think>need the weather</think>\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```')
    r2, c2, calls = p.finish()
    assert r + r2 == "need the weather" and c + c2 == "" and [k["name"] for k in calls] == ["get_weather"]


def test_schema_fit_and_call_shapes():
    tools = {"get_weather": WEATHER["function"], "free": {"name": "free"}}
    assert fits({"city": "x"}, WEATHER["function"]["parameters"]) and not fits({"city": 3}, WEATHER["function"]["parameters"])
    assert fits({"anything": 1}, None) and fits({}, {})
    assert calls_in('{"name": "free"}', tools) == [("free", {})]  # no arguments: an empty object
    assert calls_in('{"name": "free", "arguments": ""}', tools) == [("free", {})]
    assert calls_in('{"name": "get_weather", "arguments": {"city": "x"}, "parameters": {"city": "y"}}', tools) is None
    assert calls_in("[]", tools) is None and calls_in("", tools) is None
    assert calls_in('{"name": "get_weather", "arguments": {"city": "x"}} trailing', tools) is None
    deep = "[" * 5000 + "]" * 5000  # RecursionError-deep JSON is no call (and no crash)
    assert calls_in(deep, tools) is None
    assert LenientCalls.run(deep, tools) == (deep, [])


# Claude Code's Read tool, as Claude Code 2.1 sends it (trimmed to the typed properties)
READ = {"name": "Read", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["file_path"],
    "properties": {"file_path": {"type": "string"}, "offset": {"type": "integer", "minimum": 0},
                   "limit": {"type": "integer", "exclusiveMinimum": 0}, "pages": {"type": "string"}}}}
TYPED = {"name": "typed", "parameters": {"type": "object", "properties": {
    "n": {"type": "number"}, "flag": {"type": "boolean"}, "either": {"type": ["integer", "null"]},
    "s": {"type": "string"}, "inner": {"type": "object", "properties": {"k": {"type": "integer"}}}}}}


def test_numbers_and_booleans_written_as_strings_are_coerced_before_the_check():
    tools = {"Read": READ, "typed": TYPED}
    # recorded, 0.5B under Claude Code: offset and limit as strings
    text = '```json\n{"name": "Read", "arguments": {"file_path": "notes.txt", "offset": "0", "limit": "200"}}\n```'
    assert LenientCalls.run(text, tools) == ("", [("Read", {"file_path": "notes.txt", "offset": 0, "limit": 200})])
    got = calls_in('{"name": "typed", "arguments": {"n": "-2.5", "flag": "true", "either": "7", "s": "12", '
                   '"inner": {"k": "3"}}}', tools)
    assert got == [("typed", {"n": -2.5, "flag": True, "either": 7, "s": "12", "inner": {"k": 3}})]
    assert type(got[0][1]["either"]) is int and type(got[0][1]["n"]) is float
    assert calls_in('{"name": "typed", "arguments": {"n": "4"}}', tools) == [("typed", {"n": 4})]
    assert calls_in('{"name": "typed", "arguments": {"flag": "false"}}', tools) == [("typed", {"flag": False})]


@pytest.mark.parametrize("args", [
    '{"file_path": "a", "offset": "zero"}', '{"file_path": "a", "offset": " 0"}', '{"file_path": "a", "offset": "0.5"}',
    '{"file_path": "a", "offset": "1e3"}', '{"file_path": "a", "offset": "007"}', '{"file_path": "a", "offset": "-1"}',
    '{"file_path": "a", "offset": ""}', '{"file_path": 5}', '{"file_path": "a", "pages": 3}',
    '{"file_path": "a", "offset": "0", "bogus": 1}',
])
def test_everything_else_stays_strict(args):
    text = '{"name": "Read", "arguments": %s}' % args
    assert calls_in(text, {"Read": READ}) is None
    assert LenientCalls.run(text, {"Read": READ}) == (text, [])


def test_coerce_leaves_what_it_does_not_type_alone():
    schema = TYPED["parameters"]
    args = {"flag": "True", "n": "1,5", "s": "3", "other": "4", "inner": "x"}
    assert coerce(args, schema) == args and coerce(args, None) == args and coerce({"n": "2"}, {}) == {"n": "2"}
    mine = {"n": "2"}
    assert coerce(mine, schema) == {"n": 2} and mine == {"n": "2"}  # a new dict: the model's own is unchanged


def test_the_templates_own_markers_get_the_same_coercion():
    tools = [{"type": "function", "function": READ}]
    p = OutputParser(reasoning_for(QWEN_TEMPLATE, ""), {"Read"}, tool_format=learn(QWEN_TEMPLATE), tools=tools,
                     lenient=False)
    _, content = p.feed('<tool_call>\n{"name": "Read", "arguments": {"file_path": "notes.txt", "offset": "0"}}\n</tool_call>')
    _, rest, calls = p.finish()
    assert content + rest == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("Read", {"file_path": "notes.txt", "offset": 0})]
