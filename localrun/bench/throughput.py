"""`localrun bench throughput`: offline throughput, engine in-process.

Method (docs/benchmarks.md): ShareGPT prompts sampled as vLLM does, a
warm-up of 20 prompts, then timed passes of ``engine.generate`` over all prompts with
temperature 1.0, top_p 1.0, ignore_eos and max_tokens = the real completion length, so
every engine produces the same token counts (a pass where any request's token count differs
from what was asked fails the run). Throughput = tokens / wall time of the generate call
(model load excluded). ``--baseline transformers`` runs HF generate on the
same prompts in the same process afterwards (batched as vLLM's ``run_hf`` does).

Imports only torch / transformers / rich / psutil (+ the engine): no server dependencies.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from localrun.bench.dataset import DatasetError, PromptSet

BUNDLED_PROMPTS = Path(__file__).resolve().parent / "data" / "sharegpt-smollm2-1000.jsonl.gz"

# Dense bf16 peak TFLOP/s of devices the reference names (for "fraction of the ceiling").
PEAK_TFLOPS = {"H100": 800.0, "H200": 800.0}


class ThroughputError(Exception):
    """Bad arguments or an unusable model; the message says what to do."""


@dataclass
class BenchModelSource:
    """The model a benchmark runs: a GGUF file, a safetensors dir, or random weights of a named shape."""

    kind: str  # "gguf" | "safetensors" | "random"
    path: Path | None = None
    shape: str | None = None
    name: str = ""


def resolve_model(model: str | None, random_weights: bool = False, shape: str | None = None) -> BenchModelSource:
    """--model (a GGUF file, a safetensors dir, or a library name) or --random-weights --shape."""
    if random_weights:
        if not shape:
            raise ThroughputError("--random-weights needs --shape, e.g. --shape llama-3.1-8b")
        from localrun.engine.models.shapes import SHAPES

        if shape.lower() not in SHAPES:
            raise ThroughputError(f"unknown --shape {shape!r}; known: {', '.join(SHAPES)}")
        return BenchModelSource("random", shape=shape.lower(), name=f"random:{shape.lower()}")
    if not model:
        raise ThroughputError("pass --model (a library model, a .gguf file or a safetensors dir) or --random-weights --shape NAME")
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return BenchModelSource("gguf", p, name=p.name)
    if p.is_dir():
        if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            return BenchModelSource("safetensors", p, name=p.name)
        raise ThroughputError(f"{p} is not a safetensors model directory (config.json + *.safetensors)")
    return _resolve_library(model)


def _resolve_library(name: str) -> BenchModelSource:
    try:
        from localrun.library.api import Library
    except ImportError as exc:
        raise ThroughputError(
            f"{name!r} is not a file or directory, and the model library is not available here ({exc}): "
            "pass a .gguf path or a safetensors directory"
        ) from None
    try:
        rm = Library().resolve(name)
    except Exception as exc:  # the library's NotFound / InvalidRequest carry a message
        raise ThroughputError(f"{name}: {getattr(exc, 'message', exc)}") from None
    return BenchModelSource(rm.format, Path(rm.weights), name=rm.name)


def engine_config(args: dict[str, Any]):
    from localrun.engine import EngineConfig

    kw = {k: v for k, v in args.items() if v is not None}
    try:
        return EngineConfig(**kw)
    except (TypeError, ValueError) as exc:
        raise ThroughputError(f"bad engine setting: {exc}") from None


def load_engine(src: BenchModelSource, config, engine_class=None):
    """The engine of `src`; `engine_class` a subclass of LLMEngine to build instead (bench profile's)."""
    from localrun.engine import LLMEngine

    cls = engine_class or LLMEngine
    if src.kind == "gguf":
        return cls.from_gguf(src.path, config)
    if src.kind == "safetensors":
        return cls.from_safetensors(src.path, config)
    return cls.from_random(src.shape, config, seed=0)


def engine_encoder(engine) -> Callable[[str], list[int]] | None:
    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        return None
    return lambda text: tok.encode(text, add_special=True)  # == HF tokenizer(text).input_ids


def check_vocab(prompts: PromptSet, vocab_size: int) -> None:
    top = max(max(r.prompt_token_ids) for r in prompts.requests)
    if top >= vocab_size:
        raise ThroughputError(
            f"the prompts hold token id {top} but the model's vocabulary has {vocab_size} entries: "
            "sample prompts with this model's tokenizer (--tokenizer DIR, or `localrun bench sample`)"
        )


def _params(requests, ignore_eos: bool = True):
    from localrun.engine import SamplingParams

    return [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=ignore_eos, max_tokens=r.output_len) for r in requests]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def rates(num_requests: int, input_tokens: int, output_tokens: int, elapsed: float) -> dict[str, float]:
    return {
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "input_tok_s": input_tokens / elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (input_tokens + output_tokens) / elapsed,
    }


def run_engine(engine, prompts: PromptSet, warmup: int, passes: int, console=None) -> dict[str, Any]:
    """Warm-up, then ``passes`` timed generate calls over all prompts."""
    from localrun.bench.results import PeakMemory, progress_bar

    device = str(getattr(getattr(engine, "config", None), "device", "cpu"))
    reqs = prompts.requests
    if warmup:
        w = reqs[:warmup]
        prog, update = progress_bar("warm-up", len(w), console)
        with prog:
            engine.generate([r.prompt_token_ids for r in w], _params(w), progress=update)
    clear = getattr(engine, "clear_prefix_cache", None)
    pass_results = []
    with PeakMemory() as mem:
        for i in range(passes):
            if callable(clear):  # no pass may reuse the KV of the warm-up or of an earlier pass
                clear()
            prog, update = progress_bar(f"pass {i + 1}/{passes}", len(reqs), console)
            with prog:
                _sync(device)
                t = time.perf_counter()
                outs = engine.generate([r.prompt_token_ids for r in reqs], _params(reqs), progress=update)
                _sync(device)
                elapsed = time.perf_counter() - t
            input_tokens = sum(o.prompt_tokens for o in outs)
            output_tokens = sum(o.completion_tokens for o in outs)
            mismatched = sum(
                1 for o, r in zip(outs, reqs)
                if o.completion_tokens != r.output_len or len(o.token_ids) != r.output_len or o.prompt_tokens != r.prompt_len
            )
            if mismatched:
                first = next((r, o) for o, r in zip(outs, reqs) if o.completion_tokens != r.output_len
                             or len(o.token_ids) != r.output_len or o.prompt_tokens != r.prompt_len)
                raise ThroughputError(
                    f"{mismatched} of {len(reqs)} requests did not produce exactly the tokens asked (e.g. "
                    f"{first[0].prompt_len} prompt / {first[0].output_len} output tokens asked, "
                    f"{first[1].prompt_tokens} / {first[1].completion_tokens} counted, finish "
                    f"{first[1].finish_reason!r}): the throughput would not be comparable")
            pass_results.append({
                "input_tokens": input_tokens, "output_tokens": output_tokens,
                "cached_tokens": sum(o.cached_tokens for o in outs),
                "mismatched_requests": mismatched,
                **rates(len(outs), input_tokens, output_tokens, elapsed),
            })
    return _summarise(pass_results, len(reqs), mem)


def _summarise(passes: list[dict[str, Any]], num_requests: int, mem) -> dict[str, Any]:
    """Totals over all passes: tok/s = all tokens / all generate time (= mean rate)."""
    elapsed = sum(p["elapsed_s"] for p in passes)
    inp = sum(p["input_tokens"] for p in passes) // len(passes)
    out = sum(p["output_tokens"] for p in passes) // len(passes)
    res = {
        "requests": num_requests,
        "input_tokens": inp,
        "output_tokens": out,
        **rates(num_requests * len(passes), inp * len(passes), out * len(passes), elapsed),
        "passes": passes,
        **mem.as_dict(),
    }
    res["elapsed_s"] = elapsed / len(passes)  # per pass
    return res


# ---------------------------------------------------------------------------------------
# The transformers baseline
# ---------------------------------------------------------------------------------------


def _dtype_kw(dtype) -> dict[str, Any]:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def hf_config_for(cfg) -> Any:
    """A transformers config with the exact shape of an engine ModelConfig."""
    from transformers import AutoConfig

    kw = dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.rope_scaling:
        kw["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.arch == "llama":
        kw["attention_bias"] = cfg.attention_bias
    if cfg.rotary_dim and cfg.rotary_dim != cfg.head_dim:  # Phi-4-mini: partial rotary
        kw["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if cfg.arch != "llama":  # (transformers' Mistral defaults to a 4096 window: say there is none)
        kw["sliding_window"] = cfg.sliding_window or None
    if cfg.sliding_window and cfg.layer_types:
        kw["layer_types"] = cfg.layer_types
    if cfg.is_gemma:
        kw.update(query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                  attn_logit_softcapping=cfg.attn_logit_softcap or None,
                  final_logit_softcapping=cfg.final_logit_softcap or None)
        if cfg.rope_local_theta:
            kw["rope_local_base_freq"] = cfg.rope_local_theta
    return AutoConfig.for_model("gemma3_text" if cfg.arch == "gemma3" else cfg.arch, **kw)


def load_hf_model(src: BenchModelSource, model_config, dtype, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    if src.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, **_dtype_kw(dtype))
    elif src.kind == "safetensors":
        model = AutoModelForCausalLM.from_pretrained(str(src.path), **_dtype_kw(dtype))
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config_for(model_config), **_dtype_kw(dtype))
    return model.to(device).eval()


def hf_batches(requests, max_batch_size: int) -> list[list]:
    """vLLM run_hf's batching: in order, grow a batch while it has room and
    max(prompt) + max(output) stays <= 2048."""
    batches, batch = [], []
    max_p = max_o = 0
    for i, r in enumerate(requests):
        batch.append(r)
        max_p, max_o = max(max_p, r.prompt_len), max(max_o, r.output_len)
        if len(batch) < max_batch_size and i != len(requests) - 1:
            nxt = requests[i + 1]
            if max(max_p, nxt.prompt_len) + max(max_o, nxt.output_len) <= 2048:
                continue
        batches.append(batch)
        batch, max_p, max_o = [], 0, 0
    return batches


def run_hf_baseline(model, prompts: PromptSet, max_batch_size: int, device: str, console=None) -> dict[str, Any]:
    """HF generate, sampling at temperature 1.0 / top_p 1.0, each batch generating exactly
    its longest output (min_new_tokens = max_new_tokens: EOS ignored, as for the engine).
    Credited tokens are the requests' real lengths, as vLLM's run_hf counts them."""
    import torch

    from localrun.bench.results import PeakMemory, progress_bar

    reqs = prompts.requests
    batches = hf_batches(reqs, max_batch_size)
    generated = 0
    with PeakMemory() as mem:
        prog, update = progress_bar("transformers baseline", len(reqs), console)
        with prog, torch.inference_mode():
            _sync(device)
            t = time.perf_counter()
            done = 0
            for batch in batches:
                width = max(r.prompt_len for r in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for j, r in enumerate(batch):  # left padding
                    ids[j, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
                    mask[j, width - r.prompt_len:] = 1
                n = max(r.output_len for r in batch)
                out = model.generate(
                    input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0,
                    top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n, use_cache=True, pad_token_id=0,
                )
                generated += (out.shape[1] - width) * len(batch)
                done += len(batch)
                update(done)
            _sync(device)
            elapsed = time.perf_counter() - t
    inp, outp = prompts.input_tokens, prompts.output_tokens
    return {
        "requests": len(reqs), "input_tokens": inp, "output_tokens": outp, "batches": len(batches),
        "max_batch_size": max_batch_size, "generated_tokens_incl_padding": generated,
        **rates(len(reqs), inp, outp, elapsed), **mem.as_dict(),
    }


def model_flops_fraction(total_tok_s: float, num_params: int, device: str) -> dict[str, Any]:
    """~2 x params FLOPs per token (a mixture of experts' active ones; attention excluded): achieved TFLOP/s
    and, on a device the reference gives a ceiling for, the fraction of it."""
    tflops = total_tok_s * 2 * num_params / 1e12
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    return {"model_tflops": tflops, "peak_tflops": peak, "fraction_of_peak": (tflops / peak) if peak else None}


def shutdown_engine(engine) -> None:
    """Stop the engine's loop if it runs; the caller then drops its last reference and
    calls release_memory() (an 8B model and its KV pool must be gone before the next load)."""
    fn = getattr(engine, "shutdown", None)
    if callable(fn):
        try:
            fn()
        except Exception:
            pass


def release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_prompts(
    num_prompts: int,
    prompts_file: Path | None = None,
    dataset: Path | None = None,
    tokenizer: str | None = None,
    engine=None,
    console=None,
) -> PromptSet:
    """The workload: a prompt file, or ShareGPT sampled with --tokenizer or the engine's
    tokenizer; random-weight models with neither use the bundled SmolLM2-tokenized file."""
    from localrun.bench.dataset import hf_encoder, load_hf_tokenizer, read_prompt_file, sample_sharegpt
    from localrun.bench.results import progress_bar

    if prompts_file:
        return read_prompt_file(prompts_file, num_prompts)
    if tokenizer:
        encode = hf_encoder(load_hf_tokenizer(tokenizer))
        source = str(tokenizer)
    else:
        encode = engine_encoder(engine) if engine is not None else None
        source = "model"
        if encode is None:
            if BUNDLED_PROMPTS.is_file():
                if console is not None:
                    console.print(f"[dim]no tokenizer: using the bundled prompts {BUNDLED_PROMPTS.name} "
                                  "(ShareGPT, SmolLM2 tokenizer); pass --tokenizer DIR for the model's own[/dim]")
                return read_prompt_file(BUNDLED_PROMPTS, num_prompts)
            raise ThroughputError("a random-weight model has no tokenizer: pass --tokenizer DIR or --prompts FILE")
    prog, update = progress_bar("sampling ShareGPT", num_prompts, console)
    with prog:
        ps = sample_sharegpt(encode, num_prompts, dataset, progress=update)
    ps.meta["tokenizer"] = source
    return ps


def run_throughput(
    src: BenchModelSource,
    num_prompts: int = 1000,
    prompts_file: Path | None = None,
    dataset: Path | None = None,
    tokenizer: str | None = None,
    warmup: int = 20,
    passes: int = 1,
    baseline: str | None = None,
    hf_max_batch_size: int = 64,
    engine_args: dict[str, Any] | None = None,
    console=None,
) -> dict[str, Any]:
    """The whole `bench throughput` run; returns the result dict."""
    from localrun.bench.results import device_name

    if num_prompts < 1 or passes < 1 or warmup < 0:
        raise ThroughputError("--num-prompts and --passes must be >= 1, --warmup >= 0")
    config = engine_config(engine_args or {})
    t = time.perf_counter()
    engine = load_engine(src, config)
    load_s = time.perf_counter() - t
    prompts = get_prompts(num_prompts, prompts_file, dataset, tokenizer, engine, console)
    mc = engine.model_config
    check_vocab(prompts, mc.vocab_size)
    warm = min(warmup, len(prompts.requests))
    device = device_name() if str(config.device).startswith("cuda") else "cpu"
    result: dict[str, Any] = {
        "mode": "throughput",
        "model": src.name,
        "model_kind": src.kind,
        "num_params": mc.num_params, "active_params": mc.active_params,
        "engine_config": {k: getattr(config, k) for k in vars(config)},
        "workload": {**prompts.meta, "num_prompts": len(prompts.requests), "input_tokens": prompts.input_tokens,
                     "output_tokens": prompts.output_tokens, "warmup": warm, "passes": passes,
                     "temperature": 1.0, "top_p": 1.0, "ignore_eos": True,
                     "prefix_cache_cleared_before_each_pass": callable(getattr(engine, "clear_prefix_cache", None))},
        "load_s": load_s,
        "device": device,
    }
    result["engine"] = run_engine(engine, prompts, warm, passes, console)
    result["engine"].update(model_flops_fraction(result["engine"]["total_tok_s"], mc.active_params, device))
    if baseline == "transformers":
        dtype = config.torch_dtype
        shutdown_engine(engine)
        engine = None
        release_memory()
        hf = load_hf_model(src, mc, dtype, str(config.device))
        if warm:
            run_hf_baseline(hf, PromptSet(prompts.requests[:warm], prompts.meta), hf_max_batch_size, str(config.device))
        result["baseline"] = {"name": "transformers", **run_hf_baseline(hf, prompts, hf_max_batch_size, str(config.device), console)}
        result["ratio_total_tok_s"] = result["engine"]["total_tok_s"] / result["baseline"]["total_tok_s"]
        hf = None
        release_memory()
    elif baseline:
        raise ThroughputError(f"unknown --baseline {baseline!r}: only 'transformers'")
    if engine is not None:
        shutdown_engine(engine)
        engine = None
        release_memory()
    return result


__all__ = [
    "BenchModelSource", "ThroughputError", "DatasetError", "resolve_model", "engine_config", "load_engine",
    "engine_encoder", "check_vocab", "run_engine", "run_hf_baseline", "hf_batches", "rates",
    "load_hf_model", "model_flops_fraction", "shutdown_engine", "release_memory", "BUNDLED_PROMPTS", "get_prompts", "run_throughput",
]
