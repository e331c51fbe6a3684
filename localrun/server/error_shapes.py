"""Error bodies in each API's own shape: Anthropic's, OpenAI's, Ollama's and llama-server's."""

from __future__ import annotations

import re

_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                     503: "overloaded_error", 529: "overloaded_error"}


_OVER_WINDOW = re.compile(r"^the prompt is (\d+) tokens but the context window is (\d+) tokens(?: \(num_ctx\))?;?\s*")


def anthropic_error(status: int, message: str, code: str = "") -> dict:
    """A prompt over the window reads as Anthropic words it, "prompt is too long: N tokens > M maximum":
    Claude Code and agent loops look for that phrase to compact the conversation and try again."""
    etype = _ANTHROPIC_ERRORS.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    if code == "context_length_exceeded":
        m = _OVER_WINDOW.match(message)
        message = (f"prompt is too long: {m[1]} tokens > {m[2]} maximum (the context window, num_ctx); "
                   f"{message[m.end():]}" if m else f"prompt is too long: {message}")
    return {"type": "error", "error": {"type": etype, "message": message}}


def llama_server_error(status: int, message: str, code: str = "") -> dict:
    """llama-server's error object (format_error_response); a prompt of N tokens over the window is its
    exceed_context_size_error with n_prompt_tokens and n_ctx (the llama.cpp web UI reads them)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}
    etype = kind.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    err: dict = {"code": status, "message": message, "type": etype}
    m = _OVER_WINDOW.match(message) if code == "context_length_exceeded" else None
    if m:  # (a prompt refused by its length in characters, before tokenizing, has no count to give: not this type)
        err.update(type="exceed_context_size_error", n_prompt_tokens=int(m[1]), n_ctx=int(m[2]))
    return {"error": err}


def error_body(path: str, status: int, message: str, code: str) -> dict:
    """Anthropic's error shape under /v1/messages, OpenAI's under the rest of /v1, Ollama's
    {"error": "..."} elsewhere."""
    if path.startswith("/v1/messages"):
        return anthropic_error(status, message, code)
    if path in ("/completion", "/completions", "/props", "/infill", "/tokenize", "/detokenize", "/rerank", "/reranking", "/v2/rerank", "/tokenizer_info",
                "/health"):
        return llama_server_error(status, message, code)
    if path.startswith("/v1"):
        etype = "invalid_request_error" if 400 <= status < 500 else "server_error"
        if status == 401:
            etype = "authentication_error"
        return {"error": {"message": message, "type": etype, "param": None, "code": code}}
    return {"error": message}
