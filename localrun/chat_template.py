"""Chat templates, rendered only inside jinja2's ImmutableSandboxedEnvironment.

A GGUF's ``tokenizer.chat_template`` (or a Modelfile TEMPLATE, or a safetensors
repo's tokenizer_config.json) is untrusted input: llama-cpp-python's CVE-2024-34359
was exactly a template rendered by plain Jinja2. Here a template can reach no Python
internals (the sandbox refuses attribute access to ``__class__`` and friends and
mutation of the objects we pass in), and its work is bounded:

- size: ``*``, ``+`` and ``**`` are intercepted and refused when the result would be huge;
  any value a template reads back (attribute, item) over the size cap is refused (so a
  string doubled with ``~`` in a loop stops at twice the cap); the output is streamed and
  capped as it grows;
- time: a hard deadline, checked on every line of Python run while rendering (a trace
  function on the rendering thread: the template's code and the filters and globals it
  calls), so nested loops or ``lipsum(10**9)`` end with a clear error, not a frozen daemon;
- memory: the process's resident memory is sampled while rendering; growth past a budget
  stops the render.

The environment is transformers' (loop controls and the ``generation`` tag included), so the
templates llama.cpp ships render as transformers renders them.

Rendering is meant to run off the event loop (the generation service uses a thread).

Both the daemon and the native engine render through :func:`render_chat`.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import Environment, TemplateError, nodes
from jinja2.ext import Extension
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localrun.errors import InvalidRequest

MAX_TEMPLATE_CHARS = 200_000
MAX_OUTPUT_CHARS = 4_000_000  # the rendered prompt, and any single value a template builds
RENDER_SECONDS = 2.0  # a hard deadline for one render
RENDER_MEMORY_BYTES = 256 * 2**20  # resident memory a render may add
_CHECK_EVERY = 256  # template lines between deadline checks (memory: every 16th check)

# Used when a model carries no template at all: ChatML, the most common format.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateRenderError(InvalidRequest):
    """The template is malformed or tried something the sandbox forbids."""


# a printf width or precision (%1000000000s, %.*f) or a str.format one ({:>1000000000}) that would
# build a string over the size limit in one C call, before any budget check could run
_PRINTF_WIDE = re.compile(r"%[-#0 +]*(?:\d{8,}|\*)|%[-#0 +]*\d*\.(?:\d{8,}|\*)")
_FORMAT_WIDE = re.compile(r"\{[^{}]*:[^{}]*\d{8,}[^{}]*\}|\{[^{}]*:[^{}]*\{")
_PADDING_METHODS = frozenset(["ljust", "rjust", "center", "zfill", "expandtabs"])


def _too_big() -> SecurityError:
    return SecurityError(f"the template builds a value over {MAX_OUTPUT_CHARS} characters")


def _check_ints(args: tuple, kwargs: dict) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
            raise _too_big()


def _check_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = len(s) + 1 if not old else s.count(old)
        if len(s) + hits * (len(new) - len(old)) > MAX_OUTPUT_CHARS:
            raise _too_big()


def _check_format(fmt: Any, printf: bool, args: Any = ()) -> None:
    """A format whose result could be over the limit: a huge width, or (fields x longest string
    argument) over it, as in ('{0}' * 1000).format(s) or ('%s' * 1000) % ((s,) * 1000)."""
    if not isinstance(fmt, str):
        return
    if (_PRINTF_WIDE if printf else _FORMAT_WIDE).search(fmt):
        raise SecurityError("the template formats with a width or precision that is too large")
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, (list, tuple)) else [args]
    lens = [len(v) for v in values if isinstance(v, str)]
    if lens:
        fields = fmt.count("%") if printf else fmt.count("{")
        grow = fields * max(lens)  # each field at most the longest argument
        if printf:  # and %-formatting uses each argument once
            grow = min(grow, sum(lens))
        if len(fmt) + grow > MAX_OUTPUT_CHARS:
            raise _too_big()


def _check_join(sep: Any, items: Any) -> None:
    if isinstance(sep, str) and isinstance(items, (list, tuple)):
        if len(sep) * len(items) + sum(len(x) for x in items if isinstance(x, str)) > MAX_OUTPUT_CHARS:
            raise _too_big()


def _guard_filter(name: str, f: Any) -> Any:
    """A built-in filter with its size arguments checked first (center(10**9), indent(10**9),
    format('%1000000000s'), replace with a long `new`) and its result checked after."""

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_ints(args, kwargs)
        plain = [a for a in args if not isinstance(a, (Context, Environment, EvalContext))]
        if name == "format" and plain:
            _check_format(plain[0], True, tuple(plain[1:]) or kwargs)
        elif name == "join" and plain:
            _check_join(plain[1] if len(plain) > 1 else kwargs.get("d", ""), plain[0])
        elif name == "replace" and len(plain) >= 3:
            _check_replace(plain[0], plain[1], plain[2])
        return _sized(f(*args, **kwargs))

    return guarded


class _Env(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "+", "**", "%"])

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
        inner = getattr(__obj, "__wrapped__", __obj)  # the sandbox hands out str.format wrapped
        target = getattr(inner, "__self__", None)
        name = getattr(inner, "__name__", "")
        if isinstance(target, str):
            if name in _PADDING_METHODS:
                _check_ints(args, kwargs)
                if name == "expandtabs" and args and isinstance(args[0], int):
                    if target.count("\t") * args[0] + len(target) > MAX_OUTPUT_CHARS:
                        raise _too_big()
            elif name == "replace" and len(args) >= 2:
                _check_replace(target, args[0], args[1])
            elif name == "format":
                _check_format(target, False, (*args, *kwargs.values()))
            elif name == "format_map":
                _check_format(target, False, args[0] if args else ())
            elif name == "join" and args:
                _check_join(target, args[0])
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 and right > 256:
                raise SecurityError("the template computes a power that is too large")
        elif operator == "*":
            if _is_seq(left) or _is_seq(right):
                seq, n = (left, right) if _is_seq(left) else (right, left)
                if isinstance(n, int) and len(seq) * max(n, 0) > MAX_OUTPUT_CHARS:
                    raise SecurityError(f"the template builds a value over {MAX_OUTPUT_CHARS} items")
            elif isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
                raise SecurityError("the template computes a number that is too large")
        elif operator == "+" and _is_seq(left) and _is_seq(right) and len(left) + len(right) > MAX_OUTPUT_CHARS:
            raise SecurityError(f"the template builds a value over {MAX_OUTPUT_CHARS} items")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, True, right)
        return _sized(super().call_binop(context, operator, left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _sized(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _sized(super().getitem(obj, argument))


def _is_seq(v: Any) -> bool:
    return isinstance(v, (str, list, tuple))


def _sized(v: Any) -> Any:
    if isinstance(v, (str, list, tuple, dict)) and len(v) > MAX_OUTPUT_CHARS:
        raise SecurityError(f"the template built a value over {MAX_OUTPUT_CHARS} items")
    return v


class _Budget:
    """A trace function for the rendering thread: the deadline on the template's own lines,
    and the process's resident memory now and then."""

    def __init__(self, seconds: float, memory: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.lines = 0
        self.checks = 0
        self.memory = memory
        self.rss0 = _rss()
        self.tripped: str | None = None

    def trace(self, frame, event, arg):
        # every frame, not only the template's own: filters and globals written in Python
        # (lipsum, wordwrap, slice, ...) loop there, and the deadline must reach them too
        return self.line if event == "call" else None

    def line(self, frame, event, arg):
        self.lines += 1
        if self.lines % _CHECK_EVERY == 0:
            self.check()
        return self.line

    def check(self) -> None:
        self.checks += 1
        if time.monotonic() > self.deadline:
            self.tripped = f"the chat template took longer than {RENDER_SECONDS:g}s to render"
        elif self.checks % 16 == 0 and self.rss0 and _rss() - self.rss0 > self.memory:
            self.tripped = f"the chat template used more than {self.memory // 2**20} MiB of memory"
        if self.tripped:
            raise _Abort(self.tripped)


class _Abort(Exception):
    pass


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency
        return 0


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    if isinstance(indent, int) and indent > 64:
        raise SecurityError("tojson's indent is too large (64 at most)")
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' environment knows (it marks
    the assistant's tokens for training masks): rendered as its body, as transformers renders it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=1)
def _env() -> _Env:
    # the extensions transformers' chat-template environment has: loop controls ({% break %},
    # {% continue %}: they only end loops early) and the generation tag
    env = _Env(trim_blocks=True, lstrip_blocks=True, autoescape=False, keep_trailing_newline=True,
               extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=64)
def _compile(template: str):
    return _env().from_string(template)


def check_template(template: str) -> None:
    """Compile `template` in the sandbox; raise TemplateRenderError naming the problem."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRenderError(f"chat template is too long ({len(template)} characters, limit {MAX_TEMPLATE_CHARS})")
    try:
        _compile(template)
    except Exception as exc:  # TemplateSyntaxError and friends
        raise TemplateRenderError(f"chat template does not compile: {exc}") from None


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with `template` (ChatML when None) in the sandbox.

    Raises TemplateRenderError (an HTTP 400) for a broken or hostile template.
    """
    template = template or CHATML_TEMPLATE
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRenderError(f"chat template is too long ({len(template)} characters, limit {MAX_TEMPLATE_CHARS})")
    budget = _Budget(RENDER_SECONDS, RENDER_MEMORY_BYTES)
    parts: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(budget.trace)
    try:
        compiled = _compile(template)
        for piece in compiled.generate(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        ):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateRenderError(f"chat template produced a prompt over {MAX_OUTPUT_CHARS} characters")
            parts.append(piece)
            budget.check()
    except TemplateRenderError:
        raise
    except _Abort as exc:
        raise TemplateRenderError(str(exc)) from None
    except RecursionError:
        raise TemplateRenderError("chat template recursed too deeply") from None
    except MemoryError:
        raise TemplateRenderError("chat template ran out of memory") from None
    except Exception as exc:  # SecurityError, TemplateSyntaxError, UndefinedError, TypeError, ...
        if budget.tripped:  # the abort surfaced through jinja's own error handling
            raise TemplateRenderError(budget.tripped) from None
        raise TemplateRenderError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
    finally:
        sys.settrace(previous)
    return "".join(parts)


def template_supports_tools(template: str | None) -> bool:
    """True when the template references `tools` (so tool definitions reach the model)."""
    return bool(template) and "tools" in template  # type: ignore[operator]
