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

Rendering is meant to run off the event loop (the generation service uses a thread).

Both the daemon and the native engine render through :func:`render_chat`. A template in Go's
template language (an Ollama Modelfile's TEMPLATE) is rendered by :mod:`localrun.templates.go`, as
Ollama renders it, under the same deadline and output cap.
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
from jinja2.ext import Extension, loopcontrols
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2 import utils as jinja2_utils

from localrun.templates.go import compile_ollama, is_go_template, render_ollama
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

    def compiling(self, frame, event, arg):
        # compiling runs jinja's own lexer, parser and code generator (work linear in the capped
        # template size) and folds constant filter calls: the deadline is checked on every call
        # there, and per line only inside the filters and globals (whose loops a template steers)
        if event == "call":
            self.line(frame, event, arg)
            return self.line if frame.f_globals.get("__name__") in _TEMPLATE_CODE else None
        return None

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


# modules whose Python code a template's constants can run while it compiles (filters, globals)
_TEMPLATE_CODE = frozenset(["jinja2.filters", "jinja2.utils", "jinja2.runtime", "localrun.templates.chat"])


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


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: json.dumps with its options (no HTML escaping), indent bounded."""
    if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
        raise SecurityError("tojson's indent is too large (64 at most)")
    if separators is not None:
        if not (isinstance(separators, (list, tuple)) and len(separators) == 2
                and all(isinstance(x, str) and len(x) <= 64 for x in separators)):
            raise SecurityError("tojson's separators must be two short strings")
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's own text with
    it (to build an assistant-token mask); rendering a prompt, the block is its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """The ``dict`` global transformers gives templates: dict(...) and dict.fromkeys(...) only."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return _sized(dict(*args, **kwargs))

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return _sized(dict.fromkeys(*args, **kwargs))


class _Namespace(jinja2_utils.Namespace):
    """jinja's namespace(), refusing underscore names as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2_utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2_utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot store underscore-prefixed attributes on a namespace ({name!r})")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _env() -> _Env:
    # the environment transformers renders chat templates in (apply_chat_template), bounds added
    env = _Env(trim_blocks=True, lstrip_blocks=True, autoescape=False, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=64)
def _compile(template: str):
    return _env().from_string(template)


def check_template(template: str) -> None:
    """Compile `template` in the sandbox; raise TemplateRenderError naming the problem."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRenderError(f"chat template is too long ({len(template)} characters, limit {MAX_TEMPLATE_CHARS})")
    if is_go_template(template):  # Ollama's language
        try:
            compile_ollama(template)
        except InvalidRequest as exc:
            raise TemplateRenderError(f"chat template does not compile: {exc.message}") from None
        return
    try:
        _compile(template)
    except Exception as exc:  # TemplateSyntaxError and friends
        raise TemplateRenderError(f"chat template does not compile: {exc}") from None


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under each name templates read it by (``reasoning_content``;
    ``thinking`` for gpt-oss), as transformers passes it."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if r is not None:
                m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out


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
    messages = _alias_reasoning(messages)
    budget = _Budget(RENDER_SECONDS, RENDER_MEMORY_BYTES)
    if is_go_template(template):
        return _render_go(template, messages, tools, budget, **extra)
    parts: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(budget.trace)
    try:
        sys.settrace(budget.compiling)
        compiled = _compile(template)
        sys.settrace(budget.trace)
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


def _render_go(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, budget: _Budget,
               **extra: Any) -> str:
    """An Ollama (Go) template, rendered as Ollama does, under the budget's deadline and memory bound."""
    previous = sys.gettrace()
    sys.settrace(budget.trace)
    try:
        return render_ollama(template, messages, tools=tools, think=extra.get("enable_thinking"),
                             effort=extra.get("reasoning_effort"), out_limit=MAX_OUTPUT_CHARS)
    except InvalidRequest as exc:
        raise TemplateRenderError(f"chat template failed to render: {exc.message}") from None
    except _Abort as exc:
        raise TemplateRenderError(str(exc)) from None
    except RecursionError:
        raise TemplateRenderError("chat template recursed too deeply") from None
    finally:
        sys.settrace(previous)


def template_supports_tools(template: str | None) -> bool:
    """True when the template references `tools` (so tool definitions reach the model): `.Tools` in
    an Ollama template."""
    if not template:
        return False
    if is_go_template(template):
        return ".Tools" in template
    return "tools" in template
