"""All of localrun's settings, in one place.

Every ``LOCALRUN_*`` environment variable is read here and nowhere else.  Other
modules call :func:`settings` (a fresh read of the environment each call, so tests
and ``localrun serve`` flags that set variables take effect) and never touch
``os.environ`` for a ``LOCALRUN_*`` name themselves.

This module imports nothing beyond the standard library (platformdirs is optional),
so the engine, the kernels and ``localrun bench throughput`` stay importable on a
machine that has torch but none of the server dependencies.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 11480  # not Ollama's 11434, so both can run side by side
DEFAULT_HOST = f"127.0.0.1:{DEFAULT_PORT}"

# name -> (default, help). The order here is the order `localrun serve --help` shows.
ENV_VARS: dict[str, tuple[str, str]] = {
    "LOCALRUN_HOME": ("(platform user data dir)/localrun", "where the model library, logs, chats and stored responses live"),
    "LOCALRUN_MODELS": ("$LOCALRUN_HOME/models", "where the model library lives (blobs and manifests), like OLLAMA_MODELS: e.g. a larger disk; chats, logs and stored responses stay under LOCALRUN_HOME"),
    "LOCALRUN_NOPRUNE": ("0", "1 = keep blobs no model uses when the daemon starts; 0 = remove those older than an hour (an upload no create named, what a killed create left), as Ollama does"),
    "LOCALRUN_HOST": (DEFAULT_HOST, "host:port the daemon binds and the CLI/TUI talk to"),
    "LOCALRUN_KEEP_ALIVE": ("5m", "how long an idle model stays loaded (duration, seconds, -1 = forever, 0 = unload at once)"),
    "LOCALRUN_NUM_PARALLEL": ("auto", "requests a loaded llama.cpp model decodes at once, in one batched context of NUM_PARALLEL x num_ctx KV cells (auto: up to 4, fewer when their KV cache would not fit the free memory; the native engine batches up to max(NUM_PARALLEL, 64))"),
    "LOCALRUN_MAX_LOADED_MODELS": ("3", "models kept loaded at once; the least recently used is evicted beyond this"),
    "LOCALRUN_MAX_QUEUE": ("512", "requests allowed to wait for a slot; beyond this the daemon answers 503 with Retry-After"),
    "LOCALRUN_ORIGINS": ("(none)", "comma-separated CORS origins allowed to call the API from a browser"),
    "LOCALRUN_API_KEY": ("(none)", "when set, every API route requires 'Authorization: Bearer <key>'"),
    "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND": ("0", "1 = listen on a non-loopback address (e.g. 0.0.0.0 in a container) without LOCALRUN_API_KEY; only requests addressed to localhost are answered then (publish the port on 127.0.0.1 only). 0 = such a bind is refused"),
    "LOCALRUN_BACKEND": ("auto", "auto | llamacpp | native: which backend runs models"),
    "LOCALRUN_NATIVE_ON_CPU": ("0", "1 = with LOCALRUN_BACKEND=auto and no CUDA GPU, run GGUF models of the architectures the native engine supports on the native engine (torch on the CPU) instead of llama.cpp (vision models stay on llama.cpp); a model the native engine fails to load falls back to llama.cpp, the reason shown in ps"),
    "LOCALRUN_CONTEXT_LENGTH": ("4096", "default context window (num_ctx) when a request and the Modelfile name none"),
    "LOCALRUN_GPU_MEMORY_FRACTION": ("0.8", "fraction of free GPU memory the native engine may use for weights + KV pool"),
    "LOCALRUN_KV_CACHE_TYPE": ("auto", "the KV cache's element type, like OLLAMA_KV_CACHE_TYPE: auto | fp16 | bf16 | fp32 | int8 (q8_0) | q4_0 | fp8. llama.cpp: auto = f16; int8 = q8_0 blocks, about half of f16's memory; q4_0, about a quarter; fp8 = q8_0 there (llama.cpp has no fp8 cache); a model whose head size the blocks do not divide keeps f16 (ps says why). Native engine: auto = the model's dtype; fp8 / int8 with per-token scales, about half of bf16; q4_0 = int8 there (Modelfile: PARAMETER kv_cache_type)"),
    "LOCALRUN_WEIGHT_DTYPE": ("auto", "auto | int8 | fp8: how the native engine stores weight matrices (auto = model dtype; int8 = weight-only int8, half of bf16; fp8 = e4m3, CUDA compute capability >= 8.9 only)"),
    "LOCALRUN_HOST_CACHE": ("auto", "native engine: host RAM for prefix-cache pages evicted from the KV pool (size like '4GiB', a fraction of available RAM like '0.1' or '10%', 0 = off; auto = 10% of available RAM, at most 16 GiB and 4x the KV pool)"),
    "LOCALRUN_PROMPT_CACHE_DISK": ("4GiB", "the prompt cache on disk (LOCALRUN_HOME/prompt-cache): the computed state of prompts of at least LOCALRUN_PROMPT_CACHE_MIN tokens is written there and read back when a later prompt starts with them (after a restart, an unload or an eviction); bounded to this size, least recently used first; 0 = off (llama.cpp)"),
    "LOCALRUN_PROMPT_CACHE_MIN": ("1024", "prompt tokens a prompt needs for its state to be written to the prompt cache on disk"),
    "LOCALRUN_TENSOR_PARALLEL": ("1", "native engine: split each model over N ranks (processes; one GPU each on CUDA) by attention heads; N must divide its KV heads (Modelfile: PARAMETER tensor_parallel N)"),
    "LOCALRUN_SPECULATIVE": ("off", "speculative decoding: off | ngram (prompt lookup: drafts copied from the prompt and output, verified by the model; pays on summarise/quote/edit work) | draft:PATH (native engine: a small draft model with the same tokenizer, GGUF file or safetensors directory); greedy output is unchanged (Modelfile: PARAMETER speculative ngram)"),
    "LOCALRUN_SPECULATIVE_TOKENS": ("4", "tokens drafted per step when LOCALRUN_SPECULATIVE is on (Modelfile: PARAMETER num_speculative_tokens N)"),
    "LOCALRUN_LLAMACPP_EXTRA_BUFFERS": ("auto", "auto | on | off: llama.cpp's extra buffer types (AMX, repacked weights); auto = on, with AMX denied to llama.cpp on CPUs that have it (its AMX path crashes there)"),
    "LOCALRUN_LLAMA_SERVER": ("(built)", "benchmarks and tests that compare with llama.cpp's own server: the llama-server binary to run; unset, it is built once from the llama.cpp that the installed llama-cpp-python vendors and cached under the user cache dir (`localrun bench build-llama-server`)"),
    "LOCALRUN_IMAGE_URLS": ("0", "1 = fetch http(s) image URLs named in requests (public addresses only: never loopback, private, link-local or reserved ones; bounded by LOCALRUN_IMAGE_MAX_BYTES and LOCALRUN_IMAGE_URL_TIMEOUT); 0 = only images sent inline (base64 / data URLs)"),
    "LOCALRUN_IMAGE_URL_TIMEOUT": ("10s", "how long fetching one image URL may take, redirects included (LOCALRUN_IMAGE_URLS=1)"),
    "LOCALRUN_IMAGE_MAX_BYTES": ("20MiB", "encoded image bytes one request may carry, all its images together (bytes, or a size like 20MiB)"),
    "LOCALRUN_IMAGE_MAX_COUNT": ("16", "images one request may carry"),
    "LOCALRUN_IMAGE_MAX_PIXELS": ("16777216", "pixels (width x height) one image may have; read from its header, so a decompression bomb is refused before it is decoded"),
    "LOCALRUN_LOAD_TIMEOUT": ("5m", "how long a model's runner process may take to load it before the load fails"),
    "LOCALRUN_SHUTDOWN_GRACE": ("10s", "on SIGTERM, how long running generations may go on before their streams are ended with an error"),
    "LOCALRUN_HTTP_KEEPALIVE": ("2m", "how long an idle kept-alive HTTP connection stays open (clients that pause between requests, as agents and editors do, reuse it; a client that writes on one the daemon just closed gets a broken pipe)"),
    "LOCALRUN_LOG_LEVEL": ("info", "debug | info | warning | error"),
    "LOCALRUN_FAULTS": ("(none)", "diagnostics and tests: make named steps of a model load or a step fail for real, to exercise the fallbacks (comma-separated: kernel:NAME, graph_capture[:BATCH], kv_alloc[:N], step_oom[:N], native_load[:MODEL]); never set it in normal use"),
    "LOCALRUN_TOOL_CALL_SHAPES": ("lenient", "lenient | template: which replies are tool calls when tools are offered. lenient: also JSON naming an offered tool with arguments that fit its schema outside the template's markers (a fenced ```json block, bare JSON, a list of calls, text around them; docs/tool-calls.md); template: only the template's own markers (and the bare JSON a forced call is written as)"),
    "LOCALRUN_GENERIC_TOOLS": ("on", "on | off: a request with tools for a model whose chat template cannot render them gets the generic tool format (the tool definitions in the system prompt, the output constrained to JSON: an answer or tool calls); off: such a request is a 400"),
}

_DURATION_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


MAX_TENSOR_PARALLEL = 64  # ranks per model (also the Modelfile's bound)
MAX_DURATION = 100 * 365 * 86400.0  # longer than this (a century) means forever; no date holds 1e300 s


def _bounded(seconds: float) -> float | None:
    if seconds != seconds:
        raise ValueError("invalid duration NaN")
    return None if seconds < 0 or seconds > MAX_DURATION else seconds


def parse_duration(value: str | int | float | None, default: float | None = None) -> float | None:
    """Ollama-style keep_alive: '5m', '1h30m', '300', 300, '-1' (forever -> None), '0'.

    Returns seconds as a float, or None for "forever" (negative, or over a century).
    Raises ValueError on junk and NaN.
    """
    if value is None:
        return default
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    if isinstance(value, int) and abs(value) > MAX_DURATION:  # float() of a 400-digit int overflows
        return None
    if isinstance(value, (int, float)):
        return _bounded(float(value))
    text = str(value).strip()
    if not text:
        return default
    m = _DURATION_RE.match(text)
    if m:
        return _bounded(float(m.group(1)) * _UNIT_SECONDS[m.group(2) or "s"])
    parts = _DURATION_PART_RE.findall(text)
    if parts and "".join(n + u for n, u in parts) == text.replace(" ", ""):
        return _bounded(sum(float(n) * _UNIT_SECONDS[u] for n, u in parts))
    raise ValueError(f"invalid duration {value!r}: use e.g. '5m', '1h', '300' (seconds), '-1' (forever) or '0'")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
MAX_HOST_CACHE_FRACTION = 0.9


def parse_host_cache(value: str | None) -> int | float | None:
    """LOCALRUN_HOST_CACHE: None for 'auto' (or unset), an int of bytes ('4GiB', '512M', '2GB',
    '1073741824'; 0 or 'off' = no host tier), or a float fraction of available RAM ('0.1', '10%').
    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000."""
    text = (value or "").strip().lower()
    if text in ("", "auto"):
        return None
    if text in ("0", "off", "none", "no", "false"):
        return 0
    hint = "use a size like '4GiB' or '512MiB', a fraction of available RAM like '0.1' or '10%', 0/off, or auto"
    try:
        if text.endswith("%"):
            frac = float(text[:-1]) / 100.0
        elif "." in text and _SIZE_RE.match(text) and not _SIZE_RE.match(text).group(2) \
                and not _SIZE_RE.match(text).group(4):
            frac = float(text)
        else:
            frac = None
    except ValueError:
        raise ValueError(f"LOCALRUN_HOST_CACHE: cannot read {value!r}; {hint}") from None
    if frac is not None:
        if not 0.0 < frac <= MAX_HOST_CACHE_FRACTION:
            raise ValueError(f"LOCALRUN_HOST_CACHE: a fraction of available RAM must be in (0, "
                             f"{MAX_HOST_CACHE_FRACTION:g}], got {value!r}; {hint}")
        return frac
    v = _size_bytes(text)
    if v is None:
        raise ValueError(f"LOCALRUN_HOST_CACHE: cannot read {value!r}; {hint}")
    return v


def _size_bytes(text: str) -> int | None:
    """'4GiB', '4G' (binary), '5GB' (decimal), '1048576': bytes; None when it is not a size."""
    m = _SIZE_RE.match(text)
    if not m:
        return None
    num, unit, binary, b = m.groups()
    if binary and not unit:
        return None
    base = 1000 if (unit and b and not binary) else 1024
    return int(float(num) * base ** _SIZE_POWER[unit.lower()])


def describe_host_cache(v: int | float | None) -> str:
    if v is None:
        return "auto"
    if isinstance(v, float):
        return f"{v:.0%} of available RAM"
    return "off" if v == 0 else (f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB")


def _default_home() -> Path:
    try:
        import platformdirs

        return Path(platformdirs.user_data_dir("localrun", appauthor=False))
    except ImportError:  # engine-only machines (e.g. a bare GPU box) lack platformdirs
        base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        return Path(base) / "localrun"


def _int(name: str, raw: str | None, default: int, minimum: int) -> int:
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


MAX_PARALLEL = 128  # llama.cpp holds at most 256 sequences: the running ones and the cached prefixes
AUTO_PARALLEL = 4  # the most LOCALRUN_NUM_PARALLEL=auto picks (as Ollama's default did)


def _parallel(raw: str | None) -> int:
    """LOCALRUN_NUM_PARALLEL: a number from 1 to MAX_PARALLEL, or auto (0: sized at load from memory)."""
    if raw is None or raw.strip().lower() in ("", "auto"):
        return 0
    v = _int("LOCALRUN_NUM_PARALLEL", raw, 0, 1)
    if v > MAX_PARALLEL:
        raise ValueError(f"LOCALRUN_NUM_PARALLEL must be at most {MAX_PARALLEL}, got {v}")
    return v


def parse_hostport(text: str) -> tuple[str, int]:
    """'127.0.0.1:11480', 'localhost', ':8080', 'http://0.0.0.0:9000', '[::1]:80'."""
    t = text.strip()
    for prefix in ("http://", "https://"):
        if t.startswith(prefix):
            t = t[len(prefix):]
    t = t.rstrip("/")
    if t.startswith("["):  # IPv6 literal
        host, _, rest = t[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif t.count(":") == 1:
        host, port = t.split(":")
    else:
        host, port = t, ""
    host = host or "127.0.0.1"
    try:
        p = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"LOCALRUN_HOST: bad port in {text!r}") from None
    if not 0 < p < 65536:
        raise ValueError(f"LOCALRUN_HOST: port out of range in {text!r}")
    return host, p


@dataclass(frozen=True)
class Settings:
    home: Path
    host: str
    port: int
    keep_alive: float | None  # seconds; None = forever
    num_parallel: int
    max_loaded_models: int
    max_queue: int
    origins: tuple[str, ...]
    api_key: str | None
    backend: str
    context_length: int
    gpu_memory_fraction: float
    log_level: str
    kv_cache_type: str = "auto"
    llamacpp_extra_buffers: str = "auto"
    llama_server: str | None = None  # llama.cpp's llama-server binary for comparisons (None: built and cached)
    host_cache: int | float | None = None  # bytes, a fraction of available RAM, or None (auto)
    load_timeout: float | None = 300.0  # seconds; None = no limit
    shutdown_grace: float = 10.0  # seconds
    http_keepalive: float = 120.0  # seconds an idle kept-alive connection stays open
    weight_dtype: str = "auto"  # native engine: auto | int8 | fp8
    tensor_parallel: int = 1  # native engine ranks per model
    speculative: str = "off"  # off | ngram | draft:PATH
    speculative_tokens: int = 4
    allow_unauthenticated_bind: bool = False  # a non-loopback bind without an API key (containers)
    image_urls: bool = False  # fetch http(s) image URLs (public addresses only)
    image_url_timeout: float = 10.0  # seconds per image URL
    image_max_bytes: int = 20 << 20  # encoded image bytes per request
    image_max_count: int = 16  # images per request
    image_max_pixels: int = 1 << 24  # width x height per image
    generic_tools: bool = True  # tools for templates that cannot render them: the generic JSON format
    tool_call_shapes: str = "lenient"  # lenient | template: calls outside the template's markers (server/lenient_calls.py)
    faults: str = ""  # LOCALRUN_FAULTS (engine/faults.py): diagnostics and tests only
    native_on_cpu: bool = False  # auto without a CUDA GPU: the native engine for GGUF models it runs
    models: Path | None = None  # LOCALRUN_MODELS: the model library (None: LOCALRUN_HOME/models)
    noprune: bool = False  # LOCALRUN_NOPRUNE: keep unused blobs at start
    prompt_cache_disk: int = 4 << 30  # LOCALRUN_PROMPT_CACHE_DISK: bytes of the prompt cache on disk (0 = off)
    prompt_cache_min: int = 1024  # LOCALRUN_PROMPT_CACHE_MIN: prompt tokens to be saved there

    @property
    def prompt_cache_dir(self) -> Path:
        return self.home / "prompt-cache"

    @property
    def models_dir(self) -> Path:
        return self.models if self.models is not None else self.home / "models"

    @property
    def chats_dir(self) -> Path:
        return self.home / "chats"

    @property
    def responses_dir(self) -> Path:
        return self.home / "responses"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def base_url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def describe(self) -> list[tuple[str, str]]:
        """(variable, current value) pairs for `localrun serve --help` and logs."""
        values = {
            "LOCALRUN_HOME": str(self.home),
            "LOCALRUN_MODELS": str(self.models_dir),
            "LOCALRUN_NOPRUNE": "1" if self.noprune else "0",
            "LOCALRUN_HOST": f"{self.host}:{self.port}",
            "LOCALRUN_KEEP_ALIVE": "forever" if self.keep_alive is None else f"{self.keep_alive:g}s",
            "LOCALRUN_NUM_PARALLEL": str(self.num_parallel or "auto"),
            "LOCALRUN_MAX_LOADED_MODELS": str(self.max_loaded_models),
            "LOCALRUN_MAX_QUEUE": str(self.max_queue),
            "LOCALRUN_ORIGINS": ",".join(self.origins) or "(none)",
            "LOCALRUN_API_KEY": "(set)" if self.api_key else "(none)",
            "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND": "1" if self.allow_unauthenticated_bind else "0",
            "LOCALRUN_BACKEND": self.backend,
            "LOCALRUN_NATIVE_ON_CPU": "1" if self.native_on_cpu else "0",
            "LOCALRUN_CONTEXT_LENGTH": str(self.context_length),
            "LOCALRUN_GPU_MEMORY_FRACTION": f"{self.gpu_memory_fraction:g}",
            "LOCALRUN_KV_CACHE_TYPE": self.kv_cache_type,
            "LOCALRUN_WEIGHT_DTYPE": self.weight_dtype,
            "LOCALRUN_HOST_CACHE": describe_host_cache(self.host_cache),
            "LOCALRUN_PROMPT_CACHE_DISK": describe_host_cache(self.prompt_cache_disk),
            "LOCALRUN_PROMPT_CACHE_MIN": str(self.prompt_cache_min),
            "LOCALRUN_TENSOR_PARALLEL": str(self.tensor_parallel),
            "LOCALRUN_SPECULATIVE": self.speculative,
            "LOCALRUN_SPECULATIVE_TOKENS": str(self.speculative_tokens),
            "LOCALRUN_LLAMACPP_EXTRA_BUFFERS": self.llamacpp_extra_buffers,
            "LOCALRUN_LLAMA_SERVER": self.llama_server or "(built)",
            "LOCALRUN_IMAGE_URLS": "1" if self.image_urls else "0",
            "LOCALRUN_IMAGE_URL_TIMEOUT": f"{self.image_url_timeout:g}s",
            "LOCALRUN_IMAGE_MAX_BYTES": str(self.image_max_bytes),
            "LOCALRUN_IMAGE_MAX_COUNT": str(self.image_max_count),
            "LOCALRUN_IMAGE_MAX_PIXELS": str(self.image_max_pixels),
            "LOCALRUN_LOAD_TIMEOUT": "none" if self.load_timeout is None else f"{self.load_timeout:g}s",
            "LOCALRUN_SHUTDOWN_GRACE": f"{self.shutdown_grace:g}s",
            "LOCALRUN_HTTP_KEEPALIVE": f"{self.http_keepalive:g}s",
            "LOCALRUN_LOG_LEVEL": self.log_level,
            "LOCALRUN_TOOL_CALL_SHAPES": self.tool_call_shapes,
            "LOCALRUN_GENERIC_TOOLS": "on" if self.generic_tools else "off",
            "LOCALRUN_FAULTS": self.faults or "(none)",
        }
        return [(k, values[k]) for k in ENV_VARS]


KV_CACHE_TYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "int8", "q4_0")  # the engine parses all but q4_0 (llama.cpp's)
_KV_CACHE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "f16": "fp16", "half": "fp16", "float32": "fp32",
                     "f32": "fp32", "q8_0": "int8", "fp8_e4m3": "fp8"}


def parse_kv_cache_type(text: str | None) -> str:
    """LOCALRUN_KV_CACHE_TYPE's canonical name (Ollama's f16 / q8_0 are accepted)."""
    key = (text or "auto").strip().lower()
    key = _KV_CACHE_ALIASES.get(key, key)
    if key not in KV_CACHE_TYPES:
        raise ValueError(f"LOCALRUN_KV_CACHE_TYPE must be one of {', '.join(KV_CACHE_TYPES)} (int8 is q8_0 on llama.cpp; "
                         f"fp8 quantizes the native engine's KV cache, q4_0 llama.cpp's), got {text!r}")
    return key


MAX_SPECULATIVE_TOKENS = 32


def parse_speculative(text: str | None, name: str = "LOCALRUN_SPECULATIVE") -> tuple[str, str | None]:
    """(mode, draft model path) from 'off' | 'ngram' | 'draft:PATH'."""
    raw = (text or "off").strip()
    mode, _, path = raw.partition(":")
    mode = mode.strip().lower()
    if mode in ("off", "none", "0", "false", "no", ""):
        return "off", None
    if mode in ("ngram", "prompt_lookup", "lookup") and not path:
        return "ngram", None
    if mode == "draft" and path.strip():
        return "draft", path.strip()
    raise ValueError(f"{name} must be off, ngram or draft:PATH (a draft model's GGUF file or safetensors "
                     f"directory), got {text!r}")


def speculative_for_load(extra: dict) -> tuple[str, str | None, int]:
    """(mode, draft model path, tokens per step) for loading a model: its Modelfile's
    PARAMETER speculative / num_speculative_tokens, else LOCALRUN_SPECULATIVE(_TOKENS)."""
    s = settings()
    raw = extra.get("speculative")
    mode, draft = parse_speculative(s.speculative if raw is None else str(raw),
                                    "LOCALRUN_SPECULATIVE" if raw is None else "PARAMETER speculative")
    k = int(extra.get("num_speculative_tokens") or s.speculative_tokens)
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}")
    return mode, draft, k


FAULT_KINDS = ("kernel", "graph_capture", "kv_alloc", "step_oom", "native_load")


def parse_faults(text: str | None) -> list[tuple[str, str | None]]:
    """LOCALRUN_FAULTS: ``"kernel:rope, step_oom:2"`` -> ``[("kernel", "rope"), ("step_oom", "2")]``
    (localrun/engine/faults.py uses it); an unknown kind is an error."""
    out: list[tuple[str, str | None]] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, _, arg = item.partition(":")
        kind = kind.strip().lower()
        if kind not in FAULT_KINDS:
            raise ValueError(f"LOCALRUN_FAULTS: unknown fault {kind!r}; known: {', '.join(FAULT_KINDS)}")
        out.append((kind, arg.strip() or None))
    return out


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
def parse_size(name: str, raw: str | None, default: int, minimum: int = 1) -> int:
    """A byte count: '1048576', '20MiB', '5 MB' (the grammar of LOCALRUN_HOST_CACHE's sizes)."""
    if raw is None or raw.strip() == "":
        return default
    v = _size_bytes(raw.strip())
    if v is None:
        raise ValueError(f"{name} must be a size in bytes (like 20MiB or 5000000), got {raw!r}")
    if v < minimum:
        raise ValueError(f"{name} must be at least {minimum} bytes, got {raw!r}")
    return v


def _flag(name: str, raw: str | None) -> bool:
    v = (raw or "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {raw!r}")


def settings(env: dict[str, str] | None = None) -> Settings:
    """Read the settings from the environment (or from `env`). Raises ValueError with a
    message naming the variable when one is malformed."""
    e = os.environ if env is None else env
    home = Path(e["LOCALRUN_HOME"]).expanduser() if e.get("LOCALRUN_HOME") else _default_home()
    models = Path(e["LOCALRUN_MODELS"]).expanduser() if (e.get("LOCALRUN_MODELS") or "").strip() else None
    host, port = parse_hostport(e.get("LOCALRUN_HOST") or DEFAULT_HOST)
    try:
        keep_alive = parse_duration(e.get("LOCALRUN_KEEP_ALIVE"), default=300.0)
    except ValueError as exc:
        raise ValueError(f"LOCALRUN_KEEP_ALIVE: {exc}") from None
    backend = (e.get("LOCALRUN_BACKEND") or "auto").strip().lower().replace(".", "").replace("_", "").replace("-", "")
    if backend == "llamacpp" or backend == "llama":
        backend = "llamacpp"
    if backend not in ("auto", "llamacpp", "native"):
        raise ValueError(f"LOCALRUN_BACKEND must be auto, llamacpp or native, got {e.get('LOCALRUN_BACKEND')!r}")
    frac_raw = e.get("LOCALRUN_GPU_MEMORY_FRACTION") or "0.8"
    try:
        frac = float(frac_raw)
    except ValueError:
        raise ValueError(f"LOCALRUN_GPU_MEMORY_FRACTION must be a number, got {frac_raw!r}") from None
    if not 0.05 <= frac <= 0.99:
        raise ValueError("LOCALRUN_GPU_MEMORY_FRACTION must be between 0.05 and 0.99")
    log_level = (e.get("LOCALRUN_LOG_LEVEL") or "info").lower()
    if log_level not in ("debug", "info", "warning", "error"):
        raise ValueError(f"LOCALRUN_LOG_LEVEL must be debug, info, warning or error, got {log_level!r}")
    origins = tuple(o.strip() for o in (e.get("LOCALRUN_ORIGINS") or "").split(",") if o.strip())
    extra_buffers = (e.get("LOCALRUN_LLAMACPP_EXTRA_BUFFERS") or "auto").strip().lower()
    if extra_buffers not in ("auto", "on", "off"):
        raise ValueError(f"LOCALRUN_LLAMACPP_EXTRA_BUFFERS must be auto, on or off, got {extra_buffers!r}")
    weight_dtype = (e.get("LOCALRUN_WEIGHT_DTYPE") or "auto").strip().lower()
    if weight_dtype not in ("auto", "int8", "fp8"):
        raise ValueError(f"LOCALRUN_WEIGHT_DTYPE must be auto, int8 or fp8, got {e.get('LOCALRUN_WEIGHT_DTYPE')!r} "
                         "(auto keeps the model dtype; int8 halves the native engine's bf16 weights)")
    try:
        load_timeout = parse_duration(e.get("LOCALRUN_LOAD_TIMEOUT"), default=300.0)
    except ValueError as exc:
        raise ValueError(f"LOCALRUN_LOAD_TIMEOUT: {exc}") from None
    if load_timeout == 0:
        raise ValueError("LOCALRUN_LOAD_TIMEOUT must be positive (or -1 for no limit)")
    try:
        grace = parse_duration(e.get("LOCALRUN_SHUTDOWN_GRACE"), default=10.0)
    except ValueError as exc:
        raise ValueError(f"LOCALRUN_SHUTDOWN_GRACE: {exc}") from None
    if grace is None or grace > 3600:
        raise ValueError("LOCALRUN_SHUTDOWN_GRACE must be between 0 and 1h")
    try:
        http_keepalive = parse_duration(e.get("LOCALRUN_HTTP_KEEPALIVE"), default=120.0)
    except ValueError as exc:
        raise ValueError(f"LOCALRUN_HTTP_KEEPALIVE: {exc}") from None
    if http_keepalive is None or not 1 <= http_keepalive <= 86400:
        raise ValueError("LOCALRUN_HTTP_KEEPALIVE must be between 1s and 1d")
    tensor_parallel = _int("LOCALRUN_TENSOR_PARALLEL", e.get("LOCALRUN_TENSOR_PARALLEL"), 1, 1)
    if tensor_parallel > MAX_TENSOR_PARALLEL:
        raise ValueError(f"LOCALRUN_TENSOR_PARALLEL must be at most {MAX_TENSOR_PARALLEL}, got {tensor_parallel}")
    speculative = (e.get("LOCALRUN_SPECULATIVE") or "off").strip()
    mode, draft = parse_speculative(speculative)
    speculative = mode if draft is None else f"draft:{draft}"
    speculative_tokens = _int("LOCALRUN_SPECULATIVE_TOKENS", e.get("LOCALRUN_SPECULATIVE_TOKENS"), 4, 1)
    if speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"LOCALRUN_SPECULATIVE_TOKENS must be at most {MAX_SPECULATIVE_TOKENS}, got {speculative_tokens}")
    try:
        image_url_timeout = parse_duration(e.get("LOCALRUN_IMAGE_URL_TIMEOUT"), default=10.0)
    except ValueError as exc:
        raise ValueError(f"LOCALRUN_IMAGE_URL_TIMEOUT: {exc}") from None
    if image_url_timeout is None or not 0 < image_url_timeout <= 600:
        raise ValueError("LOCALRUN_IMAGE_URL_TIMEOUT must be more than 0 and at most 10m")
    raw_generic = e.get("LOCALRUN_GENERIC_TOOLS")
    generic_tools = _flag("LOCALRUN_GENERIC_TOOLS", raw_generic) if (raw_generic or "").strip() else True
    tool_call_shapes = (e.get("LOCALRUN_TOOL_CALL_SHAPES") or "lenient").strip().lower()
    if tool_call_shapes not in ("lenient", "template"):
        raise ValueError(f"LOCALRUN_TOOL_CALL_SHAPES must be lenient or template, got {tool_call_shapes!r}")
    parse_faults(e.get("LOCALRUN_FAULTS"))  # a misspelt fault is a start-up error, not a silently ignored one
    return Settings(
        home=home,
        host=host,
        port=port,
        keep_alive=keep_alive,
        num_parallel=_parallel(e.get("LOCALRUN_NUM_PARALLEL")),
        max_loaded_models=_int("LOCALRUN_MAX_LOADED_MODELS", e.get("LOCALRUN_MAX_LOADED_MODELS"), 3, 1),
        max_queue=_int("LOCALRUN_MAX_QUEUE", e.get("LOCALRUN_MAX_QUEUE"), 512, 0),
        origins=origins,
        api_key=e.get("LOCALRUN_API_KEY") or None,
        backend=backend,
        context_length=_int("LOCALRUN_CONTEXT_LENGTH", e.get("LOCALRUN_CONTEXT_LENGTH"), 4096, 16),
        gpu_memory_fraction=frac,
        log_level=log_level,
        kv_cache_type=parse_kv_cache_type(e.get("LOCALRUN_KV_CACHE_TYPE")),
        llamacpp_extra_buffers=extra_buffers,
        llama_server=(e.get("LOCALRUN_LLAMA_SERVER") or "").strip() or None,
        host_cache=parse_host_cache(e.get("LOCALRUN_HOST_CACHE")),
        load_timeout=load_timeout,
        shutdown_grace=grace,
        http_keepalive=http_keepalive,
        weight_dtype=weight_dtype,
        tensor_parallel=tensor_parallel,
        speculative=speculative,
        speculative_tokens=speculative_tokens,
        allow_unauthenticated_bind=_flag("LOCALRUN_ALLOW_UNAUTHENTICATED_BIND",
                                         e.get("LOCALRUN_ALLOW_UNAUTHENTICATED_BIND")),
        image_urls=_flag("LOCALRUN_IMAGE_URLS", e.get("LOCALRUN_IMAGE_URLS")),
        image_url_timeout=image_url_timeout,
        image_max_bytes=parse_size("LOCALRUN_IMAGE_MAX_BYTES", e.get("LOCALRUN_IMAGE_MAX_BYTES"), 20 << 20),
        image_max_count=_int("LOCALRUN_IMAGE_MAX_COUNT", e.get("LOCALRUN_IMAGE_MAX_COUNT"), 16, 1),
        image_max_pixels=_int("LOCALRUN_IMAGE_MAX_PIXELS", e.get("LOCALRUN_IMAGE_MAX_PIXELS"), 1 << 24, 1),
        generic_tools=generic_tools,
        tool_call_shapes=tool_call_shapes,
        faults=(e.get("LOCALRUN_FAULTS") or "").strip(),
        native_on_cpu=_flag("LOCALRUN_NATIVE_ON_CPU", e.get("LOCALRUN_NATIVE_ON_CPU")),
        models=models,
        noprune=_flag("LOCALRUN_NOPRUNE", e.get("LOCALRUN_NOPRUNE")),
        prompt_cache_disk=parse_size("LOCALRUN_PROMPT_CACHE_DISK", e.get("LOCALRUN_PROMPT_CACHE_DISK"), 4 << 30, 0),
        prompt_cache_min=_int("LOCALRUN_PROMPT_CACHE_MIN", e.get("LOCALRUN_PROMPT_CACHE_MIN"), 1024, 16),
    )


__all__ = ["Settings", "settings", "parse_duration", "parse_hostport", "parse_host_cache", "ENV_VARS", "DEFAULT_PORT", "DEFAULT_HOST"]
