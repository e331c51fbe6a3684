"""A request's own output constraint (a regex, choices, a GBNF grammar) or JSON schema as llguidance's grammar.

The constraints: a regular expression the whole output matches (vLLM's structured_outputs.regex / guided_regex,
SGLang's regex), a list of strings the output is one of (vLLM's choice), or a grammar in llama.cpp's GBNF
(llama-server's grammar, SGLang's ebnf, vLLM's grammar).

llguidance runs all three, on both backends, because its work per token is bounded (PARSER_LIMITS): llama.cpp's
own grammar engine, given a repetition of 200 identical alternatives, spun on one token for over five minutes
while the model's other streams waited. (The JSON grammars localrun writes itself stay with llama.cpp's engine
on that backend: structured/gbnf.py.)

- A regex is read by Python's own parser (``re._parser``) and written as one llguidance lexeme, so it has exactly
  the regex's strings: re.fullmatch's, with ``\\d``, ``\\w`` and ``\\s`` the ASCII classes. Lookarounds,
  backreferences, anchors inside the pattern and case-insensitive matching are refused (400).
- Choices are one lexeme too: an alternation of the exact strings.
- A GBNF grammar goes through llguidance's GBNF reader (``gbnf_to_lark``). llguidance's lexer takes the longest
  terminal first: where two adjacent terminals could split a text two ways (``("a" | "ab") ("c" | "bcd")`` and
  ``abcd``), it keeps the longer first one, where llama.cpp would try both.

Every check here runs in the daemon before a request goes on (server.params), and again in the runner.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from typing import Any

from localrun.errors import InvalidRequest

MAX_PATTERN_CHARS = 4096  # of a regular expression
MAX_REPEAT = 1000  # a {m,n} count
MAX_REPEATS = 10_000  # all {m,n} counts of one regex or grammar together (each repetition is written out)
MAX_DEPTH = 64  # nested groups
MAX_GRAMMAR_BYTES = 64 * 1024
# llguidance's bounds on the work of one token (its defaults) and on the lexer's memory (its default, 250k states
# of 1-2 kB each, is up to 500 MB a grammar): a grammar past them ends its request with an error
PARSER_LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=20_000)
LARK_CACHE = 64  # compiled grammars kept per model
_CASELESS = ("case-insensitive regular expressions ((?i)) are not supported: write the letters as classes, "
             "e.g. [Yy]es")


def _char(c: int) -> str:
    """One code point in a Rust regex (llguidance's syntax): letters, digits and a space as they are, the rest as
    \\x{...} (which also keeps a '/' from ending the lexeme)."""
    if 0xD800 <= c <= 0xDFFF:
        raise InvalidRequest("a constraint names a lone surrogate code point, which no UTF-8 output has")
    ch = chr(c)
    return ch if ch.isascii() and (ch.isalnum() or ch == " ") else f"\\x{{{c:X}}}"


def _literal(text: str) -> str:
    return "".join(_char(ord(ch)) for ch in text)


# \d, \s, \w as ASCII classes (as grammar engines have them), and their complements
_CATEGORIES = {"DIGIT": "0-9", "SPACE": "\\t\\n\\x{B}\\x{C}\\r ", "WORD": "0-9A-Za-z_"}


class _RegexWriter:
    """Python's regex parser reads the pattern; this writes its tree as one Rust regex (a single llguidance
    lexeme) that matches the same whole strings."""

    def __init__(self, pattern: str) -> None:
        try:
            import re._constants as C
            import re._parser as P
        except ImportError:  # Python < 3.11
            import sre_constants as C  # type: ignore[no-redef]
            import sre_parse as P  # type: ignore[no-redef]
        self.C, self.repeats = C, 0
        try:
            tree = P.parse(pattern)
        except re.error as exc:
            raise InvalidRequest(f"the regular expression does not parse: {exc}") from None
        except RecursionError:
            raise InvalidRequest("the regular expression nests too deeply") from None
        if tree.state.flags & C.SRE_FLAG_IGNORECASE:
            raise InvalidRequest(_CASELESS)
        self.dotall = bool(tree.state.flags & C.SRE_FLAG_DOTALL)
        items = list(tree.data)
        # ^ at the start and $ at the end say what a whole-output match means anyway
        while items and items[0][0] is C.AT and items[0][1] in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
            items = items[1:]
        while items and items[-1][0] is C.AT and items[-1][1] in (C.AT_END, C.AT_END_STRING):
            items = items[:-1]
        self.regex = self.seq(items, 0)

    def unsupported(self, what: str) -> InvalidRequest:
        return InvalidRequest(f"the regular expression uses {what}, which a constraint cannot follow; literals, "
                              "classes, groups, alternatives and repetitions can be used")

    def seq(self, items, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"the regular expression nests more than {MAX_DEPTH} groups deep")
        return "".join(self.node(op, av, depth) for op, av in items)

    def node(self, op, av, depth: int) -> str:
        C = self.C
        if op is C.LITERAL:
            return _char(av)
        if op is C.NOT_LITERAL:
            return f"[^{_char(av)}]"
        if op is C.ANY:
            return "(?s:.)" if self.dotall else "[^\\n]"
        if op is C.IN:
            return self.char_class(av)
        if op is C.BRANCH:
            return "(?:" + "|".join(self.seq(b, depth + 1) for b in av[1]) + ")"
        if op is C.SUBPATTERN:
            _group, add_flags, _del_flags, sub = av
            if add_flags & C.SRE_FLAG_IGNORECASE:
                raise InvalidRequest(_CASELESS)
            return "(?:" + self.seq(sub, depth + 1) + ")"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # lazy or greedy: the same whole strings match
            lo, hi, sub = av
            unbounded = hi is C.MAXREPEAT
            if lo > MAX_REPEAT or (not unbounded and hi > MAX_REPEAT):
                raise InvalidRequest(f"the regular expression repeats something {lo if unbounded else hi} times; a "
                                     f"constraint allows counts up to {MAX_REPEAT}")
            self.repeats += lo if unbounded else hi
            if self.repeats > MAX_REPEATS:
                raise InvalidRequest(f"the regular expression's repetition counts add up to over {MAX_REPEATS}")
            inner = "(?:" + self.seq(sub, depth + 1) + ")"
            return inner + (f"{{{lo},}}" if unbounded else f"{{{lo},{hi}}}")
        if op is C.AT:
            raise self.unsupported("an anchor (^, $, \\b) that is not at its start or end")
        if op in (C.ASSERT, C.ASSERT_NOT):
            raise self.unsupported("a lookaround")
        if op in (C.GROUPREF, C.GROUPREF_EXISTS):
            raise self.unsupported("a backreference")
        raise self.unsupported(str(op).lower().replace("_", " "))

    def char_class(self, items) -> str:
        C = self.C
        negate = bool(items) and items[0][0] is C.NEGATE
        parts = []
        for op, av in items[1:] if negate else items:
            if op is C.LITERAL:
                parts.append(_char(av))
            elif op is C.RANGE:
                parts.append(f"{_char(av[0])}-{_char(av[1])}")
            elif op is C.CATEGORY:
                name = str(av).removeprefix("CATEGORY_")
                if name in _CATEGORIES:
                    parts.append(_CATEGORIES[name])
                elif name.removeprefix("NOT_") in _CATEGORIES:  # \D beside others: a nested class (Rust's union)
                    parts.append(f"[^{_CATEGORIES[name.removeprefix('NOT_')]}]")
                else:
                    raise self.unsupported(f"the class {name.lower()}")
            else:
                raise self.unsupported(str(op).lower())
        return f"[{'^' if negate else ''}{''.join(parts)}]"


def _llguidance():
    try:
        import llguidance
        import llguidance.gbnf_to_lark
    except ImportError:
        raise InvalidRequest("a regex, choice or grammar constraint needs the llguidance package: "
                             "pip install llguidance") from None
    return llguidance


def _lark(regex: str) -> str:
    """llguidance's grammar of one lexeme: the whole output matches `regex`."""
    return f"start: /{regex}/\n"


@functools.lru_cache(maxsize=256)
def regex_lark(pattern: str) -> str:
    """llguidance's grammar whose strings are those the regular expression matches whole; InvalidRequest, saying
    why, for a pattern it cannot follow or that is too large."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequest("the regular expression must be a non-empty string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"the regular expression is {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    return _lark(_RegexWriter(pattern).regex)


def choice_lark(choices: tuple[str, ...]) -> str:
    """llguidance's grammar whose strings are exactly the choices (vLLM's choice)."""
    return _lark("(?:" + "|".join(_literal(c) for c in choices) + ")")


MAX_CHOICES = 1024  # strings a choice constraint may offer
MAX_CHOICES_BYTES = 64 * 1024


def check_choices(value: Any, key: str) -> list[str]:
    """A request's choices (its field `key`), checked against localrun's bounds, duplicates dropped."""
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)):
        raise InvalidRequest(f"'{key}' must be a list of 1 to {MAX_CHOICES} non-empty strings: the output is one of them")
    if sum(len(c.encode("utf-8")) for c in value) > MAX_CHOICES_BYTES:
        raise InvalidRequest(f"'{key}' is over {MAX_CHOICES_BYTES} bytes")
    return list(dict.fromkeys(value))


_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*|\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|[()]')


def check_gbnf(text: Any) -> str:
    """A request's own GBNF grammar, checked against localrun's bounds: its size, how deep its groups nest and
    its repetition counts (each repetition is written out). llguidance's reader says whether it is a grammar."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("the grammar must be a non-empty string (llama.cpp's GBNF)")
    if len(text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"the grammar is over {MAX_GRAMMAR_BYTES} bytes")
    depth = repeats = 0
    for m in _GBNF_TOKEN.finditer(text):
        tok = m.group(0)
        if tok == "(":
            depth += 1
            if depth > MAX_DEPTH:
                raise InvalidRequest(f"the grammar nests more than {MAX_DEPTH} groups deep")
        elif tok == ")":
            depth -= 1
        elif tok[0] == "{":
            counts = [int(g) for g in m.groups() if g]
            if any(n > MAX_REPEAT for n in counts):
                raise InvalidRequest(f"the grammar repeats something {max(counts)} times; at most {MAX_REPEAT}")
            repeats += max(counts)
            if repeats > MAX_REPEATS:
                raise InvalidRequest(f"the grammar's repetition counts add up to over {MAX_REPEATS}")
    if not re.search(r"(?m)^\s*root\s*::=", text):
        raise InvalidRequest("the grammar has no 'root' rule: GBNF starts from 'root ::= ...'")
    return text


_GBNF_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')
_GBNF_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|x[0-9a-fA-F]{2}|.)", re.S)


def _plain_escapes(text: str) -> str:
    """GBNF text with its \\u, \\U and non-ASCII \\x escapes (in literals and classes) written as the characters
    they stand for: llguidance's GBNF reader passes them on in a form its Lark parser refuses."""
    def char(m: re.Match) -> str:
        e = m.group(1)
        if len(e) == 1 or (e[0] == "x" and int(e[1:], 16) < 0x80):
            return m.group(0)
        c = int(e[1:], 16)
        if c > 0x10FFFF or 0xD800 <= c <= 0xDFFF:
            raise InvalidRequest(f"the grammar escapes \\{e}, which is no Unicode character")
        return f"\\x{c:02X}" if c < 0x80 else chr(c)

    def token(m: re.Match) -> str:
        tok = m.group(0)
        return tok if tok[0] == "#" else _GBNF_ESCAPE.sub(char, tok)

    return _GBNF_QUOTED.sub(token, text)


# a token reference (llama.cpp's GBNF: <|channel|>, <think>, <[1000]>), outside literals, classes and comments
_GBNF_TOKEN_REF = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*|(!?)(<\[\d{1,7}\]>|<[^\s<>"\[\]]{1,64}>)')


def _token_refs(text: str) -> tuple[str, dict[str, str]]:
    """GBNF text with each token reference as a placeholder literal, and {placeholder: the reference}
    (llguidance's GBNF reader knows none; its Lark takes them as written)."""
    refs: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        if m.group(2) is None:
            return m.group(0)
        if m.group(1):
            raise InvalidRequest(f"the grammar negates a token ({m.group(0)}): not supported; list what may come instead")
        key = f'"LRTOKENREF{len(refs)}Z"'
        refs[key] = m.group(2)
        return key

    return _GBNF_TOKEN_REF.sub(sub, text), refs


@functools.lru_cache(maxsize=64)
def gbnf_lark(text: str) -> str:
    """llguidance's grammar for GBNF text (checked with check_gbnf); InvalidRequest when its reader cannot
    read it. Token references (<|channel|>, <[1000]>) stay token references."""
    g = _llguidance().gbnf_to_lark

    if "is_atomic" not in vars(g.RepetitionNode):
        # the reader writes a repetition of a repetition without parentheses ("a"++), which Lark refuses
        g.RepetitionNode.is_atomic = lambda self: False
    text, refs = _token_refs(text)
    try:
        lark = g.gbnf_to_lark(_plain_escapes(text))
        for key, ref in refs.items():
            if key not in lark:
                raise InvalidRequest(f"the grammar's token reference {ref} cannot be used where it stands")
            lark = lark.replace(key, ref)
        return lark
    except InvalidRequest:
        raise
    except g.GbnfToLarkError as exc:
        raise InvalidRequest(f"the grammar (GBNF) does not parse: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the grammar nests too deeply") from None
    except Exception as exc:  # the reader's other complaints (a rule that is not defined, ...)
        raise InvalidRequest(f"the grammar (GBNF) cannot be used: {exc}") from None


def constraint_lark(regex: str | None, choices: list[str] | None, grammar: str | None) -> str | None:
    """llguidance's grammar for a request's regex, choices or GBNF grammar (None without one of them)."""
    if regex is not None:
        return regex_lark(regex)
    if choices is not None:
        return choice_lark(tuple(choices))
    if grammar is not None:
        return gbnf_lark(check_gbnf(grammar))
    return None


# llguidance's JSON, here and in the native engine (structured/masks.py): compact with the usual separators, so a
# model cannot spin on whitespace, and the text reads like json.dumps' default output
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def has_number_bounds(schema: Any) -> bool:
    """Whether a JSON schema bounds a number that need not be an integer anywhere in it: llama.cpp's GBNF
    converter keeps any value there (structured/gbnf.py), llguidance's JSON follows the bounds. (The schema's
    size is bounded before: structured/bounds.check_schema_bounds.)"""
    from localrun.structured.gbnf import NUMBER_BOUNDS

    todo = [schema]
    while todo:
        s = todo.pop()
        if isinstance(s, list):
            todo.extend(s)
        elif isinstance(s, dict):
            if s.get("type") != "integer" and any(isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)
                                                  for k in NUMBER_BOUNDS):
                return True
            todo.extend(v for v in s.values() if isinstance(v, (dict, list)))
    return False


NUMBER_STEP = 1e-9  # a number's precision under llguidance (llama.cpp's converter: 16 fraction digits)
_VALUES = ("const", "enum", "default", "examples")  # JSON values in a schema, not schemas


def _with_precision(s: Any) -> Any:
    """`s` with multipleOf NUMBER_STEP on each number that has none: llguidance's JSON bounds no number's
    digits, and a sampled model wrote a fraction of hundreds of digits until max_tokens."""
    if isinstance(s, list):
        return [_with_precision(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: (v if k in _VALUES else _with_precision(v)) for k, v in s.items()}
    kind = s.get("type")
    if (kind == "number" or (isinstance(kind, list) and "number" in kind)) and "multipleOf" not in s:
        out["multipleOf"] = NUMBER_STEP
    return out


def json_schema_lark(schema: dict) -> str:
    """llguidance's grammar for JSON valid under `schema` (compact separators, as the native engine writes it;
    numbers to NUMBER_STEP)."""
    import json

    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(_with_precision(schema)),
                                                                defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid JSON schema: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}") \
            from None


def stopped_message(why: str) -> str:
    """The error of a request whose matcher stopped it (llguidance's reason, its first line)."""
    why = (why or "").strip().split("\n", 1)[0] or "no token fits it"
    return (f"the output constraint stopped the generation ({why}): a grammar whose language is empty, or that needs "
            "more work for one token than llguidance's bounds allow, needs fixing or simplifying")


class Matchers:
    """llguidance matchers for the llama.cpp requests with a regex, choices or a grammar of their own. The model's
    tokenizer for llguidance is made on the first such request (0.2 s for SmolLM2's 49k tokens); each grammar is
    compiled once, and a request gets a copy. Thread-safe; call it off the event loop."""

    def __init__(self, lib, vocab, n_vocab: int) -> None:
        self.lib, self.vocab, self.n_vocab = lib, vocab, n_vocab
        self._tokenizer = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, lark: str):
        llguidance = _llguidance()
        with self._lock:
            m = self._cache.get(lark)
            if m is not None:
                self._cache.move_to_end(lark)
                return m.deep_copy()
            if self._tokenizer is None:
                import warnings

                from llguidance.llamacpp import lltokenizer_from_vocab

                eog = [t for t in range(self.n_vocab) if self.lib.llama_vocab_is_eog(self.vocab, t)]
                with warnings.catch_warnings():  # it asks llama-cpp-python's deprecated name once per token
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(self.vocab, self.n_vocab, eos_token=eog or None)
            m = llguidance.LLMatcher(self._tokenizer, lark, log_level=0,
                                     limits=llguidance.LLParserLimits(**PARSER_LIMITS))
            if m.is_error():
                raise InvalidRequest(f"the grammar cannot be used: {m.get_error().strip().splitlines()[0]}")
            self._cache[lark] = m
            while len(self._cache) > LARK_CACHE:
                self._cache.popitem(last=False)
            return m.deep_copy()
