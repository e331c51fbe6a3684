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

Both the daemon and the native engine render through :func:`render_chat`.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
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


class _Env(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "+", "**"])

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
        return super().call_binop(context, operator, left, right)

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
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _env() -> _Env:
    env = _Env(trim_blocks=True, lstrip_blocks=True, autoescape=False, keep_trailing_newline=True)
    env.filters["tojson"] = _tojson
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
