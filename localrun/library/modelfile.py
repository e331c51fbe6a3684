"""Ollama-style Modelfile parsing and rendering.

    FROM smollm2:135m            # a library model, ./file.gguf or ./safetensors-dir
    PARAMETER temperature 0.7
    PARAMETER stop "<|im_end|>"  # repeatable
    SYSTEM \"\"\"You are ...\"\"\"   # \"\"\"...\"\"\" spans lines; "..." is one line
    TEMPLATE ...  MESSAGE user ...  LICENSE ...  ADAPTER ./lora.gguf

ADAPTER names one LoRA adapter in GGUF (llama.cpp applies it when the model loads). Errors raise
InvalidRequest naming the line ("Modelfile line 3: ...").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.config import MAX_SPECULATIVE_TOKENS
from localrun.errors import InvalidRequest

INSTRUCTIONS = ("FROM", "PARAMETER", "SYSTEM", "TEMPLATE", "MESSAGE", "LICENSE", "ADAPTER")
ROLES = ("system", "user", "assistant", "tool")
MAX_STOPS = 16

# name -> (type, minimum, maximum); None bounds are open.
PARAMETERS: dict[str, tuple[type, float | None, float | None]] = {
    "num_ctx": (int, 16, 1 << 20),
    "temperature": (float, 0.0, 100.0),
    "top_k": (int, 0, 1 << 20),
    "top_p": (float, 0.0, 1.0),
    "min_p": (float, 0.0, 1.0),
    "typical_p": (float, 0.0, 1.0),
    "seed": (int, -(1 << 63), (1 << 64) - 1),
    "stop": (str, None, None),
    "num_predict": (int, -2, 1 << 24),
    "repeat_penalty": (float, 0.0, 100.0),
    "repeat_last_n": (int, -1, 1 << 24),
    "presence_penalty": (float, -2.0, 2.0),
    "frequency_penalty": (float, -2.0, 2.0),
    "num_keep": (int, -1, 1 << 24),
    "num_batch": (int, 1, 1 << 20),
    "num_gpu": (int, -1, 1 << 16),
    "num_thread": (int, 0, 1 << 12),
    "main_gpu": (int, 0, 1 << 10),  # llama.cpp, load time: the GPU that holds what is not split across GPUs
    "use_mmap": (bool, None, None),  # llama.cpp, load time: map the weights file (true) or read it into memory
    "tensor_parallel": (int, 1, 64),  # native engine: ranks the model is split over (load time)
    "kv_cache_type": (str, None, None),  # load time: as LOCALRUN_KV_CACHE_TYPE, for this model
    "weight_dtype": (str, None, None),  # native engine, load time: as LOCALRUN_WEIGHT_DTYPE, for this model
    "speculative": (str, None, None),  # load time: as LOCALRUN_SPECULATIVE (off | ngram | draft:PATH), for this model
    "num_speculative_tokens": (int, 1, MAX_SPECULATIVE_TOKENS),  # load time: as LOCALRUN_SPECULATIVE_TOKENS
    "mirostat": (int, 0, 2),
    "mirostat_tau": (float, 0.0, 100.0),
    "mirostat_eta": (float, 0.0, 100.0),
}

# string parameters with a closed set of values (load-time choices; the
# library does not import the engine, so the names are listed here and checked again at load)
CHOICES: dict[str, tuple[str, ...]] = {
    "kv_cache_type": ("auto", "bf16", "fp16", "fp32", "fp8", "int8", "f16", "q8_0", "q4_0"),
    "weight_dtype": ("auto", "int8", "fp8"),
}


@dataclass
class Modelfile:
    from_: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    license: str | None = None
    adapter: str | None = None
    projector: str | None = None  # a second FROM: the vision projector (a GGUF whose architecture is clip)

    def to_text(self, from_: str | None = None, header: str | None = None) -> str:
        return render_modelfile(from_ or self.from_ or "", self.parameters, self.template, self.system,
                                self.messages, self.license, self.adapter, header=header, projector=self.projector)


def _err(line: int, msg: str) -> InvalidRequest:
    return InvalidRequest(f"Modelfile line {line}: {msg}")


def parse_parameter(key: str, value: Any, line: int | None = None) -> Any:
    """Convert and range-check one parameter value (strings from a Modelfile, or JSON
    values from an API request). Raises InvalidRequest naming the parameter."""
    where = f"Modelfile line {line}: " if line else ""
    spec = PARAMETERS.get(key)
    if spec is None:
        known = ", ".join(sorted(PARAMETERS))
        raise InvalidRequest(f"{where}unknown parameter {key!r} (known: {known})")
    typ, lo, hi = spec
    if typ is str:
        if not isinstance(value, str) or value == "":
            raise InvalidRequest(f"{where}parameter {key} needs a non-empty string")
        if key in CHOICES:
            value = value.strip().lower()
            if value not in CHOICES[key]:
                raise InvalidRequest(f"{where}parameter {key} must be one of {', '.join(CHOICES[key])}, got {value!r}")
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower() if isinstance(value, str) else None
        if text in ("true", "false"):
            return text == "true"
        raise InvalidRequest(f"{where}parameter {key} must be true or false, got {value!r}")
    try:
        if isinstance(value, bool):
            raise ValueError
        if typ is int:
            v: Any = int(value) if not isinstance(value, float) or value.is_integer() else None
            if v is None:
                raise ValueError
        else:
            v = float(value)
            if v != v or v in (float("inf"), float("-inf")):
                raise ValueError
    except (ValueError, TypeError):
        raise InvalidRequest(f"{where}parameter {key} must be {'an integer' if typ is int else 'a number'}, got {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidRequest(f"{where}parameter {key} = {v} is out of range [{lo}, {hi}]")
    return v


def _split_first(text: str) -> tuple[str, str]:
    text = text.lstrip()
    for i, c in enumerate(text):
        if c.isspace():
            return text[:i], text[i:].lstrip()
    return text, ""


def _unquote_line(arg: str, line: int) -> str:
    """A one-line "quoted" argument (JSON escapes), or a bare one (kept as is)."""
    if arg.startswith('"'):
        try:
            v, end = json.JSONDecoder().raw_decode(arg)
        except ValueError:
            raise _err(line, "unterminated or malformed quoted string") from None
        if not isinstance(v, str) or arg[end:].strip():
            raise _err(line, "unexpected text after the quoted string")
        return v
    return arg


def parse_modelfile(text: str, require_from: bool = True) -> Modelfile:
    """require_from=False: the model comes from elsewhere (/api/create's `files`)."""
    if not isinstance(text, str):
        raise InvalidRequest("Modelfile must be text")
    if "\x00" in text:
        raise InvalidRequest("Modelfile contains a NUL byte")
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark (editors on Windows write one): Ollama skips it too
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    mf = Modelfile()
    licenses: list[str] = []
    i = 0
    while i < len(lines):
        lineno = i + 1
        raw = lines[i]
        i += 1
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        word, rest = _split_first(stripped)
        instr = word.upper()
        if instr not in INSTRUCTIONS:
            raise _err(lineno, f"unknown instruction {word!r} (expected one of {', '.join(INSTRUCTIONS)})")

        def take_value(arg: str) -> str:
            """The argument: \"\"\"multi-line\"\"\", "quoted" or the bare rest of the line."""
            nonlocal i
            if arg.startswith('"""'):
                body = arg[3:]
                end = body.find('"""')
                if end >= 0:
                    if body[end + 3:].strip():
                        raise _err(lineno, 'unexpected text after the closing """')
                    return body[:end]
                parts = [body]
                while i < len(lines):
                    ln = lines[i]
                    i += 1
                    end = ln.find('"""')
                    if end >= 0:
                        if ln[end + 3:].strip():
                            raise _err(i, 'unexpected text after the closing """')
                        parts.append(ln[:end])
                        return "\n".join(parts)
                    parts.append(ln)
                raise _err(lineno, 'the """ opened here is never closed')
            return _unquote_line(arg, lineno)

        if instr == "FROM":
            v = take_value(rest).strip()
            if not v:
                raise _err(lineno, "FROM needs a model name, a .gguf file or a safetensors directory")
            if mf.from_ is None:
                mf.from_ = v
            elif mf.projector is None:  # a second FROM: a vision projector GGUF (checked when it is read)
                mf.projector = v
            else:
                raise _err(lineno, "FROM appears three times (a Modelfile has one FROM for the model and at "
                                   "most one more for its vision projector)")
        elif instr == "PARAMETER":
            key, val = _split_first(rest)
            key = key.lower()
            if not key or not val:
                raise _err(lineno, "PARAMETER needs a name and a value, e.g. PARAMETER temperature 0.7")
            v = parse_parameter(key, take_value(val) if val.startswith('"') else val.strip(), lineno)
            if key == "stop":
                stops = mf.parameters.setdefault("stop", [])
                if len(stops) >= MAX_STOPS:
                    raise _err(lineno, f"at most {MAX_STOPS} stop sequences")
                if v not in stops:
                    stops.append(v)
            else:
                mf.parameters[key] = v
        elif instr in ("SYSTEM", "TEMPLATE", "LICENSE"):
            if not rest:
                raise _err(lineno, f"{instr} needs text")
            v = take_value(rest)
            if instr == "SYSTEM":
                mf.system = v
            elif instr == "TEMPLATE":
                _check_template(v, lineno)
                mf.template = v
            else:
                licenses.append(v)
        elif instr == "MESSAGE":
            role, content = _split_first(rest)
            role = role.lower()
            if role not in ROLES:
                raise _err(lineno, f"MESSAGE role must be one of {', '.join(ROLES)}, got {role!r}")
            if not content:
                raise _err(lineno, "MESSAGE needs a role and the message text")
            mf.messages.append({"role": role, "content": take_value(content)})
        elif instr == "ADAPTER":
            v = take_value(rest).strip()
            if not v:
                raise _err(lineno, "ADAPTER needs a file path")
            if mf.adapter is not None:
                raise _err(lineno, "only one ADAPTER is supported")
            mf.adapter = v
    if mf.from_ is None and require_from:
        if not any(ln.strip() and not ln.strip().startswith("#") for ln in lines):
            raise InvalidRequest("the Modelfile is empty: it has no FROM line (start it with e.g. `FROM smollm2:135m` "
                                 "or `FROM ./model.gguf`)")
        raise InvalidRequest("Modelfile has no FROM line: start it with e.g. `FROM smollm2:135m` or `FROM ./model.gguf`")
    if licenses:
        mf.license = "\n\n".join(licenses)
    return mf


def _check_template(template: str, lineno: int) -> None:
    """TEMPLATE is a Jinja chat template (rendered in the sandbox): it must compile."""
    from localrun.templates.chat import check_template

    try:
        check_template(template)
    except InvalidRequest as e:
        raise _err(lineno, "TEMPLATE " + e.message.removeprefix("chat template ")) from None


def quote_value(text: str) -> str:
    """Render a value so parse_modelfile reads back exactly the same text. Text the
    parser would change (a CR becomes a line break, a NUL is refused) is JSON-quoted."""
    if "\r" in text or "\x00" in text:
        return json.dumps(text, ensure_ascii=False)
    if text and text.strip() == text and "\n" not in text and not text.startswith('"'):
        return text
    if '"""' not in text and not text.endswith('"') and text.strip() == text:
        return f'"""{text}"""'
    return json.dumps(text, ensure_ascii=False)


def local_source(text: str, base: Path) -> Path | None:
    """The file or directory a FROM names (relative to `base`, the Modelfile's folder), or None when
    it names a model."""
    if "\x00" in text:
        raise InvalidRequest("FROM contains a NUL byte")
    looks = text.startswith(("./", "../", "/", "~", ".\\")) or text.lower().endswith(".gguf") or text in (".", "..")
    p = Path(os.path.expanduser(text))
    if not p.is_absolute():
        p = base / p
    if looks:
        return p
    try:
        return p if p.exists() else None
    except OSError:  # e.g. a 10 KB name: too long for a path, so it names a model (or nothing)
        return None


def format_parameter_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, float) and v.is_integer():
        return str(int(v)) if abs(v) < 1e15 else repr(v)
    return str(v)


def parameter_lines(parameters: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for k in sorted(parameters):
        v = parameters[k]
        for item in (v if isinstance(v, list) else [v]):
            out.append((k, format_parameter_value(item)))
    return out


def render_modelfile(from_: str | None, parameters: dict, template: str | None, system: str | None,
                     messages: list[dict], license: str | None, adapter: str | None,
                     header: str | None = None, projector: str | None = None) -> str:
    out = []
    if header:
        out += [f"# {h}" if h else "#" for h in header.splitlines()] + [""]
    if from_ is not None:  # None: the model comes as uploaded files (/api/create's `files`)
        out.append(f"FROM {from_}")
    if projector:
        out.append(f"FROM {projector}")
    if template:
        out.append(f"TEMPLATE {quote_value(template)}")
    if system:
        out.append(f"SYSTEM {quote_value(system)}")
    for k, v in parameter_lines(parameters):
        out.append(f"PARAMETER {k} {v}")
    for m in messages:
        out.append(f"MESSAGE {m['role']} {quote_value(m['content'])}")
    if adapter:
        out.append(f"ADAPTER {adapter}")
    if license:
        out.append(f"LICENSE {quote_value(license)}")
    return "\n".join(out) + "\n"


__all__ = ["Modelfile", "parse_modelfile", "parse_parameter", "quote_value", "render_modelfile", "parameter_lines",
           "format_parameter_value", "PARAMETERS"]
