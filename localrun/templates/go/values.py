"""Go's values as Ollama's templates see them, and how fmt and encoding/json print them.

Values print as Go prints them: lists of tools, tool-call arguments and tool properties as JSON
(Go's encoding: keys of maps sorted, ``<``, ``>`` and ``&`` escaped), booleans as true / false, a
missing map key as ``<no value>``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


@dataclass
class GoStruct:
    """A Go struct: fields by their Go names; `as_json` (when set) is its JSON form, which it prints
    as (Ollama's tool types have String() methods that marshal them)."""

    fields: dict[str, Any]
    as_json: Any = None


class GoJSONMap(dict):
    """A map whose String() is its JSON (Ollama's tool-call arguments and tool properties)."""


class GoJSONList(list):
    """A slice whose String() is its JSON (Ollama's list of tools)."""


class Ordered(dict):
    """A struct's JSON form: its fields in declaration order (encoding/json keeps them so; maps it sorts)."""


class PropertyType(list):
    """Ollama's PropertyType ([]string): prints as its one type, or as [a b]; JSON: a string, or a list."""


class _Missing:
    """A key a map does not have (missingkey=zero on map[string]any: a nil interface)."""

    def __repr__(self) -> str:
        return "<no value>"


MISSING = _Missing()


def go_json(v: Any) -> str:
    """encoding/json's Marshal: maps with sorted keys, no spaces, <, > and & escaped."""
    s = json.dumps(_plain(v), ensure_ascii=False, separators=(",", ":"), sort_keys=False)
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _plain(v: Any) -> Any:
    if isinstance(v, GoStruct):
        return _plain(v.as_json) if v.as_json is not None else {k: _plain(x) for k, x in v.fields.items()}
    if isinstance(v, PropertyType):
        return v[0] if len(v) == 1 else list(v)
    if isinstance(v, Ordered):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, dict):
        return {str(k): _plain(v[k]) for k in sorted(v, key=str)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is MISSING:
        return None
    return v


def fmt_float(f: float) -> str:
    """Go's %v of a float64 (strconv 'g' with the shortest repr, exponent from 1e21)."""
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if math.isnan(f):
        return "NaN"
    if f == int(f) and abs(f) < 1e21:
        return str(int(f))
    r = repr(f)
    if "e" in r:
        mant, exp = r.split("e")
        return f"{mant}e{int(exp):+03d}"
    return r


def go_str(v: Any) -> str:
    """fmt.Sprint of one value, as text/template prints an action's result."""
    if isinstance(v, str):
        return v
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None or v is MISSING:
        return "<no value>" if v is MISSING else "<nil>"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return fmt_float(v)
    if isinstance(v, PropertyType):
        return "" if not v else v[0] if len(v) == 1 else "[" + " ".join(v) + "]"
    if isinstance(v, (GoJSONMap, GoJSONList)):
        return go_json(v)
    if isinstance(v, GoStruct):
        if v.as_json is not None:
            return go_json(v)
        return "{" + " ".join(go_str(x) for x in v.fields.values()) + "}"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{go_str(k)}:{go_str(v[k])}" for k in sorted(v, key=str)) + "]"
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(go_str(x) for x in v) + "]"
    return str(v)


def truth(v: Any) -> bool:
    """text/template's truth: false, 0, nil and empty strings, slices and maps are false; structs are true."""
    if v is None or v is MISSING:
        return False
    if isinstance(v, GoStruct):
        return True
    if isinstance(v, (bool, int, float)):
        return bool(v)
    if isinstance(v, (str, list, tuple, dict)):
        return len(v) > 0
    return True

