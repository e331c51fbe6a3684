"""Output constraints a request brings (a regex, choices, a GBNF grammar): localrun.structured.constraints turns them
into llguidance's grammars, checked against the real tokenizer of the bundled SmolLM2. A string the regex
matches whole (re.fullmatch, ASCII classes) must be accepted by the matcher token by token, and one it does not
match refused; the bounds refuse what would be too much work; the daemon's parsing takes each server's names."""

from __future__ import annotations

import ctypes
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from localrun.backends.base import SamplingOptions
from localrun.structured.constraints import (MAX_REPEATS, check_gbnf, choice_lark, constraint_lark, gbnf_lark,
                                             regex_lark)
from localrun.errors import InvalidRequest
from localrun.server.params import apply_structured

llguidance = pytest.importorskip("llguidance")
# llguidance's tokenizer reader asks llama-cpp-python's deprecated name once per token
pytestmark = pytest.mark.filterwarnings("ignore:llama_token_get_attr is deprecated")

PATTERNS = [r"\d{3}-\d{4}", r"(yes|no)", r"[A-Z][a-z]+ [^\s]+", r"a.b*?c", r"\w+@\w+\.com", r'say "hi"\\', r"[^a-c\d]x",
            "é|日本語", r"(a|ab)(c|bcd)", r"(?s)a.b", r"[\]\-^\\\[]+", r"x*y*x", r"(a+)+b", r"[a-z]+ing",
            r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", r"\s*\S+\s*", r"(ab){2,3}c?", r"[^\n]{0,5}!", r"\D\W\S", "\t\x01~",
            r"[\Da]b", r"[^\Wb]+", "a/b|c", r"(?s:x.)y", r"(a|b)*a(a|b){3}"]
ALPHABET = "abcdxyABZ0159-_ .@!\"\\\n\téç日本語]^[+"


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    import llama_cpp.llama_cpp as lib

    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(smollm2_gguf).encode(), params)
    assert model
    yield lib, lib.llama_model_get_vocab(model)
    lib.llama_model_free(model)


@pytest.fixture(scope="module")
def accepts(vocab):
    """(lark grammar, text) -> whether llguidance's matcher takes text's tokens and may stop there."""
    from llguidance.llamacpp import lltokenizer_from_vocab

    lib, v = vocab
    tokenizer = lltokenizer_from_vocab(v)
    cache: dict[str, object] = {}

    def tokens(text: str) -> list[int]:
        b = text.encode("utf-8")
        out = (ctypes.c_int32 * (len(b) + 8))()
        n = lib.llama_tokenize(v, b, len(b), out, len(b) + 8, False, False)
        assert n >= 0
        return list(out[:n])

    def run(lark: str, text: str) -> bool | None:
        """None when the tokenizer does not write `text` back (an unassigned code point, say)."""
        from localrun.backends.llamacpp.pieces import token_piece

        ids = tokens(text)
        if b"".join(token_piece(lib, v, t) for t in ids) != text.encode("utf-8"):
            return None
        if lark not in cache:
            m = llguidance.LLMatcher(tokenizer, lark, log_level=0)
            assert not m.is_error(), m.get_error()
            cache[lark] = m
        m = cache[lark].deep_copy()
        return m.consume_tokens(ids) and m.is_accepting()

    return run


def _utf8(s: str) -> bool:
    return "\x00" not in s and not any(0xD800 <= ord(c) <= 0xDFFF for c in s)


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_regex_and_its_grammar_take_the_same_strings(pattern, accepts, data):
    lark = regex_lark(pattern)
    py = re.compile(pattern, re.ASCII)
    match = data.draw(st.from_regex(py, fullmatch=True).filter(_utf8), label="matching")
    took = accepts(lark, match)
    assume(took is not None)
    assert took, (pattern, match)
    other = data.draw(st.text(ALPHABET, max_size=10).filter(_utf8), label="any")
    assert accepts(lark, other) == bool(py.fullmatch(other)), (pattern, other)


def test_choices_are_exact_strings(accepts):
    choices = ["red", 'say "hi"', "back\\slash", "two\nlines", "日本"]
    lark = choice_lark(tuple(choices))
    for c in choices:
        assert accepts(lark, c)
    for c in ["re", "redd", "say hi", "back\\\\slash", "two lines", ""]:
        assert not accepts(lark, c), c


def test_a_request_grammar_and_its_escapes(accepts):
    lark = gbnf_lark(check_gbnf('root ::= "\\u00e9" [\\u0041-\\u005A]+ "\\x21" # a comment "\\u00e9\nx ::= "y"'))
    assert accepts(lark, "éAB!") and not accepts(lark, "éab!")
    lark = gbnf_lark(check_gbnf('root ::= ((("a")+)+ "b")+'))  # nested repetitions (llguidance's reader drops parens)
    assert accepts(lark, "aabab") and not accepts(lark, "aa")


@pytest.mark.parametrize("pattern, needle", [
    ("(?=a)b", "lookaround"), ("(?!a)b", "lookaround"), (r"(a)\1", "backreference"), (r"a\bb", "anchor"),
    ("a^b", "anchor"), ("(?i)yes", "case-insensitive"), ("(?i:y)es", "case-insensitive"), ("(", "does not parse"),
    ("a{1001}", "1000"), ("(a{900}){900}" * 13, "add up"), ("a" * 5000, "4096"), ("", "non-empty"),
    ("\ud800", "surrogate")])
def test_regexes_it_cannot_follow(pattern, needle):
    with pytest.raises(InvalidRequest, match=re.escape(needle)):
        regex_lark(pattern)


@pytest.mark.parametrize("grammar, needle", [
    ("", "non-empty"), ('x ::= "a"', "root"), ("root ::= " + "(" * 65 + '"a"' + ")" * 65, "64 groups"),
    ('root ::= "a"{1001}', "1000"), ("root ::= " + ' '.join(['"a"{900}'] * 12), "add up"),
    ("root ::= " + '"' + "a" * 70000 + '"', "65536")])
def test_grammars_past_the_bounds(grammar, needle):
    with pytest.raises(InvalidRequest, match=re.escape(needle)):
        check_gbnf(grammar)


def test_grammars_the_reader_refuses_are_400s():
    for grammar in ["root ::= undefined", 'root ::= "a', "root ::= [a-", 'root ::= "\\q"']:
        with pytest.raises(InvalidRequest, match="grammar"):
            constraint_lark(None, None, check_gbnf(grammar))


def test_bounds_are_counted_not_guessed():
    assert MAX_REPEATS == 10_000
    regex_lark("(a{900}){9}b{900}")  # 9,000: inside
    check_gbnf("root ::= " + " ".join(['"a"{1000}'] * 10))  # 10,000: inside
    # counts inside literals, classes and comments are text, not repetitions
    check_gbnf('root ::= "{2000}" [{}0-9] # {5000}\n')


def test_each_servers_name_for_a_constraint():
    cases = [({"guided_regex": "a+"}, "regex", "a+"), ({"regex": "a+"}, "regex", "a+"),
             ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
             ({"guided_choice": ["x", "y", "x"]}, "choices", ["x", "y"]),
             ({"structured_outputs": {"choice": ["x"]}}, "choices", ["x"]),
             ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'), ({"ebnf": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
             ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
             ({"guided_json": '{"type": "object"}'}, "json_schema", {"type": "object"}),
             ({"json_schema": {"type": "object"}}, "json_schema", {"type": "object"}),
             ({"structured_outputs": {"json_object": True}}, "json_mode", True)]
    for body, field, value in cases:
        opts = SamplingOptions()
        apply_structured(opts, body)
        assert getattr(opts, field) == value and len(opts.constraints()) == 1, body
    opts = SamplingOptions(json_mode=True)  # response_format's
    with pytest.raises(InvalidRequest, match="'response_format', 'guided_regex'"):
        apply_structured(opts, {"guided_regex": "a"})
    opts = SamplingOptions()
    apply_structured(opts, {"guided_regex": None, "guided_decoding_backend": "xgrammar"})  # nothing asked
    assert opts.constraints() == []
