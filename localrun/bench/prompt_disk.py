"""`localrun bench prompt-disk`: a long system prompt's time to the first token cold, and after a restart with
the prompt cache on disk (backends/prompt_disk.py), as an agent's first request after a daemon restart meets it.

In-process llama.cpp backends, as a runner process loads them; a restart is a fresh backend (a new context, its
KV cache empty) over the same cache folder (a temporary one). Cold: the system prompt and question 1, nothing
cached. Then a restart and question 1 again (its greedy answer must be the cold one), and another restart and
question 2 (the same system prompt: what is shared is the system prompt only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("prompt-disk", help="a long system prompt's TTFT cold vs after a restart (the prompt cache on disk)")
    p.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=20000, help="about this many tokens of system prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of each greedy answer")


def _system(words: int) -> str:
    return "You are a coding agent. Follow the rules below.\n" + "\n".join(
        f"Rule {i}: file src/module_{i % 97}.py keeps function f_{i}() returning {i * 31 % 1009}." for i in range(max(1, words // 28)))


def _prompt(system: str, question: str) -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


async def _ask(spec, prompt: str, max_tokens: int) -> tuple[float, str, dict, int]:
    from localrun.backends.base import GenerationRequest, SamplingOptions
    from localrun.backends.llamacpp.backend import LlamaCppBackend

    b = LlamaCppBackend(spec)
    try:
        n = len(await b.tokenize(prompt))
        t0 = time.perf_counter()
        first, text = None, ""
        async for c in b.generate(GenerationRequest(prompt=prompt, request_id="bench",
                                                    options=SamplingOptions(temperature=0, max_tokens=max_tokens))):
            if first is None and c.text:
                first = time.perf_counter() - t0
            text += c.text
        if b.engine.disk is not None:
            b.engine.disk.disk.flush(600)
        return first or time.perf_counter() - t0, text, await b.stats(), n
    finally:
        await b.close()


def run(args: argparse.Namespace) -> int:
    from localrun.backends.base import LoadSpec
    from localrun.library.catalog import bundled_gguf

    gguf = args.gguf or bundled_gguf()
    if gguf is None or not Path(gguf).is_file():
        raise SystemExit(f"no such GGUF file: {gguf} (give --gguf)")
    system = _system(args.tokens)
    q1, q2 = "Which function does src/module_5.py keep?", "What does f_12() return?"
    with tempfile.TemporaryDirectory(prefix="localrun-prompt-disk-") as folder:
        def spec():
            return LoadSpec(Path(gguf).stem, Path(gguf), "gguf", num_ctx=int(args.tokens * 1.6) + 1024, num_parallel=1,
                            extra={"prompt_cache_dir": folder, "prompt_cache_disk": 64 << 30, "prompt_cache_min": 1024,
                                   # a fixed thread count: the automatic one follows other processes' load, and
                                   # llama.cpp rounds differently at another count (greedy answers would differ)
                                   "n_threads": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                   else (os.cpu_count() or 1)})

        cold, cold_text, st, n = asyncio.run(_ask(spec(), _prompt(system, q1), args.max_tokens))
        print(f"{Path(gguf).name}: {n} prompt tokens; cold TTFT {cold:.2f} s; state written: "
              f"{st.get('disk_written_bytes', 0) / 2**20:.0f} MiB", flush=True)
        same, same_text, st, _ = asyncio.run(_ask(spec(), _prompt(system, q1), args.max_tokens))
        print(f"after a restart, the same request: TTFT {same:.2f} s ({same / cold:.1%} of cold), "
              f"{st.get('disk_restored_tokens', 0)} tokens read back; greedy answer "
              f"{'the same as cold' if same_text == cold_text else 'DIFFERENT from cold'}", flush=True)
        other, _, st, _ = asyncio.run(_ask(spec(), _prompt(system, q2), args.max_tokens))
        print(f"after a restart, the same system prompt and another question: TTFT {other:.2f} s ({other / cold:.1%} "
              f"of cold), {st.get('disk_restored_tokens', 0)} tokens read back", flush=True)
    return 0 if same_text == cold_text else 1


__all__ = ["add_parser", "run"]
