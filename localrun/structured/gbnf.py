"""JSON schema -> llama.cpp grammar (GBNF), built once per schema: llama-cpp-python's converter, with fixes.

:func:`json_schema_grammar` is llama-cpp-python's converter with what llama.cpp's own
converter (common/json-schema-to-grammar.cpp, the one llama-server and Ollama use) does and the
older copy in llama-cpp-python does not. Each gap made a valid schema fail:

- a string's ``char`` was ``[^"\\]``: it let a raw control character into a string, which JSON
  forbids (json.loads rejects a newline there): a sampled forced tool call came back as text;
- a literal (enum, const, a property's name) escaped ``"`` but not the backslash before it, so
  json.dumps' own escapes broke the grammar: a value with a quote or a backslash made it
  unparseable (a 400), and one with a newline forced a raw newline into the JSON;
- an integer's ``minimum`` / ``maximum`` (and the exclusive ones) were ignored: a "rating from
  1 to 5" could come back as 0 or 17. They are digit ranges now (:func:`integer_range`);
- a list of types (``["string", "null"]``) dropped the schema's other keywords (its maxLength).

Numbers that are not integers keep any value here, as in llama.cpp: a schema that bounds one goes to
llguidance instead (structured/constraints.has_number_bounds, json_schema_lark).
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from localrun.errors import InvalidRequest
from localrun.structured.bounds import GRAMMAR_MAX_BYTES, check_schema_bounds

MAX_DIGITS = 16  # llama-cpp-python's integral-part: at most 16 digits
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _same_length(a: str, b: str) -> str:
    """GBNF for the digit strings of len(a) == len(b) from a to b (a <= b), each digit as written."""
    if a == b:
        return f'"{a}"'
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return f'"{a[0]}" ({_same_length(a[1:], b[1:])})'
    k, alts = len(a) - 1, []
    lo, hi = a[0], b[0]
    if a[1:] != "0" * k:  # a's own first digit takes only the tails from a's
        alts.append(f'"{a[0]}" ({_same_length(a[1:], "9" * k)})')
        lo = chr(ord(lo) + 1)
    upper = None
    if b[1:] != "9" * k:
        upper = f'"{b[0]}" ({_same_length("0" * k, b[1:])})'
        hi = chr(ord(hi) - 1)
    if lo <= hi:
        alts.append(f"{'[' + lo + '-' + hi + ']' if lo != hi else chr(34) + lo + chr(34)} [0-9]{{{k}}}")
    if upper:
        alts.append(upper)
    return " | ".join(alts)


def _natural(lo: int, hi: int) -> list[str]:
    """Alternatives for the integers lo..hi (0 <= lo <= hi), written without leading zeros."""
    alts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10 ** n - 1)
        if a <= b:
            alts.append(_same_length(str(a), str(b)))
    return alts


def integer_range(lo: int | None, hi: int | None) -> str:
    """GBNF (no trailing space) for the JSON integers from lo to hi (None: no bound; at most
    MAX_DIGITS digits either way, as an unbounded integer)."""
    top = 10 ** MAX_DIGITS - 1
    lo = -top if lo is None else max(lo, -top)
    hi = top if hi is None else min(hi, top)
    if lo > hi:
        raise InvalidRequest(f"invalid JSON schema: an integer's bounds leave no value of at most {MAX_DIGITS} digits")
    alts = []
    if lo < 0:
        alts.append('"-" (' + " | ".join(_natural(max(1, -hi), -lo)) + ")")
    if hi >= 0:
        alts += _natural(max(lo, 0), hi)
    return "(" + " | ".join(f"({a})" for a in alts) + ")"


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The inclusive integer bounds an integer schema sets."""
    lo = hi = None
    for key in NUMBER_BOUNDS:
        value = schema.get(key)
        if isinstance(value, bool) or value is None:
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequest(f"invalid JSON schema: '{key}' must be a number")
        if key == "minimum":
            b = math.ceil(value)
            lo = b if lo is None else max(lo, b)
        elif key == "exclusiveMinimum":
            b = math.floor(value) + 1
            lo = b if lo is None else max(lo, b)
        elif key == "maximum":
            b = math.floor(value)
            hi = b if hi is None else min(hi, b)
        else:
            b = math.ceil(value) - 1
            hi = b if hi is None else min(hi, b)
    # draft 4: exclusiveMinimum / exclusiveMaximum as booleans beside minimum / maximum
    if schema.get("exclusiveMinimum") is True and isinstance(schema.get("minimum"), (int, float)) \
            and lo == schema["minimum"]:
        lo += 1
    if schema.get("exclusiveMaximum") is True and isinstance(schema.get("maximum"), (int, float)) \
            and hi == schema["maximum"]:
        hi -= 1
    if lo is not None and hi is not None and lo > hi:
        raise InvalidRequest(f"invalid JSON schema: no integer lies between its bounds ({lo} > {hi})")
    return lo, hi


@functools.lru_cache(maxsize=1)
def converter_class() -> type:
    """llama-cpp-python's SchemaConverter with the fixes above."""
    from llama_cpp import llama_grammar as g

    json_char = g.BuiltinRule(_JSON_CHAR, [])

    class Converter(g.SchemaConverter):
        def _add_primitive(self, name, rule):
            return super()._add_primitive(name, json_char if name == "char" else rule)

        def _format_literal(self, literal):
            return '"' + re.sub(r'[\r\n"\\]', lambda m: _ESCAPES[m.group(0)], literal) + '"'

        def visit(self, schema, name):
            kind = schema.get("type") if isinstance(schema, dict) else None
            rule_name = name + "-" if name in g.RESERVED_NAMES else name or "root"  # as the base class names it
            if isinstance(kind, list) and not any(k in schema for k in ("$ref", "oneOf", "anyOf")):
                # each type keeps the schema's other keywords ({"type": ["string", "null"], "maxLength": 15})
                return self._add_rule(rule_name, self._generate_union_rule(name, [{**schema, "type": t} for t in kind]))
            if kind == "integer" and any(k in schema for k in NUMBER_BOUNDS) \
                    and not any(k in schema for k in ("$ref", "oneOf", "anyOf", "const", "enum")):
                lo, hi = integer_bounds(schema)
                if lo is not None or hi is not None:
                    return self._add_rule(rule_name, integer_range(lo, hi) + " space")
            return super().visit(schema, name)

    return Converter


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """llama.cpp grammar text (GBNF) for a JSON schema, built once per schema (cached); InvalidRequest
    when it cannot be built or is over the bounds (structured/bounds.py)."""
    return _grammar(json.dumps(schema, sort_keys=True, separators=(",", ":")))


@functools.lru_cache(maxsize=64)
def _grammar(schema_json: str) -> str:
    schema = json.loads(schema_json)
    check_schema_bounds(schema)
    try:  # as llama_grammar.json_schema_to_gbnf does, with localrun's fixes (above)
        converter = converter_class()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        converter.visit(converter.resolve_refs(schema, "stdin"), "")
        gbnf = converter.format_grammar()
    except Exception as exc:
        raise InvalidRequest(f"invalid JSON schema in response_format: {exc}") from None
    if len(gbnf) > GRAMMAR_MAX_BYTES:
        raise InvalidRequest(f"the JSON schema's grammar is {len(gbnf)} bytes, over the {GRAMMAR_MAX_BYTES} byte limit; "
                             "simplify the schema")
    return gbnf
