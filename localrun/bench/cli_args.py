"""The argument groups and helpers `localrun bench`'s subcommands share: engine options, result saving, printing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def console(stderr: bool = True):
    from rich.console import Console

    return Console(stderr=stderr)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def ladder(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,10,50,100, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return vals


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (table on stderr)")
    p.add_argument("--out", type=Path, default=None, help="JSONL file results are appended to (default: results/bench.jsonl)")
    p.add_argument("--no-save", action="store_true", help="do not append the result to the JSONL file")


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a library model name, a .gguf file or a safetensors directory")
    p.add_argument("--random-weights", action="store_true", help="random weights with the exact --shape (no download)")
    p.add_argument("--shape", help="named shape for --random-weights, e.g. llama-3.1-8b, smollm2-135m")


def add_engine(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    g.add_argument("--gpu-memory-fraction", type=float, default=None, help="CUDA: weights + KV pool share (default 0.8)")
    g.add_argument("--kv-memory-gb", type=float, default=None, help="CPU: KV pool budget in GiB")
    g.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                   help="size the KV pool for this many tokens (when --kv-memory-gb is not given)")
    g.add_argument("--host-cache", default=None,
                   help="prefix cache host tier: a size ('4GiB'), a fraction of available RAM ('0.1'), 0 = off "
                        "(default: the engine's)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--max-model-len", type=positive_int, default=None)
    g.add_argument("--page-size", type=positive_int, default=None)
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (torch.set_num_threads; default: torch's choice)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly (default on CUDA: CUDA graphs)")
    g.add_argument("--no-overlap", action="store_true", help="serial steps (default on CUDA: overlap scheduling)")
    g.add_argument("--fused-sampling", action="store_true",
                   help="plain temperature draws in one Triton kernel at every batch size (EngineConfig.fused_sampling; "
                        "default: batches of up to 8 rows)")


def _host_cache_bytes(text: str | None) -> int | None:
    if text is None:
        return None
    from localrun.config import parse_host_cache

    try:
        v = parse_host_cache(text)
    except ValueError as exc:
        raise SystemExit(f"--host-cache: {exc}") from None
    if isinstance(v, float):
        from localrun.engine.kv.host import available_ram

        return int(v * available_ram())
    return v


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    kv = None if a.kv_memory_gb is None else int(a.kv_memory_gb * (1 << 30))
    return {
        "device": a.device, "dtype": a.dtype, "gpu_memory_fraction": a.gpu_memory_fraction, "kv_memory_bytes": kv,
        "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_model_len": a.max_model_len, "page_size": a.page_size, "kv_cache_tokens": a.kv_cache_tokens,
        "host_cache_bytes": _host_cache_bytes(a.host_cache),
        "cuda_graphs": False if a.no_cuda_graphs else None, "overlap": False if a.no_overlap else None,
        "fused_sampling": a.fused_sampling,
    }



def source(a: argparse.Namespace):
    from localrun.bench.throughput import resolve_model

    return resolve_model(a.model, a.random_weights, a.shape)


def finish(result: dict[str, Any], a: argparse.Namespace, rows_fn) -> int:
    from localrun.bench.results import append_result, environment

    result["env"] = environment()
    if not a.no_save:
        path = append_result(result, a.out)
        result["saved_to"] = str(path)
    if a.json:
        rows_fn(console(stderr=True))
        print(json.dumps(result, indent=2, default=str))
    else:
        con = console(stderr=False)
        rows_fn(con)
        if not a.no_save:
            con.print(f"[dim]appended to {result['saved_to']}[/dim]")
    return 0
