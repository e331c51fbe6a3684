"""llama.cpp contexts that pool an input into one vector (embeddings) or scores (reranking), and their backend.

They pool a whole input; :class:`PooledBackend` is the backend of a model that does nothing else.

:class:`Pooled` is one such context, made through llama-cpp-python's ``Llama(embedding=True)`` with a
pooling type: the model's own (its GGUF's ``pooling_type``: CLS for bge-m3 and mxbai-embed-large, mean for
nomic-embed-text, last token for Qwen3-Embedding), mean for a generating model that sets none, rank for a
reranker. The generating backend keeps one beside its batched context for ``/api/embed``.

:class:`PooledBackend` is the whole backend of an embedding model or a reranker (``LoadSpec.embedding``): no
batched generation context and no decoding KV cache, only the pooling context, its window capped at the
model's trained context (an encoder's positions end there). A reranker's input is laid out as llama-server's
``format_prompt_rerank`` lays it out: the model's ``rerank`` chat template with ``{query}`` and ``{document}``
(Qwen3-Reranker), else ``[BOS] query [EOS] [SEP] document [EOS]``, each special token where the vocabulary
adds it (XLM-RoBERTa's ``<s> query </s></s> document </s>``, as its Hugging Face tokenizer pairs them). Its
scores are the classifier's raw outputs, ``llama_model_n_cls_out`` floats per document; the daemon turns them
into relevance scores.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from localrun.backends.base import (CONTEXT_EXCEEDED, POOLED_WINDOW, BackendInfo, Chunk, GenerationRequest, LoadSpec,
                                    check_token_ids)
from localrun.backends.llamacpp.lora import load_lora
from localrun.backends.llamacpp.pieces import longest_piece, pieces_text
from localrun.errors import BackendError, InvalidRequest

log = logging.getLogger("localrun.llamacpp")

MAX_WINDOW = POOLED_WINDOW  # tokens one input (a text, or a query with a document) may have
CAUSAL_UBATCH = 512  # tokens a pass of a causal model's pooling context computes (llama-server's default)
PASS_TOKENS = 512  # tokens of inputs one call to llama.cpp takes together (pass_groups)
POOLING_NAMES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's LLAMA_POOLING_TYPE_*


@contextlib.contextmanager
def model_params(**fields: Any):
    """Set llama_model_params fields that llama_cpp.Llama() does not expose (use_extra_bufts).

    Llama() builds its params from llama_model_default_params() and loads the model inside
    its constructor, so the defaults are adjusted for the duration of that call. A runner
    process loads one model at a time, so nothing else sees the change."""
    import llama_cpp.llama_cpp as lib

    original = lib.llama_model_default_params
    if not fields:
        yield
        return

    def patched():
        params = original()
        names = {f[0] for f in type(params)._fields_}
        for k, v in fields.items():
            if k not in names:  # a ctypes struct would take the name and do nothing with it
                raise AttributeError(f"llama_model_params has no field {k!r} in this llama-cpp-python")
            setattr(params, k, v)
        return params

    lib.llama_model_default_params = patched
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def load_options(spec: LoadSpec) -> dict[str, Any]:
    """The Modelfile's PARAMETER use_mmap and main_gpu, as llama-cpp-python's Llama() takes them (the low-level
    load sets llama_model_params' load_mode and main_gpu from them: backend.LlamaCppBackend)."""
    out: dict[str, Any] = {}
    if spec.extra.get("use_mmap") is not None:
        out["use_mmap"] = bool(spec.extra["use_mmap"])
    if spec.extra.get("main_gpu") is not None:
        out["main_gpu"] = int(spec.extra["main_gpu"])
    return out


def model_pooling(info: Any) -> int | None:
    """The pooling type the GGUF header sets (llama.cpp's numbering), None when it sets none or none known."""
    if info is None:
        return None
    value = info.metadata.get(f"{info.architecture}.pooling_type")
    return int(value) if isinstance(value, int) and int(value) in POOLING_NAMES else None


def backend_pooling(info: Any) -> int:
    """The pooling an embedding model's or a reranker's backend loads it with: rank for a reranker, else the GGUF's
    own (mean when it sets none)."""
    from localrun.library.capabilities import gguf_kind

    return 4 if gguf_kind(info) == "rerank" else (model_pooling(info) or 1)


def is_causal(info: Any) -> bool:
    """Whether the model attends causally (a decoder: Qwen3-Embedding, Qwen3-Reranker, a generating model), not
    over the whole input (an encoder: BERT and its kin, or a GGUF that says attention.causal false)."""
    from localrun.library.capabilities import EMBEDDING_ARCHS

    if info is None:
        return True
    arch = info.architecture
    return arch not in EMBEDDING_ARCHS and info.metadata.get(f"{arch}.attention.causal") is not False


def pooled_window(spec: LoadSpec, info: Any) -> int:
    """The tokens one input may have in an embedding model's or a reranker's context: num_ctx, at most
    MAX_WINDOW and the model's trained context (an encoder's position embeddings end there)."""
    trained = int(getattr(info, "context_length", 0) or 0)
    return max(1, min(spec.num_ctx, MAX_WINDOW, trained or MAX_WINDOW))


def _normalized(v: list[float]) -> list[float]:
    """v over its L2 norm (as llama-cpp-python's normalize_embedding; a zero vector as it is)."""
    import numpy as np

    norm = float(np.linalg.norm(v))
    return [x / norm for x in v] if norm != 0.0 else v


def pass_groups(sizes: list[int], max_seqs: int = 256) -> list[range]:
    """Consecutive inputs (of these token counts) grouped into llama.cpp passes of at most PASS_TOKENS tokens and
    max_seqs inputs, a longer input in a pass of its own. Every sequence in a pass attends over the pass's cells, its
    own or not (masked out, but computed): 24 texts of 84 tokens in one 2,048-token pass cost SmolLM2 5% more than in
    passes of 512, and an encoder's whole-pass attention grows with the square of the pass."""
    out, start, tokens = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and (tokens + n > PASS_TOKENS or i - start >= max_seqs):
            out.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def pooled_ubatch(window: int, pooling: int, causal: bool) -> int:
    """The tokens one llama.cpp pass of a pooling context computes. llama.cpp pools each pass on its own: an input
    cut over two passes gets the mean (or first token) of its second part only (SmolLM2, 64 texts of 80 tokens in
    passes of 512: 8 came out up to 0.066 off), so mean and CLS pooling, and an encoder, see each input whole in
    one pass of the window. A causal model's last token (last-token and rank pooling) holds the whole input
    through its KV cache, so there the passes are CAUSAL_UBATCH tokens (those 64 texts: 12.0 s against 13.0 s)."""
    return min(CAUSAL_UBATCH, window) if causal and pooling in (3, 4) else window


class EmbeddingCancelled(Exception):
    """A pooled call whose request was cancelled, stopped between passes (nobody reads its result)."""


async def cancellable(executor: ThreadPoolExecutor, fn, *args):
    """`fn(*args, cancel=event)` on `executor`; cancelled (the client went, the daemon aborted the call), the
    event is set and the work stops before its next llama.cpp pass: it held the model's one pooling context
    (a later request waited the whole of an abandoned batch: 57 s behind 4 x 1,000 words on 2 cores)."""
    import asyncio
    import functools

    cancel = threading.Event()
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, cancel=cancel))
    except asyncio.CancelledError:
        cancel.set()
        raise


class Pooled:
    """One pooling llama.cpp context (made on first use unless ``eager``); its calls hold a lock, and each runs
    on the caller's thread."""

    def __init__(self, spec: LoadSpec, *, window: int, pooling: int, n_threads: int, n_gpu_layers: int,
                 extra_bufts: bool, causal: bool = True, eager: bool = False) -> None:
        self.spec, self.window, self.pooling = spec, window, pooling
        self.ubatch = pooled_ubatch(window, pooling, causal)
        self.n_threads, self.n_gpu_layers, self.extra_bufts = n_threads, n_gpu_layers, extra_bufts
        self.lock = threading.Lock()
        self.llm = None
        if eager:
            self._llm()

    def _llm(self):
        if self.llm is None:
            import llama_cpp

            n = self.window
            kw = dict(model_path=str(self.spec.weights), n_ctx=n, n_batch=n, n_ubatch=self.ubatch, n_threads=self.n_threads,
                      n_threads_batch=self.n_threads, n_gpu_layers=self.n_gpu_layers, verbose=False, embedding=True,
                      pooling_type=self.pooling)
            kw.update(load_options(self.spec))
            with model_params(**({} if self.extra_bufts else {"use_extra_bufts": False})):
                try:
                    # flash attention, as llama-server has it wherever the device can (its "auto"): the same
                    # numbers as llama-server's, no window x window attention scores per head, and faster (the
                    # 64 texts above: 20.0 s without it)
                    self.llm = llama_cpp.Llama(**kw, flash_attn=True)
                except ValueError:
                    try:
                        self.llm = llama_cpp.Llama(**kw)
                    except ValueError as exc:  # llama-cpp-python's word for a failed load or context
                        raise BackendError(f"llama.cpp could not load {self.spec.name} for "
                                           f"{POOLING_NAMES[self.pooling]} pooling: {exc}") from None
            # the model's LoRA adapter, set here (Llama's own lora_path crashes on an adapter that does not fit)
            if self.spec.extra.get("adapter"):
                import llama_cpp.llama_cpp as lib

                try:
                    load_lora(lib, self.llm.model, self.llm.ctx, str(self.spec.extra["adapter"]), self.spec.name)
                except BackendError:
                    self.llm.close()
                    self.llm = None
                    raise
        return self.llm

    def close(self) -> None:
        with self.lock:
            if self.llm is not None:
                try:
                    self.llm.close()
                except Exception:  # pragma: no cover
                    pass
                self.llm = None

    # -- embeddings ------------------------------------------------------------------------
    def embed(self, texts: list[str], truncate: bool = False,
              cancel: threading.Event | None = None) -> list[list[float]]:
        """One L2-normalized vector per text; a text over the window is an InvalidRequest, or with
        ``truncate`` its first tokens are embedded. `cancel` set: it stops before its next pass."""
        with self.lock:
            llm = self._llm()
            inputs = [llm.tokenize(t.encode("utf-8"), add_bos=True) for t in texts]
            if not truncate:
                for ids in inputs:
                    if len(ids) > self.window:
                        raise InvalidRequest(f"an input is {len(ids)} tokens, longer than the embedding window of "
                                             f"{self.window} tokens", code=CONTEXT_EXCEEDED)
            # truncate: each input's first `window` tokens (as llama-cpp-python's Llama.embed cuts them)
            return [_normalized(v) for v in self._pool(llm, [ids[:self.window] for ids in inputs], llm.n_embd(),
                                                       cancel)]

    # -- reranking -------------------------------------------------------------------------
    def rerank(self, query: str, documents: list[str], truncate: bool = False,
               cancel: threading.Event | None = None) -> tuple[list[list[float]], list[int]]:
        """(the classifier's outputs for each document against the query, each pair's token count). A pair
        over the window is an InvalidRequest, or with ``truncate`` its document's last tokens are cut.
        `cancel` set: it stops before its next pass."""
        import llama_cpp.llama_cpp as lib

        with self.lock:
            llm = self._llm()
            pair = self._pairs(llm, query, truncate)
            pairs = [pair(d) for d in documents]
            return (self._pool(llm, pairs, max(1, int(lib.llama_model_n_cls_out(llm.model))), cancel),
                    [len(ids) for ids in pairs])

    @staticmethod
    def _pool(llm, inputs: list[list[int]], width: int, cancel: threading.Event | None = None) -> list[list[float]]:
        """Each input's pooled row (its first `width` floats: an embedding, or a classifier's outputs), the inputs
        decoded in the passes pass_groups makes, as llama-cpp-python's Llama.embed decodes a batch."""
        import llama_cpp.llama_cpp as lib

        out: list[list[float]] = []
        for group in pass_groups([len(ids) for ids in inputs], int(llm.context_params.n_seq_max)):
            if cancel is not None and cancel.is_set():
                raise EmbeddingCancelled("the request was cancelled")
            llm._batch.reset()
            for seq, ids in enumerate(inputs[group.start:group.stop]):
                llm._batch.add_sequence(ids, seq, True)
            llm._ctx.kv_cache_clear()
            llm._ctx.decode(llm._batch)  # (an encoder-only model is encoded: llama_decode calls llama_encode)
            llm._batch.reset()
            for seq in range(len(group)):
                ptr = lib.llama_get_embeddings_seq(llm._ctx.ctx, seq)
                if not ptr:
                    raise BackendError("llama.cpp returned no pooled output for an input")
                out.append([float(ptr[i]) for i in range(width)])
        return out

    def _pairs(self, llm, query: str, truncate: bool):
        """A function from a document to the tokens of its pair with ``query``, laid out as llama-server's
        format_prompt_rerank does. The query is tokenized once, and one that leaves a document no room is an
        InvalidRequest here: each document then costs the tokenizing of at most a window."""
        import llama_cpp.llama_cpp as lib

        vocab = lib.llama_model_get_vocab(llm.model)
        template = lib.llama_model_chat_template(llm.model, b"rerank")

        def tok(text: str, special: bool = False) -> list[int]:
            return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special) if text else []

        def over(n: int, what: str) -> InvalidRequest:
            return InvalidRequest(f"{what} is {n} tokens, longer than the reranking window of {self.window} tokens"
                                  + ("" if truncate or what.startswith("the query") else
                                     "; send shorter documents, or 'truncate': true to cut them"), code=CONTEXT_EXCEEDED)

        if template:
            template = template.decode("utf-8", "replace")

            def layout(d: str) -> list[int]:
                return tok(template.replace("{query}", query).replace("{document}", d), special=True)

            fixed = len(layout(""))  # the template and the query
            if fixed >= self.window:
                raise over(fixed, "the query in the model's rerank template")

            def pair(doc: str) -> list[int]:
                ids = layout(doc)
                if len(ids) > self.window and truncate:  # the document's last tokens go until the pair fits
                    doc_ids = tok(doc)
                    keep = self.window - fixed
                    for _ in range(4):  # (detokenized and tokenized again, a cut can come out a token longer)
                        ids = layout(llm.detokenize(doc_ids[:keep]).decode("utf-8", "ignore"))
                        if len(ids) <= self.window:
                            break
                        keep -= len(ids) - self.window
                if len(ids) > self.window:
                    raise over(len(ids), "a query with a document")
                return ids
            return pair

        eos = int(lib.llama_vocab_eos(vocab))
        if eos < 0:
            eos = int(lib.llama_vocab_sep(vocab))
        head, tail = [], []
        if lib.llama_vocab_get_add_bos(vocab):
            head.append(int(lib.llama_vocab_bos(vocab)))
        head += tok(query)
        if lib.llama_vocab_get_add_eos(vocab):
            head.append(eos)
            tail.append(eos)
        if lib.llama_vocab_get_add_sep(vocab):
            head.append(int(lib.llama_vocab_sep(vocab)))
        room = self.window - len(head) - len(tail)
        if room < 1:
            raise over(len(head) + len(tail), "the query")

        def pair(doc: str) -> list[int]:
            d = tok(doc)
            if len(d) > room:
                if not truncate:
                    raise over(len(head) + len(d) + len(tail), "a query with a document")
                d = d[:room]
            return head + d + tail
        return pair


class PooledBackend:
    """An embedding model or a reranker (``LoadSpec.embedding``) in one pooling llama.cpp context
    (:class:`Pooled`). It generates nothing: the daemon refuses generation requests for such a model before
    loading it, and this backend refuses them again."""

    def __init__(self, spec: LoadSpec, info: Any, *, n_threads: int, extra_bufts: bool, bufts_reason: str) -> None:
        """``info``: the GGUF's header (a GGUFInfo); the threads and llama.cpp's extra buffer types as the
        llama.cpp backend chose them (backend.load)."""
        from llama_cpp._logger import set_verbose

        from localrun.library.capabilities import KIND_USE, gguf_kind

        set_verbose(log.isEnabledFor(logging.DEBUG))  # llama.cpp's own log: errors only, unless debugging
        self.spec = spec
        self.kind = gguf_kind(info)
        if self.kind == "completion":
            raise BackendError(f"{spec.name} generates text: it is not an embedding model or a reranker")
        window = pooled_window(spec, info)
        pooling = backend_pooling(info)
        n_gpu_layers = int(spec.extra.get("n_gpu_layers", 0))
        self.pooled = Pooled(spec, window=window, pooling=pooling, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                             extra_bufts=extra_bufts, causal=is_causal(info), eager=True)
        import llama_cpp.llama_cpp as lib

        llm = self.pooled.llm
        self._lib = lib
        self._vocab = lib.llama_model_get_vocab(llm.model)
        self._n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        # every call on one thread that lives on: no batched loop shares this runner's CPUs, so its OpenMP team
        # slows nothing (fresh_threads.py), and a new team for each call cost 9 ms of a 200 ms embedding
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"llamacpp-pool-{spec.name}")
        device = spec.extra.get("device", "CPU")
        what = KIND_USE[self.kind][0]
        self.info = BackendInfo(
            name="llama.cpp", device=device, processor=spec.extra.get("processor", "100% CPU"),
            reason=(f"{spec.extra.get('reason') or 'llama.cpp on CPU'}; {what}: one {POOLING_NAMES[pooling]}-pooling "
                    f"context of {window} tokens, {n_threads} threads, {bufts_reason}"),
            context_length=window, slots=1, size_bytes=int(spec.extra.get("size_bytes") or 0),
            size_vram_bytes=int(spec.extra.get("size_vram", 0)),
            supports_embeddings=self.kind == "embedding", supports_rerank=self.kind == "rerank",
            supports_logprobs=False, supports_json_schema=False,
            max_token_bytes=longest_piece(lib, self._vocab, self._n_vocab),
            embed_window=window,
            bos_token=self._special_text(int(lib.llama_vocab_bos(self._vocab))),
            eos_token=self._special_text(int(lib.llama_vocab_eos(self._vocab))),
        )

    def _special_text(self, token: int) -> str:
        return self._detokenize([token]) if 0 <= token < self._n_vocab else ""

    def _detokenize(self, ids: list[int]) -> str:
        return pieces_text(self._lib, self._vocab, ids)

    def _refusal(self, doing: str) -> InvalidRequest:
        """What this model does not do (the daemon refuses such requests first: these are the backend's own)."""
        from localrun.library.capabilities import KIND_USE

        what, where = KIND_USE[self.kind]
        return InvalidRequest(f"{self.spec.name} does not {doing}: it is {what}; use it with {where}")

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        import asyncio

        def run() -> list[int]:
            with self.pooled.lock:
                return self.pooled.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

        return await asyncio.to_thread(run)

    async def detokenize(self, token_ids: list[int]) -> str:
        check_token_ids(token_ids, self._n_vocab)
        return self._detokenize(token_ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        raise self._refusal("generate text")
        yield  # pragma: no cover - an async generator

    async def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        import asyncio

        if self.kind != "embedding":
            raise self._refusal("make embeddings")
        return await cancellable(self._executor, self.pooled.embed, texts, truncate)

    async def rerank(self, query: str, documents: list[str], truncate: bool = False) -> tuple[list[list[float]], list[int]]:
        import asyncio

        if self.kind != "rerank":
            raise self._refusal("rerank")
        return await cancellable(self._executor, self.pooled.rerank, query, documents, truncate)

    async def close(self) -> None:
        import asyncio

        def run() -> None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self.pooled.close()

        await asyncio.to_thread(run)
