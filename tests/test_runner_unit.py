"""The runner's own machinery without a model: the worker's Runner loop (localrun.backends.runner.worker)
in a real subprocess, talking to the daemon side's RemoteBackend over a real socket pair. A backend
that reports an unrecoverable error (what a CUDA error does to the native engine) makes the runner
exit with status 70 after telling the daemon why; the daemon's error names it."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import pytest

from localrun.backends.runner import wire
from localrun.backends.base import GenerationRequest, SamplingOptions
from localrun.backends.runner.process import RemoteBackend, RunnerDied
from localrun.errors import BackendError

RUNNER = r'''
import asyncio, socket, sys
from localrun.backends.runner import wire
from localrun.backends.base import BackendInfo
from localrun.backends.runner.worker import Runner
from localrun.errors import BackendError

class Broken:
    fatal = None
    info = BackendInfo(name="broken", device="CUDA", processor="100% GPU", reason="test", context_length=64, slots=1)
    async def generate(self, request):
        if request.prompt == "ok":
            from localrun.backends.base import Chunk, Usage
            yield Chunk(text="fine", token_ids=[1])
            yield Chunk(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1))
            return
        self.fatal = "CUDA error: an illegal memory access was encountered"
        raise BackendError(self.fatal)
    async def close(self):
        pass

async def main():
    chan = await wire.Channel.connect(socket.socket(fileno=int(sys.argv[1])))
    chan.send({"t": "ready", "pid": 0, "info": wire.info_to_wire(Broken.info)})
    await Runner(chan, Broken()).serve()

asyncio.run(main())
'''


async def _start() -> RemoteBackend:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", RUNNER, str(theirs.fileno()),
                                                pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.PIPE)
    theirs.close()
    remote = RemoteBackend("broken:test", "native", proc, await wire.Channel.connect(ours))
    await asyncio.wait_for(remote._ready, 30)
    return remote


async def test_a_fatal_backend_error_ends_the_runner_with_a_clear_reason():
    remote = await _start()
    try:
        chunks = [c async for c in remote.generate(GenerationRequest("ok", SamplingOptions()))]
        assert chunks[0].text == "fine" and chunks[-1].finish_reason == "stop"
        with pytest.raises(BackendError) as e:  # the request that hit the error gets it, typed
            async for _ in remote.generate(GenerationRequest("boom", SamplingOptions())):
                pass
        assert "illegal memory access" in e.value.message
        died = await asyncio.wait_for(asyncio.shield(remote.exited), 10)
        assert isinstance(died, RunnerDied) and died.returncode == 70
        assert "unrecoverable error: CUDA error" in died.message and "broken:test" in died.message
        with pytest.raises(RunnerDied):  # and the next one on this runner is refused at once
            async for _ in remote.generate(GenerationRequest("ok", SamplingOptions())):
                pass
    finally:
        remote.kill()


SKEWED = r'''
import asyncio, socket, sys
from localrun.backends.runner import wire
from localrun.backends.base import BackendInfo, Chunk

mode = sys.argv[2]
info = wire.info_to_wire(BackendInfo(name="skewed", device="CPU", processor="100% CPU", reason="test",
                                     context_length=64, slots=1))

async def main():
    chan = await wire.Channel.connect(socket.socket(fileno=int(sys.argv[1])))
    if mode == "garbage":  # a frame that is no JSON
        chan.writer.write(wire.frame({})[:4].replace(b"\x02", b"\x05") + b"{{{{{")
    else:  # a newer runner: a field this daemon's BackendInfo lacks
        chan.send({"t": "ready", "pid": 0, "info": {**info, "from_the_future": 1}})
    while True:
        msg = await chan.recv()
        if msg.get("op") == "generate":
            chan.send({"t": "chunk", "id": msg["id"], "x": "one", "i": [1]})
            if mode == "bad-chunk":  # a chunk this daemon cannot read
                chan.send({"t": "chunk", "id": msg["id"], "x": "two"})
            else:
                chan.send({"t": "chunk", "id": msg["id"], "x": "", "i": [], "f": "stop",
                           "u": {"prompt_tokens": 1, "completion_tokens": 1}})

asyncio.run(main())
'''


async def _start_skewed(mode: str) -> RemoteBackend:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SKEWED, str(theirs.fileno()), mode,
                                                pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.PIPE)
    theirs.close()
    return RemoteBackend("skewed:test", "llamacpp", proc, await wire.Channel.connect(ours))


async def test_a_runner_of_a_newer_localrun_loads_and_serves():
    """Its BackendInfo has a field this daemon does not know: left out, the rest is read."""
    remote = await _start_skewed("newer")
    try:
        await asyncio.wait_for(remote._ready, 30)
        assert remote.info.name == "skewed" and remote.info.context_length == 64
        chunks = [c async for c in remote.generate(GenerationRequest("hi", SamplingOptions()))]
        assert chunks[0].text == "one" and chunks[-1].finish_reason == "stop"
    finally:
        remote.kill()
        await asyncio.wait_for(asyncio.shield(remote.exited), 10)


@pytest.mark.parametrize("mode", ["garbage", "bad-chunk"])
async def test_a_message_the_daemon_cannot_read_stops_the_runner_with_a_clear_error(mode):
    """What the daemon cannot read (no JSON; a chunk without its fields) used to end its reader task
    silently: the load (or the stream) then waited for ever, past LOCALRUN_LOAD_TIMEOUT too. Now the
    runner is stopped and everything waiting on it gets why, at once."""
    t0 = time.monotonic()
    remote = await _start_skewed(mode)
    try:
        if mode == "garbage":
            with pytest.raises(RunnerDied) as e:
                await asyncio.wait_for(asyncio.shield(remote._ready), 30)
            assert e.value.during_load and "while loading" in e.value.message
        else:
            await asyncio.wait_for(remote._ready, 30)
            got = []
            with pytest.raises(RunnerDied) as e:
                async for c in remote.generate(GenerationRequest("hi", SamplingOptions())):
                    got.append(c.text)
            assert got == ["one"] and "while serving" in e.value.message
        assert "sent a message the daemon could not read" in e.value.message
        assert "restart the daemon" in e.value.message and "skewed:test" in e.value.message
        assert "unloaded" not in e.value.message and "out-of-memory" not in e.value.message
        assert time.monotonic() - t0 < 20
        died = await asyncio.wait_for(asyncio.shield(remote.exited), 10)
        assert died is e.value or died.message == e.value.message
        with pytest.raises(RunnerDied):  # and the next request on it is refused at once
            async for _ in remote.generate(GenerationRequest("hi", SamplingOptions())):
                pass
    finally:
        remote.kill()
        await asyncio.wait_for(asyncio.shield(remote.exited), 10)


class _Pipe:
    """The runner's end of the channel, in process: messages in through a queue, out into a list."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []

    async def recv(self) -> dict:
        return await self.inbox.get()

    def send(self, obj: dict) -> None:
        self.sent.append(obj)

    async def drain(self) -> None:
        pass


class _Endless:
    """Generates until closed; says when it was closed."""

    fatal = None

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def generate(self, request):
        from localrun.backends.base import Chunk
        try:
            while True:
                await asyncio.sleep(0.001)
                yield Chunk(text="x", token_ids=[1])
        finally:
            self.closed.set()


async def test_abort_arriving_with_delivered_stops_the_generation():
    """The daemon's 'delivered' (first chunk handed on) and 'abort' (the client left) often arrive
    in one read. The runner must stop generating then too (Python 3.11's wait_for swallowed that
    cancel, and the abandoned answer ran to max_tokens in the background)."""
    from localrun.backends.runner.worker import Runner

    pipe, backend = _Pipe(), _Endless()
    serve = asyncio.ensure_future(Runner(pipe, backend).serve())
    try:
        req = wire.request_to_wire(GenerationRequest("go", SamplingOptions()))
        pipe.inbox.put_nowait({"op": "generate", "id": 1, "request": req})
        for _ in range(500):
            if pipe.sent:
                break
            await asyncio.sleep(0.01)
        assert pipe.sent and pipe.sent[0]["t"] == "chunk"
        pipe.inbox.put_nowait({"op": "delivered", "id": 1})
        pipe.inbox.put_nowait({"op": "abort", "id": 1})
        await asyncio.wait_for(backend.closed.wait(), 2)
        n = len(pipe.sent)
        await asyncio.sleep(0.1)
        assert len(pipe.sent) == n  # nothing more after the abort
    finally:
        pipe.inbox.put_nowait({"op": "close"})
        await asyncio.wait_for(serve, 5)


def test_merged_chunks_keep_the_last_chunks_stop_sequence():
    """What piles up for a slow consumer is merged (llama.cpp's queue and the runner pipe alike);
    the last chunk's finish_reason, usage and stop string must survive the merge."""
    from localrun.backends.base import Chunk, TokenLogprob, Usage, merge_chunks

    lp = TokenLogprob("a", -0.1, [])
    a = Chunk(text="Hel", token_ids=[1], logprobs=[lp])
    b = Chunk(text="lo", token_ids=[2], finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=2),
              stop_sequence="\n\n")
    m = merge_chunks(a, b)
    assert (m.text, m.token_ids, m.logprobs) == ("Hello", [1, 2], [lp])
    assert (m.finish_reason, m.usage, m.stop_sequence) == ("stop", b.usage, "\n\n")
    assert merge_chunks(Chunk(text="x"), Chunk(text="y")).logprobs is None


class _Echo:
    """A token per character; records the requests it was handed."""

    fatal = None

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.tokenized = 0

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        self.tokenized += 1
        return [ord(c) for c in text]

    async def generate(self, request):
        from localrun.backends.base import Chunk, Usage
        self.requests.append(request)
        yield Chunk(text="a", token_ids=[97])
        yield Chunk(finish_reason="length", usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1))


async def test_the_runner_tokenizes_a_request_with_a_window():
    """GenerationRequest.window and no token ids: the runner tokenizes, checks the window, caps
    max_tokens at the room left, and reports the prompt's length on the first chunk; a prompt that
    does not fit is the daemon's typed 400, and the backend never sees it."""
    from localrun.backends.runner.worker import Runner
    from localrun.errors import InvalidRequest

    pipe, backend = _Pipe(), _Echo()
    serve = asyncio.ensure_future(Runner(pipe, backend).serve())

    async def answer(rid: int) -> list[dict]:
        for _ in range(500):
            got = [m for m in pipe.sent if m.get("id") == rid]
            if got and (got[-1]["t"] == "error" or "f" in got[-1]):
                return got
            await asyncio.sleep(0.01)
        raise AssertionError(pipe.sent)

    try:
        req = GenerationRequest("hello", SamplingOptions(max_tokens=100), window=8)
        pipe.inbox.put_nowait({"op": "generate", "id": 1, "request": wire.request_to_wire(req)})
        first = wire.chunk_from_wire((await answer(1))[0])
        assert first.prompt_tokens == 5 and first.text == "a"
        assert backend.requests[0].prompt_token_ids == [ord(c) for c in "hello"]
        assert backend.requests[0].options.max_tokens == 3  # 8 - 5

        req = GenerationRequest("far too long", SamplingOptions(), window=8)
        pipe.inbox.put_nowait({"op": "generate", "id": 2, "request": wire.request_to_wire(req)})
        err = wire.error_from_wire((await answer(2))[-1]["error"])
        assert isinstance(err, InvalidRequest) and err.status == 400
        assert err.message.startswith("the prompt is 12 tokens but the context window is 8 tokens")
        assert len(backend.requests) == 1

        req = GenerationRequest("hi", SamplingOptions(), prompt_token_ids=[1, 2])  # the daemon tokenized
        pipe.inbox.put_nowait({"op": "generate", "id": 3, "request": wire.request_to_wire(req)})
        assert wire.chunk_from_wire((await answer(3))[0]).prompt_tokens is None
        assert backend.tokenized == 2 and backend.requests[-1].prompt_token_ids == [1, 2]
    finally:
        pipe.inbox.put_nowait({"op": "close"})
        await asyncio.wait_for(serve, 5)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_channel_to_a_dead_peer_drops_messages(loop):
    """Writing to a runner (or a daemon) that just died: uvloop raises RuntimeError on the closed
    transport where asyncio drops the write. The channel drops it on both; the reader's EOF and the
    process watcher say what happened."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")

    async def main():
        a, b = socket.socketpair()
        chan = await wire.Channel.connect(a)
        b.close()
        for _ in range(4):
            chan.send({"op": "abort", "id": 1})
            await asyncio.sleep(0.02)
        with pytest.raises(EOFError):
            await chan.recv()
        chan.close()

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


def _messages(data: bytes) -> list[dict]:
    """The framed messages (wire.frame) in `data`, in order."""
    out, pos = [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "little")
        out.append(wire.loads(data[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_message_sent_now_goes_out_before_the_turn_ends_after_those_queued_before_it(loop):
    """The daemon's messages go out together at the end of a turn of the event loop; a request's
    `generate` (on its way to the first token) goes out at once, behind whatever this turn queued
    before it, in order; what is queued after it waits for the turn's end as before."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")

    def framed(data: bytes) -> list[int]:
        return [m["id"] for m in _messages(data)]

    async def main():
        a, b = socket.socketpair()
        b.setblocking(False)
        chan = await wire.Channel.connect(a)
        chan.send({"op": "abort", "id": 1})
        chan.send({"op": "generate", "id": 2}, now=True)
        chan.send({"op": "delivered", "id": 3})
        now = framed(b.recv(1 << 16))  # before this turn ends: no await since the sends
        await asyncio.sleep(0.05)
        later = framed(b.recv(1 << 16))
        chan.close()
        b.close()
        return now, later

    now, later = (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    assert now == [1, 2] and later == [3]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_direct_channel_takes_whole_messages_from_a_thread_and_the_loop(loop):
    """The runner's end is direct: the llama.cpp loop's thread writes a step's chunks itself while
    the event loop sends its own messages (here large ones, as an embeddings result is, which the
    kernel takes in pieces). The other end (another process in life, a thread here) reads every
    message whole, each writer's in order (a write that cut into another's would garble the length
    prefixes); the socket buffer filling up (the reader starts late) is waited out; after close() a
    thread's write is dropped, and the reader sees the end."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
    import threading

    n_small, n_big = 2000, 30
    a, b = socket.socketpair()
    got: dict[int, list[int]] = {1: [], 2: []}

    def read_all():
        time.sleep(0.3)  # late: both writers meet a full buffer first
        data = b"".join(iter(lambda: b.recv(1 << 20), b""))  # everything, until the runner's end closes
        for msg in _messages(data):
            got[msg["id"]].append(msg["i"][0] if msg["id"] == 1 else msg["result"])

    async def main():
        runner = await wire.Channel.connect(a, direct=True)

        def thread_writes():
            for i in range(0, n_small, 10):  # a step's chunks, framed and written together
                runner.write(b"".join(wire.frame({"t": "chunk", "id": 1, "i": [j], "x": "tok"})
                                      for j in range(i, i + 10)))
                time.sleep(0.0005)

        writer = threading.Thread(target=thread_writes)
        writer.start()
        for i in range(n_big):
            runner.send({"t": "result", "id": 2, "result": i, "x": "v" * 400_000})
            await asyncio.sleep(0.01)
        await asyncio.to_thread(writer.join)
        runner.close()
        runner.write(wire.frame({"t": "chunk", "id": 1, "i": [n_small]}))  # dropped: closed

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    reader.join(30)
    assert not reader.is_alive()
    assert got[1] == list(range(n_small)) and got[2] == list(range(n_big))
    b.close()


def test_start_runner_reports_a_runner_killed_before_its_load_order(monkeypatch):
    """A runner killed as it starts (before the daemon wrote its load order to stdin) is RunnerDied
    ('while loading'), on uvloop too, not whatever the write to its dead pipe raised."""
    uvloop = pytest.importorskip("uvloop")
    from localrun.backends.runner import process
    from localrun.backends.base import LoadSpec

    real = asyncio.create_subprocess_exec

    async def spawn_and_kill(*args, **kw):
        proc = await real(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                          stdin=kw["stdin"], pass_fds=kw.get("pass_fds", ()))
        await proc.wait()
        await asyncio.sleep(0.05)
        return proc

    monkeypatch.setattr(process.asyncio, "create_subprocess_exec", spawn_and_kill)
    spec = LoadSpec(name="m:latest", weights=__import__("pathlib").Path("/nonexistent"), format="gguf", num_ctx=64,
                    num_parallel=1, embedding=False, extra={})

    async def main():
        with pytest.raises(RunnerDied) as e:
            await process.start_runner(spec, "llamacpp", timeout=20)
        assert e.value.during_load and "SIGKILL" in e.value.message

    uvloop.run(main())
