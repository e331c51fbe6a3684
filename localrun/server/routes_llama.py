"""llama-server-shaped routes: ``POST /completion`` (and ``/completions``: llama-server's own completions, as
Continue's llama.cpp provider, SillyTavern and scripts call them), ``POST /infill`` (fill in the middle, as
llama.vscode and llama.vim call it), ``GET /props``, ``GET /health``, ``POST /tokenize`` / ``POST /detokenize`` in both llama-server's and vLLM's shapes, and ``POST /v1/rerank``
(with ``/rerank``, ``/v2/rerank``, ``/reranking``) in the shape Jina, Cohere, vLLM and llama-server share, and TEI's.

A translator only: the body becomes a :class:`Job` with an :class:`Infill` (the backend lays the prompt out
with the model's FIM tokens exactly as llama-server's format_prompt_infill does), the events become
llama-server's answer: ``content``, ``stop``, ``tokens_predicted``, ``tokens_evaluated``, ``stop_type``,
``timings``... (one JSON object, or SSE ``data:`` lines ending with the ``stop: true`` object, no
``[DONE]``, as llama-server streams its own completions). Errors use llama-server's shape:
``{"error": {"code", "message", "type"}}``.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, Response

from localrun import __version__
from localrun.backends.base import Infill, Usage
from localrun.templates.go import is_go_template
from localrun.errors import InvalidRequest, LocalrunError
from localrun.library.modelfile import PARAMETERS
from localrun.server import params as p
from localrun.server.error_shapes import llama_server_error as error_shape
from localrun.server.disconnect import until_disconnected
from localrun.server.generation import Generation
from localrun.server.job import Delta, Done, Job
from localrun.server.llama_limits import bounded
from localrun.server.images import take_images
from localrun.server.routes_openai import BATCH_CONCURRENCY, gather_bounded
from localrun.server.state import State, generation_response, json_body

router = APIRouter()

async def _model(st: State, body: dict, hint: str = "e.g. a code model with fill-in-the-middle tokens",
                 able: str | None = None):
    """The model named in the body. Without one (llama-server serves a single model, so its clients send
    none): the loaded model used last, or with `able` (a capability: "insert") the one used last of those
    that have it (an editor's completions beside a chat model); with none loaded, the one model in the
    library."""
    name = body.get("model")
    if name is not None and name != "":
        return await st.resolve(p.get_str(body, "model", required=True))
    loaded = sorted((r for r in st.manager.runners.values() if not r.orphan), key=lambda r: -r.last_used)
    if able is not None and len(loaded) > 1:
        from localrun.library.capabilities import model_capabilities

        loaded = [r for r in loaded if able in model_capabilities(r.resolved)] or loaded
    if loaded:
        return await st.resolve(loaded[0].name)
    models = await st.list_models()
    if len(models) == 1:
        return await st.resolve(models[0].name)
    raise InvalidRequest(f"'model' is required: no model is loaded and {len(models)} are in the library (name one, "
                         f"{hint})")


def _options(body: dict, resolved: Any):
    opts, num_ctx = p.base_options(resolved)
    # n_predict 0: the prompt evaluated into the cache, nothing generated (llama.vscode's and llama.vim's
    # warm-up requests as a file is opened or saved)
    n_predict = p.get_int(body, "n_predict", -1, 1 << 20)
    if n_predict is None:  # llama-server takes OpenAI's name too
        n_predict = p.get_int(body, "max_tokens", -1, 1 << 20)
    if n_predict is not None:
        opts.max_tokens = None if n_predict < 0 else n_predict
    for key in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        v = p.get_float(body, key, *PARAMETERS[key][1:])  # (the Modelfile's ranges: llama-server caps none)
        if v is not None:
            setattr(opts, key, v)
    if (v := p.get_int(body, "top_k", *PARAMETERS["top_k"][1:])) is not None:
        opts.top_k = v
    if (v := p.get_int(body, "repeat_last_n", *PARAMETERS["repeat_last_n"][1:])) is not None:
        opts.repeat_last_n = v
    if (v := p.get_int(body, "seed")) is not None:
        opts.seed = v if v >= 0 else None  # llama-server: -1 is a random seed
    if body.get("stop") is not None:
        opts.stop = p.get_stop(body["stop"])
    opts.ignore_eos = opts.ban_eog = p.get_bool(body, "ignore_eos")  # llama-server's: end tokens never sampled
    return opts, num_ctx


def _fields(paths: Any, obj: dict) -> dict:
    """llama-server's response_fields: only the named (a/b nested) values, keyed by their paths."""
    if not isinstance(paths, list) or not paths:
        return obj
    out = {}
    for path in paths:
        if not isinstance(path, str):
            continue
        cur: Any = obj
        for k in path.split("/"):
            if isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                break
        else:
            out[path] = cur
    return out


def _timings(u: Usage) -> dict:
    prompt_n = max(0, u.prompt_tokens - u.cached_tokens)
    prompt_ms, predicted_ms = u.prompt_eval_seconds * 1e3, u.eval_seconds * 1e3
    return {"cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": u.completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / u.completion_tokens if u.completion_tokens else 0.0,
            "predicted_per_second": 1e3 * u.completion_tokens / predicted_ms if predicted_ms > 0 else 0.0}


def _stop_type(reason: str, stop_sequence: str | None) -> str:
    if reason == "length":
        return "limit"
    if stop_sequence:
        return "word"
    return "eos" if reason == "stop" else "none"


def _settings(opts: Any, stream: bool, n_probs: int = 0) -> dict:
    """llama-server's generation_settings: the sampling a request ran with."""
    return {"n_predict": -1 if opts.max_tokens is None else opts.max_tokens, "seed": -1 if opts.seed is None else opts.seed,
            "temperature": opts.temperature, "top_k": opts.top_k, "top_p": opts.top_p, "min_p": opts.min_p,
            "repeat_last_n": opts.repeat_last_n, "repeat_penalty": opts.repeat_penalty,
            "presence_penalty": opts.presence_penalty, "frequency_penalty": opts.frequency_penalty,
            "stop": list(opts.stop), "ignore_eos": opts.ignore_eos, "n_probs": n_probs, "stream": stream,
            "grammar": opts.grammar or "",
            "logit_bias": [[t, b] for t, b in (opts.logit_bias or {}).items()]}


def _final(gen: Generation, prompt: Any, content: str, reason: str, stop_sequence: str | None, settings: dict, *,
           index: int = 0, tokens: list[int] | None = None) -> dict:
    """llama-server's last object of a completion (to_json_non_oaicompat): the text (all of it, or "" at the
    end of a stream), why it stopped, the counts and the timings."""
    return _result(gen.model, gen.usage, gen.lease.num_ctx, prompt, content, reason, stop_sequence, settings,
                   index=index, tokens=tokens)


def _result(model: str, u: Usage, window: int, prompt: Any, content: str, reason: str, stop_sequence: str | None,
            settings: dict, *, index: int = 0, tokens: list[int] | None = None) -> dict:
    """_final's object from a model's name, usage and window (an empty prompt's answer has no generation)."""
    return {"index": index, "content": content, "tokens": tokens or [], "id_slot": -1, "stop": True,
            "model": model, "tokens_predicted": u.completion_tokens, "tokens_evaluated": u.prompt_tokens,
            "generation_settings": settings, "prompt": prompt, "has_new_line": "\n" in content,
            "truncated": reason == "length" and u.prompt_tokens + u.completion_tokens >= window,
            "stop_type": _stop_type(reason, stop_sequence), "stopping_word": stop_sequence or "",
            "tokens_cached": u.prompt_tokens + u.completion_tokens, "timings": _timings(u)}


def _probs(lps: list, ids: list[int]) -> list[dict]:
    """llama-server's completion_probabilities: each generated token's id, text, bytes and log-probability, and
    its n_probs most likely alternatives (id, text, bytes, log-probability)."""
    def one(text: str, raw: bytes, lp: float | None) -> dict:
        return {"token": text, "bytes": list(raw), "logprob": lp if lp is not None else -3.4028234663852886e38}

    out = []
    for k, x in enumerate(lps):
        top = [({"id": x.top_ids[j]} if x.top_ids else {}) | one(t, x.top_bytes(j), lp) for j, (t, lp) in enumerate(x.top)]
        out.append({"id": ids[k] if k < len(ids) else -1, **one(x.token, x.token_bytes, x.logprob), "top_logprobs": top})
    return out


def _data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _stream(gen: Generation, t_max: int | None, last: Any, n_probs: int = 0, n_indent: int | None = None):
    """A completion streamed as llama-server streams it: a ``data:`` object a chunk (its text, token ids,
    counts, and with n_probs its tokens' probabilities), then ``last(finish_reason, stop_sequence)``'s object
    (``stop: true``), no ``[DONE]``."""
    async def produce() -> AsyncIterator[bytes]:
        n, new_line = 0, False
        async for ev in bounded(gen, t_max, n_indent):
            if isinstance(ev, Delta) and (ev.content or ev.token_ids):
                n += len(ev.token_ids)
                # llama-server's stream never sends the bytes after the output's last whole character
                content = ev.content[:len(ev.content) - min(ev.cut_chars, len(ev.content))]
                new_line = new_line or "\n" in content
                if content or (n_probs and ev.logprobs):
                    out = {"index": 0, "content": content, "tokens": ev.token_ids, "stop": False, "id_slot": -1,
                           "tokens_predicted": n, "tokens_evaluated": gen.prompt_tokens}
                    if n_probs and ev.logprobs:
                        out["completion_probabilities"] = _probs(ev.logprobs, ev.token_ids)
                    yield _data(out)
            elif isinstance(ev, Done):
                out = last(ev.finish_reason, ev.stop_sequence)
                if "has_new_line" in out:
                    out["has_new_line"] = new_line
                yield _data(out)

    def failed(exc: Exception) -> list[bytes]:
        if not isinstance(exc, LocalrunError):
            exc = LocalrunError(f"internal error: {type(exc).__name__}")
        return [_data(error_shape(exc.status, exc.public_message, exc.code))]

    return generation_response(gen, produce, failed)


@router.post("/infill")
async def infill(request: Request):
    st: State = request.app.state.lr
    body = await json_body(request)
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise InvalidRequest('"prompt" must be a string')
    for key in ("input_prefix", "input_suffix"):
        if key not in body:
            raise InvalidRequest(f'"{key}" is required')
        if not isinstance(body[key], str):
            raise InvalidRequest(f'"{key}" must be a string')
    extra = p.infill_extra(body.get("input_extra"))
    stream = p.get_bool(body, "stream")
    resolved = await _model(st, body, able="insert")
    opts, num_ctx = _options(body, resolved)
    fields = body.get("response_fields")
    t_max = p.get_int(body, "t_max_predict_ms", 0, 1 << 40) or None
    n_indent = p.get_int(body, "n_indent", 0, 1 << 20) or None  # llama-server's indentation limit
    job = Job(resolved, opts, prompt=prompt, raw=True, num_ctx=num_ctx, keep_alive=st.keep_alive(body),
              api="llama.infill", infill=Infill(prefix=body["input_prefix"], suffix=body["input_suffix"], extra=extra))

    settings = _settings(opts, stream)

    def final(gen: Generation, content: str, reason: str, stop_sequence: str | None) -> dict:
        return _final(gen, prompt, content, reason, stop_sequence, settings)

    if not stream:
        async def run():
            gen = await st.generation.start(job)
            parts: list[str] = []
            done = None
            try:
                async for ev in bounded(gen, t_max, n_indent):
                    if isinstance(ev, Delta):
                        parts.append(ev.content)
                    else:
                        done = ev
            finally:
                await gen.release()
            reason, word = (done.finish_reason, done.stop_sequence) if done is not None else ("stop", None)
            return _fields(fields, final(gen, "".join(parts), reason, word))

        return await until_disconnected(request, run())

    gen = await until_disconnected(request, st.generation.start(job))
    return _stream(gen, t_max, lambda *a: _fields(fields, final(gen, "", *a)), n_indent=n_indent)


# -- llama-server's own completions ------------------------------------------------------------------
MAX_COMPLETION_PROMPTS = 64  # prompts one /completion request may carry (each its own answer)


def _completion_prompts(value: Any) -> list[str | list[int]]:
    """/completion's `prompt`: a string, an array of token ids, or an array of those (one answer each).
    llama-server also takes one prompt mixing strings and ids; that is a 400 here, with what to send."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest('"prompt" must be a string, an array of token ids, or an array of those')
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [p.token_ids(value, "prompt")]
    if not all(isinstance(x, (str, list)) for x in value):
        raise InvalidRequest('"prompt" mixes text and token ids: send the text as a string, or the whole prompt as '
                             'token ids (/tokenize gives them)')
    if len(value) > MAX_COMPLETION_PROMPTS:
        raise InvalidRequest(f'"prompt" holds {len(value)} prompts; at most {MAX_COMPLETION_PROMPTS} (send them in '
                             'several requests)')
    return [x if isinstance(x, str) else p.token_ids(x, f"prompt[{i}]") for i, x in enumerate(value)]


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request):
    """llama-server's completion: the prompt as it is (its special tokens read, the model's BOS put first), the
    answer as llama-server gives it (``content``, ``stop_type``, ``timings``, ``completion_probabilities`` with
    ``n_probs``...); with several prompts, an array of those; streamed, its ``data:`` lines."""
    st: State = request.app.state.lr
    body = await json_body(request)
    if "prompt" not in body:
        raise InvalidRequest('"prompt" is required')
    prompts = _completion_prompts(body["prompt"])
    stream = p.get_bool(body, "stream")
    if stream and len(prompts) > 1:
        raise InvalidRequest(f"a stream takes one prompt; this request has {len(prompts)}: send them without "
                             '"stream", or as separate requests')
    if p.get_bool(body, "post_sampling_probs"):
        raise InvalidRequest('"post_sampling_probs" is not supported: "n_probs" gives each token\'s log-probability '
                             "under the model, before sampling")
    resolved = await _model(st, body, "the one to complete with")
    opts, num_ctx = _options(body, resolved)
    opts.logit_bias = _logit_bias(body.get("logit_bias"))
    p.apply_structured(opts, body)  # llama-server's grammar and json_schema (one of them)
    n_probs = p.get_int(body, "n_probs", 0, p.MAX_TOP_LOGPROBS, default=0)
    if n_probs:
        opts.logprobs, opts.top_logprobs = True, n_probs
    fields = body.get("response_fields")
    t_max = p.get_int(body, "t_max_predict_ms", 0, 1 << 40) or None
    n_indent = p.get_int(body, "n_indent", 0, 1 << 20) or None  # llama-server's indentation limit
    want_tokens = p.get_bool(body, "return_tokens")
    settings = _settings(opts, stream, n_probs)

    def job_for(x: str | list[int]) -> Job:
        ids = x if isinstance(x, list) else None
        return Job(resolved, replace(opts), prompt="" if ids is not None else x, raw=True, num_ctx=num_ctx,
                   keep_alive=st.keep_alive(body), api="llama.completion", token_prompt=ids)

    async def shown(x: str | list[int]) -> str:
        """The prompt as the answer shows it: text (token ids detokenized, as llama-server shows them)."""
        return x if isinstance(x, str) else await st.generation.detokenize(resolved, x, keep_alive=st.keep_alive(body))

    def empty(k: int) -> dict:
        """An empty prompt: nothing to evaluate, nothing generated (llama-server's answer for a model without BOS;
        the model is loaded, as a probe expects)."""
        out = _result(resolved.name, Usage(), 0, "", "", "none", None, settings, index=k)
        return _fields(fields, {**out, "completion_probabilities": []} if n_probs else out)

    if stream:
        if prompts[0] == "":
            await until_disconnected(request, st.generation.tokenizer(resolved, keep_alive=st.keep_alive(body)))
            return Response(_data(empty(0)), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text = await until_disconnected(request, shown(prompts[0]))
        gen = await until_disconnected(request, st.generation.start(job_for(prompts[0])))
        return _stream(gen, t_max, lambda *a: _fields(fields, _final(gen, text, "", *a, settings)), n_probs, n_indent)

    async def one(k: int, x: str | list[int]) -> dict:
        if x == "":
            await st.generation.tokenizer(resolved, keep_alive=st.keep_alive(body))
            return empty(k)
        text = await shown(x)
        gen = await st.generation.start(job_for(x))
        parts: list[str] = []
        ids: list[int] = []
        lps: list = []
        done = None
        try:
            async for ev in bounded(gen, t_max, n_indent):
                if isinstance(ev, Delta):
                    parts.append(ev.content)
                    ids += ev.token_ids
                    lps += ev.logprobs or []
                else:
                    done = ev
        finally:
            await gen.release()
        reason, word = (done.finish_reason, done.stop_sequence) if done is not None else ("stop", None)
        out = _final(gen, text, "".join(parts), reason, word, settings, index=k, tokens=ids if want_tokens else [])
        if n_probs:
            out["completion_probabilities"] = _probs(lps, ids)
        return _fields(fields, out)

    calls = [lambda k=k, x=x: one(k, x) for k, x in enumerate(prompts)]
    results = await until_disconnected(request, gather_bounded(calls, BATCH_CONCURRENCY))
    return results[0] if len(results) == 1 else results


def _logit_bias(value: Any) -> dict[int, float] | None:
    """llama-server's logit_bias: ``[[token id, bias], ...]`` (a bias of ``false``: the token never comes) or
    OpenAI's ``{"id": bias}``. (Token text in place of an id, which llama-server also takes, is a 400.)"""
    if value is None or value == [] or value == {}:
        return None
    if isinstance(value, dict):
        return p.get_logit_bias({"logit_bias": value})
    if not isinstance(value, list) or len(value) > p.MAX_LOGIT_BIAS:
        raise InvalidRequest(f'"logit_bias" must be an array of at most {p.MAX_LOGIT_BIAS} [token id, bias] pairs')
    out: dict[int, float] = {}
    for pair in value:
        ok = isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool)
        bias = pair[1] if ok else None
        if bias is False:
            bias = -100.0
        if not ok or isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidRequest('"logit_bias" entries must be [token id, bias] with a bias from -100 to 100 (or '
                                 'false: never)')
        out[pair[0]] = float(bias)
    return out


@router.get("/props")
async def props(request: Request):
    """llama-server's server properties, for the model ``?model=`` names (else the loaded one used last, else the
    one in the library; it is loaded): the context a sequence gets, the parallel sequences, the chat template, BOS/EOS,
    whether it takes images."""
    st: State = request.app.state.lr
    resolved = await _model(st, {"model": request.query_params.get("model")}, "with ?model=")
    bos, eos, window = await until_disconnected(request, st.generation.tokenizer(resolved))
    from localrun.library.capabilities import model_capabilities

    runner = st.manager.runners.get(resolved.name)
    slots = (runner.info.slots if runner is not None else None) or 1
    opts, _ = p.base_options(resolved)
    template = resolved.template if resolved.template and not is_go_template(resolved.template) else ""
    return {"default_generation_settings": {"params": _settings(opts, False), "n_ctx": window},
            "total_slots": slots, "model_alias": resolved.name, "model_path": resolved.name,
            "modalities": {"vision": "vision" in model_capabilities(resolved), "audio": False},
            "chat_template": template, "bos_token": bos or "", "eos_token": eos or "",
            "build_info": f"localrun {__version__}", "is_sleeping": False}


@router.get("/health")
async def health():
    """llama-server's readiness probe (editor plugins and proxies poll it): the daemon answers, so it is ok (it
    loads models on use)."""
    return {"status": "ok"}


# -- tokens ---------------------------------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(request: Request):
    """llama-server's ``{"content", "add_special"}`` and vLLM's ``{"prompt", "add_special_tokens"}`` or
    ``{"messages", "tools"}`` (rendered by the model's chat template, as a chat completion's prompt is):
    ``{"tokens", "count", "max_model_len"}``, the ids the model would see and the window they run in."""
    st: State = request.app.state.lr
    body = await json_body(request)
    given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequest("send one of 'content' (llama-server), 'prompt' or 'messages' (vLLM): the text or chat "
                             "to tokenize" if not given else f"send one of 'content', 'prompt' and 'messages', not "
                             f"{' and '.join(repr(k) for k in given)}")
    if p.get_bool(body, "with_pieces"):
        raise InvalidRequest("'with_pieces' is not supported: detokenize the ids with /detokenize")
    resolved = await _model(st, body, "the one whose tokens you want")
    opts, num_ctx = p.base_options(resolved)
    key = given[0]
    if key == "messages":
        messages = p.normalize_messages(body["messages"])
        tools = p.check_tools(body.get("tools"), resolved.template)
        if body.get("add_generation_prompt") is False:
            raise InvalidRequest("'add_generation_prompt': false is not supported: the prompt is rendered as a chat "
                                 "completion's, with the assistant's turn opened")
        job = Job(resolved, opts, messages=messages, tools=tools, num_ctx=num_ctx, keep_alive=st.keep_alive(body),
                  api="tokenize", images=take_images(messages))
        if body.get("add_special_tokens") is not None:
            job.add_special = p.get_bool(body, "add_special_tokens")
    else:
        text = body[key]
        if not isinstance(text, str):
            raise InvalidRequest(f"'{key}' must be a string")
        # llama-server adds no BOS unless asked (add_special); vLLM adds it unless told not to
        special = p.get_bool(body, "add_special") if key == "content" else p.get_bool(body, "add_special_tokens", True)
        job = Job(resolved, opts, prompt=text, raw=True, num_ctx=num_ctx, keep_alive=st.keep_alive(body),
                  api="tokenize", add_special=special)
    ids, window = await until_disconnected(request, st.generation.tokenize(job))
    return {"tokens": ids, "count": len(ids), "max_model_len": window, "model": resolved.name}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """vLLM's tokenizer facts (lm-eval's remote tokenizer reads them, then tokenizes with /tokenize): the
    begin- and end-of-text tokens as text, the chat template (a Jinja one: clients render it; none for an
    Ollama template), the window. ``?model=`` names the model (without it: the one loaded, else the one in
    the library)."""
    st: State = request.app.state.lr
    resolved = await _model(st, {"model": request.query_params.get("model")}, "with ?model=")
    bos, eos, window = await until_disconnected(request, st.generation.tokenizer(resolved))
    template = resolved.template
    if is_go_template(template):  # clients render chat_template with Jinja (lm-eval's apply_chat_template)
        template = None
    return {"model": resolved.name, "bos_token": bos or None, "eos_token": eos or None, "pad_token": None,
            "chat_template": template, "model_max_length": window}


@router.post("/detokenize")
async def detokenize(request: Request):
    """llama-server's and vLLM's ``{"tokens": [ids]}``: ``{"content"}`` (llama-server) and ``{"prompt"}``
    (vLLM), the same text."""
    st: State = request.app.state.lr
    body = await json_body(request)
    ids = p.token_ids(body.get("tokens"), "tokens")
    resolved = await _model(st, body, "the one whose tokens these are")
    text = await until_disconnected(request, st.generation.detokenize(resolved, ids, keep_alive=st.keep_alive(body)))
    return {"content": text, "prompt": text, "model": resolved.name}


# -- reranking ------------------------------------------------------------------------------------
MAX_DOCUMENTS = 1024  # documents one rerank request may score


def _documents(body: dict) -> tuple[list[str], bool]:
    """The documents (strings, or objects with a "text": Jina's and Cohere's shapes), and whether the
    request is TEI's (its key is "texts")."""
    tei = "texts" in body and "documents" not in body
    key = "texts" if tei else "documents"
    docs = body.get(key)
    if not isinstance(docs, list) or not docs:
        raise InvalidRequest(f"'{key}' must be a non-empty array of strings")
    if len(docs) > MAX_DOCUMENTS:
        raise InvalidRequest(f"'{key}' holds {len(docs)} documents; the limit is {MAX_DOCUMENTS} (send them in "
                             "several requests)")
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise InvalidRequest(f"'{key}[{i}]' must be a string (or an object with a \"text\" string)")
        out.append(d)
    return out, tei


def _relevance(outputs: list[float], raw: bool) -> float:
    """A document's score from the classifier's outputs: one output (a cross-encoder's logit: bge-reranker)
    through the sigmoid, as vLLM, TEI and sentence-transformers score it (0 to 1), unless `raw`; several
    (Qwen3-Reranker's, llama.cpp's softmax over "yes" and "no") the first, P(yes)."""
    if len(outputs) == 1 and not raw:
        x = outputs[0]
        return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return outputs[0]


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
@router.post("/v1/reranking")
@router.post("/reranking")
async def rerank(request: Request):
    """Rerank documents against a query with a reranker model (bge-reranker-v2-m3, Qwen3-Reranker...), in the
    shape Jina, Cohere, vLLM and llama-server share: ``{"model", "query", "documents", "top_n",
    "return_documents"}`` -> ``{"results": [{"index", "relevance_score", "document": {"text"}}], "usage"}``, best
    first. Or TEI's: ``{"query", "texts", "raw_scores", "return_text", "truncate"}`` -> ``[{"index", "score",
    "text"}]``. A relevance score is the sigmoid of a cross-encoder's logit (``raw_scores`` keeps the logit, which
    is what llama-server returns)."""
    st: State = request.app.state.lr
    body = await json_body(request)
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest("'query' must be a non-empty string")
    docs, tei = _documents(body)
    top_n = p.get_int(body, "top_n", 1, MAX_DOCUMENTS)
    raw = p.get_bool(body, "raw_scores")
    with_text = p.get_bool(body, "return_text") if tei else p.get_bool(body, "return_documents", True)
    truncate = p.get_bool(body, "truncate")
    resolved = await _model(st, body, "a reranker")
    scores, counts = await until_disconnected(request, st.generation.rerank(
        resolved, query, docs, keep_alive=st.keep_alive(body), truncate=truncate))
    ranked = sorted(range(len(docs)), key=lambda i: -_relevance(scores[i], raw))[:top_n or len(docs)]
    if tei:
        return [{"index": i, "score": _relevance(scores[i], raw), **({"text": docs[i]} if with_text else {})}
                for i in ranked]
    n = sum(counts)
    return {"id": f"rerank-{uuid.uuid4().hex[:24]}", "model": resolved.name, "object": "list",
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "results": [{"index": i, "relevance_score": _relevance(scores[i], raw),
                         **({"document": {"text": docs[i]}} if with_text else {})} for i in ranked]}
