"""Ray Serve replicas of the native engine: a local Ray (2 CPUs, no dashboard) runs 2 replicas of the real
SmolLM2 GGUF on CPU behind the OpenAI-compatible ingress; the real `openai` SDK calls it, streamed and not,
and a conversation's turns land on the replica that holds its prefix while new conversations spread."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time

import pytest

from localrun.cluster.ray_serve import REPLICA_HEADER, ModelSource, ModelTooLarge, build_app, check_fits

HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray[serve] is not installed: pip install \"localrun[ray]\"")
if HAVE_RAY:
    import openai
    import ray
    from ray import serve

pytestmark = pytest.mark.timeout(240)


def test_works_without_ray(tmp_path):
    """localrun and its ray-serve command import without Ray; the command then says how to install it."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import localrun.cli, localrun.cluster.ray_serve as m\n"
            "sys.exit(localrun.cli.main(['ray-serve', 'model.gguf']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and 'pip install "localrun[ray]"' in r.stderr, r.stderr


@needs_ray
def test_cli_errors_before_touching_ray(capsys):
    from localrun.cli import main

    assert main(["ray-serve", "/nonexistent/model.gguf", "--replicas", "2"]) == 1
    assert "no such GGUF file" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    from localrun.library.gguf_info import read_gguf_info

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
        src = ModelSource(name="smollm2", weights=str(smollm2_gguf),
                          template=read_gguf_info(smollm2_gguf).chat_template)
        app = build_app(src, replicas=2, num_ctx=1024, num_parallel=2, cpus_per_replica=0.5, device="cpu")
        serve.run(app, name="localrun", route_prefix="/")
        print(f"ray up + 2 replicas ready in {time.perf_counter() - t0:.1f}s")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
        yield client
    finally:
        ray.shutdown()  # stops the local Ray and every Serve actor in it (serve.shutdown first only adds seconds)


@needs_ray
def test_models(served):
    assert [m.id for m in served.models.list().data] == ["smollm2"]
    assert served.models.retrieve("smollm2").id == "smollm2"


@needs_ray
def test_chat_not_streamed(served):
    raw = served.chat.completions.with_raw_response.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0)
    r = raw.parse()
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 10
    assert raw.headers[REPLICA_HEADER] == r.model_extra["localrun_replica"]


@needs_ray
def test_chat_streamed(served):
    stream = served.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert len({c.model_extra["localrun_replica"] for c in chunks}) == 1
    # greedy: the same question, not streamed, gives the same text
    r = served.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Name three colors."}],
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content == text


@needs_ray
def test_completions_and_errors(served):
    r = served.completions.create(model="smollm2", prompt="The sky is", max_tokens=6, temperature=0)
    assert r.choices[0].text and r.model_extra["localrun_replica"]
    s = list(served.completions.create(model="smollm2", prompt="The sky is", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text
    with pytest.raises(openai.NotFoundError, match="not served here"):
        served.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="context window"):
        served.completions.create(model="smollm2", prompt="word " * 1200, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="images are not supported on the Ray Serve ingress"):
        served.chat.completions.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "text", "text": "what is this?"}]}])


TOPICS = [
    "the migration routes of arctic terns between Greenland and the Weddell Sea, and how they navigate",
    "the chemistry of sourdough fermentation, wild yeasts and lactic acid bacteria in a rye starter",
    "how a four-stroke diesel engine differs from a petrol engine in ignition and compression ratio",
    "the history of the printing press in fifteenth century Mainz and the spread of movable type",
]


@needs_ray
def test_prefix_affinity(served):
    """Each conversation's later turns land on the replica of its first turn, and hit its prefix cache;
    different conversations use both replicas."""
    t0 = time.perf_counter()
    first, cached = {}, []
    convs = {i: [{"role": "user", "content": f"Tell me briefly about {t}."}] for i, t in enumerate(TOPICS)}
    for turn in range(3):
        for i, msgs in convs.items():
            raw = served.chat.completions.with_raw_response.create(model="smollm2", messages=msgs, max_tokens=8,
                                                                   temperature=0)
            r = raw.parse()
            rep = raw.headers[REPLICA_HEADER]
            assert r.model_extra["localrun_replica"] == rep
            if turn == 0:
                first[i] = rep
            else:
                assert rep == first[i], f"conversation {i} turn {turn} went to {rep}, its prefix is on {first[i]}"
                cached.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Go on."}]
    assert len(set(first.values())) == 2, f"new conversations did not spread over both replicas: {first}"
    # the routed-to replica really had the conversation's KV: most of every later prompt came from its cache
    assert min(cached) > 0.5, cached
    print(f"{3 * len(TOPICS)} chat turns in {time.perf_counter() - t0:.1f}s; cached fraction {min(cached):.2f}..")


@needs_ray
def test_too_large_for_one_node(served, smollm2_gguf):
    """A memory plan over the largest node is refused, pointing to vLLM on Ray."""
    src = ModelSource(name="smollm2", weights=str(smollm2_gguf))
    assert check_fits(src, 1024, 2, "cpu", 0) > 0
    with pytest.raises(ModelTooLarge, match="vLLM on Ray"):
        check_fits(src, 1 << 20, 4096, "cpu", 0)  # a KV plan of terabytes


@needs_ray
def test_prefix_table_bounds_and_matching():
    from localrun.cluster.router import PrefixTable

    t = PrefixTable(block_chars=4, max_blocks=10)
    t.insert("abcdefgh-12", "r1")  # blocks abcd, efgh (the tail "-12" is not a full block)
    assert t.match("abcdefgh-12 and more", {"r1"}) == ("r1", 8, True)  # extends a whole earlier prompt
    assert t.match("abcdXXXX", {"r1"}) == ("r1", 4, False)  # only a shared head
    assert t.match("abcdefgh", {"r2"}) == (None, 0, False)  # r1 is gone
    t.insert("zzzz" * 20, "r2")  # 20 blocks into a table of 10: the oldest go first
    assert len(t) == 10 and t.match("abcdefgh", None) == (None, 0, False)
    t.drop("r2")
    assert len(t) == 0
    with pytest.raises(ValueError, match="at least 1"):
        PrefixTable(block_chars=0)


@needs_ray
def test_autoscaling_bounds_and_validation(smollm2_gguf):
    """--min/--max-replicas become Serve's autoscaling config on the replica deployment (with our router);
    bad bounds are refused with the reason."""
    from localrun.errors import InvalidRequest

    src = ModelSource(name="smollm2", weights=str(smollm2_gguf))
    app = build_app(src, replicas=2, min_replicas=1, max_replicas=3, num_parallel=4, check_memory=False)
    replica = app._bound_deployment.init_args[0]._bound_deployment  # the ingress is bound to the replica app
    cfg = replica._deployment_config
    a = cfg.autoscaling_config
    assert (a.min_replicas, a.initial_replicas, a.max_replicas, a.target_ongoing_requests) == (1, 2, 3, 4)
    assert cfg.request_router_config.request_router_class == "localrun.cluster.router.PrefixAffinityRouter"
    fixed = build_app(src, replicas=3, check_memory=False)._bound_deployment.init_args[0]._bound_deployment
    assert fixed._deployment_config.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None
    with pytest.raises(InvalidRequest, match="min-replicas"):
        build_app(src, min_replicas=4, max_replicas=2, check_memory=False)
    with pytest.raises(InvalidRequest, match="one GPU"):
        build_app(src, gpus_per_replica=2, check_memory=False)
