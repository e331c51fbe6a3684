"""Images in a llama.cpp prompt: the vision projector (mtmd), the prompt's image spans, and their prefill.

:class:`Vision` is a model's projector (llama.cpp's multimodal library, mtmd): it tokenizes a prompt's text
and images together, encodes an image into embeddings and decodes them into a sequence's cells. In the
prompt an image's positions hold stand-ins derived from the image's hash (:func:`image_standins`), so the
prefix cache shares an image's cells only with a prompt that holds the same image at the same place.
:class:`ImageFeed` is the batched loop's side: each image is encoded on a thread of its own (a running
stream never waits for another request's image to encode) and put in the cache when its prefill reaches it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from localrun.backends.base import MEDIA_MARKER, GenerationRequest
from localrun.backends.llamacpp.fresh_threads import FreshThreadExecutor
from localrun.backends.llamacpp.slots import Request, Slot
from localrun.errors import BackendError, InvalidRequest

log = logging.getLogger("localrun.llamacpp")


@dataclass(eq=False)
class ImageSpan:
    """An image in a prompt: ``n`` positions from ``start``, whose prompt "tokens" are stand-ins
    derived from the image's hash (negative: never a vocabulary id), so the prefix cache shares an
    image's cells only with a prompt that holds the same image at the same place. ``chunk`` is
    llama.cpp's (mtmd) image chunk; ``embd`` its encoded embeddings once the encoder thread is done."""

    start: int
    n: int
    chunk: Any
    embd: Any = None
    error: BaseException | None = None
    encoding: bool = False

    @property
    def end(self) -> int:
        return self.start + self.n


def image_standins(digest: bytes, n: int) -> list[int]:
    """The prompt's stand-ins for an image of n positions (see ImageSpan)."""
    key = int.from_bytes(digest[:8], "little")
    return [-1 - ((key + i) % (2**31 - 2)) for i in range(n)]


def mtmd_lib():
    """llama-cpp-python's bindings of llama.cpp's multimodal library (imported on first use)."""
    import llama_cpp.mtmd_cpp as mtmd

    return mtmd


class Vision:
    """A vision projector loaded for a model (LoadSpec.extra["projector"]) beside its batched context `ctx`
    (`n_batch` tokens a decode). :meth:`close` frees it."""

    def __init__(self, lib, path: str, model, ctx, *, n_batch: int, use_gpu: bool, n_threads: int, name: str) -> None:
        from llama_cpp._logger import llama_log_callback

        self.lib, self.model, self.ctx, self.n_batch, self.name = lib, model, ctx, n_batch, name
        mtmd = mtmd_lib()
        mtmd.mtmd_helper_log_set(llama_log_callback, None)  # its log as llama.cpp's: errors only, unless debugging
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads
        mctx = mtmd.mtmd_init_from_file(path.encode("utf-8"), model, params)
        if not mctx:
            raise BackendError(f"llama.cpp could not load the vision projector {path} for {name} (see the "
                               "runner's log): is it the projector of this model?")
        if not mtmd.mtmd_support_vision(mctx):
            mtmd.mtmd_free(mctx)
            raise BackendError(f"{path} is not a vision projector (it has no image encoder)")
        if mtmd.mtmd_decode_use_mrope(mctx):  # positions are not cells there: no prefix sharing across images
            log.info("%s uses M-RoPE positions: prompts with images are not shared with others", name)
        self.mctx = mctx

    def tokenize(self, request: GenerationRequest) -> tuple[list[int], list, Any]:
        """(tokens, image spans, mtmd chunks) of a prompt with MEDIA_MARKER where each image goes;
        an image's positions hold stand-ins from its bytes' hash (image_standins).
        Runs off the event loop: decoding the images is real work."""
        mtmd = mtmd_lib()
        n_markers = request.prompt.count(MEDIA_MARKER)
        if n_markers != len(request.images):
            raise InvalidRequest(f"the prompt has {n_markers} image place(s) but {len(request.images)} image(s) came")
        bitmaps = []
        chunks = None
        try:
            for i, data in enumerate(request.images):
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bm = mtmd.mtmd_helper_bitmap_init_from_buf(self.mctx, buf, len(data), False)
                if not bm:
                    raise InvalidRequest(f"image {i + 1} could not be decoded: send a PNG, JPEG, GIF or BMP image")
                mtmd.mtmd_bitmap_set_id(bm, hashlib.sha256(data).hexdigest().encode("ascii"))
                bitmaps.append(bm)
            text = mtmd.mtmd_input_text()
            raw = request.prompt.replace(MEDIA_MARKER, mtmd.mtmd_default_marker().decode("utf-8")).encode("utf-8")
            text.text, text.text_len = raw, len(raw)
            text.add_special, text.parse_special = request.add_special, True
            chunks = mtmd.mtmd_input_chunks_init()
            arr = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            if mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(text), arr, len(bitmaps)) != 0:
                raise InvalidRequest("llama.cpp could not place the images in the prompt")
            tokens: list[int] = []
            spans = []
            digests = [hashlib.sha256(d).digest() for d in request.images]
            for k in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, k)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    tokens += [ptr[j] for j in range(n.value)]
                else:
                    n_tok = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                    spans.append(ImageSpan(len(tokens), n_tok, chunk))
                    tokens += image_standins(digests[len(spans) - 1], n_tok)
            if spans and mtmd.mtmd_decode_use_mrope(self.mctx):
                # positions there are not one per cell: make the stand-ins unique to this request
                salt = os.urandom(8)
                for sp in spans:
                    tokens[sp.start:sp.end] = image_standins(hashlib.sha256(salt + bytes(sp.start)).digest(), sp.n)
            return tokens, spans, chunks
        except BaseException:
            if chunks is not None:
                mtmd.mtmd_input_chunks_free(chunks)
            raise
        finally:
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)

    def encode(self, span: ImageSpan) -> Any:
        """Runs on the loop's encoder thread: the image chunk's embeddings (a copy)."""
        import numpy as np

        mtmd = mtmd_lib()
        if mtmd.mtmd_encode_chunk(self.mctx, span.chunk) != 0:
            raise BackendError("llama.cpp could not encode an image (see the runner's log)")
        n_embd = int(self.lib.llama_model_n_embd_inp(self.model))
        ptr = mtmd.mtmd_get_output_embd(self.mctx)
        return np.ctypeslib.as_array(ptr, shape=(span.n * n_embd,)).copy()

    def decode(self, span: ImageSpan, seq: int, pos: int) -> None:
        """Runs on the loop's thread: the encoded image into sequence `seq` from position `pos`."""
        mtmd = mtmd_lib()
        new_pos = self.lib.llama_pos(0)
        embd = span.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        rc = mtmd.mtmd_helper_decode_image_chunk(self.mctx, self.ctx, span.chunk, embd, pos, seq,
                                                 self.n_batch, ctypes.byref(new_pos),
                                                 mtmd.mtmd_helper_post_decode_callback(), None)
        if rc != 0:
            raise BackendError(f"llama.cpp could not decode an image into the context (code {rc})")

    def close(self) -> None:
        if self.mctx:
            mtmd_lib().mtmd_free(self.mctx)
            self.mctx = None



class ImageFeed:
    """The loop's side of its requests' images (see the module docstring): ``encode(span)`` -> embeddings on
    an encoder thread, ``decode_image(span, seq, pos)`` into the KV cache on the loop's thread (both None
    without a projector). ``wake`` is the loop's condition, notified when an encode is done; ``truncate``
    and ``fail`` cut a slot's cells and end a request with an error, as the loop does."""

    def __init__(self, encode, decode_image, *, name: str, slots: list[Slot], counters: dict[str, Any],
                 wake: threading.Condition, truncate: Callable[[Slot, int], None],
                 fail: Callable[[Request, BaseException], None]) -> None:
        self._encode, self._decode_image = encode, decode_image
        self.slots, self.counters, self.wake, self.truncate, self.fail = slots, counters, wake, truncate, fail
        self._encoder = None
        if encode is not None:  # each encode on a thread that then exits (its OpenMP team with it: fresh_threads.py)
            self._encoder = FreshThreadExecutor(f"llama-image-{name}")

    def shutdown(self) -> None:
        if self._encoder is not None:
            self._encoder.shutdown(wait=True, cancel_futures=True)

    def ready(self, r: Request) -> bool:
        """Whether r's prefill goes on with text now: an image due next is put in the cache first
        (once encoded: its encode is started here, on the encoder thread, if it is not yet)."""
        while (img := r.image_at()) is not None:
            if img.error is not None:
                self.fail(r, img.error)
                return False
            if img.embd is None:
                if not img.encoding:
                    img.encoding = True
                    self._encoder.submit(self._encode_one, img)
                return False
            try:
                self._decode_image(img, r.sid, r.computed)
            except Exception as exc:  # noqa: BLE001 - this request fails, the loop goes on
                self.truncate(self.slots[r.sid], r.computed)  # whatever part of it got in
                self.fail(r, exc if isinstance(exc, (InvalidRequest, BackendError)) else
                                   BackendError(f"llama.cpp could not decode an image: {exc}"))
                return False
            img.embd = None  # only the cells keep it
            self.slots[r.sid].tokens += r.prompt[img.start:img.end]
            r.computed += img.n
            r.pending = r.pending[img.n:]
            self.counters["image_tokens"] += img.n
        return r.computed < len(r.prompt)

    def _encode_one(self, img: ImageSpan) -> None:
        try:
            img.embd = self._encode(img)
        except BaseException as exc:  # noqa: BLE001 - the request gets it
            img.error = exc if isinstance(exc, (InvalidRequest, BackendError)) else \
                BackendError(f"llama.cpp could not encode an image: {exc}")
        with self.wake:
            self.wake.notify()
