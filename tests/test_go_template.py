"""Ollama's chat templates (Go's text/template language), as Ollama renders them: the language (trim
markers, variables, branches, ranges, pipelines, Go's functions and Ollama's), Ollama's two ways of
rendering a chat (a template that reads .Messages; an older .System/.Prompt/.Response one, rendered per
turn and cut after the last .Response), tools as Ollama's templates see them, clear 400s for what does
not parse; then through the real daemon with the ollama SDK: a model created with a Go TEMPLATE answers
as the same model with its own (Jinja) template, and /api/generate takes a Go `template` per request.
"""

from __future__ import annotations

import datetime

import pytest

from localrun.templates import go as gt
from localrun.templates.chat import TemplateRenderError, check_template, render_chat, template_supports_tools
from localrun.library.modelfile import parse_modelfile


def render(text: str, data) -> str:
    return gt.execute(gt.parse(text), data, 1_000_000)


@pytest.mark.parametrize("text,data,want", [
    ("a {{- \" b \" -}} c", {}, "a b c"),
    ("x  {{- /* a comment */ -}}  y{{/* another */}}", {}, "xy"),
    ("{{ .A }}|{{ .Missing }}|{{ .N }}|{{ .F }}|{{ .T }}|{{ .L }}", {"A": "s", "N": 3, "F": 1.5, "T": True,
                                                                   "L": [1, "x"]},
     "s|<no value>|3|1.5|true|[1 x]"),
    ("{{ $x := \"one\" }}{{ $x }}{{ $x = \"two\" }}{{ $x }}", {}, "onetwo"),
    ("{{ if eq .R \"a\" \"b\" }}ab{{ else if eq .R \"c\" }}c{{ else }}other{{ end }}", {"R": "b"}, "ab"),
    ("{{ if eq .R \"a\" \"b\" }}ab{{ else if eq .R \"c\" }}c{{ else }}other{{ end }}", {"R": "c"}, "c"),
    ("{{ if eq .R \"a\" \"b\" }}ab{{ else if eq .R \"c\" }}c{{ else }}other{{ end }}", {"R": "z"}, "other"),
    ("{{ range $i, $m := .L }}{{ $i }}={{ $m }};{{ end }}", {"L": ["a", "b"]}, "0=a;1=b;"),
    ("{{ range .M }}{{ . }},{{ end }}", {"M": {"b": 2, "a": 1}}, "1,2,"),  # maps in key order
    ("{{ range $k, $v := .M }}{{ $k }}{{ $v }}{{ end }}", {"M": {"b": 2, "a": 1}}, "a1b2"),
    ("{{ range .L }}x{{ else }}empty{{ end }}", {"L": []}, "empty"),
    ("{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}",
     {"L": [1, 2, 3, 4, 5]}, "13"),
    ("{{ range 3 }}{{ . }}{{ end }}", {}, "012"),
    ("{{ with .A }}[{{ . }}]{{ else }}none{{ end }}{{ with .B }}[{{ . }}]{{ else }}none{{ end }}", {"A": "x", "B": ""},
     "[x]none"),
    ("{{ range .L }}{{ $.Top }}{{ .N }}{{ end }}", {"Top": "t", "L": [{"N": 1}, {"N": 2}]}, "t1t2"),
    ("{{ .A | printf \"%s-%d\" \"x\" }}", {"A": 7}, "x-7"),
    ("{{ printf \"%q %v %5s|%-3d|%%\" \"hi\" true \"ab\" 4 }}", {}, '"hi" true    ab|4  |%'),
    ("{{ (index .L 1).N }} {{ index .M \"k\" }} {{ len .L }} {{ len \"héllo\" }}", {"L": [{"N": 1}, {"N": 2}],
                                                                                  "M": {"k": "v"}}, "2 v 2 6"),
    ("{{ slice .L 1 }} {{ slice .S 1 3 }} {{ len (slice .L 0 1) }}", {"L": [1, 2, 3], "S": "abcd"}, "[2 3] bc 1"),
    ("{{ and .A .B }}|{{ or .B .C }}|{{ or .B .D }}|{{ not .B }}", {"A": "a", "B": "", "C": "c", "D": 0},
     "|c|0|true"),
    ("{{ and .Zero .Missing.Deep }}", {"Zero": 0}, "0"),  # lazy: the second is never evaluated
    ("{{ if and (ne .R \"x\") (lt .N 3) (ge .N 2) }}yes{{ end }}", {"R": "y", "N": 2}, "yes"),
    ("{{ print \"a\" 1 2 \"b\" }}|{{ println 1 \"c\" }}", {}, "a1 2b|1 c\n"),
    ("{{ html \"<a href='x'>&</a>\" }} {{ urlquery \"a b&c\" }}", {}, "&lt;a href=&#39;x&#39;&gt;&amp;&lt;/a&gt; a+b%26c"),
    ("{{ json .V }}", {"V": {"b": [1, "<&>"], "a": None, "é": True}}, '{"a":null,"b":[1,"\\u003c\\u0026\\u003e"],"é":true}'),
    ("{{ `raw \\n` }}{{ \"esc\\n\" }}", {}, "raw \\nesc\n"),
])
def test_the_language(text, data, want):
    assert render(text, data) == want


def test_current_date():
    assert render("{{ currentDate }}", {}) == datetime.date.today().isoformat()


@pytest.mark.parametrize("text,words", [
    ("{{ if .A }}x", "missing {{ end }}"),
    ("x{{ end }}", "unexpected {{ end }}"),
    ("{{ .A ", "unclosed action"),
    ("{{ nosuch .A }}", "function 'nosuch' not defined"),
    ("{{ define \"x\" }}y{{ end }}", "not supported"),
    ("{{ template \"x\" }}", "not supported"),
    ("{{ if .A }}{{ else }}{{ else }}{{ end }}", "{{ else }} after {{ else }}"),
    ("{{ $undefined }}", "undefined variable"),
    ("{{ index .L 5 }}", "index out of range"),
    ("{{ .A.B }}", "can't evaluate field B"),
    ("{{ break }}", "outside a range"),
])
def test_errors_say_what_is_wrong(text, words):
    with pytest.raises(gt.GoTemplateError) as e:
        render(text, {"A": "s", "L": []})
    assert words in e.value.message


def test_which_language():
    assert gt.is_go_template("{{ .Prompt }}") and gt.is_go_template("{{- range .Messages }}x{{ end }}")
    assert gt.is_go_template("{{ if .System }}{{ .System }}{{ end }}")
    assert not gt.is_go_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not gt.is_go_template("{{ bos_token }}{{ messages[0]['content'] }}{{ end_token }}")
    assert template_supports_tools("{{ range .Tools }}{{ .Function.Name }}{{ end }}")
    assert not template_supports_tools("{{ .Prompt }} tools")


CHATML_MESSAGES = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

CHATML_LEGACY = """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}<|im_end|>
"""

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]


def test_a_messages_template_gets_the_collated_chat():
    """Consecutive messages of one role are one (joined by a blank line), tool results stay apart, and
    .System holds every system message."""
    msgs = [{"role": "system", "content": "A"}, {"role": "user", "content": "one"}, {"role": "user", "content": "two"},
            {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}, {"role": "system", "content": "B"}]
    out = render_chat("[{{ .System }}]{{ range .Messages }}<{{ .Role }}:{{ .Content }}>{{ end }}", msgs)
    assert out == "[A\n\nB]<system:A><user:one\n\ntwo><tool:r1><tool:r2><system:B>"
    assert render_chat(CHATML_MESSAGES, CHAT) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                                                  "<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>"
                                                  "user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")


def test_an_older_template_is_rendered_per_turn_and_cut_after_the_response():
    """.System/.Prompt/.Response templates: one render per turn, the last cut after {{ .Response }} (the
    prompt ends where the answer begins); one without .Response gets it appended, as Ollama does."""
    assert render_chat(CHATML_LEGACY, CHAT) == render_chat(CHATML_MESSAGES, CHAT)
    assert render_chat("U: {{ .Prompt }}\nA: ", CHAT[1:]) == "U: Hi\nA: Hello!U: Name a colour.\nA: "
    # a final assistant message (a prefill) is continued: the cut keeps its text
    assert render_chat(CHATML_LEGACY, CHAT[:3], add_generation_prompt=False).endswith("<|im_start|>assistant\nHello!")


QWEN_TOOLS = """{{- if .Messages }}
{{- if or .System .Tools }}<|im_start|>system
{{- if .System }}
{{ .System }}
{{- end }}
{{- if .Tools }}

# Tools
<tools>
{{- range .Tools }}
{"type": "function", "function": {{ .Function }}}
{{- end }}
</tools>
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if .Content }}{{ .Content }}
{{- else if .ToolCalls }}<tool_call>
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{ end }}</tool_call>
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
<tool_response>
{{ .Content }}
</tool_response><|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}
{{- else }}{{ .Prompt }}{{ end }}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & here", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "unit": {"enum": ["c", "f"], "type": "string", "description": "Unit"},
        "city": {"description": "City", "type": "string"}}}}}]


def test_tools_and_tool_calls_as_ollamas_templates_see_them():
    """.Tools print as Go marshals them (struct fields in order, map keys sorted, <, > and & escaped);
    a call's .Function.Arguments print as JSON; tool results are messages of their own."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"unit": "c", "city": "Paris"}'}}]},
            {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]
    out = render_chat(QWEN_TOOLS, msgs, tools=TOOLS)
    fn = ('{"name":"get_weather","description":"Weather \\u003cnow\\u003e \\u0026 here","parameters":{"type":"object",'
          '"required":["city"],"properties":{"city":{"type":"string","description":"City"},"unit":{"type":"string",'
          '"description":"Unit","enum":["c","f"]}}}}')
    assert out == ('<|im_start|>system\n\n# Tools\n<tools>\n{"type": "function", "function": ' + fn + '}\n</tools>'
                   '<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
                   '{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}\n</tool_call><|im_end|>\n'
                   '<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    props = "{{ range $k, $v := (index .Tools 0).Function.Parameters.Properties }}{{ $k }}:{{ $v.Type }}:" \
            "{{ toTypeScriptType $v }};{{ end }}{{ range .Messages }}{{ end }}"
    assert render_chat(props, msgs, tools=TOOLS) == "city:string:string;unit:string:string;"


def test_thinking_flags():
    t = "{{ range .Messages }}{{ end }}{{ .Think }} {{ .ThinkLevel }} {{ .IsThinkSet }}"
    assert render_chat(t, CHAT) == "false  false"
    assert render_chat(t, CHAT, enable_thinking=True, reasoning_effort="high") == "true high true"
    assert render_chat(t, CHAT, enable_thinking=False) == "false  true"


def test_a_go_template_that_does_not_parse_is_a_clear_400():
    with pytest.raises(TemplateRenderError) as e:
        check_template("{{ if .System }}{{ .System }}")
    assert "missing {{ end }}" in e.value.message and e.value.status == 400
    with pytest.raises(TemplateRenderError) as e:
        render_chat("{{ range .Messages }}{{ index .Images 3 }}{{ end }}", CHAT)
    assert "index out of range" in e.value.message
    mf = parse_modelfile(f'FROM smollm2:135m\nTEMPLATE """{CHATML_LEGACY}"""\n')
    assert mf.template == CHATML_LEGACY
    with pytest.raises(Exception) as e:
        parse_modelfile('FROM smollm2:135m\nTEMPLATE """{{ if .Prompt }}x"""\n')
    assert "line 2" in str(e.value) and "missing {{ end }}" in str(e.value)


def test_output_is_bounded():
    with pytest.raises(gt.GoTemplateError) as e:
        gt.execute(gt.parse("{{ range .L }}{{ range $.L }}{{ $.S }}{{ end }}{{ end }}"),
                   {"L": list(range(300)), "S": "x" * 100}, 1_000_000)
    assert "over 1000000 characters" in e.value.message


# -- through the daemon, with the ollama SDK ----------------------------------------------------------------
def test_a_modelfile_with_an_ollama_template_through_the_daemon(tmp_path):
    """A model created (ollama SDK) with an Ollama-style Go TEMPLATE renders as the base model's own
    ChatML template does: the same prompt tokens and the same greedy answer; /api/generate takes a Go
    `template` for one request; a Go template that does not parse is a 400 and nothing is created."""
    pytest.importorskip("llama_cpp")
    ollama = pytest.importorskip("ollama")
    from daemon import MODEL, Daemon

    d = Daemon(tmp_path / "home", LOCALRUN_CONTEXT_LENGTH="1024", LOCALRUN_NUM_PARALLEL="1")
    try:
        d.pull()
        client = ollama.Client(host=d.url)
        client.create(model="go-chatml", from_=MODEL, template=CHATML_LEGACY)
        client.create(model="go-messages", from_=MODEL, template=CHATML_MESSAGES)
        msgs = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}]
        opts = {"temperature": 0, "num_predict": 12}
        base = client.chat(model=MODEL, messages=msgs, options=opts)
        for name in ("go-chatml", "go-messages"):
            mine = client.chat(model=name, messages=msgs, options=opts)
            assert mine.message.content == base.message.content and mine.prompt_eval_count == base.prompt_eval_count
        assert client.show("go-chatml").template == CHATML_LEGACY
        # vLLM's /tokenizer_info gives clients a template they render with Jinja: none for an Ollama one
        info = d.http.get("/tokenizer_info", params={"model": "go-chatml"}).json()
        assert info["chat_template"] is None and info["eos_token"] == "<|im_end|>"
        one = client.generate(model=MODEL, prompt="Sky colour?", options=opts,
                              template="<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n")
        raw = client.generate(model=MODEL, prompt="<|im_start|>user\nSky colour?<|im_end|>\n<|im_start|>assistant\n",
                              raw=True, options=opts)
        assert one.response == raw.response and one.prompt_eval_count == raw.prompt_eval_count
        with pytest.raises(ollama.ResponseError) as e:
            client.create(model="go-broken", from_=MODEL, template="{{ if .Prompt }}x")
        assert e.value.status_code == 400 and "missing {{ end }}" in str(e.value)
        assert "go-broken" not in [m.model for m in client.list().models]
    finally:
        d.stop()


@pytest.mark.parametrize("text", [
    "{{ range 1000000000000 }}x{{ end }}",  # lazily: ended by the deadline or the output cap
    "{{ $x := \"ab\" }}{{ range .Messages }}{{ range $.Messages }}{{ range $.Messages }}{{ $x = printf \"%s%s\" $x $x }}"
    "{{ end }}{{ end }}{{ end }}{{ $x }}",  # a value doubled in a loop
    "{{ $x := printf \"%999999999s\" \"x\" }}",
    "{{ if .A }}" * 5000 + "{{ end }}" * 5000,  # nested deeper than Python recurses
])
def test_hostile_templates_end_with_a_400_quickly(text):
    import time

    t = time.monotonic()
    assert gt.is_go_template(text)
    with pytest.raises(TemplateRenderError):
        render_chat(text, CHAT * 10)
    assert time.monotonic() - t < 10


def test_any_text_parses_or_is_a_400():
    """Whatever text comes as an Ollama template, rendering gives a prompt or a TemplateRenderError:
    never another exception (a 500)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    parts = st.sampled_from(["{{", "}}", "{{-", "-}}", " ", ".", ".Messages", ".Role", "$", "$x", ":=", "=", "|", "(",
                             ")", "\"", "`", "'a'", "if", "else", "end", "range", "with", "break", "printf", "eq",
                             "index", "slice", "len", "and", "not", "json", "1", "-1", "2.5", "/*", "*/", "\n", "x",
                             "%s", ",", "nil", "true", ".Tools", ".Function.Arguments"])

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.lists(parts, max_size=25).map("".join))
    def check(text):
        text = "{{ range .Messages }}{{ end }}" + text  # (a Go template, whatever follows)
        try:
            assert isinstance(render_chat(text, CHAT, tools=TOOLS), str)
        except TemplateRenderError:
            pass

    check()
