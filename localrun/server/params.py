"""Reading request JSON: typed getters, sampling options under both vocabularies (OpenAI's
and Ollama's), messages, tools and tool_choice, JSON schemas.

The API translators (routes_*.py) build a generation job from these; nothing here knows
HTTP beyond already-parsed JSON values. Everything a backend sees is validated first (see
docs/security.md, 'Request bounds' and 'Structured output bounds': invalid JSON, wrong types,
out-of-range values, invalid JSON schemas): bad values raise InvalidRequest (400) before any work. Output constraints
are checked and bounded by localrun.structured; this module reads each server's names for them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from localrun.backends.base import SamplingOptions
from localrun.templates.chat import template_supports_tools
from localrun.errors import InvalidRequest
from localrun.library.modelfile import PARAMETERS
from localrun.server import images as img
from localrun.structured.bounds import SCHEMA_MAX_DEPTH, SCHEMA_MAX_NODES, check_json_size
from localrun.structured.constraints import check_choices, check_gbnf, regex_lark

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_EXTRA_CHUNKS = 1024  # input_extra entries one request may carry (their text is bounded by the body's size)


# -- typed getters ---------------------------------------------------------------------------
def _num(body: dict, key: str, kind: type, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, default: Any = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and isinstance(v, float) and not v.is_integer()):
        raise InvalidRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {json.dumps(v)[:40]}")
    try:
        v = kind(v)
    except OverflowError:  # an integer past a float's range (JSON numbers have no bound), or inf as an int
        raise InvalidRequest(f"'{key}' is out of range, got {json.dumps(body.get(key))[:40]}") from None
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


MAX_CACHE_KEY = 1024


def infill_extra(value: Any) -> list[dict]:
    """llama-server's input_extra: other files of the project, [{"filename", "text"}] (filename "tmp" when
    absent), laid out before the prefix with the model's repository tokens (<|repo_name|>, <|file_sep|>)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    if len(value) > MAX_EXTRA_CHUNKS:
        raise InvalidRequest(f'"input_extra" has {len(value)} chunks; at most {MAX_EXTRA_CHUNKS}')
    out = []
    for chunk in value:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise InvalidRequest('extra_context chunk must contain a "text" field with a string value')
        name = chunk.get("filename")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest('extra_context chunk\'s "filename" field must be a string')
        out.append({"filename": name if name is not None else "tmp", "text": chunk["text"]})
    return out


def cache_key(body: dict) -> str | None:
    """OpenAI's `prompt_cache_key` (Chat Completions and Responses): a routing / prefix-cache hint
    (requests with the same key prefer the cached prefix the key last used); empty: none."""
    v = get_str(body, "prompt_cache_key")
    if v is not None and len(v) > MAX_CACHE_KEY:
        raise InvalidRequest(f"'prompt_cache_key' must be at most {MAX_CACHE_KEY} characters")
    return v or None


def get_stop(value: Any, key: str = "stop") -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest(f"'{key}' must be a string or a list of strings")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_LEN for s in stops):
        raise InvalidRequest(f"'{key}' allows at most {MAX_STOP} strings of up to {MAX_STOP_LEN} characters")
    return [s for s in stops if s]


def get_logit_bias(body: dict, key: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's logit_bias: {token id (a string of digits): bias from -100 to 100}."""
    value = body.get(key)
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"'{key}' must be an object of at most {MAX_LOGIT_BIAS} token ids -> biases")
    out: dict[int, float] = {}
    for k, v in value.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 10):
            raise InvalidRequest(f"'{key}' keys must be token ids (digits), not {k[:40]!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise InvalidRequest(f"'{key}' biases must be numbers from -100 to 100 (token {k})")
        out[int(k)] = float(v)
    return out


MAX_TOOLS = 512  # tools one request may offer (the Responses API's own bound too)
_CHECKED: "OrderedDict[str, None]" = OrderedDict()  # schemas validated before (agents resend theirs every turn)
_CHECKED_MAX = 256


def check_json_schema(schema: Any) -> dict:
    """A JSON schema must be an object that is itself a valid schema; else 400 (and the daemon
    keeps serving). Turning it into a grammar is the backend's business (it answers 400 too).
    The check runs on the event loop: bounded by the size and depth checks first, against draft 7's
    meta-schema unless the schema names its own ($schema; 2020-12's took 6x as long, and both take
    what tools send), and done once per schema (kept by its JSON text)."""
    if not isinstance(schema, dict):
        raise InvalidRequest("the JSON schema must be an object")
    # objects + arrays, checked before the (event-loop) validation, as the backends build grammars
    check_json_size(schema, SCHEMA_MAX_NODES, "the JSON schema", SCHEMA_MAX_DEPTH)
    key = json.dumps(schema, sort_keys=True)
    if key in _CHECKED:
        _CHECKED.move_to_end(key)
        return schema
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema) if "$schema" in schema else jsonschema.Draft7Validator
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc.message}") from None
    except RecursionError:
        raise InvalidRequest("invalid JSON schema: it refers to itself or nests too deeply to check") from None
    except Exception as exc:  # a bad $schema, ...
        raise InvalidRequest(f"invalid JSON schema: {type(exc).__name__}") from None
    _CHECKED[key] = None
    while len(_CHECKED) > _CHECKED_MAX:
        _CHECKED.popitem(last=False)
    return schema


def _regex(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{key}' must be a non-empty string: a regular expression the whole output matches")
    try:
        regex_lark(value)  # the check every backend shares: Python's syntax, localrun's bounds
    except InvalidRequest as exc:
        raise InvalidRequest(f"'{key}': {exc.message}") from None
    return value


def _grammar(value: Any, key: str) -> str:
    try:
        return check_gbnf(value)
    except InvalidRequest as exc:
        raise InvalidRequest(f"'{key}': {exc.message}") from None


def _json(value: Any, key: str) -> dict:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidRequest(f"'{key}' must be a JSON schema (an object, or its JSON text)") from None
    return check_json_schema(value)


# (key, constraint, reader): what each server's extension asks for
_STRUCTURED = (("guided_json", "json_schema", _json), ("guided_regex", "regex", _regex),  # vLLM (before 0.11)
               ("guided_choice", "choices", check_choices), ("guided_grammar", "grammar", _grammar),
               ("regex", "regex", _regex), ("ebnf", "grammar", _grammar),  # SGLang
               ("grammar", "grammar", _grammar), ("json_schema", "json_schema", _json))  # llama-server
_STRUCTURED_OUTPUTS = (("json", "json_schema", _json), ("regex", "regex", _regex),
                       ("choice", "choices", check_choices), ("grammar", "grammar", _grammar))  # vLLM's structured_outputs


def apply_structured(opts: SamplingOptions, body: dict) -> None:
    """The output constraints that vLLM (structured_outputs, guided_*), SGLang (regex, ebnf) and llama-server
    (grammar, json_schema) take beside OpenAI's response_format, onto `opts`: at most one constraint per
    request, response_format's included."""
    found: list[tuple[str, str, Any]] = []
    for key, kind, read in _STRUCTURED:
        if body.get(key) is not None:
            found.append((key, kind, read(body[key], key)))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("'structured_outputs' must be an object")
        if so.get("structural_tag") is not None:
            raise InvalidRequest("'structured_outputs.structural_tag' is not supported; use json, regex, choice or "
                                 "grammar")
        for key, kind, read in _STRUCTURED_OUTPUTS:
            if so.get(key) is not None:
                found.append((f"structured_outputs.{key}", kind, read(so[key], f"structured_outputs.{key}")))
        if so.get("json_object"):
            found.append(("structured_outputs.json_object", "json_mode", True))
    if not found:
        return
    given = ["response_format"] if opts.constraints() else []
    if len(found) + len(given) > 1:
        names = given + [k for k, _, _ in found]
        raise InvalidRequest(f"one output constraint per request: {', '.join(repr(n) for n in names)} were given")
    _, kind, value = found[0]
    setattr(opts, kind, value)


# -- Modelfile / Ollama options --------------------------------------------------------------
# one range per option, the Modelfile's (localrun.library.modelfile.PARAMETERS): a value `create` stores is one
# every request takes, and a request's options are bounded as a Modelfile's are (Ollama caps no temperature)
_OPTION_FLOATS = {k: PARAMETERS[k][1:] for k in ("temperature", "top_p", "min_p", "repeat_penalty",
                                                 "presence_penalty", "frequency_penalty", "typical_p")}


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
    if (v := get_int(params, "top_k", *PARAMETERS["top_k"][1:])) is not None:
        opts.top_k = v
    if (v := get_int(params, "repeat_last_n", *PARAMETERS["repeat_last_n"][1:])) is not None:
        opts.repeat_last_n = v
    if (v := get_int(params, "seed")) is not None:
        opts.seed = v if v >= 0 else None
    if (v := get_int(params, "num_predict")) is not None:
        if v == 0:
            raise InvalidRequest("'num_predict' must not be 0 (use -1 for no limit)")
        opts.max_tokens = v if v > 0 else None
    if "stop" in params:
        opts.stop = get_stop(params["stop"])
    return get_int(params, "num_ctx", *PARAMETERS["num_ctx"][1:])


MAX_TOKEN_IDS = 1 << 20  # token ids one request may carry (detokenize, a context, a prompt of ids)


def token_ids(value: Any, what: str, hint: str = "") -> list[int]:
    """A request's array of token ids (integers, not booleans; at most MAX_TOKEN_IDS), else
    InvalidRequest naming `what`. Whether each is in the model's vocabulary the backend checks."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest(f"'{what}' must be an array of token ids (integers){hint}")
    if len(value) > MAX_TOKEN_IDS:
        raise InvalidRequest(f"'{what}' has {len(value)} token ids; at most {MAX_TOKEN_IDS}")
    return value


_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def reasoning_effort(value: Any, what: str) -> tuple[bool | None, str | None]:
    """(Job.think, Job.effort) for an OpenAI-style reasoning effort (chat's `reasoning_effort`, the
    Responses API's `reasoning.effort`): "none" asks the template not to think; minimal, low, medium,
    high (xhigh) go to templates that take an effort (gpt-oss: low, medium, high), thinking otherwise
    left to the template: clients such as Codex always send one, and a model that cannot think still
    answers them. An effort this daemon does not know is passed over the same way."""
    if value is None:
        return None, None
    if not isinstance(value, str):
        raise InvalidRequest(f"'{what}' must be a string (none, minimal, low, medium, high)")
    if value == "none":
        return False, None
    return None, _EFFORTS.get(value)


def apply_logprobs(opts: SamplingOptions, body: dict) -> None:
    """The top-level `logprobs` / `top_logprobs` of OpenAI's chat and Ollama's chat and generate: each
    token's log-probability, and that many alternatives (0-20; above 0 only with logprobs true)."""
    if get_bool(body, "logprobs"):
        opts.logprobs = True
        opts.top_logprobs = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, default=0)
    elif get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, default=0):  # 0 asks for nothing (as vLLM reads it)
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true")


def base_options(resolved: Any) -> tuple[SamplingOptions, int | None]:
    """Sampling defaults: the model's Modelfile PARAMETERs over localrun's defaults."""
    opts = SamplingOptions()
    try:
        num_ctx = apply_ollama_options(opts, dict(resolved.parameters or {}))
    except InvalidRequest as exc:
        raise InvalidRequest(f"the model's Modelfile has a bad PARAMETER: {exc.message}") from None
    return opts, num_ctx


# -- messages and prompts ----------------------------------------------------------------------
def _content_text(content: Any, where: str, images: list | None = None) -> str:
    """A message's text; OpenAI image_url parts (when `images` collects them) become MEDIA_MARKER
    where they stand, the image going on `images`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for k, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "image_url" and images is not None:
                ref = p.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref  # {"url", "detail"}; detail is ignored
                images.append(img.from_url(url, f"{where}.content[{k}]"))
                parts.append(img.markers(1))
                continue
            if kind not in ("text", "input_text"):
                raise InvalidRequest(f"{where}: only text and image_url content parts are supported")
            if not isinstance(p.get("text"), str):
                raise InvalidRequest(f"{where}: a text part needs a 'text' string")
            parts.append(p["text"])
        return "".join(parts)
    raise InvalidRequest(f"{where}: 'content' must be a string or a list of content parts")


def normalize_messages(messages: Any, ollama_images: bool = False) -> list[dict]:
    """Chat messages in the service's shape. A message with images keeps them under "images" (a
    list of images.ImageInput, in the order of the MEDIA_MARKERs in its content; take them off with
    images.take_images): OpenAI image_url parts; with `ollama_images`, Ollama's "images" (base64
    strings, placed before the text as Ollama does); or ImageInputs a translator put there."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequest(f"messages[{i}].role must be system, user, assistant or tool")
        images: list = [x for x in m.get("images") or () if isinstance(x, img.ImageInput)] \
            if isinstance(m.get("images"), list) else []
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), f"messages[{i}]", images)}
        if ollama_images and m.get("images") is not None:
            if not isinstance(m["images"], list):
                raise InvalidRequest(f"messages[{i}].images must be a list of base64 strings")
            given = [img.from_base64(b, f"messages[{i}].images[{k}]") for k, b in enumerate(m["images"])]
            msg["content"] = img.markers(len(given)) + msg["content"]
            images = given + images
        if images:
            msg["images"] = images
        if m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidRequest(f"messages[{i}].tool_calls must be a list")
            msg["tool_calls"] = [_normalize_call(c, i) for c in calls]
        for k in ("name", "tool_call_id"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        if role == "assistant":  # its reasoning, as sent back (templates decide whether to render it: gpt-oss's
            thought = next((m[k] for k in ("reasoning_content", "thinking", "reasoning")  # before a tool call)
                            if isinstance(m.get(k), str) and m[k]), None)
            if thought is not None:
                msg["reasoning_content"] = thought
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
        except (ValueError, RecursionError):
            raise InvalidRequest(f"messages[{i}].tool_calls: arguments is not valid JSON") from None
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}, **({"id": c["id"]} if c.get("id") else {})}


def check_tools(tools: Any, template: str | None) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("'tools' must be a list of objects")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS} a request")
    # all the tools' schemas together within one schema's bound: what the event loop checks stays bounded
    check_json_size([t.get("function", {}).get("parameters") if isinstance(t.get("function"), dict) else None
                     for t in tools], SCHEMA_MAX_NODES, "the tools' parameter schemas together")
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        if fn.get("parameters") is not None:
            check_json_schema(fn["parameters"])
    if tools and not template_supports_tools(template):
        from localrun.server import generic_tools

        if not generic_tools.enabled():
            raise InvalidRequest("this model's chat template does not support tools (it never mentions them) and "
                                 "the generic tool format is off (LOCALRUN_GENERIC_TOOLS=off); use a model whose "
                                 "template renders tools, or create one with a TEMPLATE that does")
    return tools or None


def tool_choice_schema(tools: list[dict], choice: Any) -> tuple[list[dict] | None, dict | None]:
    """Returns (tools to render, JSON schema forcing a call or None).

    `choice`: "auto" | "none" | "required" | {"name": N} (each API's own shape is mapped to
    these first; OpenAI's {"type": "function", "function": {"name": N}} is taken as is)."""
    if choice in (None, "auto"):
        return tools, None
    if choice == "none":
        return None, None
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        choice = {"name": choice["function"].get("name")}
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and choice.get("name") in names:
        chosen = [t for t in tools if t["function"]["name"] == choice["name"]]
    else:
        raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required' or name one of the tools")
    variants = [{"type": "object",
                 "properties": {"name": {"const": t["function"]["name"]},
                                "arguments": t["function"].get("parameters") or {"type": "object"}},
                 # closed: else a sampled model goes on after the arguments with keys of its own
                 # ("type", "parameters", ...) until max_tokens, and the call never parses
                 "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    return tools, variants[0] if len(variants) == 1 else {"anyOf": variants}


MAX_EMBED_INPUTS = 2048  # OpenAI's limit a request (LangChain's embedders send up to 1,000 documents at once)


def embed_inputs(value: Any, key: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if isinstance(texts, list) and texts and all(isinstance(t, int) or (isinstance(t, list) and t and all(
            isinstance(i, int) for i in t)) for t in texts):
        # another tokenizer's ids (OpenAI's tiktoken) would be meaningless to this model's vocabulary
        raise InvalidRequest(f"'{key}' holds token ids: localrun embeds text, each model with its own tokenizer. "
                             "Send the texts (LangChain's OpenAIEmbeddings sends tiktoken ids unless it is made with "
                             "check_embedding_ctx_length=False)")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest(f"'{key}' must be a non-empty string or a list of strings")
    if len(texts) > MAX_EMBED_INPUTS:
        raise InvalidRequest(f"'{key}' holds {len(texts)} strings; the limit is {MAX_EMBED_INPUTS} a request: send "
                             "them in batches")
    if any(not t.strip() for t in texts):
        raise InvalidRequest(f"'{key}' must not contain empty strings")
    return texts
