"""The batched llama.cpp backend on the real SmolLM2 GGUF: one context, many sequences.

In process (the backend object, no daemon): prefix reuse across requests and conversations,
cancellation, logit bias, grammar and speculative rows batched beside plain ones. Through the real daemon over HTTP: 8 concurrent streams each get the answer the same request
gets alone (up to an honest near tie: localrun.bench.greedy), a cancelled stream frees its sequence,
a shared system prompt is computed once and reported in cached_tokens, bad input is a 4xx.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from daemon import MODEL, Daemon
from fakes import metric_samples
from llama_backend import smollm2_backend

from localrun.backends.base import GenerationRequest, SamplingOptions
from localrun.bench.greedy import compare, openai_tokens

pytestmark = pytest.mark.timeout(600)

pytest.importorskip("llama_cpp")

QUESTIONS = [
    "Why is the sky blue?", "Name three primary colors.", "What is the capital of France?", "Count from one to ten.",
    "What do bees make?", "Describe a cat in five words.", "Give me a short tip for learning.",
    "Write one sentence about the sea.",
]
# a long shared system prompt (~600 tokens), as agents and IDE plugins send with every request
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer briefly, cite nothing, and never repeat rule {i} back to the user." for i in range(40))


def chatml(user: str, system: str | None = None) -> str:
    sys_part = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_part}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    b = smollm2_backend(smollm2_gguf, 1024, 4)
    yield b
    asyncio.run(b.close())


def run(coro):
    return asyncio.run(coro)


async def collect(backend, prompt: str, **opts):
    o = SamplingOptions(**{"temperature": 0.0, "max_tokens": 24, **opts})
    text, last, ids = [], None, []
    async for ch in backend.generate(GenerationRequest(prompt=prompt, options=o)):
        text.append(ch.text)
        ids += ch.token_ids
        last = ch
    return "".join(text), last, ids


def test_one_context_many_sequences(backend):
    st = run(backend.stats())
    assert backend.info.slots == 4 and backend.info.supports_groups and st["parallel"] == 4
    assert st["cells"] == 4 * 1024 and "one batched context" in backend.info.reason


def test_prefix_shared_across_requests_and_reported(backend):
    async def main():
        a = await collect(backend, chatml("What is 2+2?", SYSTEM))
        b = await collect(backend, chatml("Name a fruit.", SYSTEM))
        return a, b

    before = run(backend.stats())
    (_, ua, _), (_, ub, _) = run(main())
    after = run(backend.stats())
    n_sys = len(run(backend.tokenize(chatml("", SYSTEM).split("<|im_start|>user")[0])))
    assert ub.usage.cached_tokens >= n_sys and ub.usage.prompt_tokens > ub.usage.cached_tokens
    # the second prompt's shared part was not computed again
    assert after["prefill_tokens"] - before["prefill_tokens"] == (ua.usage.prompt_tokens - ua.usage.cached_tokens
                                                                    + ub.usage.prompt_tokens - ub.usage.cached_tokens)


def test_concurrent_requests_sharing_a_prompt_prefill_it_once(backend):
    """Four requests with one long system prompt arrive together: one computes it, the others wait
    for that prefill and share its cells instead of computing the same tokens beside it."""
    system = "Answer as a pirate would. " + SYSTEM  # not cached yet (differs from its start)
    before = run(backend.stats())

    async def main():
        return await asyncio.gather(*(collect(backend, chatml(q, system), max_tokens=8) for q in QUESTIONS[:4]))

    outs = run(main())
    after = run(backend.stats())
    prompt_tokens = sum(o[1].usage.prompt_tokens for o in outs)
    cached = sum(o[1].usage.cached_tokens for o in outs)
    n_sys = len(run(backend.tokenize(chatml("", system).split("<|im_start|>user")[0])))
    assert cached >= 3 * (n_sys - 40)  # three of the four reused (nearly) the whole system prompt
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_tokens - cached
    assert after["shared_waits"] > before["shared_waits"]


def test_cancel_frees_the_sequence_within_a_step(backend):
    async def main():
        o = SamplingOptions(temperature=0.0, max_tokens=400, ignore_eos=True)
        gen = backend.generate(GenerationRequest(prompt=chatml("Tell me a long story."), options=o))
        await gen.__anext__()
        assert (await backend.stats())["running"] == 1
        await gen.aclose()
        t0 = time.monotonic()
        while (await backend.stats())["running"]:
            await asyncio.sleep(0.005)
        return time.monotonic() - t0

    assert run(main()) < 2.0
    # the model serves the next request as usual
    text, last, _ = run(collect(backend, chatml("What is 2+2?")))
    assert last.finish_reason in ("stop", "length") and text


def test_a_prefix_copied_cell_by_cell_answers_as_the_whole_stream_copy(smollm2_gguf):
    """Below half a stream only the cells in use are copied (llama.cpp's state of one sequence, saved
    and loaded); llama.cpp's own stream copy moves all num_ctx cells. The same requests in the same
    order answer the same either way, token for token."""
    def serve(cell_by_cell: bool):
        b = smollm2_backend(smollm2_gguf, 2048, 2)
        b.engine.copy_cells = cell_by_cell
        try:
            texts = [run(collect(b, chatml(q, "You are a terse assistant who answers in one sentence."),
                                 max_tokens=24, ignore_eos=True))[0] for q in QUESTIONS[:3]]
            return texts, run(b.stats())
        finally:
            run(b.close())

    (cells, st_cells), (whole, st_whole) = serve(True), serve(False)
    assert st_cells["copied_prefixes"] == st_whole["copied_prefixes"] >= 1
    assert st_cells["copied_cells"] > 0 and st_cells["copied_streams"] == 0, st_cells
    assert st_whole["copied_streams"] == st_whole["copied_prefixes"] and st_whole["copied_cells"] == 0, st_whole
    assert cells == whole


def test_two_conversations_keep_their_prefixes(smollm2_gguf):
    """Two conversations share a system prompt. The second gets a copy of the first's stream (its
    own cells) and computes only its own question, and the first keeps every token it had: its next
    turn starts from all of them. Twelve more distinct prompts through two slots: slots are reused,
    every answer is complete, no slot holds more than its window."""
    b = smollm2_backend(smollm2_gguf, 1024, 2)
    try:
        async def main():
            p1 = chatml("What is 2+2?", SYSTEM)
            t1, l1, _ = await collect(b, p1)
            p2 = chatml("Name a fruit.", SYSTEM)
            _, l2, _ = await collect(b, p2)
            st = await b.stats()
            n_sys = len(await b.tokenize(chatml("", SYSTEM).split("<|im_start|>user")[0]))
            assert st["copied_prefixes"] == 1 and l2.usage.cached_tokens >= n_sys
            # the first conversation fills most of its 1,024 cells: its stream is copied whole (below half a
            # stream only the cells in use move: test_a_stream_moves_next_to_the_others_...)
            assert st["copied_streams"] == 1 and st["copied_cells"] == 0, st
            turn2 = p1 + t1 + "<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
            _, l3, _ = await collect(b, turn2)
            assert l3.usage.cached_tokens >= l1.usage.prompt_tokens + l1.usage.completion_tokens - 1
            for i in range(12):
                _, last, _ = await collect(b, chatml(f"{QUESTIONS[i % 8]} (take {i}) " + "please " * 20), max_tokens=40,
                                           ignore_eos=True)
                assert last.finish_reason == "length" and last.usage.completion_tokens == 40
            outs = await asyncio.gather(*(collect(b, chatml(q + " " + "again " * 30), max_tokens=60, ignore_eos=True)
                                          for q in QUESTIONS[:4]))
            assert all(o[1].finish_reason == "length" for o in outs)
            return await b.stats()

        st = run(main())
        assert st["running"] == 0 and st["cells_used"] <= st["cells"] and st["idle_sequences"] == 2
    finally:
        run(b.close())


class _DecodeOrder:
    """The real llama.cpp bindings, with the sequence ids of every batch handed to llama_decode noted
    (the call itself goes through unchanged)."""

    def __init__(self, lib, engine) -> None:
        self._lib, self._engine, self.batches = lib, engine, []

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def llama_decode(self, ctx, batch):
        self.batches.append([int(s) for s in self._engine._seq[:batch.n_tokens]])
        return self._lib.llama_decode(ctx, batch)


def test_each_step_feeds_its_sequences_in_slot_order(smollm2_gguf):
    """A request that ended leaves its prefix in slot 0, so four requests that arrive together run in
    slots 1, 2, 3 and then 0. Every step's batch still lists its sequences in slot order: llama.cpp
    cuts a batch into one forward pass per run of consecutive sequence ids (in arrival order each
    step took two passes, 19% slower at 8 streams). That each stream still gets its own answer is
    test_eight_concurrent_streams_each_get_their_own_answer's."""
    b = smollm2_backend(smollm2_gguf, 1024, 4)
    try:
        for q in QUESTIONS[4:8]:
            run(collect(b, chatml(q), max_tokens=4))
        run(collect(b, chatml("Hello."), max_tokens=4))  # the slot it leaves is the LRU: taken last
        spy = b.engine.lib = _DecodeOrder(b.engine.lib, b.engine)

        async def main():
            return await asyncio.gather(*(collect(b, chatml(q), max_tokens=12) for q in QUESTIONS[4:8]))

        outs = run(main())
        b.engine.lib = spy._lib
        sids = [s for batch in spy.batches for s in batch]
        assert set(sids) == {0, 1, 2, 3}  # all four slots ran, slot 0 among them
        assert any(len(set(batch)) == 4 for batch in spy.batches)  # at times all four in one step
        for batch in spy.batches:
            assert batch == sorted(batch), batch
        assert all(o[1].usage.completion_tokens == 12 or o[1].finish_reason == "stop" for o in outs)
    finally:
        run(b.close())


def test_a_stream_moves_next_to_the_others_when_one_between_them_ends(backend, smollm2_gguf):
    """Three streams run in slots 0, 1 and 2; the middle one is cancelled. The one in slot 2 moves to
    slot 1 (its stream copied) instead of leaving a gap that would cost a second forward pass on
    every step, and both remaining streams still get the answers they get alone."""
    qa, qb, qc = chatml(QUESTIONS[0]), chatml(QUESTIONS[1]), chatml(QUESTIONS[3])
    alone = {q: run(collect(backend, q, max_tokens=40, ignore_eos=True))[0] for q in (qa, qc)}
    b = smollm2_backend(smollm2_gguf, 1024, 4)
    try:
        spy = b.engine.lib = _DecodeOrder(b.engine.lib, b.engine)

        async def cancelled_early():
            o = SamplingOptions(temperature=0.0, max_tokens=40, ignore_eos=True)
            gen = b.generate(GenerationRequest(prompt=qb, options=o))
            for _ in range(3):
                await gen.__anext__()
            await gen.aclose()

        async def main():
            return await asyncio.gather(collect(b, qa, max_tokens=40, ignore_eos=True), cancelled_early(),
                                        collect(b, qc, max_tokens=40, ignore_eos=True))

        (ta, _, _), _, (tc, _, _) = run(main())
        st = run(b.stats())
    finally:
        b.engine.lib = spy._lib
        run(b.close())
    assert {s for batch in spy.batches for s in batch} == {0, 1, 2}
    assert st["moved_sequences"] == 1
    assert st["copied_cells"] > 0 and st["copied_streams"] == 0, st  # the move took only the cells in use
    for batch in spy.batches:  # never two runs of sequence ids (two passes) in one step
        ids = sorted(set(batch))
        assert ids == list(range(ids[0], ids[0] + len(ids))), batch
    assert ta == alone[qa] and tc == alone[qc]


def test_a_waiting_request_fills_the_gap_and_the_prefix_there_moves_instead(backend, smollm2_gguf):
    """Four streams run in slots 0-3 and a fifth request waits. The streams in slots 1 and 3 end in one
    step, and the waiting request shares the start of slot 1's prompt. It runs in slot 1, between the
    streams still running, and slot 1's cached prefix goes to slot 3 (one copy): not the request into
    slot 3 and then slot 2's stream moved next to slot 0 (a second copy). Slot 1's prompt, asked again,
    still comes from the cache, and the answers equal the answers given alone."""
    qa, qc = chatml(QUESTIONS[0]), chatml(QUESTIONS[2])
    qb, qd = chatml("Explain how a bridge carries weight, step by step, for a child of six."), chatml(QUESTIONS[3])
    qr = chatml("Explain how a bridge carries weight in one short sentence.")
    alone = {q: run(collect(backend, q, max_tokens=40, ignore_eos=True))[0] for q in (qa, qr)}
    b = smollm2_backend(smollm2_gguf, 1024, 4)
    engine = b.engine
    try:
        async def main():
            o = SamplingOptions(temperature=0.0, max_tokens=40, ignore_eos=True)
            gens = [b.generate(GenerationRequest(prompt=q, options=o)) for q in (qa, qb, qc, qd)]
            firsts = [await g.__anext__() for g in gens]  # one after another: slots 0, 1, 2, 3
            assert sorted(r.sid for r in engine._running) == [0, 1, 2, 3]
            waiting = asyncio.create_task(collect(b, qr, max_tokens=40, ignore_eos=True))
            while engine.stats()["waiting"] < 1:
                await asyncio.sleep(0.005)
            ended = [r for r in engine._running if r.sid in (1, 3)]
            with engine._cv:  # both in one step (the loop reads the flags at its next step boundary)
                for r in ended:
                    r.cancelled = True
            for g in (gens[1], gens[3]):
                await g.aclose()
            texts = []
            for first, g in ((firsts[0], gens[0]), (firsts[2], gens[2])):
                texts.append(first.text + "".join([ch.text async for ch in g]))
            tr, _, _ = await waiting
            return texts[0], tr

        ta, tr = run(main())
        st = run(b.stats())
        _, last, _ = run(collect(b, qb, max_tokens=1))
    finally:
        run(b.close())
    assert st["handed_over_prefixes"] == 1 and st["moved_sequences"] == 0, st
    assert last.usage.cached_tokens >= last.usage.prompt_tokens - 2  # (MIN_RECOMPUTE)
    assert ta == alone[qa] and tr == alone[qr]


def test_a_prompt_chunk_is_not_cut_by_the_streams_decoding_beside_it(backend):
    """A long prompt arriving while a stream decodes is prefilled in chunks of step_tokens beside
    that stream's token (not step_tokens less the decode tokens: a chunk cut by them left llama.cpp
    a short extra pass)."""
    engine = backend.engine
    prompt = chatml("Summarise the rules.", "Reply as a poet. " + SYSTEM)  # not cached by the tests before

    async def main():
        o = SamplingOptions(temperature=0.0, max_tokens=60, ignore_eos=True)
        gen = backend.generate(GenerationRequest(prompt=chatml("Tell me a long story."), options=o))
        await gen.__anext__()
        spy = engine.lib = _DecodeOrder(engine.lib, engine)
        try:
            _, last, _ = await collect(backend, prompt, max_tokens=2)
        finally:
            engine.lib = spy._lib
            await gen.aclose()
        return spy.batches, last

    batches, last = run(main())
    n_prompt = last.usage.prompt_tokens - last.usage.cached_tokens
    assert n_prompt > engine.step_tokens  # the test needs a prompt longer than one chunk
    sizes = [len(b) for b in batches if len(set(b)) == 2]  # steps that fed both sequences
    assert engine.step_tokens + 1 in sizes, sizes


class _Pipe:
    """The runner's channel as the loop's thread sees it: the framed messages of each write."""

    def __init__(self):
        self.writes: list[list[dict]] = []
        self.threads: set[int] = set()
        self.sinks: dict[int, object] = {}  # the daemon's 'delivered' once it has a stream's first chunk

    def write(self, data: bytes) -> None:
        from localrun.backends.runner import wire

        self.threads.add(threading.get_ident())
        msgs, pos = [], 0
        while pos < len(data):
            n = int.from_bytes(data[pos:pos + 4], "little")
            msgs.append(wire.loads(data[pos + 4:pos + 4 + n]))
            pos += 4 + n
        self.writes.append(msgs)
        for m in msgs:
            if m["id"] in self.sinks:
                self.sinks[m["id"]].delivered.set()


def test_the_runner_path_writes_each_step_once_from_the_loop_and_answers_the_same(backend):
    """generate_direct, as a runner process serves a stream: the loop's thread frames every chunk
    itself and writes a step's chunks for all streams at once (never from the event loop's thread);
    three concurrent greedy streams get the text they get through generate(); a 'delivered' from
    the daemon ends the first-token wait; cancelling a stream (the daemon's abort) frees its sequence
    and nothing more is written for it."""
    from localrun.backends.runner import wire
    from localrun.backends.runner.worker import _DirectSink, _Outbox

    prompts = [chatml(q) for q in QUESTIONS[:3]]
    opts = dict(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=5)

    async def alone_tokens(prompt):
        text, toks = [], []
        async for ch in backend.generate(GenerationRequest(prompt=prompt, options=SamplingOptions(**opts))):
            text.append(ch.text)
            toks += [(lp.token, lp.logprob, lp.top) for lp in ch.logprobs or []]
        return "".join(text), toks

    alone = [run(alone_tokens(p)) for p in prompts]

    async def main():
        pipe = _Pipe()
        outbox = _Outbox(pipe, asyncio.get_running_loop())
        sinks = [_DirectSink(outbox, i, None, None) for i in range(3)]
        pipe.sinks = dict(enumerate(sinks))
        tasks = [asyncio.ensure_future(backend.generate_direct(GenerationRequest(
            prompt=p, options=SamplingOptions(**opts)), s))
            for p, s in zip(prompts, sinks)]
        await asyncio.gather(*tasks)
        # a long one, aborted after its first chunks
        sink = _DirectSink(outbox, 9, None, None)
        long = asyncio.ensure_future(backend.generate_direct(GenerationRequest(
            prompt=chatml("Tell me a long story."), options=SamplingOptions(temperature=0.0, max_tokens=400,
                                                                            ignore_eos=True)), sink))
        while sum(m["id"] == 9 for w in pipe.writes for m in w) < 3:
            await asyncio.sleep(0.005)
        sink.delivered.set()
        long.cancel()
        t0 = time.monotonic()
        while (await backend.stats())["running"]:
            await asyncio.sleep(0.005)
        freed = time.monotonic() - t0
        n9 = sum(m["id"] == 9 for w in pipe.writes for m in w)
        await asyncio.sleep(0.3)
        return pipe, threading.get_ident(), freed, n9

    pipe, loop_thread, freed, n9 = run(main())
    assert loop_thread not in pipe.threads
    for i, (want, want_tokens) in enumerate(alone):
        msgs = [m for w in pipe.writes for m in w if m["id"] == i]
        chunks = [wire.chunk_from_wire(m) for m in msgs]
        assert all(m["t"] == "chunk" for m in msgs) and chunks[-1].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 16
        # the same answer as alone, up to a near tie that batched arithmetic may flip (bench.greedy)
        cmp = compare(want_tokens, [(lp.token, lp.logprob, lp.top) for c in chunks for lp in c.logprobs or []])
        assert cmp.acceptable, (want, cmp)
        if cmp.verdict == "same":
            assert "".join(c.text for c in chunks) == want
    # one write a step: no write holds two chunks of one stream
    assert all(len({m["id"] for m in w}) == len(w) for w in pipe.writes)
    assert max(len(w) for w in pipe.writes) == 3  # the three streams' steps went out together
    assert freed < 2.0 and sum(m["id"] == 9 for w in pipe.writes for m in w) == n9


def _os_threads(settle: float = 3.0, want: int | None = None) -> int:
    """This process's threads (Linux), once threads that are exiting are gone (up to `settle` s)."""
    import os

    deadline = time.monotonic() + settle
    while True:
        n = len(os.listdir("/proc/self/task"))
        if (want is not None and n <= want) or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_embeddings_leave_no_openmp_team_behind(backend):
    """llama.cpp's OpenMP keeps a team of worker threads for each thread that computed, while that thread
    lives; with more of them than CPUs its barriers sleep instead of spinning and every step of the loop
    slowed (SmolLM2 on 2 CPUs: ~160 -> ~90 tok/s after one embeddings request). Embeddings now compute on
    a thread that exits, and its team goes with it."""
    import os

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through /proc")
    run(collect(backend, "Hello", max_tokens=2))  # the loop's own team exists
    before = _os_threads(settle=0)
    vecs = run(backend.embed(["the sky is blue", "bees make honey"]))
    assert len(vecs) == 2 and len(vecs[0]) == 576
    assert _os_threads(want=before) <= before
    assert run(collect(backend, "Hello", max_tokens=2))[0]


def test_the_loop_ends_its_openmp_team_after_first_tokens_and_keeps_it_when_idle(backend):
    """libgomp's workers spin ~10 ms after each parallel region for the next one. The loop ends its team
    (llamacpp.batch.omp_release) after a step that gave requests their first tokens, where its threads take
    every CPU, so no worker spins on a CPU the daemon and the client need then; the next decode starts the
    team again, and a stream's steps keep it. When the loop runs out of work it keeps the team (its worker
    sleeps once its spin is done): a team started after an idle spell ran both threads on one CPU at first
    (Linux starts a thread on its parent's CPU), ~8 ms more for a short prefill on 2 AMD vCPUs."""
    import os

    if backend.engine._release_threads is None or not os.path.isdir("/proc/self/task"):
        pytest.skip("llama.cpp's 2 threads leave CPUs to spare or do not compute on libgomp here (or no /proc)")

    def tasks(settle: float) -> set[str]:
        time.sleep(settle)  # threads that are exiting are gone
        return set(os.listdir("/proc/self/task"))

    assert run(collect(backend, "Hello", max_tokens=3))[0]
    after_first = tasks(0.5)

    async def counts() -> list[set[str]]:
        seen = []
        o = SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True)
        async for _ in backend.generate(GenerationRequest(prompt=chatml("Count to twenty."), options=o)):
            seen.append(set(os.listdir("/proc/self/task")))
        return seen

    seen = run(counts())
    assert len(seen) >= 3
    worker = seen[2] - after_first  # the team started again after the first token: a new worker
    assert len(worker) == 1 and all(worker <= s for s in seen[2:]), (after_first, seen)  # kept while it streams
    assert worker <= tasks(1.0)  # and kept once the loop is idle


def test_logit_bias_bans_a_token(backend):
    text, last, ids = run(collect(backend, chatml("What is the capital of France?"), max_tokens=8))
    banned = ids[0]
    _, _, ids2 = run(collect(backend, chatml("What is the capital of France?"), max_tokens=8,
                             logit_bias={banned: -100.0}))
    assert ids2[0] != banned and banned not in ids2


def test_json_strings_hold_no_raw_control_characters(backend):
    """JSON forbids a raw newline inside a string, so the grammar must too: with every token that
    holds a newline pushed up, the answer is still JSON that json.loads reads. (llama-cpp-python's
    converter allowed them: a sampled model's forced tool call then came back as text.)"""
    schema = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 12}}, "required": ["note"]}
    newline_ids = {t for piece in ("\n", "\n\n", "\t") for t in run(backend.tokenize(piece))}
    assert newline_ids and all("\n" in run(backend.detokenize([t])) or "\t" in run(backend.detokenize([t]))
                               for t in newline_ids)
    text, last, _ = run(collect(backend, chatml("Write a note as JSON."), max_tokens=60, json_schema=schema,
                                logit_bias={t: 30.0 for t in newline_ids}))
    assert last.finish_reason == "stop", text
    assert isinstance(json.loads(text)["note"], str), text


def test_enum_values_and_keys_with_quotes_backslashes_and_newlines(backend):
    """A schema's literals (enum, const, property names) are JSON text in the grammar: their own
    escapes must survive (llama-cpp-python's converter left the backslash unescaped, so these made
    the grammar unparseable, a 400, or forced a raw newline into the JSON)."""
    values = ['say "hi"', "back\\slash", "two\nlines"]
    for i, key in enumerate(("pick", 'the "pick"')):
        schema = {"type": "object", "properties": {key: {"enum": values}}, "required": [key]}
        prompt = chatml(f"Pick one of {values} as JSON.")
        bias = {} if i == 0 else {t: 20.0 for t in run(backend.tokenize("\\"))}  # lean towards the backslash
        text, last, _ = run(collect(backend, prompt, max_tokens=40, json_schema=schema, logit_bias=bias))
        assert last.finish_reason == "stop" and json.loads(text)[key] in values, text


def test_the_grammar_checks_the_chosen_token_and_masks_only_when_it_refuses(backend):
    """As llama-server samples: the chain picks, the grammar checks that token, and only a refused
    one costs a pass over the whole vocabulary. Most tokens of a JSON answer are the model's own
    first choice; the answers stay JSON, greedy and sampled, and a seed still repeats."""
    schema = {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                          "minItems": 3, "maxItems": 3}}, "required": ["cities"]}
    prompt = chatml("List three large cities as JSON.")
    before = run(backend.stats())["grammar_resamples"]
    text, last, ids = run(collect(backend, prompt, max_tokens=60, json_schema=schema))
    resampled = run(backend.stats())["grammar_resamples"] - before
    assert last.finish_reason == "stop" and len(json.loads(text)["cities"]) == 3, text
    assert 0 < resampled < len(ids) / 2, (resampled, len(ids))
    sampled = [run(collect(backend, prompt, max_tokens=200, json_schema=schema, temperature=1.0, seed=7))
               for _ in range(2)]
    assert sampled[0][0] == sampled[1][0] and sampled[0][1].finish_reason == "stop", sampled
    assert isinstance(json.loads(sampled[0][0])["cities"], list)


def test_integer_bounds_hold_against_the_model(backend):
    """An integer's minimum / maximum are part of the grammar (llama-cpp-python's converter dropped
    them): with the digits outside the range pushed up, the answer is still inside it."""
    cases = [({"minimum": 1, "maximum": 5}, "0789-"), ({"minimum": 15, "maximum": 2307}, "09-"),
             ({"exclusiveMinimum": -10, "maximum": -3}, "0123456"), ({"minimum": 100}, "-0")]
    for bounds, pushed in cases:
        schema = {"type": "object", "properties": {"n": {"type": "integer", **bounds}}, "required": ["n"]}
        bias = {t: 15.0 for ch in pushed for t in run(backend.tokenize(ch))}
        text, last, _ = run(collect(backend, chatml("Give me a number as JSON."), max_tokens=40, json_schema=schema,
                                    logit_bias=bias))
        n = json.loads(text)["n"]
        lo = bounds.get("minimum", bounds.get("exclusiveMinimum", -10 ** 20) + 1)
        assert last.finish_reason == "stop" and isinstance(n, int) and lo <= n <= bounds.get("maximum", 10 ** 20), text
    # a list of types keeps the other keywords (llama-cpp-python's converter dropped them)
    schema = {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": 1, "maximum": 5},
                                               "s": {"type": ["string", "null"], "maxLength": 3}}, "required": ["n", "s"]}
    bias = {t: 15.0 for ch in "0789-abcdefgh" for t in run(backend.tokenize(ch))}
    text, last, _ = run(collect(backend, chatml("Give me a number and a word as JSON."), max_tokens=60, json_schema=schema,
                                logit_bias=bias))
    got = json.loads(text)
    assert got["n"] is None or 1 <= got["n"] <= 5, text
    assert got["s"] is None or len(got["s"]) <= 3, text


def test_plain_greedy_takes_the_argmax_and_answers_as_the_sampler_chain_does(backend):
    """A greedy request with nothing else to apply picks its token by an argmax over the logits row;
    the same request through llama.cpp's sampler chain (a zero logit bias keeps it there, changing
    no logit) gets the same tokens."""
    from localrun.backends.llamacpp.sampling import plain_greedy

    assert plain_greedy(SamplingOptions(temperature=0.0))
    for other in ({"temperature": 0.7}, {"logit_bias": {5: 0.0}}, {"repeat_penalty": 1.1}, {"presence_penalty": 0.5},
                  {"frequency_penalty": 0.5}):
        assert not plain_greedy(SamplingOptions(**{"temperature": 0.0, **other})), other
    assert not plain_greedy(SamplingOptions(temperature=0.0), grammar='root ::= "{}"')
    # (a JSON schema or JSON mode gets a grammar: test_grammar_speculative_and_plain_rows_share_steps)
    prompt = chatml("Write one sentence about the sea.")
    text, last, ids = run(collect(backend, prompt, max_tokens=32))
    text2, last2, ids2 = run(collect(backend, prompt, max_tokens=32, logit_bias={ids[0]: 0.0}))
    assert len(ids) >= 8 and ids2 == ids and text2 == text
    # a prompt longer than a step's chunk: its first step has no output row at all
    long = chatml("Sort these: " + " ".join(f"item{i}" for i in range(260)))
    engine = backend.engine
    steps = engine.counters["steps"]
    text, last, ids = run(collect(backend, long, max_tokens=8))
    assert last.usage.prompt_tokens > engine.step_tokens and engine.counters["steps"] - steps >= 2 + 7
    _, _, ids2 = run(collect(backend, long, max_tokens=8, logit_bias={ids[0]: 0.0}))
    assert len(ids) == 8 and ids2 == ids


def test_grammar_speculative_and_plain_rows_share_steps(smollm2_gguf):
    """A JSON-schema row, a prompt-lookup speculative row and plain rows in the same steps: the
    JSON is valid, the speculative answer equals the plain one, drafts were accepted."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    echo = chatml("Repeat exactly: the cat sat on the mat, and the dog sat on the log.")
    b = smollm2_backend(smollm2_gguf, 512, 4, speculative="ngram", num_speculative_tokens=4)
    try:
        alone = run(collect(b, echo, max_tokens=20))[0]

        async def main():
            return await asyncio.gather(collect(b, chatml("Which city is the capital of France? JSON."), max_tokens=40,
                                                json_schema=schema),
                                        collect(b, echo, max_tokens=20),
                                        collect(b, chatml("Name three colors."), max_tokens=20))

        js, spec, plain = run(main())
        assert isinstance(json.loads(js[0])["city"], str)
        assert spec[0] == alone and "cat sat on the mat" in spec[0]
        st = run(b.stats())
        assert st["spec_accepted_tokens"] > 0 and st["decode_tokens"] > st["steps"] / 2
    finally:
        run(b.close())


def test_bad_requests_are_clear_errors(backend):
    from localrun.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        run(collect(backend, chatml("hi"), logit_bias={10**7: 1.0}))
    with pytest.raises(InvalidRequest, match="context window"):
        run(collect(backend, "word " * 1100))
    assert run(backend.stats())["running"] == 0


# -- through the real daemon ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("home_batch"), LOCALRUN_NUM_PARALLEL="8", LOCALRUN_CONTEXT_LENGTH="1024",
               LOCALRUN_BACKEND="llamacpp")
    try:
        d.pull()
        yield d
    finally:
        d.stop()


def _chat(d: Daemon, content: str, max_tokens: int = 32, system: str | None = None) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": MODEL, "messages": msgs, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "logprobs": True, "top_logprobs": 5, "stream_options": {"include_usage": True}}
    out = {"text": "", "tokens": [], "usage": None}
    with httpx.stream("POST", d.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            ev = json.loads(line[5:])
            for ch in ev.get("choices") or []:
                out["text"] += (ch.get("delta") or {}).get("content") or ""
                out["tokens"] += openai_tokens((ch.get("logprobs") or {}).get("content") or [])
            out["usage"] = ev.get("usage") or out["usage"]
    return out


def _metrics(d: Daemon) -> dict:
    return metric_samples(d.http.get("/metrics").text)


def _metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model": MODEL, **labels}.items()))), 0.0)


def test_eight_concurrent_streams_each_get_their_own_answer(daemon):
    alone = [_chat(daemon, q) for q in QUESTIONS]  # one at a time: the references
    m0 = _metrics(daemon)
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda q: _chat(daemon, q), QUESTIONS))
    wall = time.monotonic() - t0
    m1 = _metrics(daemon)
    for q, a, t in zip(QUESTIONS, alone, together):
        cmp = compare(a["tokens"], t["tokens"])
        assert cmp.acceptable, (q, a["text"], t["text"], cmp)
        if cmp.verdict == "same":
            assert t["text"] == a["text"]
    steps = _metric(m1, "localrun_engine_steps_total") - _metric(m0, "localrun_engine_steps_total")
    decoded = _metric(m1, "localrun_decode_tokens_total") - _metric(m0, "localrun_decode_tokens_total")
    assert decoded / steps > 3, (decoded, steps)  # the streams were decoded together, not one by one
    # llama_decode's time by step: the prompts' steps and the decode-only ones, within the phase's wall time
    prefill, decode = (_metric(m1, "localrun_compute_seconds_total", step=k) -
                       _metric(m0, "localrun_compute_seconds_total", step=k) for k in ("prefill", "decode"))
    assert prefill > 0 and decode > 0 and prefill + decode < wall, (prefill, decode, wall)


def test_a_cancelled_stream_frees_its_sequence(daemon):
    body = {"model": MODEL, "prompt": "Once upon a time", "stream": True, "max_tokens": 500, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", daemon.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert _metric(_metrics(daemon), "localrun_sequences", state="running") == 1
    deadline = time.monotonic() + 3
    while _metric(_metrics(daemon), "localrun_sequences", state="running"):
        assert time.monotonic() < deadline, "the cancelled sequence kept running"
        time.sleep(0.05)
    assert _chat(daemon, "What is 2+2?", max_tokens=8)["text"]


def test_a_shared_system_prompt_is_cached(daemon):
    first = _chat(daemon, "What is 2+2?", system=SYSTEM, max_tokens=8)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda q: _chat(daemon, q, system=SYSTEM, max_tokens=8), QUESTIONS[:4]))
    n_sys = first["usage"]["prompt_tokens"] - 20
    for o in outs:
        assert o["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_sys, o["usage"]


def test_bad_input_is_a_4xx_and_the_daemon_keeps_serving(daemon):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 5}}
    r = daemon.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "vocabulary" in r.text
    r = daemon.http.post("/v1/chat/completions", json={**body, "logit_bias": {"12": 500}})
    assert r.status_code == 400 and "logit_bias" in r.text
    r = daemon.http.post("/v1/chat/completions", json={**body, "logit_bias": {"12": -100}, "max_tokens": 4})
    assert r.status_code == 200
    r = daemon.http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 1200, "max_tokens": 4})
    assert r.status_code == 400 and "1024" in r.text
    assert _chat(daemon, "What is 2+2?", max_tokens=8)["text"]


def test_every_llama_cpp_params_field_the_backend_sets_exists():
    """A ctypes struct takes an attribute of any name: `mparams.use_mmap = False` set nothing once llama.cpp had
    replaced the field with load_mode, and PARAMETER use_mmap false was silently ignored. Every
    llama_context_params / llama_model_params / mtmd_context_params field the backends assign is a field."""
    import re
    from pathlib import Path

    import llama_cpp.llama_cpp as lib
    import llama_cpp.mtmd_cpp as mtmd

    root = Path(__file__).resolve().parent.parent / "localrun" / "backends" / "llamacpp"
    src = "".join(p.read_text() for p in root.glob("*.py"))
    for var, struct in (("cparams", lib.llama_context_params), ("mparams", lib.llama_model_params),
                        ("params", mtmd.mtmd_context_params)):
        used = set(re.findall(rf"\b{var}\.(\w+)\s*=[^=]", src))
        assert used, var
        assert used <= {f[0] for f in struct._fields_}, (var, used - {f[0] for f in struct._fields_})
