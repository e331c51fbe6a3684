"""The prompt a job renders to: the model's template over its messages, or a text prompt, and the checks on it.

The template runs in the sandbox (templates.chat.render_chat) with the Modelfile's SYSTEM and MESSAGE
history; a chat too long for any window and a prompt over the model's window get a 400 that says
what to change.
"""

from __future__ import annotations

import json
from typing import Any

from localrun.templates.chat import MAX_OUTPUT_CHARS, render_chat
from localrun.errors import InvalidRequest
from localrun.server import generic_tools
from localrun.server.job import Job
from localrun.server.loaded import Lease
from localrun.server.harmony import HARMONY_TOKENS, harmony_messages, harmony_tools, is_harmony
from localrun.server.tool_formats import learn as learn_tool_format


def uses_harmony(job: Job) -> bool:
    """The prompt was rendered by a harmony template (gpt-oss): a chat, or a templated /api/generate
    (not a raw prompt, whose output goes back as the model wrote it)."""
    return (job.messages is not None or not job.raw) and is_harmony(job.template or job.resolved.template)


def preserved_specials(job: Job) -> list[str] | None:
    """The tool-call markers of the model's template, kept as text in the output (tools only), and
    a harmony template's message framing (its channels are parsed from the text)."""
    if uses_harmony(job):
        return list(HARMONY_TOKENS)
    fmt = learn_tool_format(job.resolved.template) if job.tools and job.tool_format != generic_tools.NAME \
        else None
    return list(fmt.specials) or None if fmt is not None else None



def context_advice(exc: InvalidRequest, job: Job, lease: Lease) -> InvalidRequest:
    """A prompt over the window: say what the model's limit is and advice that can work (a
    larger num_ctx only when the model was trained for one)."""
    if "context window" not in exc.message or "num_ctx" not in exc.message:
        return exc
    train = getattr(getattr(job.resolved, "info", None), "context_length", None)
    head = exc.message.split(";")[0]
    if train and lease.num_ctx < train:
        # where this request's API takes a num_ctx (/v1 and Anthropic: a top-level extension; llama.cpp's: none)
        where = ("options.num_ctx, " if job.api.startswith("ollama.") else "" if job.api.startswith("llama.")
                 else "the request's top-level num_ctx, ")
        advice = (f"{job.resolved.name} was trained for {train} tokens: ask for a larger num_ctx (up to {train}: "
                  f"{where}PARAMETER num_ctx or LOCALRUN_CONTEXT_LENGTH), or shorten the prompt")
    else:
        advice = (f"{lease.num_ctx} tokens is {job.resolved.name}'s limit (the context it was trained for); shorten "
                  "the prompt (fewer or smaller tools, a shorter system prompt, fewer turns) or use a model with a "
                  "longer context")
    return InvalidRequest(f"{head}; {advice}", code=exc.code)



def _check_text_size(messages: list[dict]) -> None:
    """A chat whose text is more than a template may build (MAX_OUTPUT_CHARS, about a million tokens: more
    than any context window) is a 400 saying so, before the template runs into its own bound and is blamed."""
    n = 0
    for m in messages:
        n += len(m.get("content") or "") if isinstance(m.get("content"), str) else 0
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            n += len(args) if isinstance(args, str) else len(json.dumps(args)) if args is not None else 0
    if n > MAX_OUTPUT_CHARS:
        raise InvalidRequest(f"the messages hold {n:,} characters of text; a prompt may hold at most "
                             f"{MAX_OUTPUT_CHARS:,} (about a million tokens, more than any context window): "
                             "shorten the conversation, or send the text in parts")


def render_prompt(job: Job) -> str:
    """The prompt text the model sees (runs on a worker thread: templates can be slow)."""
    r = job.resolved
    extra: dict[str, Any] = {}
    if job.think is not None:
        extra["enable_thinking"] = job.think  # Qwen3's switch; templates that lack it ignore it
    if job.effort is not None:
        extra["reasoning_effort"] = job.effort  # gpt-oss's "Reasoning: high"
    if job.messages is not None:
        msgs = list(job.messages)
        _check_text_size(msgs)
        harmony = is_harmony(r.template)
        if harmony:  # gpt-oss's template reads one call a turn, never a None content or description
            msgs = harmony_messages(msgs)
        history = [dict(m) for m in (r.messages or [])]
        if r.system and not any(m["role"] == "system" for m in msgs):
            history.insert(0, {"role": "system", "content": r.system})
        tools = None if job.tool_format == generic_tools.NAME else (job.tools or None)
        tools = harmony_tools(tools) if harmony else tools
        if tools:
            learn_tool_format(r.template)  # learned here, off the event loop (cached per template)
        if job.continue_final:
            rendered = render_chat(r.template, history + msgs, add_generation_prompt=False, tools=tools, **extra)
            return _cut_after_final(rendered, msgs[-1])
        return render_chat(r.template, history + msgs, add_generation_prompt=True, tools=tools, **extra)
    assert job.prompt is not None
    before = job.context_text or ""
    if job.raw:
        return before + job.prompt
    msgs = []
    system = job.system if job.system is not None else r.system
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": job.prompt})
    return before + render_chat(job.template or r.template, msgs, add_generation_prompt=True, **extra)


def _cut_after_final(rendered: str, final: dict) -> str:
    """The rendered chat up to the end of its last (assistant) message's text, so that the model goes
    on writing it (transformers' continue_final_message does the same): the text as given, else as
    the template trimmed it; a 400 when the template does not write it at all."""
    if final.get("role") != "assistant":
        raise InvalidRequest("only an assistant message can be continued: the last message is the "
                             f"{final.get('role')}'s")
    text = final.get("content") or ""
    if not text.strip():
        raise InvalidRequest("the last (assistant) message to continue is empty: drop it, or give it the "
                             "text the answer should start with")
    for cut in (text, text.strip(), text.rstrip()):
        i = rendered.rfind(cut)
        if i >= 0:
            return rendered[:i + len(cut)]
    raise InvalidRequest("this model's chat template does not write the last assistant message as it was "
                         "given, so the answer cannot continue it; end with a user message instead")



__all__ = ["render_prompt", "uses_harmony", "preserved_specials", "context_advice"]
