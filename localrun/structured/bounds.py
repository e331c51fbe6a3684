"""Bounds on how much grammar a JSON schema may ask for: its repetition counts, its objects and arrays, its depth.

Repetition counts are expanded into nested rules by llama.cpp's grammar (minItems 1024 made sampling take ~1 s
per token; a huge one took gigabytes), so a schema past these bounds is refused (400) before any grammar is built,
on both backends and in the daemon.
"""

from __future__ import annotations

from typing import Any

from localrun.errors import InvalidRequest

SCHEMA_MAX_COUNT = 256  # minItems, maxLength, ... above this are refused
SCHEMA_MAX_NODES = 5000  # objects and arrays in the schema
SCHEMA_MAX_DEPTH = 32
GRAMMAR_MAX_BYTES = 64 * 1024  # of GBNF text
_COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
               "minContains", "maxContains")


def check_schema_bounds(schema: Any) -> None:
    """InvalidRequest when the schema asks for more grammar than localrun builds (walked
    iteratively, so a deep schema cannot exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            nodes += 1
            for k in _COUNT_KEYS:
                v = node.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v > SCHEMA_MAX_COUNT:
                    raise InvalidRequest(f"the JSON schema's '{k}' is {v:g}; localrun builds grammars for counts up "
                                         f"to {SCHEMA_MAX_COUNT}")
            children = list(node.values())
        elif isinstance(node, list):
            nodes += 1
            children = node
        else:
            continue
        if nodes > SCHEMA_MAX_NODES or depth > SCHEMA_MAX_DEPTH:
            raise InvalidRequest(f"the JSON schema is too large to build a grammar for (over {SCHEMA_MAX_NODES} "
                                 f"objects or {SCHEMA_MAX_DEPTH} levels deep)")
        stack.extend((c, depth + 1) for c in children)


def check_json_size(value: Any, limit: int, what: str, depth: int | None = None) -> None:
    """InvalidRequest when `value` holds more than `limit` objects and arrays, or nests them deeper than
    `depth` (walked iteratively, stopping at the limit: bounded work however big the value is)."""
    stack, n = [(value, 0)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
        else:
            continue
        n += 1
        if n > limit:
            raise InvalidRequest(f"{what} is too large (over {limit} objects and arrays)")
        if depth is not None and d > depth:
            raise InvalidRequest(f"{what} nests objects and arrays more than {depth} levels deep")
