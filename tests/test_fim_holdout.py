"""Fill in the middle on a real coder model (Qwen2.5-Coder-0.5B): holes cut from the standard library
(localrun/bench/fim_holes.py), half with another file as repository context, go through localrun's /infill,
/api/generate (suffix) and /v1/completions (suffix) and through llama.cpp's own llama-server /infill on the same
GGUF (both started by the `bench fim` helpers: real processes, real HTTP); every route's greedy text equals
llama-server's, hole by hole. And the set itself: deterministic, holes that are code lines, bounded context.
Bad input_extra on the Ollama and OpenAI routes is a clear 400."""

from __future__ import annotations

import asyncio
import json

import pytest
from daemon import KEY, Daemon

from localrun.bench import fim_holes

pytestmark = pytest.mark.timeout(900)
pytest.importorskip("llama_cpp")

N_HOLES = 4


def test_held_out_set_is_deterministic_and_bounded():
    a, b = fim_holes.make_holes(20), fim_holes.make_holes(20)
    assert [(h.file, h.line, h.answer) for h in a] == [(h.file, h.line, h.answer) for h in b]
    assert fim_holes.describe(a)["sha256"] == fim_holes.describe(b)["sha256"]
    assert fim_holes.make_holes(20, seed=1)[0].file != a[0].file or fim_holes.make_holes(20, seed=1)[0].line != a[0].line
    assert len({h.file for h in a}) == 20 and sum(1 for h in a if h.extra) == 10
    root = fim_holes.stdlib_dir()
    for h in a:
        lines = (root / h.file).read_text(encoding="utf-8").split("\n")
        line = lines[h.line - 1]
        assert line.strip() == h.answer and len(h.answer.replace(" ", "")) >= fim_holes.MIN_CHARS
        assert not h.answer.startswith(("#", '"', "'"))
        # the prefix is whole lines above and the line's indentation; the suffix a new line and whole lines below
        indent = line[:len(line) - len(line.lstrip())]
        assert h.prefix.endswith("\n" + indent) or h.prefix == indent
        assert ("\n".join(lines[:h.line - 1]) + "\n" + indent).endswith(h.prefix)
        assert h.suffix.startswith("\n") and "\n".join(lines[h.line:]).startswith(h.suffix[1:])
        assert len(h.prefix) <= fim_holes.PREFIX_CHARS + len(indent)
        assert len(h.suffix) <= fim_holes.SUFFIX_CHARS + 1
        for chunk in h.extra:
            assert (root / chunk["filename"]).read_text(encoding="utf-8").startswith(chunk["text"])
    assert fim_holes.first_line("x = 1  \ny = 2") == "x = 1"


def test_every_route_gives_llama_servers_text(qwen_coder_05b, llama_server_bin):
    """4 holes x (llama-server /infill, localrun /infill, /api/generate, /v1/completions): the same greedy text."""
    from localrun.bench import fim_match

    holes = fim_holes.make_holes(N_HOLES)
    got = asyncio.run(fim_match.compare(str(qwen_coder_05b), str(llama_server_bin), holes, max_tokens=24, ctx=4096,
                                        threads=2, progress=lambda s: None))
    texts = got["texts"]
    ref = texts["llama-server"]
    assert len(ref) == N_HOLES and any(t.strip() for t in ref), ref  # the model completes something
    for route in ("infill", "ollama", "openai"):
        assert texts[route] == ref, (route, texts[route], ref)
    res = fim_match.score(holes, texts)
    assert all(res[r]["same_as_llama_server"] == N_HOLES for r in ("infill", "ollama", "openai"))
    assert res["infill"]["exact"] == res["llama-server"]["exact"]


@pytest.fixture(scope="module")
def coder(tmp_path_factory, qwen_coder_05b):
    d = Daemon(tmp_path_factory.mktemp("home_fim"), LOCALRUN_API_KEY=KEY, LOCALRUN_BACKEND="llamacpp",
               LOCALRUN_CONTEXT_LENGTH="4096")
    try:
        r = d.http.post("/api/create", json={"model": "coder", "from": str(qwen_coder_05b), "stream": False})
        assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop()


@pytest.mark.parametrize("extra,msg", [
    (5, "must be an array"),
    ([{"filename": "a.py"}], '"text" field'),
    ([{"text": "x = 1", "filename": 3}], '"filename" field'),
    ([{"text": "x"}] * 1025, "at most 1024"),
])
def test_bad_input_extra_is_400(coder, extra, msg):
    for path, body in (("/api/generate", {"model": "coder", "prompt": "def f(", "suffix": "\n", "input_extra": extra,
                                          "stream": False}),
                       ("/v1/completions", {"model": "coder", "prompt": "def f(", "suffix": "\n",
                                            "input_extra": extra})):
        r = coder.http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert msg in (err if isinstance(err, str) else err["message"]), (path, r.text)


def test_input_extra_on_ollama_and_openai(coder):
    """input_extra makes a fill in the middle on both routes (the suffix may be left out): the same text as /infill
    with the same body, and a file named in it reaches the model (its prompt grows by the file's tokens)."""
    extra = [{"filename": "shapes.py", "text": "def area(w, h):\n    return w * h\n"}]
    base = {"model": "coder", "temperature": 0, "n_predict": 8, "input_prefix": "x = area(", "input_suffix": ""}
    r0 = coder.http.post("/infill", json=base)
    r1 = coder.http.post("/infill", json={**base, "input_extra": extra})
    assert r0.status_code == r1.status_code == 200, (r0.text, r1.text)
    assert r1.json()["tokens_evaluated"] > r0.json()["tokens_evaluated"] + 10
    o = coder.http.post("/api/generate", json={"model": "coder", "prompt": "x = area(", "input_extra": extra,
                                               "stream": False, "options": {"temperature": 0, "num_predict": 8}})
    c = coder.http.post("/v1/completions", json={"model": "coder", "prompt": "x = area(", "input_extra": extra,
                                                 "max_tokens": 8, "temperature": 0})
    assert o.status_code == 200 and c.status_code == 200, (o.text, c.text)
    assert o.json()["response"] == c.json()["choices"][0]["text"] == r1.json()["content"]
    assert o.json()["prompt_eval_count"] == c.json()["usage"]["prompt_tokens"] == r1.json()["tokens_evaluated"]


def test_indent_limit_cuts_as_llama_server():
    """n_indent (llama.vscode sends it): a later line indented less than n ends the completion at its indentation."""
    from localrun.server.llama_limits import IndentLimit

    def run(n: int, pieces: list[str]) -> tuple[str, bool]:
        il, out = IndentLimit(n), ""
        for piece in pieces:
            text, stop = il.feed(piece)
            out += text
            if stop:
                return out, True
        return out + il.flush(), False

    assert run(4, ["x = 1\n", "    y", " = 2\n", "z = 3\n"]) == ("x = 1\n    y = 2\n", True)
    assert run(4, ["x = 1\n    ", "y = 2\n\n", "    w"]) == ("x = 1\n    y = 2\n", True)  # an empty line ends it
    assert run(4, ["    x = 1\n  ", "  y\n\t\t", "\t\tz"]) == ("    x = 1\n    y\n\t\t\t\tz", False)
    assert run(2, ["a\n b"]) == ("a\n ", True)  # the first line is never checked; the cut keeps the indentation


def test_n_indent_on_infill_equals_llama_server(coder, qwen_coder_05b, llama_server_bin):
    from llama_server import llama_server_client

    body = {"input_prefix": "def area(shapes):\n    total = 0\n    for s in shapes:\n", "input_suffix": "\n",
            "n_predict": 48, "temperature": 0, "n_indent": 8}
    with llama_server_client(llama_server_bin, qwen_coder_05b, 4096) as h:
        want = h.post("/infill", json=body).json()
    r = coder.http.post("/infill", json={**body, "model": "coder"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["content"] == want["content"], (got["content"], want["content"])
    assert got["stop_type"] == want["stop_type"]
    lines = got["content"].split("\n")
    assert all(x.startswith(" " * 8) for x in lines[1:-1]), lines
    with coder.http.stream("POST", "/infill", json={**body, "model": "coder", "stream": True}) as s:
        streamed = "".join(json.loads(x[6:])["content"] for x in s.iter_lines() if x.startswith("data: "))
    assert streamed == want["content"]
    for bad in (-1, "4", 1.5):
        r = coder.http.post("/infill", json={**body, "model": "coder", "n_indent": bad})
        assert r.status_code == 400 and "n_indent" in r.text, r.text
