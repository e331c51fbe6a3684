"""LLMEngine: offline generate() and an online loop thread feeding asyncio streams.

A step schedules a batch, launches it (forward and sampling, queued on the device) and then
handles the previous step's tokens: with overlap scheduling (the default on CUDA) step N+1
is prepared and launched while step N still runs, and step N's tokens are detokenized,
checked for stop strings and streamed while step N+1 runs, so the GPU never waits for
Python bookkeeping. Without overlap (CPU) a step handles its own tokens at once. Both give
identical outputs.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from localrun.engine import fallbacks as fb
from localrun.engine import faults
from localrun.engine.build import KernelTrials, decode_graphs, host_kv_pool, kernel_names, kv_budget, make_engine
from localrun.engine.config import EngineConfig, ModelConfig, kv_dtype_name
from localrun.engine.failures import StepFailures
from localrun.engine.groups import RequestGroups
from localrun.engine.info import engine_stats
from localrun.engine.kv.pool import KVPool
from localrun.engine.kv.radix import RadixCache
from localrun.engine.layers.attention import check_kv_dtype, use_triton
from localrun.engine.layers.ops import Ops
from localrun.engine.layers.quant import weight_bytes
from localrun.engine.models.llama import LlamaModel
from localrun.engine.models.loader import recipe_source
from localrun.engine.output import TokenOutput
from localrun.engine.parallel.group import TPGroup
from localrun.engine.requests import (MAX_GROUP, EngineRequest, GenerationOutput, RequestStream, check_group,
                                      generation_output, new_request)
from localrun.engine.runner import ModelRunner, StepHandle, profile_and_warm
from localrun.engine.sampler import SamplingParams
from localrun.engine.scheduler import ScheduledBatch, Scheduler
from localrun.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from localrun.structured.masks import Grammar

log = logging.getLogger("localrun.engine")


class LLMEngine(TokenOutput, StepFailures):
    """The native engine: its model, KV pool, prefix cache, runner and scheduler, and the loop
    that steps them (offline `generate`, or the online thread behind `add_request`)."""

    def __init__(self, model: LlamaModel, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | None, timings: dict | None = None,
                 kernel_trials: KernelTrials | None = None) -> None:
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
            kernel_trials = KernelTrials(kv_cfg, config, kernel_names(type(model), model_config, config),
                                         background=False)
        refs = kernel_trials.result(self._fallback, self.timings) if triton else frozenset()
        if model.ops.reference == triton or refs:
            model.ops = Ops(reference=not triton, refs=refs)
        t = time.perf_counter()
        activations = profile_and_warm(model, config, triton) if self.device.type == "cuda" else 0
        self.timings["profile_warmup_s"] = time.perf_counter() - t
        self.weight_bytes = weight_bytes(model)  # as stored: int8/fp8 data + scales when quantized
        per_page = kv_cfg.kv_bytes_per_token(kv_dtype) * config.page_size
        num_pages = self.tp.min_int(kv_budget(config, self.device, per_page, activations) // per_page, self.device)
        if num_pages < 2:
            raise MemoryError("not enough memory for a KV cache; lower gpu_memory_fraction use or max_model_len")
        t = time.perf_counter()
        make = lambda n: KVPool(kv_cfg, n, config.page_size, kv_dtype, self.device)  # noqa: E731
        floor = min(int(num_pages), -(-config.max_model_len // config.page_size) + 1)  # one full-length sequence
        # tensor parallelism: every rank needs the same page count, so no rank retries on its own
        self.pool = make(int(num_pages)) if self.tp.world > 1 else fb.allocate_pool(
            make, int(num_pages), floor, self.device, self._fallback)
        self.host_pool = host_kv_pool(config, self.pool, self.tp) if config.enable_prefix_cache else None
        self.cache = RadixCache(self.pool, self.host_pool) if config.enable_prefix_cache else None
        self.runner = ModelRunner(model, self.pool, config, triton)
        self.runner.defer_grammar = True  # grammar masks are filled in _launch, after the previous step's tokens
        self.runner.step_faults = bool(faults.active("step_oom"))  # read once: nothing per step otherwise
        self.scheduler = Scheduler(config, self.pool, self.cache, self.runner.table)
        self.timings["kv_alloc_s"] = time.perf_counter() - t
        graphs = decode_graphs(config, self.device, triton, self.runner, self._fallback, self.timings)
        self.spec = None
        if config.speculative != "off":
            from localrun.engine.speculative import SpecDecoder

            self.spec = SpecDecoder(self)
        self.overlap = bool(config.overlap) and self.spec is None  # verification needs host tokens: serial
        # SamplingParams.prompt_logprobs: scored in the runner's forward (speculative steps run their own;
        # tensor-parallel followers would have to compute the same logits)
        self.scores_prompts = self.spec is None and self.tp.world == 1
        self.eos_ids = set(tokenizer.eos_token_ids if tokenizer else model_config.eos_token_ids)
        self._requests: dict[str, EngineRequest] = {}
        self._done: dict[str, EngineRequest] = {}
        self._inbox: list[tuple[str, object]] = []
        self._inflight: StepHandle | None = None  # launched, its tokens not yet handled
        self.groups = RequestGroups(self.scheduler, enabled=self.tp.world == 1)  # n > 1: members still arriving
        self._grammars = None  # structured.masks.GrammarCompiler, made at the first structured request
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

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def _make(cls, mcfg: ModelConfig, config: EngineConfig | None, fill, tokenizer=lambda: None,
              recipe: tuple | None = None, tp: TPGroup | None = None) -> "LLMEngine":
        """Build the model (this rank's shard) and the engine (build.make_engine)."""
        return make_engine(cls, mcfg, config, fill, tokenizer, recipe, tp)

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

    # -- requests ----------------------------------------------------------------------------
    def _new_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> EngineRequest:
        """A request for `prompt_ids`, checked against this engine's limits (requests.new_request)."""
        limit = min(self.config.max_model_len, self.pool.num_pages * self.config.page_size)
        return new_request(prompt_ids, params, request_id, limit=limit, vocab=self.model_config.vocab_size,
                           scores_prompts=self.scores_prompts, tokenizer=self.tokenizer)

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
        req.group = check_group(group) if req.seq.prompt_lps is None else None
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
                if item.group is None or not self.groups.join(item):
                    self.scheduler.add(item.seq)
            else:
                req = self._requests.get(item)
                if req is not None and (self.groups.leave(req) or self.scheduler.abort(item) is not None):
                    self._finish(req, "abort", release=False)
        self.groups.start_due(time.perf_counter())

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

    def compile_grammar(self, json_schema: dict | None = None, *, lark: str | None = None) -> "Grammar":
        """The grammar for JSON valid under `json_schema` (None: any JSON object), or of llguidance's
        `lark` text, for SamplingParams.grammar. Cached per schema; call it off the engine thread (a new
        schema takes milliseconds, the first one also indexes the vocabulary: ~1.5 s). ValueError when
        it cannot be compiled."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this engine has none")
        with self._cv:
            if self._grammars is None:
                from localrun.structured.masks import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids))
        return self._grammars.lark(lark) if lark is not None else self._grammars.json_schema(json_schema)

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
        self._done: dict[str, EngineRequest] = {}
        with self._lock:
            for r in reqs:
                self._requests[r.seq.id] = r
                if r.group is None or not self.groups.join(r):
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

    @staticmethod
    def _output(req: EngineRequest) -> GenerationOutput:
        return generation_output(req)

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
                    wait = self.groups.wait()
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
        return engine_stats(self)
