"""Chat templates, rendered only inside jinja2's ImmutableSandboxedEnvironment.

A GGUF's ``tokenizer.chat_template`` (or a Modelfile TEMPLATE, or a safetensors
repo's tokenizer_config.json) is untrusted input: llama-cpp-python's CVE-2024-34359
was exactly a template rendered by plain Jinja2. Here a template can reach no Python
internals (the sandbox refuses attribute access to ``__class__`` and friends and
mutation of the objects we pass in), ``range`` is capped by the sandbox, and the
rendered output is capped in size.

Both the daemon and the native engine render through :func:`render_chat`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localrun.errors import InvalidRequest

MAX_TEMPLATE_CHARS = 200_000
MAX_OUTPUT_CHARS = 4_000_000

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
    pass


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
    try:
        compiled = _compile(template)
        out = compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except RecursionError:
        raise TemplateRenderError("chat template recursed too deeply") from None
    except Exception as exc:  # SecurityError, TemplateSyntaxError, UndefinedError, TypeError, ...
        raise TemplateRenderError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
    if len(out) > MAX_OUTPUT_CHARS:
        raise TemplateRenderError("chat template produced an oversized prompt")
    return out


def template_supports_tools(template: str | None) -> bool:
    """True when the template references `tools` (so tool definitions reach the model)."""
    return bool(template) and "tools" in template  # type: ignore[operator]
