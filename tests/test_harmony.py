"""gpt-oss's harmony format: recorded outputs (tests/harmony_samples.py) parse into reasoning, content
and tool calls at any chunking, on every API, streamed and not; a chat with tool results renders
through gpt-oss's own template; both backends hand the parser the markers' text."""

from __future__ import annotations

import json
import random

import pytest

from harmony_samples import SAMPLES, TOOL_NAMES, TOOLS
from localrun.server.harmony import HARMONY_TOKENS, MAX_HEADER, HarmonyParser, harmony_messages, is_harmony

NAMES = list(SAMPLES)


@pytest.fixture(scope="module")
def gpt_oss_template(request, tmp_path_factory) -> str:
    """gpt-oss's chat template as llama.cpp vendors it (models/templates/openai-gpt-oss-120b.jinja)."""
    from vlm_model import _sdist

    try:
        cache = request.config.cache.mkdir("llama-sdist")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("llama-sdist")
    return (_sdist(cache) / "vendor" / "llama.cpp" / "models" / "templates" / "openai-gpt-oss-120b.jinja").read_text(
        encoding="utf-8")


def _parse(pieces: list[str]) -> tuple[list[str], list[str], list[dict]]:
    p = HarmonyParser(set(TOOL_NAMES))
    rs, cs = [], []
    for piece in pieces:
        r, c = p.feed(piece)
        rs.append(r)
        cs.append(c)
    r, c, calls = p.finish()
    return rs + [r], cs + [c], calls


def _check(name: str, pieces: list[str]) -> None:
    text, want_r, want_c, want_calls, _ = SAMPLES[name]
    rs, cs, calls = _parse(pieces)
    assert ("".join(rs), "".join(cs)) == (want_r, want_c), (name, pieces)
    assert [(k["name"], json.loads(k["arguments"])) for k in calls] == want_calls, (name, pieces)
    if name != "not_harmony":  # never a marker (nor a piece of one) as text
        assert not any("<|" in x or "|>" in x for x in rs + cs), (name, pieces, rs, cs)


@pytest.mark.parametrize("name", NAMES)
def test_each_sample_parses_whole_and_split_anywhere(name):
    text = SAMPLES[name][0]
    _check(name, [text])
    _check(name, list(text))  # a character at a time
    for k in range(len(text) + 1):  # split in two at every boundary
        _check(name, [text[:k], text[k:]])
    rng = random.Random(name)
    for _ in range(40):  # random chunkings
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        _check(name, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])


def test_reasoning_streams_as_written():
    """The analysis goes out piece by piece (never held to the end), and the final answer too."""
    text = SAMPLES["analysis_final"][0]
    rs, cs, _ = _parse(list(text))
    assert sum(1 for r in rs if r) > 20 and sum(1 for c in cs if c) > 20


def test_a_tool_the_request_does_not_offer_is_no_call_and_no_text():
    p = HarmonyParser({"get_time"})
    assert p.feed(SAMPLES["analysis_call"][0]) == (SAMPLES["analysis_call"][1], "")
    assert p.finish() == ("", "", [])


def test_text_that_is_no_header_is_content_as_written():
    p = HarmonyParser()
    assert p.feed("<|channel|>final<|message|>Hi<|end|>") == ("", "Hi")
    assert p.feed("trailing") == ("", "trailing")
    assert p.finish() == ("", "", [])
    p = HarmonyParser()  # what begins like a header but never gets its <|message|>: held no longer than MAX_HEADER
    assert p.feed("<|start|>") == ("", "")
    assert p.feed("a" * MAX_HEADER) == ("", "<|start|>" + "a" * MAX_HEADER)


def test_harmony_template_is_recognized(gpt_oss_template):
    assert is_harmony(gpt_oss_template) and not is_harmony("{{ messages }}") and not is_harmony(None)
