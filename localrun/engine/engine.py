"""LLMEngine: offline generate() and an online loop thread feeding asyncio streams.

A step schedules a batch, launches it (forward and sampling, queued on the device) and then
handles the previous step's tokens: with overlap scheduling (the default on CUDA) step N+1
is prepared and launched while step N still runs, and step N's tokens are detokenized,
checked for stop strings and streamed while step N+1 runs, so the GPU never waits for
Python bookkeeping. Without overlap (CPU) a step handles its own tokens at once. Both give
identical outputs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from localrun.engine import fallbacks as fb
from localrun.engine import faults
from localrun.engine.config import EngineConfig, ModelConfig, kv_dtype_name
from localrun.engine.kv.host import HostKVPool, default_host_cache_bytes
from localrun.engine.kv.pool import KVPool
from localrun.engine.kv.radix import RadixCache
from localrun.engine.layers.attention import check_kv_dtype, use_triton
from localrun.engine.layers.ops import Ops
from localrun.engine.layers.quant import weight_bytes
from localrun.engine.models import build_model
from localrun.engine.models.registry import model_class
from localrun.engine.models.llama import LlamaModel
from localrun.engine.models.loader import recipe_source
from localrun.engine.parallel import launch
from localrun.engine.parallel.group import TPGroup, check_shapes
from localrun.engine.runner import ModelRunner, StepHandle, profile_and_warm
from localrun.engine.sampler import SamplingParams
from localrun.engine.scheduler import ScheduledBatch, Scheduler, Sequence
from localrun.engine.tokenizer import Detokenizer, Tokenizer
from localrun.stop_strings import held_back

if TYPE_CHECKING:
    from localrun.engine.grammar import Grammar

log = logging.getLogger("localrun.engine")

CUDA_RESERVE_BYTES = 1 << 30  # CUDA: decode graphs and their logits buffer, cuBLAS workspaces, allocator slack
HOST_AUTO_POOL_MULTIPLE = 4  # the default host tier holds at most this many times the device KV pool
GROUP_WAIT_S = 0.25  # a group (n > 1) waits at most this long for all its members before it starts
MAX_GROUP = 128  # members of one group (the OpenAI API allows n up to 128)


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list | None = None  # per token: (token_id, logprob, [(id, logprob), ...])
    first_token_time: float | None = None
    prompt_logprobs: list | None = None  # params.prompt_logprobs: per prompt token, as logprobs (the first's None)
    finish_time: float | None = None
    arrival_time: float = 0.0


@dataclass
class StreamDelta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list | None = None
    usage: dict | None = None  # on the last delta: prompt/completion/cached tokens and timings
    error: str | None = None
    error_kind: str | None = None  # "out_of_memory": the step ran out of memory (the engine goes on)
    stop_sequence: str | None = None  # on the last delta: the stop string that ended the request
    prompt_logprobs: list | None = None  # on the first delta when params.prompt_logprobs is set


@dataclass(eq=False)
class _Request:
    seq: Sequence
    detok: Detokenizer | None
    stream: "RequestStream | None" = None
    text: str = ""  # text so far (stop strings cut it)
    sent: int = 0  # characters of `text` already streamed
    logprobs: list = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    pending_ids: list[int] = field(default_factory=list)  # tokens not yet streamed
    pending_lp: list = field(default_factory=list)
    stop_sequence: str | None = None  # the stop string that ended it
    num_tokens: int = 0  # output tokens handled (the sequence may hold more, still in flight)
    group: tuple[str, int, int] | None = None  # (group id, size, index): n > 1 sharing one prefill
    prompt_sent: bool = False  # its prompt logprobs went out (on the first delta)


@dataclass
class _Group:
    """Members of a group that arrived while it waits for the rest (at most GROUP_WAIT_S)."""

    size: int
    deadline: float
    members: list[_Request] = field(default_factory=list)
    arrived: int = 0  # members seen, including aborted ones
    started: bool = False  # handed to the scheduler; members arriving later run on their own


class RequestStream:
    """Async iterator of StreamDelta for one request; closing it early aborts the request."""

    def __init__(self, engine: "LLMEngine", request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def _push(self, delta: StreamDelta) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self.done:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if delta.finish_reason is not None:
            self.done = True
        return delta

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)


def _kernel_names(cls: type, mcfg: ModelConfig, config: EngineConfig) -> tuple[str, ...]:
    """The Triton kernels a model of `cls` launches (the attention kernels, its pointwise ones, the
    sampler's, and the one-row linear layer of float weights)."""
    matmul = fb.MATMUL_KERNELS if config.weight_dtype == "auto" else ()
    return fb.ATTENTION_KERNELS + tuple(cls.pointwise_kernels(mcfg)) + fb.SAMPLER_KERNELS + matmul


class _KernelTrials:
    """fallbacks.try_kernels for one load: run at once, or on a thread of its own while the
    weights load (CUDA), the reasons recorded until the engine exists to take them."""

    def __init__(self, kv_cfg: ModelConfig, config: EngineConfig, names: tuple[str, ...], background: bool) -> None:
        self.reasons: list[str] = []
        self.failed: frozenset[str] = frozenset()
        self.error: BaseException | None = None
        self.seconds = 0.0
        device = torch.device(config.device)
        self.names = names
        self.threads = min(len(names), os.cpu_count() or 1) if device.type == "cuda" else 1
        args = (kv_cfg, config.torch_dtype, config.kv_torch_dtype, config.page_size, device)
        self._thread = threading.Thread(target=self._run, args=args, name="localrun-kernel-trials", daemon=True)
        if background:
            self._thread.start()
        else:
            self._run(*args)

    def _run(self, *args) -> None:
        t = time.perf_counter()
        try:
            self.failed = fb.try_kernels(*args, self.reasons.append, names=self.names, threads=self.threads)
        except BaseException as exc:  # noqa: BLE001 - raised again in the loading thread
            self.error = exc
        self.seconds = time.perf_counter() - t

    def wait(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()

    def result(self, record: Callable[[str], None], timings: dict) -> frozenset[str]:
        """The kernels that run their torch reference; each reason `record`ed."""
        t = time.perf_counter()
        self.wait()
        if self._thread.ident is not None:
            timings["kernels_wait_s"] = time.perf_counter() - t
        timings["kernels_s"] = self.seconds
        if self.error is not None:
            raise self.error
        for reason in self.reasons:
            record(reason)
        return self.failed


class LLMEngine:
    def __init__(self, model: LlamaModel, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | None, timings: dict | None = None,
                 kernel_trials: "_KernelTrials | None" = None) -> None:
        self.model, self.model_config, self.config, self.tokenizer = model, model_config, config, tokenizer
        self.device = torch.device(config.device)
        self.timings = dict(timings or {})  # load phases, seconds
        self.tp: TPGroup = model.tp
        self.fatal: str | None = None  # set when the engine cannot go on (a tensor-parallel rank died)
        self.fallbacks: list[str] = []  # the slower paths taken, with reasons (engine/fallbacks.py)
        self.on_fallback: Callable[[], None] | None = None  # called (engine thread) on one after loading
        kv_cfg = self.tp.local_config(model_config)  # this rank's KV heads
        dtype, kv_dtype = config.torch_dtype, config.kv_torch_dtype
        triton = use_triton(config.device, config.use_triton)
        check_kv_dtype(kv_dtype, self.device, triton)
        if kernel_trials is None and triton:
            kernel_trials = _KernelTrials(kv_cfg, config, _kernel_names(type(model), model_config, config),
                                          background=False)
        refs = kernel_trials.result(self._fallback, self.timings) if triton else frozenset()
        if model.ops.reference == triton or refs:
            model.ops = Ops(reference=not triton, refs=refs)
        t = time.perf_counter()
        activations = profile_and_warm(model, config, triton) if self.device.type == "cuda" else 0
        self.timings["profile_warmup_s"] = time.perf_counter() - t
        self.weight_bytes = weight_bytes(model)  # as stored: int8/fp8 data + scales when quantized
        per_page = kv_cfg.kv_bytes_per_token(kv_dtype) * config.page_size
        num_pages = self.tp.min_int(self._kv_budget(model, per_page, activations) // per_page, self.device)
        if num_pages < 2:
            raise MemoryError("not enough memory for a KV cache; lower gpu_memory_fraction use or max_model_len")
        t = time.perf_counter()
        make = lambda n: KVPool(kv_cfg, n, config.page_size, kv_dtype, self.device)  # noqa: E731
        floor = min(int(num_pages), -(-config.max_model_len // config.page_size) + 1)  # one full-length sequence
        # tensor parallelism: every rank needs the same page count, so no rank retries on its own
        self.pool = make(int(num_pages)) if self.tp.world > 1 else fb.allocate_pool(
            make, int(num_pages), floor, self.device, self._fallback)
        self.host_pool = self._host_pool() if config.enable_prefix_cache else None
        self.cache = RadixCache(self.pool, self.host_pool) if config.enable_prefix_cache else None
        self.runner = ModelRunner(model, self.pool, config, triton)
        self.runner.defer_grammar = True  # grammar masks are filled in _launch, after the previous step's tokens
        self.runner.step_faults = bool(faults.active("step_oom"))  # read once: nothing per step otherwise
        self.scheduler = Scheduler(config, self.pool, self.cache, self.runner.table)
        self.timings["kv_alloc_s"] = time.perf_counter() - t
        graphs = config.cuda_graphs
        if graphs is None:
            graphs = self.device.type == "cuda" and triton
        if graphs:
            capture = self.device.type == "cuda"
            if capture and not triton:
                raise ValueError("cuda_graphs=True needs the Triton kernels (use_triton); the torch reference "
                                 "path syncs with the host")
            if capture and not self.runner.attn.graphable:
                graphs = False
                self._fallback("CUDA graphs off: attention runs a torch reference (it reads lengths on the host)")
            else:
                self.timings["graphs_s"] = self._setup_graphs(capture)
        self.spec = None
        if config.speculative != "off":
            from localrun.engine.speculative import SpecDecoder

            self.spec = SpecDecoder(self)
        self.overlap = bool(config.overlap) and self.spec is None  # verification needs host tokens: serial
        # SamplingParams.prompt_logprobs: scored in the runner's forward (speculative steps run their own;
        # tensor-parallel followers would have to compute the same logits)
        self.scores_prompts = self.spec is None and self.tp.world == 1
        self.eos_ids = set(tokenizer.eos_token_ids if tokenizer else model_config.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._done: dict[str, _Request] = {}
        self._inbox: list[tuple[str, object]] = []
        self._inflight: StepHandle | None = None  # launched, its tokens not yet handled
        self._groups: dict[str, _Group] = {}  # groups (n > 1) whose members are still arriving
        self._group_deadline: float | None = None  # the earliest deadline of a waiting group (for the loop)
        self._grammars = None  # grammar.GrammarCompiler, made at the first structured request
        self._cv = threading.Condition()
        self._lock = threading.RLock()  # held while a step (or embed, or abort) touches state
        self._thread: threading.Thread | None = None
        self._stop = False
        if self.tp.world > 1 and self.tp.rank == 0:
            self.tp.on_death(self._peer_died)
        log.info("native engine%s: weights %.1f MiB (%s), %d KV pages x %d tokens (%.1f MiB, %s), %s on %s, "
                 "%s attention, decode graphs %s, overlap %s",
                 f" (tensor-parallel rank {self.tp.rank} of {self.tp.world})" if self.tp.world > 1 else "",
                 self.weight_bytes / 2**20, config.weight_dtype, num_pages,
                 config.page_size, self.pool.nbytes / 2**20, kv_dtype_name(kv_dtype), dtype, self.device,
                 "Triton" if triton else "torch", "captured" if graphs and self.device.type == "cuda"
                 else ("eager (padded)" if graphs else "off"), "on" if self.overlap else "off")

    def _fallback(self, what: str) -> None:
        log.warning("fallback: %s", what)
        self.fallbacks.append(what)
        if self.on_fallback is not None:
            self.on_fallback()

    def _setup_graphs(self, capture: bool) -> float:
        """Decode graphs at every padded size; a size whose capture fails runs eagerly (a fallback)."""
        t = self.runner.setup_graphs(capture)
        by_reason: dict[str, list[int]] = {}
        for bs, why in sorted(self.runner.graphs.failed.items()):
            by_reason.setdefault(why, []).append(bs)
        for why, sizes in by_reason.items():
            self._fallback(f"decode batch {', '.join(map(str, sizes))}: eager, not a CUDA graph "
                           f"({' '.join(why.split())[:fb.REASON_CHARS]})")
        return t

    def _out_of_memory(self, exc: Exception) -> None:
        """A step ran out of memory: its requests (those holding KV pages) end with the cause, the
        step budget, the batch and the KV pool are halved, and the engine goes on serving."""
        with self._lock:
            self._inflight = None
            victims = [r for r in self._requests.values() if r.seq.status != "waiting"]
            for req in victims:
                self.scheduler.abort(req.seq.id)
            where = "GPU memory" if self.device.type == "cuda" else "memory"
            try:
                what = fb.shrink_after_oom(self)
            except Exception as err:  # noqa: BLE001 - e.g. not even one full-length sequence fits: reload
                self.fatal = f"out of {where} in a step ({fb.short(exc)}), and shrinking failed: {fb.short(err)}"
                self._fail_all(self.fatal)
                return
            self._fallback(f"out of memory in a step ({fb.short(exc)}): {what}")
            self._fail_all(f"out of {where} while running this request ({fb.short(exc)}); the engine {what} and "
                           "goes on serving: retry, or use a smaller num_ctx or prompt", victims, "out_of_memory")

    def _host_pool(self) -> HostKVPool | None:
        """The prefix cache's host tier (None when its budget is 0 or under one page, and with
        tensor parallelism: the followers' pools would need the same copies)."""
        if self.tp.world > 1:
            return None
        budget = self.config.host_cache_bytes
        if budget is None:
            budget = min(default_host_cache_bytes(), HOST_AUTO_POOL_MULTIPLE * self.pool.nbytes)
        pages = HostKVPool.pages_for_budget(self.pool, budget)
        if pages < 1:
            return None
        host = HostKVPool(self.pool, pages)
        log.info("prefix cache host tier: %d pages (%.1f MiB, %s)", pages, host.nbytes / 2**20,
                 "host RAM, staged through pinned buffers" if host.cuda else "host RAM")
        return host

    def _kv_budget(self, model: LlamaModel, per_page: int, activations: int) -> int:
        cfg = self.config
        useful = (cfg.max_num_seqs * cfg.max_model_len // cfg.page_size + 1) * per_page
        if cfg.kv_memory_bytes is not None:
            return cfg.kv_memory_bytes
        if cfg.kv_cache_tokens is not None:
            return (-(-cfg.kv_cache_tokens // cfg.page_size) + 1) * per_page
        if self.device.type == "cuda":
            # what is in use now (weights, other processes) comes out of the fraction of the
            # total, and so do the profiled step's activations
            free, total = torch.cuda.mem_get_info(self.device)
            room = int(total * cfg.gpu_memory_fraction) - (total - free) - activations - CUDA_RESERVE_BYTES
            room = min(room, free - activations - CUDA_RESERVE_BYTES)
            log.info("KV budget: %.2f GiB (%.2f GiB free of %.2f GiB, step activations %.2f GiB, fraction %.2f)",
                     room / 2**30, free / 2**30, total / 2**30, activations / 2**30, cfg.gpu_memory_fraction)
            return min(useful, room)
        # CPU: room for four full-length sequences (preemption and the prefix cache cover the rest)
        return min(useful, 4 * (cfg.max_model_len // cfg.page_size + 1) * per_page)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def _make(cls, mcfg: ModelConfig, config: EngineConfig | None, fill, tokenizer=lambda: None,
              recipe: tuple | None = None, tp: TPGroup | None = None) -> "LLMEngine":
        """Build the model (this rank's shard) and the engine. With config.tensor_parallel > 1 and
        no `tp`, this is rank 0: it starts the other ranks, which build theirs from `recipe`."""
        config = config or EngineConfig()
        check_shapes(mcfg, config.tensor_parallel)
        if tp is None:
            tp = TPGroup()
            if config.tensor_parallel > 1:
                if recipe is None:
                    raise ValueError("tensor_parallel > 1 needs weights every rank can read itself: load with "
                                     "from_gguf, from_safetensors or from_random")
                tp = launch.start(config.tensor_parallel, config.device, recipe, config, cls.from_recipe)
        try:
            timings = {}
            trials = None
            if config.is_cuda and tp.world == 1 and use_triton(config.device, config.use_triton):
                t = time.perf_counter()
                torch.zeros(1, device=config.device)  # the CUDA context, before a second thread uses it
                timings["cuda_init_s"] = time.perf_counter() - t
                check_kv_dtype(config.kv_torch_dtype, config.device, True)  # (before a kernel compiles for it)
                # the kernels' first compile (seconds with an empty Triton cache) runs beside the weights' load
                trials = _KernelTrials(tp.local_config(mcfg), config, _kernel_names(model_class(mcfg), mcfg, config),
                                       background=True)
            t = time.perf_counter()
            try:
                model = build_model(mcfg, config, tp)
                fill(model)
                if config.is_cuda:
                    torch.cuda.synchronize()
            except BaseException:
                if trials is not None:
                    trials.wait()  # not one kernel compiling behind the error
                raise
            timings["weights_s"] = time.perf_counter() - t
            return cls(model, mcfg, config, tokenizer() if tp.rank == 0 else None, timings, trials)
        except BaseException:
            if tp.rank == 0:
                tp.close()
            raise

    @classmethod
    def from_recipe(cls, recipe: tuple, config: EngineConfig | None = None, tp: TPGroup | None = None) -> "LLMEngine":
        """("gguf", path) | ("safetensors", directory) | ("random", shape, seed): how every
        tensor-parallel rank builds its shard of the same model."""
        config = config or EngineConfig()
        mcfg, fill, tokenizer = recipe_source(recipe, config)
        return cls._make(mcfg, config, fill, tokenizer, recipe, tp)

    @classmethod
    def from_gguf(cls, path: str | Path, config: EngineConfig | None = None,
                  adapter: str | Path | None = None) -> "LLMEngine":
        """A GGUF model; with `adapter`, a LoRA adapter GGUF merged into its weights at load (exact, no cost a step)."""
        return cls.from_recipe(("gguf", str(path), *([str(adapter)] if adapter else [])), config)

    @classmethod
    def from_safetensors(cls, directory: str | Path, config: EngineConfig | None = None) -> "LLMEngine":
        return cls.from_recipe(("safetensors", str(directory)), config)

    @classmethod
    def from_hf_state(cls, mcfg: ModelConfig, get, names: set[str], config: EngineConfig | None = None,
                      tokenizer: Tokenizer | None = None) -> "LLMEngine":
        """From weights in memory by Hugging Face name (e.g. a transformers model's state_dict)."""
        return cls._make(mcfg, config, lambda m: m.load_hf_state(get, names), lambda: tokenizer)

    @classmethod
    def from_random(cls, shape: str | ModelConfig, config: EngineConfig | None = None, seed: int = 0) -> "LLMEngine":
        return cls.from_recipe(("random", shape, seed), config)

    # -- tensor parallelism ------------------------------------------------------------------
    def follow(self) -> None:
        """A follower rank: run rank 0's steps until it says stop (or is gone)."""
        while True:
            order = self.tp.recv()
            if order[0] == "step":
                self.runner.follow_step(*order[1:])
            elif order[0] == "embed":
                self.runner.hidden_states(order[1])
            else:
                return

    def _peer_died(self, message: str) -> None:
        """Rank 0's watcher: a follower is gone, so no step can complete; end every request with
        the reason. The loop thread may be stuck in a collective (NCCL waits for its timeout):
        then the streams are ended without it."""
        self.fatal = message
        if self._lock.acquire(timeout=2.0):
            try:
                self._fail_all(message)
            finally:
                self._lock.release()
            return
        for req in list(self._requests.values()):
            if req.stream is not None:
                req.finish_time = time.perf_counter()
                try:
                    req.stream._push(StreamDelta([], "", "abort", None, self._usage(req), error=message))
                except RuntimeError:
                    pass

    def _step_failed(self, exc: Exception) -> str:
        """Why a step failed. With tensor parallelism every failure is fatal: the ranks are no
        longer in step."""
        msg = f"engine step failed: {type(exc).__name__}: {exc}"
        if self.tp.world > 1:
            dead = self.tp.wait_dead(1.0)
            self.fatal = self.fatal or (dead or f"tensor-parallel {msg}")
            return self.fatal
        return msg

    # -- requests ----------------------------------------------------------------------------
    def _new_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> _Request:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        n, cfg = len(prompt_ids), self.config
        limit = min(cfg.max_model_len, self.pool.num_pages * cfg.page_size)
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens but the context window holds {limit}; shorten it")
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.grammar is not None and not hasattr(params.grammar, "matcher"):
            raise ValueError("SamplingParams.grammar must be a grammar from LLMEngine.compile_grammar()")
        if params.prompt_logprobs is not None and not self.scores_prompts:
            raise ValueError("prompt logprobs are not computed with speculative decoding or tensor parallelism")
        seq = Sequence(request_id or uuid.uuid4().hex, prompt_ids, params)
        detok = Detokenizer(self.tokenizer, prompt_ids) if self.tokenizer else None
        return _Request(seq, detok)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, group: tuple[str, int, int] | None = None) -> RequestStream:
        """Queue a request on the running loop (call from an asyncio loop); returns its stream.

        group=(group_id, size, index): one of `size` requests with the same prompt (an API
        request's n choices), each added with its own call, params and stream. The group
        starts once all have arrived (or after GROUP_WAIT_S): the first by index prefills the
        prompt once and the others fork from it, sharing its KV pages and sampling their first
        token from the same logits. Outputs equal those of separate requests."""
        if self.fatal:
            raise RuntimeError(self.fatal)
        req = self._new_request(list(prompt_token_ids), params or SamplingParams(), request_id)
        # a scored prompt runs on its own: each member computes its prompt's rows (no group sharing)
        req.group = _check_group(group) if req.seq.prompt_lps is None else None
        if req.seq.id in self._requests:
            raise ValueError(f"request id {req.seq.id!r} is already in use")
        req.stream = RequestStream(self, req.seq.id)
        with self._cv:
            self._inbox.append(("add", req))
            self._cv.notify()
        return req.stream

    def abort(self, request_id: str) -> None:
        """Abort a request; its KV pages are freed before the next step runs."""
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()
        if self._lock.acquire(blocking=False):  # not mid-step: free now
            try:
                self._drain_inbox()
            finally:
                self._lock.release()
            with self._cv:  # the loop may have looked while this drained (a group may have started)
                self._cv.notify()

    def _drain_inbox(self) -> None:
        with self._cv:
            items, self._inbox = self._inbox, []
        for kind, item in items:
            if kind == "add":
                self._requests[item.seq.id] = item
                if item.group is None or not self._join_group(item):
                    self.scheduler.add(item.seq)
            else:
                req = self._requests.get(item)
                if req is not None and (self._leave_group(req) or self.scheduler.abort(item) is not None):
                    self._finish(req, "abort", release=False)
        self._start_groups(time.perf_counter())

    # -- groups (n > 1) ----------------------------------------------------------------------
    def _join_group(self, req: _Request) -> bool:
        """Hold a group member until its group starts; False: run it on its own (a group of
        one, tensor parallelism, or its group already started)."""
        gid, size, _ = req.group
        if size < 2 or self.tp.world > 1:
            return False
        g = self._groups.get(gid)
        if g is None:
            g = self._groups[gid] = _Group(size, time.perf_counter() + GROUP_WAIT_S)
        g.arrived += 1
        if g.arrived >= g.size:
            del self._groups[gid]  # every member is here: nothing more to wait for
        if g.started:
            return False
        g.members.append(req)
        if g.arrived >= g.size:
            self._start_group(g)
        return True

    def _leave_group(self, req: _Request) -> bool:
        """An aborted member still waiting for its group: drop it (True)."""
        g = self._groups.get(req.group[0]) if req.group else None
        if g is None or g.started or req not in g.members:
            return False
        g.members.remove(req)
        return True

    def _start_groups(self, now: float) -> None:
        for gid, g in list(self._groups.items()):
            if not g.started and now >= g.deadline:
                self._start_group(g)  # late members will run on their own
            if g.started and now >= g.deadline + 60 * GROUP_WAIT_S:
                del self._groups[gid]  # members that never came: forget the group
        waits = [g.deadline for g in self._groups.values() if not g.started]
        self._group_deadline = min(waits) if waits else None

    def _start_group(self, g: _Group) -> None:
        g.started = True
        members = sorted(g.members, key=lambda r: r.group[2])
        g.members = []
        if not members:
            return
        leader = members[0].seq
        same = [r.seq for r in members[1:] if r.seq.token_ids == leader.token_ids]
        self.scheduler.add_group(leader, same)
        for r in members[1:]:
            if r.seq.token_ids != leader.token_ids:  # not the same prompt: no sharing
                self.scheduler.add(r.seq)

    def _group_wait(self) -> float | None:
        """Seconds until the next waiting group must start (None: no group waits); read by the
        loop without the step lock, so from one attribute set under it."""
        deadline = self._group_deadline
        return None if deadline is None else max(0.0, deadline - time.perf_counter())

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Schedule and launch a step; then handle the tokens of the previous one (overlap) or of
        this one (serial)."""
        with self._lock:
            self._drain_inbox()
            if self.spec is not None:
                self.spec.step()
                return
            handle = self._launch()
            if self.overlap:
                handle, self._inflight = self._inflight, handle
            if handle is not None:
                self.handle_step(handle)

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    def _launch(self) -> StepHandle | None:
        batch = self.schedule_batch()
        return None if batch is None else self.launch_batch(batch)

    # the step's three parts, public for speculative decoding (which runs its own step over them)
    def schedule_batch(self) -> ScheduledBatch | None:
        """The scheduler's next batch (None: nothing to run); requests it must end are finished."""
        batch = self.scheduler.schedule()
        if self.host_pool is not None:
            self.host_pool.flush()  # pages spilled to / loaded from host memory while scheduling
        for seq in self.scheduler.take_finished():  # the pool is too small for it
            self._finish(self._requests[seq.id], seq.finish_reason, release=False)
        return batch

    def launch_batch(self, batch: ScheduledBatch) -> StepHandle:
        """Launch a scheduled batch (forward and sampling queued on the device)."""
        handle = self.runner.launch(batch)
        self.scheduler.update(batch)
        handle.positions = [seq.add_pending(row) for row, seq in enumerate(handle.seqs)]
        if handle.deferred is not None:  # grammar rows: forward launched, the masks need their last tokens
            if self._inflight is not None:  # overlap: step N's tokens reach the matchers first
                prev, self._inflight = self._inflight, None
                self.handle_step(prev)
            self.runner.sample_with_masks(handle)
        return handle

    def handle_step(self, handle: StepHandle) -> None:
        """Wait for a launched step's tokens and hand each to its request."""
        tokens, lps = handle.result()  # the step's one wait for the device
        now = time.perf_counter()
        for seq, pos, tok, lp in zip(handle.seqs, handle.positions, tokens, lps):
            seq.resolve(pos, tok)
            self.on_token(seq, tok, lp, now)

    def on_token(self, seq: Sequence, tok: int, lp, now: float) -> bool:
        """Hand `seq`'s next token (already in seq.token_ids) to its request: stream it, check stops
        and limits. False when the request finished or was aborted while the step ran (the token
        is void)."""
        req = self._requests.get(seq.id)
        if req is None or req.seq is not seq or seq.finish_reason:
            return False
        self._on_token(req, tok, lp, now)
        return True

    def _on_token(self, req: _Request, tok: int, lp, now: float) -> None:
        seq, p = req.seq, req.seq.params
        req.first_token_time = req.first_token_time or now
        if p.max_tokens == 0:  # the prompt scored: the token its last row sampled is not wanted
            self._finish(req, "length")
            return
        if seq.matcher is not None and seq.matcher.error:  # past llguidance's bounds: its mask let only EOS through
            self._grammar_failed(req, seq.matcher.error)
            return
        req.num_tokens += 1
        req.pending_ids.append(tok)
        if lp is not None:
            req.logprobs.append((tok, lp[0], lp[1]))
            req.pending_lp.append(req.logprobs[-1])
        finish = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            finish = "stop"
        else:
            if req.detok is not None:
                req.text += req.detok.add(tok)
                if p.stop:
                    finish = self._cut_stop(req)
            if seq.matcher is not None and finish is None:
                finish = self._grammar_token(seq, tok)
                if finish == "grammar":
                    self._grammar_failed(req, seq.matcher.error)
                    return
        if finish is None and (req.num_tokens >= p.max_tokens
                               or seq.prompt_len + req.num_tokens >= self.config.max_model_len):
            finish = "length"
        if finish:
            self._finish(req, finish)
        elif req.stream is not None:
            hold = held_back(req.text[req.sent:], p.stop) if p.stop else 0  # only a possible stop's start
            self._emit(req, max(req.sent, len(req.text) - hold))

    @staticmethod
    def _grammar_token(seq: Sequence, tok: int) -> str | None:
        """Advance the request's grammar; "stop" once the grammar is complete (nothing may follow), "grammar" when
        it went past llguidance's bounds."""
        if not seq.matcher.consume(tok):
            if seq.matcher.error and "satisfy the grammar" not in seq.matcher.error:  # its bounds, not the token
                return "grammar"
            # the mask allowed it, so this is a bug: end the request cleanly
            log.warning("request %s: the grammar rejected sampled token %d (%s)", seq.id, tok, seq.matcher.error)
            return "stop"
        return "stop" if seq.matcher.is_stopped else None

    def compile_grammar(self, json_schema: dict | None = None, *, lark: str | None = None) -> "Grammar":
        """The grammar for JSON valid under `json_schema` (None: any JSON object), or of llguidance's
        `lark` text, for SamplingParams.grammar. Cached per schema; call it off the engine thread (a new
        schema takes milliseconds, the first one also indexes the vocabulary: ~1.5 s). ValueError when
        it cannot be compiled."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this engine has none")
        with self._cv:
            if self._grammars is None:
                from localrun.engine.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids))
        return self._grammars.lark(lark) if lark is not None else self._grammars.json_schema(json_schema)

    @staticmethod
    def _cut_stop(req: _Request) -> str | None:
        stops = req.seq.params.stop
        start = max(0, req.sent - max(len(s) for s in stops))
        hits = [(i, s) for i, s in ((req.text.find(s, start), s) for s in stops) if i >= 0]
        if not hits:
            return None
        cut, req.stop_sequence = min(hits, key=lambda h: h[0])
        req.text = req.text[:cut]
        return "stop"

    def _emit(self, req: _Request, upto: int, finish: str | None = None, usage: dict | None = None,
              error: str | None = None, error_kind: str | None = None) -> None:
        text = req.text[req.sent:upto] if upto > req.sent else ""
        if not (text or req.pending_ids or finish):
            return
        req.sent = max(req.sent, upto)
        delta = StreamDelta(req.pending_ids, text, finish, req.pending_lp or None, usage, error=error,
                            error_kind=error_kind, stop_sequence=req.stop_sequence if finish else None)
        if not req.prompt_sent and req.seq.prompt_lps is not None:
            req.prompt_sent, delta.prompt_logprobs = True, req.seq.prompt_lps
        req.pending_ids, req.pending_lp = [], []
        try:
            req.stream._push(delta)
        except RuntimeError:  # the client's event loop is gone: nobody is listening
            if finish is None:
                self.scheduler.abort(req.seq.id)
                self._finish(req, "abort", release=False)

    def _finish(self, req: _Request, reason: str, release: bool = True, error: str | None = None,
                error_kind: str | None = None) -> None:
        seq = req.seq
        seq.finish_reason = seq.finish_reason or reason
        if release:
            self.scheduler.finish(seq)
        req.finish_time = time.perf_counter()
        self._requests.pop(seq.id, None)
        if req.stream is not None:
            self._emit(req, len(req.text), seq.finish_reason, self._usage(req), error, error_kind)
        else:
            self._done[seq.id] = req

    def _grammar_failed(self, req: _Request, why: str) -> None:
        """End `req` with an error: its grammar stopped the generation (an empty language, or more work for one
        token than llguidance's bounds allow)."""
        from localrun.backends.constraints import stopped_message

        self._finish(req, "abort", error=stopped_message(why), error_kind="grammar")

    def _usage(self, req: _Request) -> dict:
        first = req.first_token_time or req.finish_time
        usage = {"prompt_tokens": req.seq.prompt_len, "completion_tokens": req.num_tokens,
                 "cached_tokens": max(req.seq.cached_tokens, 0),
                 "prompt_eval_seconds": first - req.arrival_time, "eval_seconds": req.finish_time - first}
        if self.spec is not None:
            usage["spec_draft_tokens"] = req.seq.spec_draft_tokens
            usage["spec_accepted_tokens"] = req.seq.spec_accepted_tokens
        return usage

    # -- offline -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: Callable[[int, int], None] | None = None, n: int = 1,
                 share_prefill: bool = True) -> list[GenerationOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.

        n > 1: n choices per prompt (outputs prompt-major: prompt 0's n, then prompt 1's ...),
        params one, one per prompt or one per choice; with share_prefill (the default) each
        prompt's choices are a group that prefills once (see add_request), else separate requests."""
        if self._thread is not None:
            raise RuntimeError("the online loop is running: use add_request(), or shutdown() first")
        if not 1 <= n <= MAX_GROUP:
            raise ValueError(f"n must be between 1 and {MAX_GROUP}")
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) == len(prompts) and n > 1:
            plist = [sp for sp in plist for _ in range(n)]
        if len(plist) != len(prompts) * n:
            raise ValueError("give one SamplingParams, one per prompt or one per choice (len(prompts) * n)")
        reqs = [self._new_request(list(prompts[k // n]), sp, None) for k, sp in enumerate(plist)]
        if n > 1 and share_prefill:
            tag = uuid.uuid4().hex
            for k, r in enumerate(reqs):
                if r.seq.prompt_lps is None:  # (a scored prompt runs on its own, as in add_request)
                    r.group = (f"offline-{tag}-{k // n}", n, k % n)
        self._done: dict[str, _Request] = {}
        with self._lock:
            for r in reqs:
                self._requests[r.seq.id] = r
                if r.group is None or not self._join_group(r):
                    self.scheduler.add(r.seq)
        if self.fatal:
            raise RuntimeError(self.fatal)
        try:
            while len(self._done) < len(reqs):
                try:
                    self.step()
                except Exception as exc:
                    if self.tp.world > 1:
                        raise RuntimeError(self._step_failed(exc)) from exc
                    raise
                if progress is not None:
                    progress(len(self._done), len(reqs))
        finally:
            for r in reqs:  # on error (or KeyboardInterrupt) free whatever is left
                if r.seq.id in self._requests:
                    self.scheduler.abort(r.seq.id)
                    self._requests.pop(r.seq.id, None)
        return [self._output(r) for r in reqs]

    def _output(self, req: _Request) -> GenerationOutput:
        s = req.seq
        return GenerationOutput(
            token_ids=s.token_ids[s.prompt_len:s.prompt_len + req.num_tokens], text=req.text if req.detok else None,
            finish_reason=s.finish_reason or "abort", prompt_tokens=s.prompt_len, cached_tokens=max(s.cached_tokens, 0),
            completion_tokens=req.num_tokens,
            logprobs=req.logprobs if s.params.needs_logprobs else None, first_token_time=req.first_token_time,
            finish_time=req.finish_time, arrival_time=req.arrival_time, prompt_logprobs=s.prompt_lps)

    # -- online loop -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._done = {}
        self._thread = threading.Thread(target=self._loop, name="localrun-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self.has_work():
                    wait = self._group_wait()
                    if wait == 0.0:
                        break  # a group's wait is over: step() starts it
                    self._cv.wait(wait)
                if self._stop:
                    break
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep the engine alive
                log.exception("engine step failed")
                if self.tp.world == 1 and fb.is_out_of_memory(exc):
                    self._out_of_memory(exc)
                else:
                    self._fail_all(self._step_failed(exc))

    def _fail_all(self, message: str, reqs: list[_Request] | None = None, kind: str | None = None) -> None:
        """End every request (or only `reqs`) with the error `message`."""
        with self._lock:
            self._inflight = None  # its tokens belong to the requests failed below
            if reqs is None:
                self._drain_inbox()
                self._groups.clear()
                self._group_deadline = None
            for req in list(self._requests.values()) if reqs is None else reqs:
                self.scheduler.abort(req.seq.id)
                self._requests.pop(req.seq.id, None)
                if req.stream is not None:
                    req.finish_time = time.perf_counter()
                    d = StreamDelta([], "", "abort", None, self._usage(req), error=message, error_kind=kind)
                    try:
                        req.stream._push(d)
                    except RuntimeError:
                        pass

    def shutdown(self) -> None:
        """Stop the loop thread; requests still running are aborted."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(None if not self.fatal else 5.0)  # fatal: it may be stuck in a collective
            self._thread = None
        if self._lock.acquire(timeout=-1 if not self.fatal else 5.0):
            try:
                self._fail_all("the engine shut down")
            finally:
                self._lock.release()
        if self.tp.rank == 0:
            self.tp.close()  # tensor parallelism: the other ranks exit

    # -- misc --------------------------------------------------------------------------------
    def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        """Mean-pooled, L2-normalised last hidden states, one vector per input."""
        if not token_lists or any(not t for t in token_lists):
            raise ValueError("every input to embed must have at least one token")
        for t in token_lists:
            if len(t) > self.config.max_model_len:
                raise ValueError(f"an input has {len(t)} tokens; the limit is {self.config.max_model_len}")
        if self.fatal:
            raise RuntimeError(self.fatal)
        with self._lock:
            try:
                states = self.runner.hidden_states(token_lists)
            except Exception as exc:
                if self.tp.world > 1:
                    raise RuntimeError(self._step_failed(exc)) from exc
                raise
        vecs = [torch.nn.functional.normalize(h.float().mean(0), dim=0) for h in states]
        return [v.tolist() for v in vecs]

    def clear_prefix_cache(self) -> None:
        with self._lock:
            if self.cache is not None:
                self.cache.reset()

    def stats(self) -> dict:
        s = self.scheduler
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {
            "tensor_parallel": self.tp.world, "weight_bytes_per_rank": weights, "kv_bytes_per_rank": self.pool.nbytes,
            "kv_pages_total": self.pool.num_pages, "kv_pages_free": self.pool.num_free,
            "page_size": self.pool.page_size, "kv_bytes": self.pool.nbytes, "kv_dtype": kv_dtype_name(self.pool.dtype),
            "weight_dtype": self.config.weight_dtype, "weight_bytes": self.weight_bytes,
            "cached_pages": self.cache.num_pages if self.cache else 0,
            "evictable_pages": self.cache.evictable_pages if self.cache else 0,
            "prefill_tokens": s.prefill_tokens, "forked_seqs": s.forked_seqs,
            "prefix_hit_tokens": s.prefix_hit_tokens, "prefix_query_tokens": s.prefix_query_tokens,
            "prefix_device_hit_tokens": s.prefix_hit_tokens - s.prefix_host_hit_tokens,
            "prefix_host_hit_tokens": s.prefix_host_hit_tokens,
            "host_pages_total": self.host_pool.num_pages if self.host_pool else 0,
            "host_pages_used": self.cache.host_pages if self.cache else 0,
            "host_bytes": self.host_pool.nbytes if self.host_pool else 0,
            "spilled_pages": self.cache.spilled_pages if self.cache else 0,
            "loaded_pages": self.cache.loaded_pages if self.cache else 0,
            "running": sum(q.status == "running" for q in s.running),
            "waiting": sum(q.status == "waiting" for q in s.waiting), "preemptions": s.num_preemptions,
            **(self.spec.stats() if self.spec is not None else {"speculative": "off"}),
        }


def _check_group(group) -> tuple[str, int, int] | None:
    if group is None:
        return None
    try:
        gid, size, index = group
        gid, size, index = str(gid), int(size), int(index)
    except (TypeError, ValueError):
        raise ValueError("group must be (group id, size, index)") from None
    if not 1 <= size <= MAX_GROUP or not 0 <= index < size:
        raise ValueError(f"a group has 1 to {MAX_GROUP} members and each index is in [0, size); got size {size}, "
                         f"index {index}")
    return gid, size, index
