"""OutputParser: reasoning / content / tool calls, the same however the text is split."""

from __future__ import annotations

import json
import random

from localrun.server.output import OutputParser, Reasoning, reasoning_for

TOOLS = {"get_weather"}


def _run(text: str, pieces: list[str], reasoning=None, tools=None):
    p = OutputParser(reasoning, tools)
    r_parts, c_parts = [], []
    for piece in pieces:
        r, c = p.feed(piece)
        r_parts.append(r)
        c_parts.append(c)
    r, c, calls = p.finish()
    return "".join(r_parts) + r, "".join(c_parts) + c, calls, c_parts


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_plain_text_streams_untouched():
    _, content, calls, parts = _run("Hello there", ["Hel", "lo", " there"], Reasoning(), TOOLS)
    assert content == "Hello there" and not calls and parts == ["Hel", "lo", " there"]


def test_reasoning_split_any_split():
    rng = random.Random(1)
    cases = [
        ("<think>I should say hi.</think>\nHi!", Reasoning(), "I should say hi.", "Hi!"),
        ("I should say hi.</think>Hi!", Reasoning(started=True), "I should say hi.", "Hi!"),
        ("Hi, no thinking <think> here", Reasoning(), "", "Hi, no thinking <think> here"),
        ("still thinking when cut", Reasoning(started=True), "still thinking when cut", ""),
        ("  <think>a<b</think>c", Reasoning(), "a<b", "c"),
    ]
    for text, spec, want_r, want_c in cases:
        for _ in range(200):
            r, c, _, _ = _run(text, _splits(text, rng), spec)
            assert (r, c) == (want_r, want_c), (text, r, c)


def test_tool_calls_any_split():
    rng = random.Random(2)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    cases = [
        (call, "", 1),  # a forced call: bare JSON
        (f"Let me check.<tool_call>{call}</tool_call>", "Let me check.", 1),
        (f"<tool_call>{call}</tool_call>\n<tool_call>{call}</tool_call>", "", 2),
        ("The weather is fine, no call needed.", "The weather is fine, no call needed.", 0),
        ('{"not": "a tool"}', '{"not": "a tool"}', 0),
        ('{"name": "get_weather", "arguments": {"ci', '{"name": "get_weather", "arguments": {"ci', 0),  # cut off
    ]
    for text, want_content, n_calls in cases:
        for _ in range(200):
            _, c, calls, _ = _run(text, _splits(text, rng), None, TOOLS)
            assert c.strip() == want_content.strip() and len(calls) == n_calls, (text, c, calls)
            for k in calls:
                assert k["name"] == "get_weather" and json.loads(k["arguments"]) == {"city": "Paris"}


def test_a_call_with_a_raw_newline_in_a_string_is_still_a_call():
    """Models write code arguments with raw newlines inside JSON strings (strict JSON forbids them):
    the call is still read, and its arguments go out as valid JSON."""
    for text in ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par\nis"}}</tool_call>',
                 '{"arguments": {"city": "Par\nis"}, "name": "get_weather"}'):
        _, c, calls, _ = _run(text, [text[:7], text[7:]], None, TOOLS)
        assert c == "" and json.loads(calls[0]["arguments"]) == {"city": "Par\nis"}, (text, c, calls)


def test_a_lone_surrogate_escape_in_a_call_becomes_a_replacement_character():
    """JSON allows "\\ud800" alone and json.loads keeps it, but UTF-8 cannot encode it: the
    response would fail. Pairs stay the character they make."""
    for written, want in (('Pa\\ud800ris', "Pa\ufffd\ufffd\ufffdris"), ("\\ud83d\\ude00", "\U0001F600")):
        text = '{"name": "get_weather", "arguments": {"city": "%s"}}' % written
        _, _, calls, _ = _run(text, [text], None, TOOLS)
        assert json.loads(calls[0]["arguments"]) == {"city": want}, calls
        calls[0]["arguments"].encode("utf-8")


def test_content_before_a_call_streams_before_the_end():
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    _, _, calls, parts = _run("Checking now. " + call, ["Checking ", "now. ", call[:5], call[5:]], None, TOOLS)
    assert parts[:2] == ["Checking ", "now. "] and len(calls) == 1


def test_reasoning_and_tool_call_together():
    text = '<think>need weather</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    r, c, calls, _ = _run(text, [text[:9], text[9:30], text[30:]], Reasoning(), TOOLS)
    assert r == "need weather" and c == "" and calls[0]["name"] == "get_weather"


def test_reasoning_for_templates():
    t = "{% for m in messages %}{{ m.content }}{% endfor %}<think>...</think>"
    assert reasoning_for(None, "x") is None and reasoning_for("plain", "x") is None
    assert reasoning_for(t, "user: hi\nassistant: <think>\n").started
    assert not reasoning_for(t, "user: hi\nassistant:").started
    assert not reasoning_for(t, "<think>\n\n</think>\n\n").started  # thinking switched off by the template


def test_harmony_channels_any_split():
    """gpt-oss: analysis -> reasoning, final -> content, a message to functions.NAME -> a tool call
    (the model's header order and the template's), text without channels -> content."""
    from localrun.server.harmony import HarmonyParser

    cases = [
        ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "Need weather.", "",
         [("get_weather", {"city": "Paris"})]),
        ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!",
         "Think.", "Hello there!", []),
        ("Plain answer <b>", "", "Plain answer <b>", []),
        (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>', "", "",
         [("get_weather", {"city": "Paris"})]),
    ]
    rng = random.Random(3)
    for text, want_r, want_c, want_calls in cases:
        for _ in range(30):
            p = HarmonyParser(TOOLS)
            r_all = c_all = ""
            for piece in _splits(text, rng):
                r, c = p.feed(piece)
                r_all, c_all = r_all + r, c_all + c
            r, c, calls = p.finish()
            assert (r_all + r, c_all + c) == (want_r, want_c), text
            assert [(k["name"], json.loads(k["arguments"])) for k in calls] == want_calls
