"""The one small protocol every backend implements.

The daemon speaks only these types to a backend: it renders the chat template itself
(``localrun/templates/chat.py``), hands the backend a prompt string plus sampling
options, and reads back a stream of :class:`Chunk` objects. It never asks which
backend it holds, except to show :class:`BackendInfo` to users.

Where a backend lives: each loaded model runs in a runner process of its own
(``localrun.backends.runner.worker``); the daemon holds a :class:`~localrun.backends.runner.process.RemoteBackend`
that speaks this same protocol over a local socket. Every method that may block is
therefore async, in the runner (llama.cpp, the native engine) and in the daemon alike.

Concurrency: ``generate`` is an async generator. The daemon admits at most
``info.slots`` generations at once per loaded model (it owns the bounded wait queue).
Closing the generator early (client gone, ``aclose()``, task cancelled) must abort
the request inside the backend and free its memory (KV slots / pages) promptly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Protocol, runtime_checkable

from localrun.errors import InvalidRequest


@dataclass
class SamplingOptions:
    """Sampling and stopping options; Ollama's option names map 1:1 onto these."""

    max_tokens: int | None = None  # None: until EOS or the context window is full
    temperature: float = 0.8  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # 1.0 = off (llama.cpp-style multiplicative penalty)
    repeat_last_n: int = 64  # window for repeat/presence/frequency penalties; -1 = whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens (vLLM's meaning: an end token is sampled, then passed)
    # llama-server's ignore_eos (its routes set it with ignore_eos): the end-of-generation tokens are never sampled,
    # so the text is exactly max_tokens of text; llama.cpp bans them, the native engine does not (it passes them)
    ban_eog: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20
    # each prompt token's logprob (given the tokens before it) and this many alternatives; None: off.
    # A backend with info.supports_prompt_logprobs computes the whole prompt (no cached prefix: the
    # cache keeps no logits) and puts them on the first chunk (Chunk.prompt_logprobs). With it,
    # max_tokens 0 scores the prompt and generates nothing (OpenAI's echo, lm-eval's loglikelihood)
    prompt_logprobs: int | None = None
    # Structured output: a JSON schema (dict) constrains generation; json_mode alone
    # means "any valid JSON object". Backends that cannot constrain raise BackendError.
    json_schema: dict[str, Any] | None = None
    json_mode: bool = False
    # Other constraints (at most one of all of them per request): the whole output matches a regular
    # expression (Python's syntax, re.fullmatch), is one of these strings, or follows a llama.cpp
    # grammar (GBNF). vLLM's structured_outputs / guided_*, SGLang's regex / ebnf, llama-server's grammar
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    # token id -> bias added to its logit (OpenAI's logit_bias, -100..100; -100 bans the token)
    logit_bias: dict[int, float] | None = None

    def own_constraint(self) -> bool:
        """A regex, choices or a grammar of the request's own (llguidance runs them: structured/constraints.py)."""
        return self.regex is not None or self.choices is not None or self.grammar is not None

    def constraints(self) -> list[str]:
        """The output constraints set: json_schema / json_mode / regex / choices / grammar."""
        return [k for k, on in (("json_schema", self.json_schema is not None), ("json_mode", self.json_mode),
                                ("regex", self.regex is not None), ("choices", self.choices is not None),
                                ("grammar", self.grammar is not None)) if on]


# Where an image goes in a rendered prompt: llama.cpp's multimodal library (mtmd) puts each image's
# embeddings at its marker. The daemon renders image parts as this text; the runner finds them.
MEDIA_MARKER = "<__media__>"


# llama-server's default n_batch: its /infill layout cuts the prefix (3/4) and the suffix (1/4) to fit one batch
INFILL_BATCH = 2048


@dataclass
class Infill:
    prefix: str
    suffix: str
    extra: list[dict] = field(default_factory=list)  # [{"filename": str, "text": str}]


@dataclass
class GenerationRequest:
    prompt: str  # fully rendered (chat template already applied)
    options: SamplingOptions = field(default_factory=SamplingOptions)
    request_id: str = ""
    add_special: bool = False  # add BOS etc. when tokenizing (rendered templates carry their own)
    prompt_token_ids: list[int] | None = None  # when set, used instead of tokenizing `prompt`
    # Set (with prompt_token_ids None) when the daemon leaves tokenizing to the runner process, which
    # holds the tokenizer: it tokenizes `prompt`, checks it against this window (fit_window) and
    # reports the prompt's length on the stream's first chunk (Chunk.prompt_tokens). One round trip
    # to the runner instead of two (tokenize, then generate) before the first token.
    window: int | None = None
    # n > 1 on a backend with info.supports_groups: (group id, n, choice index). The n requests of
    # a group share the prompt's prefill (the native engine computes it once and forks).
    group: tuple[str, int, int] | None = None
    # encoded images (PNG, JPEG, ...), one for each MEDIA_MARKER in `prompt`, in order (a backend with
    # info.supports_images; the runner tokenizes such a prompt itself, image tokens included)
    images: list[bytes] | None = None
    # fill-in-the-middle (a backend with info.supports_infill): the code before and after the cursor
    # and other files' chunks; the backend lays the prompt out with the model's FIM tokens (as
    # llama-server's /infill does), `prompt` going after the prefix
    infill: "Infill | None" = None
    # the runner that tokenizes the prompt (window set) puts its ids on the first chunk (Chunk.prompt_token_ids)
    return_prompt_ids: bool = False
    # texts of special (control) tokens the output keeps as text: a tool-call format's markers
    # (Mistral's [TOOL_CALLS], gpt-oss's <|channel|>, ...), which detokenizing drops otherwise
    preserve: list[str] | None = None
    # a client's routing / cache hint (OpenAI's prompt_cache_key): requests with the same key prefer
    # the cached prefix (llama.cpp: the sequence) the key last used, and other traffic evicts it last
    cache_key: str | None = None


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it from)
    top: list[tuple[str, float]] = field(default_factory=list)
    # the token's bytes where they are not whole UTF-8 on their own (a byte-fallback token: `token` shows
    # U+FFFD there), and the same for each of `top` (None: all whole); OpenAI's `bytes` carry them
    raw: bytes | None = None
    top_raw: list[bytes | None] | None = None
    top_ids: list[int] | None = None  # the alternatives' token ids, where the backend gives them (llama-server's "id")

    @property
    def token_bytes(self) -> bytes:
        return self.raw if self.raw is not None else self.token.encode("utf-8")

    def top_bytes(self, k: int) -> bytes:
        raw = self.top_raw[k] if self.top_raw else None
        return raw if raw is not None else self.top[k][0].encode("utf-8")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache
    prompt_eval_seconds: float = 0.0  # time to first token, backend side
    eval_seconds: float = 0.0  # first token to last token

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Chunk:
    """A piece of a generation. The last chunk has finish_reason and usage set."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended it (finish_reason "stop")
    prompt_tokens: int | None = None  # on the first chunk when the runner tokenized the prompt (request.window)
    prompt_token_ids: list[int] | None = None  # on the first chunk of an infill request: the laid-out prompt
    cached_tokens: int | None = None  # on the first chunk, where the backend says: the prompt's tokens it reused
    # on the last chunk: its text's last cut_chars characters are the bytes after the output's last whole character
    # (llama-server's streams never send them: the chunks before held them back while the bytes ended inside one)
    cut_chars: int = 0
    # on the first chunk when options.prompt_logprobs is set: one per prompt token, in order (the first's
    # logprob None)
    prompt_logprobs: list[TokenLogprob] | None = None


def merge_chunks(a: Chunk, b: Chunk) -> Chunk:
    """Chunk a followed by chunk b as one (a slow consumer gets what piled up at once): text,
    tokens and logprobs joined; b's finish_reason, usage and stop_sequence (b may be the last)."""
    lps = (a.logprobs or []) + (b.logprobs or []) if (a.logprobs or b.logprobs) else None
    return Chunk(text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=lps,
                 finish_reason=b.finish_reason, usage=b.usage, stop_sequence=b.stop_sequence,
                 prompt_tokens=a.prompt_tokens if a.prompt_tokens is not None else b.prompt_tokens,
                 prompt_token_ids=a.prompt_token_ids if a.prompt_token_ids is not None else b.prompt_token_ids,
                 cached_tokens=a.cached_tokens if a.cached_tokens is not None else b.cached_tokens,
                 cut_chars=b.cut_chars,
                 prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


# Texts up to this many characters are tokenized on the caller's event loop (llama.cpp takes about
# 1 us a character, so 2 ms at most): cheaper than the hop to a worker thread and back for the
# prompts most requests bring. Longer ones go to a thread, so the loop never stalls for long.
INLINE_TOKENIZE_CHARS = 2048


CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for it (SDKs and LangChain look for it)


def check_token_ids(ids: list[int], n_vocab: int) -> None:
    """Token ids a client sent (detokenize, a prompt of token ids): each one of the model's `n_vocab`;
    else InvalidRequest. Checked by the backend, which knows the vocabulary: llama.cpp throws
    std::out_of_range for an id outside it (the runner dies) and llama_decode refuses the whole step."""
    try:
        if not ids or (min(ids) >= 0 and max(ids) < n_vocab):  # the common case, at C speed
            return
    except TypeError:  # not all numbers: named below
        pass
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < n_vocab)), None)
    if bad is not None:
        raise InvalidRequest(f"token {bad!r} is not in this model's vocabulary of {n_vocab} tokens (0 to {n_vocab - 1})")


def fit_window(n_prompt: int, window: int, max_tokens: int | None) -> int:
    """The max_tokens a prompt of `n_prompt` tokens gets in a `window`-token context (the room left,
    or less if asked); InvalidRequest when it is empty or does not fit. The one window check, made
    where the prompt was tokenized: the daemon, or the runner (GenerationRequest.window)."""
    if n_prompt <= 0:
        raise InvalidRequest("the prompt is empty")
    if n_prompt >= window:
        raise InvalidRequest(f"the prompt is {n_prompt} tokens but the context window is {window} tokens "
                             "(num_ctx); shorten the prompt or ask for a larger num_ctx", code=CONTEXT_EXCEEDED)
    room = window - n_prompt
    return room if max_tokens is None else min(max_tokens, room)


@dataclass
class BackendInfo:
    name: str  # "llama.cpp" | "native"
    device: str  # "CPU", "CUDA", "Metal"
    processor: str  # what `ps` shows, e.g. "100% GPU", "100% CPU", "48%/52% CPU/GPU"
    reason: str  # why this backend/device was chosen, in words
    context_length: int  # the window this load was made with (num_ctx)
    slots: int  # generations the daemon may run at once on this model
    size_bytes: int = 0  # memory held: weights + KV/context
    size_vram_bytes: int = 0
    supports_embeddings: bool = True
    supports_logprobs: bool = True
    supports_json_schema: bool = True
    # the longest text (in bytes) one token stands for; prompts longer than this x the window
    # are refused before tokenizing (0: unknown, no such check)
    max_token_bytes: int = 0
    # n > 1: the backend runs a request's choices as one group sharing the prompt's prefill
    # (GenerationRequest.group); the daemon then starts all n streams at once
    supports_groups: bool = False
    # where the layers run, in words: "CUDA: 31/31 layers", "Metal", "CPU" (llama.cpp; "" = device)
    placement: str = ""
    supports_logit_bias: bool = False
    # a vision projector is loaded (LoadSpec.extra["projector"]): prompts may carry images
    supports_images: bool = False
    # the vocabulary has fill-in-the-middle tokens (prefix, suffix, middle): requests may carry `infill`
    supports_infill: bool = False
    # the slower paths this load took, each with its reason ("decode_attention: torch reference
    # (Triton compile failed: ...)", "CUDA graphs off for batch 16: ..."); shown by ps and /api/ps.
    # A runner that falls back after loading sends the new list in an "info" update.
    fallbacks: list[str] = field(default_factory=list)
    # the KV cache's element type as loaded ("f16", "q8_0", "q4_0" on llama.cpp; "bf16", "int8", ...
    # on the native engine); "" = not reported
    kv_cache_type: str = ""
    # the most tokens one embeddings input may have (0: not reported)
    embed_window: int = 0
    # options.prompt_logprobs (and max_tokens 0: the prompt scored, nothing generated)
    supports_prompt_logprobs: bool = False
    # the vocabulary's begin- and end-of-text tokens as text ("": none); vLLM's /tokenizer_info reports them
    bos_token: str = ""
    eos_token: str = ""
    # a reranker: rerank() scores documents against a query (llamacpp.pooled)
    supports_rerank: bool = False


# the most tokens one input of an embedding model or a reranker may have (a query with a document, for one): its
# pooling context computes a whole input in one pass, attention scores for every pair of its tokens
POOLED_WINDOW = 2048


@dataclass
class LoadSpec:
    """What the daemon asks a backend to load (from the library's resolved model)."""

    name: str  # library name, e.g. "smollm2:135m"
    weights: Path  # a .gguf file, or a safetensors directory
    format: str  # "gguf" | "safetensors"
    num_ctx: int
    num_parallel: int = 1
    embedding: bool = False  # an embedding model or a reranker: it pools, it generates nothing
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific knobs (n_gpu_layers, dtype, ...)


@dataclass
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int  # for num_ctx x slots
    overhead_bytes: int
    kv_type: str = ""  # the KV cache's element type when the backend knows it (native: bf16, fp8, int8, ...)
    host_cache_bytes: int = 0  # host RAM beyond the total: the native prefix cache's host tier (at most)
    note: str = ""  # a remark the plan's detail carries (native gpt-oss: MXFP4 experts dequantised at load)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes


@runtime_checkable
class Backend(Protocol):
    """A loaded model. Create one with the backend module's ``load(spec) -> Backend``."""

    info: BackendInfo

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]: ...

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens written out (as llama-server's and vLLM's /detokenize);
        an id outside the vocabulary is an InvalidRequest (check_token_ids)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Async generator of chunks; closing it early aborts the request."""
        ...

    async def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        """One vector per text; an input longer than info.embed_window is an InvalidRequest, or with
        `truncate` its first embed_window tokens are embedded (Ollama's /api/embed default)."""
        ...

    # a backend whose info.supports_rerank is set also has
    #   async def rerank(self, query: str, documents: list[str], truncate: bool = False)
    #       -> tuple[list[list[float]], list[int]]
    # the classifier's outputs for each document against the query and each pair's tokens; a pair over the
    # window is an InvalidRequest, or with `truncate` its document is cut

    async def close(self) -> None:
        """Free everything. Called once, after in-flight generations ended or were aborted."""
        ...
