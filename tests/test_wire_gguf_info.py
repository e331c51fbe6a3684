"""The daemon's parsed GGUF header travels to a runner with the load order (localrun.backends.runner.wire): the runner's
backend must read the same answers from what arrives as from the header itself, on real GGUF files: the bundled
SmolLM2, the tiny XLM-RoBERTa embedder and reranker (a classifier's output labels: an array that must travel), and
the reranker with a chat-template-like rerank template (a long string that stays behind)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from localrun.backends.runner import wire
from localrun.backends.base import LoadSpec
from localrun.backends.llamacpp.pooled import backend_pooling, is_causal, pooled_window
from localrun.backends.llamacpp.memory import _head_sizes, estimate_memory, kv_type_for_model
from localrun.library import read_gguf_info
from localrun.library.capabilities import gguf_kind


def _models(smollm2_gguf, xlmr_ggufs):
    embed, rerank, templated = xlmr_ggufs
    return [(smollm2_gguf, False), (embed, True), (rerank, True), (templated, True)]


def test_a_runner_reads_the_same_header_as_the_daemon(smollm2_gguf, xlmr_ggufs):
    kinds = []
    for path, embedding in _models(smollm2_gguf, xlmr_ggufs):
        info = read_gguf_info(path)
        spec = LoadSpec(name="m", weights=path, format="gguf", num_ctx=2048, num_parallel=3, embedding=embedding,
                        extra={"gguf_info": info, "kv_cache_type": "q8_0"})
        sent = wire.dumps({"spec": wire.spec_to_wire(spec)})
        assert len(sent) < 8192, f"{path.name}: {len(sent)} bytes (the vocabulary must stay behind)"
        got = wire.spec_from_wire(wire.loads(sent)["spec"])
        there = got.extra["gguf_info"]
        assert there is not info and not hasattr(there, "tensor_dims")
        kinds.append(gguf_kind(there))
        assert gguf_kind(there) == gguf_kind(info)
        assert _head_sizes(there) == _head_sizes(info)
        assert kv_type_for_model("q8_0", there) == kv_type_for_model("q8_0", info)
        assert estimate_memory(got) == estimate_memory(spec)
        if embedding:
            assert (backend_pooling(there), is_causal(there), pooled_window(got, there)) == \
                (backend_pooling(info), is_causal(info), pooled_window(spec, info))
    assert kinds == ["completion", "embedding", "rerank", "rerank"]


def test_without_a_header_the_runner_reads_the_file(smollm2_gguf):
    """A load order without the header (another caller of the Backend protocol) still loads: the runner reads
    the file's header itself."""
    spec = LoadSpec(name="m", weights=smollm2_gguf, format="gguf", num_ctx=2048, num_parallel=2)
    got = wire.spec_from_wire(json.loads(json.dumps(wire.spec_to_wire(spec))))
    assert "gguf_info" not in got.extra
    assert estimate_memory(got) == estimate_memory(
        LoadSpec(name="m", weights=smollm2_gguf, format="gguf", num_ctx=2048, num_parallel=2,
                 extra={"gguf_info": read_gguf_info(smollm2_gguf)}))


def test_a_runner_given_the_header_loads_without_the_gguf_reader(smollm2_gguf):
    """The point of sending it: a runner process given the header neither imports gguf-py nor reads the header
    again (a direct load, with no size from the daemon, estimates its memory from it)."""
    spec = LoadSpec(name="m", weights=smollm2_gguf, format="gguf", num_ctx=512, num_parallel=1,
                    extra={"gguf_info": read_gguf_info(smollm2_gguf), "n_threads": 1})
    code = ("import json, sys\n"
            "from localrun.backends.runner import wire\n"
            "from localrun.backends.llamacpp import load\n"
            "b = load(wire.spec_from_wire(json.loads(sys.stdin.read())))\n"
            "print(json.dumps({'gguf': 'gguf' in sys.modules, 'ctx': b.info.context_length}))\n")
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(wire.spec_to_wire(spec)), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"gguf": False, "ctx": 512}, (out, r.stderr[-1000:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
