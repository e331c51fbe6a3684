"""What both API shapes share: request validation, option mapping, prompt building,
running one generation on a leased model, tool-call parsing.

Routes translate OpenAI / Ollama JSON into these calls; nothing here knows HTTP beyond
reading already-parsed JSON values. Everything a backend sees is validated first
(security.md items 14-17): bad values raise InvalidRequest (400) before any work.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from localrun.backends.base import Chunk, GenerationRequest, SamplingOptions, Usage
from localrun.chat_template import render_chat, template_supports_tools
from localrun.errors import InvalidRequest

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_LEN = 256


# -- typed getters ---------------------------------------------------------------------------
def _num(body: dict, key: str, kind: type, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, default: Any = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and isinstance(v, float) and not v.is_integer()):
        raise InvalidRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {json.dumps(v)[:40]}")
    v = kind(v)
    if v != v:  # NaN
        raise InvalidRequest(f"'{key}' must be a number")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise InvalidRequest(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise InvalidRequest(f"'{key}' must be <= {hi}, got {v}")
    return v


def get_int(body: dict, key: str, lo: int | None = None, hi: int | None = None, default: Any = None) -> Any:
    return _num(body, key, int, lo, hi, default=default)


def get_float(body: dict, key: str, lo: float | None = None, hi: float | None = None, default: Any = None,
              lo_open: bool = False) -> Any:
    return _num(body, key, float, lo, hi, lo_open=lo_open, default=default)


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{key}' must be true or false")
    return v


def get_str(body: dict, key: str, required: bool = False, default: str | None = None) -> str | None:
    v = body.get(key)
    if v is None:
        if required:
            raise InvalidRequest(f"'{key}' is required")
        return default
    if not isinstance(v, str):
        raise InvalidRequest(f"'{key}' must be a string")
    if required and not v.strip():
        raise InvalidRequest(f"'{key}' must not be empty")
    return v


def get_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_LEN for s in stops):
        raise InvalidRequest(f"'stop' allows at most {MAX_STOP} strings of up to {MAX_STOP_LEN} characters")
    return [s for s in stops if s]


def check_json_schema(schema: Any) -> dict:
    """A JSON schema must be an object that is itself a valid schema and that the grammar
    converter accepts; else 400 (and the daemon keeps serving)."""
    if not isinstance(schema, dict):
        raise InvalidRequest("the JSON schema must be an object")
    try:
        import jsonschema

        jsonschema.validators.validator_for(schema).check_schema(schema)
    except ImportError:  # pragma: no cover - the grammar converter still checks
        pass
    except Exception as exc:
        msg = getattr(exc, "message", str(exc))
        raise InvalidRequest(f"invalid JSON schema: {msg}") from None
    try:
        from llama_cpp.llama_grammar import json_schema_to_gbnf
    except ImportError:  # the native backend validates on its own
        return schema
    try:
        json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:
        raise InvalidRequest(f"invalid JSON schema: {type(exc).__name__}: {exc}") from None
    return schema


# -- Modelfile / Ollama options --------------------------------------------------------------
_OPTION_FLOATS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "repeat_penalty": (0.0, 10.0),
                  "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0), "typical_p": (0.0, 1.0)}


def apply_ollama_options(opts: SamplingOptions, params: dict | None) -> int | None:
    """Ollama option names (Modelfile PARAMETERs or a request's "options") onto `opts`.
    Returns num_ctx when given."""
    if not params:
        return None
    if not isinstance(params, dict):
        raise InvalidRequest("'options' must be an object")
    for k, (lo, hi) in _OPTION_FLOATS.items():
        v = get_float(params, k, lo, hi)
        if v is not None and k != "typical_p":
            setattr(opts, k, v)
    if (v := get_int(params, "top_k", 0, 100_000)) is not None:
        opts.top_k = v
    if (v := get_int(params, "repeat_last_n", -1, 1_000_000)) is not None:
        opts.repeat_last_n = v
    if (v := get_int(params, "seed")) is not None:
        opts.seed = v if v >= 0 else None
    if (v := get_int(params, "num_predict")) is not None:
        if v == 0:
            raise InvalidRequest("'num_predict' must not be 0 (use -1 for no limit)")
        opts.max_tokens = v if v > 0 else None
    if "stop" in params:
        opts.stop = get_stop(params["stop"])
    return get_int(params, "num_ctx", 16, 1 << 20)


def base_options(resolved: Any) -> tuple[SamplingOptions, int | None]:
    """Sampling defaults: the model's Modelfile PARAMETERs over localrun's defaults."""
    opts = SamplingOptions()
    try:
        num_ctx = apply_ollama_options(opts, dict(resolved.parameters or {}))
    except InvalidRequest as exc:
        raise InvalidRequest(f"the model's Modelfile has a bad PARAMETER: {exc.message}") from None
    return opts, num_ctx


# -- messages and prompts ----------------------------------------------------------------------
def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("text", "input_text"):
                raise InvalidRequest(f"{where}: only text content parts are supported")
            if not isinstance(p.get("text"), str):
                raise InvalidRequest(f"{where}: a text part needs a 'text' string")
            parts.append(p["text"])
        return "".join(parts)
    raise InvalidRequest(f"{where}: 'content' must be a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequest(f"messages[{i}].role must be system, user, assistant or tool")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), f"messages[{i}]")}
        if m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidRequest(f"messages[{i}].tool_calls must be a list")
            msg["tool_calls"] = [_normalize_call(c, i) for c in calls]
        for k in ("name", "tool_call_id"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise InvalidRequest("'messages' has no content: every message is empty")
    return out


def _normalize_call(c: Any, i: int) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"messages[{i}].tool_calls entries need function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string; templates want objects
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidRequest(f"messages[{i}].tool_calls: arguments is not valid JSON") from None
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}, **({"id": c["id"]} if c.get("id") else {})}


def chat_prompt(resolved: Any, messages: list[dict], tools: list[dict] | None = None) -> str:
    """Modelfile SYSTEM (when the request has no system message) and MESSAGE lines, then the
    request's messages, rendered with the model's template in the sandbox."""
    msgs = list(messages)
    history = [dict(m) for m in (resolved.messages or [])]
    if resolved.system and not any(m["role"] == "system" for m in msgs):
        history.insert(0, {"role": "system", "content": resolved.system})
    template = resolved.template
    return render_chat(template, history + msgs, add_generation_prompt=True, tools=tools or None)


def generate_prompt(resolved: Any, prompt: str, system: str | None, template: str | None, raw: bool) -> str:
    """Ollama /api/generate: raw prompt, or the prompt wrapped as one user turn."""
    if raw:
        return prompt
    msgs = []
    system = system if system is not None else resolved.system
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": prompt})
    return render_chat(template or resolved.template, msgs, add_generation_prompt=True)


def check_tools(tools: Any, template: str | None) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("'tools' must be a list of objects")
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        if fn.get("parameters") is not None:
            check_json_schema(fn["parameters"])
    if tools and not template_supports_tools(template):
        raise InvalidRequest("this model's chat template does not support tools (it never mentions them); "
                             "use a model whose template does, or create one with a TEMPLATE that renders tools")
    return tools or None


def tool_choice_schema(tools: list[dict], choice: Any) -> tuple[list[dict] | None, dict | None]:
    """Returns (tools to render, JSON schema forcing a call or None)."""
    if choice in (None, "auto"):
        return tools, None
    if choice == "none":
        return None, None
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and choice["function"].get("name") in names:
        chosen = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    else:
        raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                             "'function': {'name': <one of the tools>}}")
    variants = [{"type": "object",
                 "properties": {"name": {"const": t["function"]["name"]},
                                "arguments": t["function"].get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"]} for t in chosen]
    return tools, variants[0] if len(variants) == 1 else {"anyOf": variants}


_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """Tool calls from model output: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks, or
    output that is one JSON object (or list) naming a known tool. Returns (content, calls)."""
    if not tools:
        return text, []
    names = {t["function"]["name"] for t in tools}
    candidates = _TOOL_CALL_RE.findall(text)
    content = _TOOL_CALL_RE.sub("", text).strip() if candidates else ""
    if not candidates:
        candidates = [text.strip()]
    calls = []
    for c in candidates:
        try:
            obj = json.loads(c)
        except ValueError:
            continue
        for o in obj if isinstance(obj, list) else [obj]:
            if isinstance(o, dict) and o.get("name") in names:
                args = o.get("arguments", o.get("parameters", {}))
                calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": o["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    return content, calls


# -- running a generation ----------------------------------------------------------------------
@dataclass
class Result:
    text: str = ""
    finish_reason: str = "stop"
    usage: Usage = field(default_factory=Usage)
    logprobs: list = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


async def prepare_request(lease: Any, prompt: str, opts: SamplingOptions, add_special: bool,
                          ids: list[int] | None = None) -> GenerationRequest:
    """Tokenize (unless `ids` are given), check the window (400 naming the limit), cap
    max_tokens at the window."""
    if ids is None:
        ids = await lease.backend.tokenize(prompt, add_special=add_special)
    if not ids:
        raise InvalidRequest("the prompt is empty")
    window = lease.num_ctx
    if len(ids) >= window:
        raise InvalidRequest(f"the prompt is {len(ids)} tokens but the context window is {window} tokens (num_ctx); "
                             "shorten the prompt or ask for a larger num_ctx")
    room = window - len(ids)
    o = SamplingOptions(**{**opts.__dict__, "stop": list(opts.stop)})
    o.max_tokens = room if o.max_tokens is None else min(o.max_tokens, room)
    return GenerationRequest(prompt=prompt, options=o, request_id=uuid.uuid4().hex, prompt_token_ids=ids)


async def stream(lease: Any, req: GenerationRequest) -> AsyncIterator[Chunk]:
    gen = lease.backend.generate(req)
    try:
        async for chunk in gen:
            yield chunk
    finally:
        await gen.aclose()


async def collect(lease: Any, req: GenerationRequest) -> Result:
    res = Result()
    parts = []
    async for c in stream(lease, req):
        parts.append(c.text)
        if c.logprobs:
            res.logprobs.extend(c.logprobs)
        res.token_ids.extend(c.token_ids)
        if c.finish_reason:
            res.finish_reason = c.finish_reason
            res.usage = c.usage or Usage()
    res.text = "".join(parts)
    return res


async def until_disconnected(request: Any, coro) -> Any:
    """Run `coro`, cancelling it when the HTTP client goes away (non-streaming requests)."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(0.25)

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()


def now_ns() -> int:
    return time.perf_counter_ns()
