"""gpt-oss's harmony format: recorded outputs (tests/harmony_samples.py) parse into reasoning, content
and tool calls at any chunking, on every API, streamed and not; a chat with tool results renders
through gpt-oss's own template; both backends hand the parser the markers' text."""

from __future__ import annotations

import json
import os
import random
import re

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


# -- every API over real HTTP ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harmony_daemon(gpt_oss_template, tmp_path_factory):
    """The real daemon (its routes, generation service and parser) over real HTTP, with a model carrying
    gpt-oss's template; the fake backend (tests/fakes.py) writes a recorded sample's text a character a
    token (the special tokens as text, as both real backends hand them over for a harmony chat: see the
    backend tests below). What is under test is the parsing and each API's shape, not a model."""
    from fakes import FakeModel, InProcessDaemon, library_home

    modelfile = f'FROM smollm2:135m\nTEMPLATE """{gpt_oss_template}"""\nPARAMETER num_ctx 32768\n'
    home = library_home(tmp_path_factory.mktemp("harmony_home"), {"gptoss": modelfile})
    fake = FakeModel()

    def reply(prompt: str) -> str:
        name = next((n for n in SAMPLES if f"[sample {n}]" in prompt), "analysis_final")
        text, *_, finish = SAMPLES[name]
        return text + (" and on it goes" if finish == "length" else "")  # cut by max_tokens

    fake.reply = reply
    d = InProcessDaemon(home, fake, LOCALRUN_NUM_PARALLEL="1")
    d.fake = fake
    yield d
    d.stop()


def _ask(name: str) -> tuple[str, int]:
    text, *_, finish = SAMPLES[name]
    return f"[sample {name}] Please answer.", len(text) if finish == "length" else 4096


def _want(name: str) -> tuple[str, str, list[tuple[str, dict]], str]:
    _, r, c, calls, finish = SAMPLES[name]
    return r, c, calls, "tool_calls" if calls else finish


def _openai(d, name: str, stream: bool):
    from openai import OpenAI

    client = OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
    q, max_tokens = _ask(name)
    kw = dict(model="gptoss", tools=TOOLS, max_tokens=max_tokens, messages=[{"role": "user", "content": q}])
    if not stream:
        ch = client.chat.completions.create(**kw).choices[0]
        m = ch.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return m.model_extra.get("reasoning_content") or "", m.content or "", calls, ch.finish_reason
    r, c, parts, finish = [], [], {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        r.append((delta.model_extra or {}).get("reasoning_content") or "")
        c.append(delta.content or "")
        for tc in delta.tool_calls or []:
            p = parts.setdefault(tc.index, ["", ""])
            p[0] += tc.function.name or ""
            p[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert not any("<|" in x for x in r + c)
    calls = [(n, json.loads(a)) for n, a in (parts[k] for k in sorted(parts))]
    return "".join(r), "".join(c), calls, finish


def _ollama(d, name: str, stream: bool):
    import ollama

    client = ollama.Client(host=d.url)
    q, max_tokens = _ask(name)
    kw = dict(model="gptoss", tools=TOOLS, messages=[{"role": "user", "content": q}], options={"num_predict": max_tokens})
    if not stream:
        res = client.chat(**kw)
        calls = [(t.function.name, dict(t.function.arguments)) for t in res.message.tool_calls or []]
        return res.message.thinking or "", res.message.content or "", calls, _ollama_reason(res.done_reason, calls)
    r, c, calls, reason = [], [], [], None
    for part in client.chat(**kw, stream=True):
        r.append(part.message.thinking or "")
        c.append(part.message.content or "")
        calls += [(t.function.name, dict(t.function.arguments)) for t in part.message.tool_calls or []]
        reason = part.done_reason or reason
    assert not any("<|" in x for x in r + c)
    return "".join(r), "".join(c), calls, _ollama_reason(reason, calls)


def _ollama_reason(reason: str, calls: list) -> str:
    assert reason in ("stop", "length")  # Ollama says "stop" for a turn that calls tools
    return "tool_calls" if calls and reason == "stop" else reason


def _anthropic(d, name: str, stream: bool):
    import anthropic

    client = anthropic.Anthropic(base_url=d.url, api_key="x", max_retries=0)
    q, max_tokens = _ask(name)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model="gptoss", tools=tools, max_tokens=max_tokens, messages=[{"role": "user", "content": q}])
    if stream:
        with client.messages.stream(**kw) as s:
            events = list(s)
            msg = s.get_final_message()
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(x.thinking for x in deltas if x.type == "thinking_delta") == _want(name)[0]
        assert "".join(x.text for x in deltas if x.type == "text_delta") == _want(name)[1]
    else:
        msg = client.messages.create(**kw)
    kinds = [b.type for b in msg.content]
    assert kinds == sorted(kinds, key=["thinking", "text", "tool_use"].index), kinds  # thinking, text, then calls
    thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
    text = "".join(b.text for b in msg.content if b.type == "text")
    calls = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
    reason = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length"}[msg.stop_reason]
    return thinking, text, calls, reason


def _responses(d, name: str, stream: bool):
    from openai import OpenAI

    client = OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
    q, max_tokens = _ask(name)
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model="gptoss", tools=tools, max_output_tokens=max_tokens, input=q)
    if stream:
        events = list(client.responses.create(**kw, stream=True))
        r = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        c = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (r, c) == _want(name)[:2]
        res = next(e.response for e in events if e.type in ("response.completed", "response.incomplete"))
    else:
        res = client.responses.create(**kw)
    kinds = [o.type for o in res.output]
    assert kinds == sorted(kinds, key=["reasoning", "message", "function_call"].index), kinds
    reasoning = "".join(p.text for o in res.output if o.type == "reasoning" for p in o.content or [])
    text = "".join(p.text for o in res.output if o.type == "message" for p in o.content)
    calls = [(o.name, json.loads(o.arguments)) for o in res.output if o.type == "function_call"]
    assert res.status == ("incomplete" if _want(name)[3] == "length" else "completed")
    return reasoning, text, calls, _want(name)[3] if res.status == "completed" and calls else (
        "length" if res.status == "incomplete" else "stop")


API = {"openai": _openai, "ollama": _ollama, "anthropic": _anthropic, "responses": _responses}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", list(API))
def test_every_sample_on_every_api(harmony_daemon, api, stream):
    """Each recorded output comes back as the API's reasoning, text and tool calls, streamed and not."""
    for name in NAMES:
        got = API[api](harmony_daemon, name, stream)
        assert got == _want(name), (api, name, got)
        req = harmony_daemon.fake.requests[-1]
        assert req.preserve == HARMONY_TOKENS and req.prompt.endswith("<|start|>assistant")


# -- tool results sent back render through gpt-oss's template -------------------------------------------------
THOUGHT = "Need both the weather and the time."
RENDERED = ("<|start|>user<|message|>[roundtrip] Weather and time in Tokyo?<|end|>"
            f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Tokyo"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"timezone": "Asia/Tokyo"}'
            '<|call|><|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"10:00"<|end|>'
            "<|start|>assistant")
QUESTION = "[roundtrip] Weather and time in Tokyo?"
ARGS = [("c1", "get_weather", {"city": "Tokyo"}), ("c2", "get_time", {"timezone": "Asia/Tokyo"})]


def _sent_back_openai(d):
    from openai import OpenAI

    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for i, n, a in ARGS]
    OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="gptoss", tools=TOOLS, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "10:00"},  # the results in another order: by id
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])


def _sent_back_ollama(d):
    import ollama

    ollama.Client(host=d.url).chat(model="gptoss", tools=TOOLS, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "thinking": THOUGHT,
         "tool_calls": [{"function": {"name": n, "arguments": a}} for _, n, a in ARGS]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_name": "get_time", "content": "10:00"}])


def _sent_back_anthropic(d):
    import anthropic

    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}  # (no description: optional)
             for t in TOOLS]
    anthropic.Anthropic(base_url=d.url, api_key="x", max_retries=0).messages.create(
        model="gptoss", tools=tools, max_tokens=200, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""}] + [
                {"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in ARGS]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
                                         {"type": "tool_result", "tool_use_id": "c2", "content": "10:00"}]}])


def _sent_back_responses(d):
    from openai import OpenAI

    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0).responses.create(
        model="gptoss", tools=tools, input=[
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            *[{"type": "function_call", "call_id": i, "name": n, "arguments": json.dumps(a)} for i, n, a in ARGS],
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "10:00"}])


@pytest.mark.parametrize("api", ["openai", "ollama", "anthropic", "responses"])
def test_tool_results_sent_back_render_through_the_template(harmony_daemon, api):
    """The assistant's reasoning and its two calls, each followed by its result, as gpt-oss's template
    writes them (its template reads one call a turn: the turn is split)."""
    globals()[f"_sent_back_{api}"](harmony_daemon)
    assert harmony_daemon.fake.requests[-1].prompt.endswith(RENDERED)


def test_harmony_messages_split_a_turn_of_several_calls():
    c = [{"id": "a", "function": {"name": "f", "arguments": {}}}, {"id": "b", "function": {"name": "g", "arguments": {}}}]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre", "thinking": "t", "tool_calls": c},
            {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "tool", "content": "extra"}, {"role": "assistant", "content": None}]
    out = harmony_messages(msgs)
    assert [(m["role"], m.get("content"), [x["id"] for x in m.get("tool_calls", [])]) for m in out] == [
        ("user", "q", []), ("assistant", "", ["a"]), ("tool", "A", []), ("assistant", "", ["b"]), ("tool", "B", []),
        ("tool", "extra", []), ("assistant", "", [])]
    assert out[1]["thinking"] == "t" and "thinking" not in out[3]  # the content gave way to the reasoning


# -- both backends hand the parser the markers' text ---------------------------------------------------------
@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_gguf):
    """SmolLM2's real tokenizer (from its GGUF, as the native engine loads it) with harmony's markers
    added as special tokens, as gpt-oss's o200k_harmony vocabulary has them."""
    from localrun.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf, [], None)
    tok._tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    return tok


@pytest.mark.parametrize("name", ["two_calls", "unicode", "preamble_call"])
def test_native_detokenizer_keeps_the_markers_it_is_asked_to(harmony_tokenizer, name):
    """The native engine's streaming detokenizer drops special tokens, except those a request
    preserves (the daemon asks for harmony's markers): token by token the text is the model's, and
    the parser reads it; without them the channels are lost."""
    from localrun.engine.tokenizer import Detokenizer

    tok = harmony_tokenizer
    text, want_r, want_c, want_calls, _ = SAMPLES[name]
    prompt = tok.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    ids = tok.encode(text)
    keep = tok.kept_specials(HARMONY_TOKENS)
    assert len(keep) == len(HARMONY_TOKENS) and keep <= tok.special_ids
    assert tok.kept_specials(["<|im_start|>x", "not special"]) == frozenset()  # one special token each, or none
    d = Detokenizer(tok, prompt, keep)
    pieces = [d.add(t) for t in ids]
    assert "".join(pieces) == text
    p = HarmonyParser(set(TOOL_NAMES))
    got = [p.feed(x) for x in pieces]
    r, c, calls = p.finish()
    assert ("".join(x[0] for x in got) + r, "".join(x[1] for x in got) + c) == (want_r, want_c)
    assert [(k["name"], json.loads(k["arguments"])) for k in calls] == want_calls
    plain = Detokenizer(tok, prompt)  # no preserve: as before, the special tokens give no text
    assert "".join(plain.add(t) for t in ids) == tok.decode(ids)
    assert "<|channel|>" not in tok.decode(ids)


def test_native_backend_asks_for_the_kept_markers(harmony_tokenizer):
    """NativeBackend turns a request's preserve list into the engine's keep_special set."""
    from localrun.backends.base import SamplingOptions
    from localrun.backends.native import _params

    keep = harmony_tokenizer.kept_specials(HARMONY_TOKENS)
    assert _params(SamplingOptions(max_tokens=8), 4, 64, None, keep).keep_special == keep


def _forcing(text: str) -> str:
    """A GBNF grammar that lets the model write exactly `text`, its markers as special tokens."""
    parts = re.split("(" + "|".join(map(re.escape, HARMONY_TOKENS)) + ")", text)
    return "root ::= " + " ".join(p if p in HARMONY_TOKENS else json.dumps(p, ensure_ascii=False) for p in parts if p)


@pytest.fixture(scope="module", params=["llamacpp", "native"])
def real_harmony_daemon(request, gpt_oss_template, smollm2_gguf, tmp_path_factory):
    """The real daemon, real backends: SmolLM2 with harmony's markers as special tokens and gpt-oss's template."""
    import hashlib

    from daemon import Daemon
    from harmony_samples import harmony_gguf
    from localrun.library import Library

    try:
        cache = request.config.cache.mkdir("harmony-gguf")
    except AttributeError:
        cache = tmp_path_factory.mktemp("harmony-gguf")
    path = cache / f"smollm2-harmony-{hashlib.sha256(gpt_oss_template.encode()).hexdigest()[:12]}.gguf"
    if not path.exists():
        harmony_gguf(smollm2_gguf, path.with_suffix(".part"), gpt_oss_template).rename(path)
    home = tmp_path_factory.mktemp(f"harmony_{request.param}")
    Library(home / "models").create("oss", f"FROM {path}\nPARAMETER num_ctx 4096\n")
    d = Daemon(home, LOCALRUN_BACKEND=request.param, LOCALRUN_NUM_PARALLEL="1", HF_HUB_OFFLINE="1")
    d.backend = request.param
    yield d
    d.stop()


@pytest.mark.parametrize("name", ["preamble_call", "recipient_first", "unicode_final"])
def test_a_real_backend_writes_harmony_that_parses(real_harmony_daemon, name):
    """Both backends, for real: the model (made to write a recorded sample by a grammar whose markers
    are its special tokens) hands the parser the markers' text, and the chat API answers with the
    sample's reasoning, content and calls, streamed and not. (<|call|> and <|return|> end generation, as
    in gpt-oss: llama.cpp makes them end-of-generation tokens by name, so a turn holds one call.)"""
    from openai import OpenAI

    if real_harmony_daemon.backend == "native" and name != "preamble_call" and not os.environ.get("LOCALRUN_TEST_HARMONY_ALL"):
        pytest.skip("the native engine on CPU is slow: one sample unless LOCALRUN_TEST_HARMONY_ALL=1")
    text = SAMPLES[name][0].removesuffix("<|return|>").removesuffix("<|call|>")
    client = OpenAI(base_url=real_harmony_daemon.url + "/v1", api_key="x", max_retries=0, timeout=300)
    kw = dict(model="oss", tools=TOOLS, temperature=0, max_tokens=400, extra_body={"grammar": _forcing(text)},
              messages=[{"role": "user", "content": "Weather?"}])
    want_r, want_c, want_calls, _ = _want(name)
    m = client.chat.completions.create(**kw).choices[0].message
    assert (m.model_extra.get("reasoning_content") or "", m.content or "") == (want_r, want_c)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []] == want_calls
    r, c, calls = "", "", {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            r += (delta.model_extra or {}).get("reasoning_content") or ""
            c += delta.content or ""
            for tc in delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    assert (r, c) == (want_r, want_c)
    assert [(n, json.loads(a)) for n, a in calls.values()] == want_calls


def test_gbnf_token_references_reach_llguidance():
    """llama.cpp's GBNF names tokens as <|channel|> or <[1000]>: they stay token references (outside
    literals, classes and comments); a negated one is a clear 400."""
    from localrun.errors import InvalidRequest
    from localrun.structured.constraints import gbnf_lark

    lark = gbnf_lark('root ::= <|channel|> "a<b>" [<>] <[12]> # <c>\n')
    assert 'start: <|channel|> "a<b>" /[<>]/ <[12]>' in lark and "LRTOKENREF" not in lark
    with pytest.raises(InvalidRequest, match="negates a token"):
        gbnf_lark('root ::= !<|end|> "x"')
