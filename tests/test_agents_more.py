"""What coding agents need beyond a chat client, against the real daemon (llama.cpp, the bundled
SmolLM2) through the SDKs they use: `prompt_cache_key` as a prefix-cache hint (Chat Completions
and Responses).
"""

from __future__ import annotations

import openai
import pytest

from daemon import MODEL, Daemon

pytestmark = pytest.mark.timeout(900)

# three long prompts, each its own beyond the template's system prompt
TEXTS = {name: f"Project {name}: " + " ".join(f"{name}{i} is the {i}th part of the {name} plan." for i in range(24))
         + " Summarize it." for name in ("alpha", "bravo", "delta")}


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory):
    """A daemon whose llama.cpp runner decodes two sequences: two cached prefixes at a time."""
    d = Daemon(tmp_path_factory.mktemp("agents_more"), LOCALRUN_CONTEXT_LENGTH="1024", LOCALRUN_NUM_PARALLEL="2")
    try:
        d.pull()
        yield d
    finally:
        d.stop()


def _chat(client: openai.OpenAI, text: str, key: str | None):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2,
                                       temperature=0, **({"prompt_cache_key": key} if key else {}))
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def _responses(client: openai.OpenAI, text: str, key: str | None):
    r = client.responses.create(model=MODEL, input=text, max_output_tokens=16, temperature=0, store=False,
                                **({"prompt_cache_key": key} if key else {}))
    assert getattr(r, "prompt_cache_key", None) == key or (r.model_extra or {}).get("prompt_cache_key") == key
    return r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("call", [_chat, _responses], ids=["chat", "responses"])
def test_prompt_cache_key_keeps_its_prefix(two_slots, call):
    """Two slots: a keyed conversation's prompt, then two other prompts. Without a key, the second
    other prompt evicts it (least recently used); with one, the other prompts take the keyless
    slot, and the keyed prompt's next request reads it from the cache."""
    client = openai.OpenAI(base_url=two_slots.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    results = {}
    for key in (None, f"conversation-{call.__name__}"):
        tag = f"[{call.__name__} {key}] "  # each round's prompts share nothing with earlier rounds' past the tag
        call(client, tag + TEXTS["delta"], None)  # some earlier traffic
        n, _ = call(client, tag + TEXTS["alpha"], key)
        call(client, tag + TEXTS["bravo"], None)  # other traffic, no key
        n2, cached = call(client, tag + TEXTS["alpha"], key)  # the keyed conversation's next turn
        assert n2 == n
        results[key is not None] = cached
    keyless, keyed = results[False], results[True]
    assert keyed >= n - 8, results  # all but the last few tokens (llama.cpp recomputes a couple)
    assert keyless < n // 2, results  # without the hint, the other traffic evicted it


def test_prompt_cache_key_must_be_a_short_string(two_slots):
    client = openai.OpenAI(base_url=two_slots.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for bad in (7, "k" * 2000):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           extra_body={"prompt_cache_key": bad})
        assert "prompt_cache_key" in str(e.value), e.value


APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Use the apply_patch tool to edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition":
                          'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
                          'end_patch: "*** End Patch" LF?\nhunk: "*** Add File: " filename LF add_line+\n'
                          'add_line: "+" /(.*)/ LF -> line\nfilename: /(.+)/\n%import common.LF'}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_custom_tool_on_the_real_model(two_slots, stream):
    """Codex's apply_patch (a custom tool with a Lark grammar) through the openai SDK on SmolLM2, whose
    template renders no tools: a forced call comes back as a custom_tool_call with the raw input the
    model wrote (a string, streamed as custom_tool_call_input events); its output goes back in."""
    client = openai.OpenAI(base_url=two_slots.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kw = dict(model=MODEL, input="Create hello.txt containing hello.", tools=[APPLY_PATCH], store=False,
              tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=48, temperature=0)
    if stream:
        with client.responses.stream(**kw) as s:
            events = list(s)
            r = s.get_final_response()
        deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
        done = [e.input for e in events if e.type == "response.custom_tool_call_input.done"]
        assert done == [deltas] == [r.output[0].input], events[-3:]
    else:
        r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["custom_tool_call"], r.output
    call = r.output[0]
    assert call.name == "apply_patch" and isinstance(call.input, str) and call.call_id
    r2 = client.responses.create(model=MODEL, tools=[APPLY_PATCH], store=False, max_output_tokens=16, temperature=0,
                                 input=[{"role": "user", "content": "Create hello.txt containing hello."},
                                        {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch",
                                         "input": call.input},
                                        {"type": "custom_tool_call_output", "call_id": call.call_id,
                                         "output": "Done: added hello.txt"}])
    assert r2.status in ("completed", "incomplete") and r2.output
    assert all(o.type in ("message", "custom_tool_call") for o in r2.output), r2.output


def test_launch_context_is_what_memory_holds(tmp_path, monkeypatch):
    """`launch`'s context: the trained context when the free memory holds it; less free memory, the
    largest multiple of 1,024 whose load the manager's own memory plan accepts."""
    import asyncio
    import dataclasses

    from fakes import library_home

    from localrun.backends import llamacpp
    from localrun.backends.base import LoadSpec
    from localrun.config import settings as read_settings
    from localrun.library import Library
    from localrun.server import manager as m
    from localrun.server.memory import plan_load

    home = library_home(tmp_path)
    settings = read_settings({"LOCALRUN_HOME": str(home), "LOCALRUN_NUM_PARALLEL": "1"})
    resolved = Library(home / "models").resolve(MODEL)
    mgr = m.ModelManager(settings, Library(home / "models"))
    n, why = asyncio.run(mgr.fitting_context(resolved, 8192))
    assert n == 8192 and "trained" in why

    spec = LoadSpec(name=MODEL, weights=resolved.weights, format=resolved.format, num_ctx=8192,
                             num_parallel=1, extra={"gguf_info": resolved.info})
    layers = resolved.info.block_count

    def fits(ctx: int, ram: int) -> bool:
        try:
            plan_load(llamacpp.estimate_memory(dataclasses.replace(spec, num_ctx=ctx)), layers, ram_free=ram)
            return True
        except m.InsufficientMemory:
            return False

    ram = llamacpp.estimate_memory(dataclasses.replace(spec, num_ctx=4096)).total_bytes  # about what 4,096 tokens need
    monkeypatch.setattr(m, "free_ram", lambda: ram)
    n, why = asyncio.run(mgr.fitting_context(resolved, 8192))
    assert 1024 <= n < 8192 and n % 1024 == 0 and "free memory" in why, (n, why)
    assert fits(n, ram) and not fits(n + 1024, ram)



def test_show_fit_context_over_http(two_slots):
    """What `localrun launch` asks the daemon: the context the model was trained for, the free memory
    permitting (on this machine it does, for SmolLM2)."""
    fit = two_slots.http.post("/api/show", json={"model": MODEL, "fit_context": True}).json()["fit_context"]
    assert fit["num_ctx"] == fit["trained"] == 8192 and fit["reason"], fit
    assert "fit_context" not in two_slots.http.post("/api/show", json={"model": MODEL}).json()


def test_cache_key_crosses_to_the_runner():
    """The hint reaches the runner process (the wire between daemon and runner keeps it)."""
    from localrun.backends.base import GenerationRequest
    from localrun.backends.runner.wire import request_from_wire, request_to_wire

    r = request_from_wire(request_to_wire(GenerationRequest(prompt="p", request_id="r", cache_key="conv-1")))
    assert r.cache_key == "conv-1"
    assert request_from_wire(request_to_wire(GenerationRequest(prompt="p", request_id="r"))).cache_key is None
