"""What a translator asks the generation service for (a Job), and the typed events it gets back.

Every API turns its JSON into a :class:`Job`; a started generation answers with :class:`Delta`,
:class:`ToolCalls` and :class:`Done` events (an :data:`Event`), or, collected, with one
:class:`FinishedChoice` per choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from localrun.backends.base import Infill, SamplingOptions, TokenLogprob, Usage
from localrun.server.manager import DEFAULT


@dataclass
class Job:
    """What a translator asks for, already validated field by field."""

    resolved: Any  # the library's ResolvedModel
    options: SamplingOptions
    messages: list[dict] | None = None  # chat: normalized messages, rendered with the model's template
    prompt: str | None = None  # text: as given when `raw`, else wrapped as one user turn
    raw: bool = True
    system: str | None = None  # text jobs: a system prompt over the Modelfile's SYSTEM
    template: str | None = None  # text jobs: a template over the model's
    tools: list[dict] | None = None  # OpenAI-style tool definitions rendered into the prompt
    think: bool | None = None  # None: as the template does; False: ask it not to think; True: must think
    # how hard to think ("low", "medium", "high"): gpt-oss's reasoning_effort, for templates that take it
    # (the rest ignore it); Ollama's think levels, OpenAI's reasoning_effort, the Responses API's effort
    effort: str | None = None
    num_ctx: int | None = None
    keep_alive: Any = DEFAULT
    n: int = 1
    add_special: bool = True
    api: str = "openai"  # for metrics and logs
    # images (server.images.ImageInput), in the order of the MEDIA_MARKERs the rendered prompt holds:
    # a translator puts a marker in the message text (or prompt) where each image goes
    images: list | None = None
    # fill in the middle: the code before and after the cursor (and other files' chunks); `prompt` (raw)
    # goes after the prefix, as llama-server's /infill takes it. The backend lays it out with the
    # model's FIM tokens; a model without them is a 400.
    infill: Infill | None = None
    prompt_ids: bool = False  # keep the prompt's token ids (Generation.prompt_ids: Ollama's `context`)
    tool_format: str | None = None  # "generic": the template cannot render tools (server/generic_tools.py)
    cache_key: str | None = None  # the client's prompt_cache_key: a routing / prefix-cache hint for the backend
    # a chat longer than the window drops its oldest turns (Ollama's /api/chat `truncate`, on by default
    # there): system messages and the last user turn stay; see GenerationService._fit_messages
    truncate: bool = False
    # the last message is the assistant's and the model continues it (Anthropic's prefill, vLLM's
    # continue_final_message): the chat is rendered without a new turn and cut after that message's text
    continue_final: bool = False
    # the prompt as token ids (OpenAI completions' other form): neither rendered nor tokenized; the
    # backend checks them against its vocabulary
    token_prompt: list[int] | None = None
    # Ollama's /api/generate `context` (an earlier answer's token ids), as text: it goes before the prompt,
    # as Ollama puts it (render_prompt)
    context_text: str | None = None


@dataclass
class Delta:
    index: int
    content: str = ""
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)
    cut_chars: int = 0  # the last chunk's Chunk.cut_chars: content's last characters a llama-server stream leaves out
    prompt_logprobs: list[TokenLogprob] | None = None  # on a choice's first Delta when options.prompt_logprobs is set


@dataclass
class ToolCalls:
    index: int
    calls: list[dict]  # [{"id", "name", "arguments": JSON string}]


@dataclass
class Done:
    index: int
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it, when one did


Event = Delta | ToolCalls | Done


@dataclass
class FinishedChoice:
    """One finished choice, for non-streamed answers."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # options.prompt_logprobs: one per prompt token


__all__ = ["Job", "Delta", "ToolCalls", "Done", "Event", "FinishedChoice"]
