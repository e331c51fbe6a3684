"""The tiny vision test model (no package ships a small vision GGUF): a random Gemma 3 VLM written by
tests/tools/tiny_vlm.py (a copy of the project's shared tool) and converted
by the converter that ships in the llama-cpp-python sdist (text GGUF + mmproj GGUF), cached under the
pytest cache directory; and llama.cpp's own multimodal path as the reference (libmtmd's helper
evaluates the prompt's chunks in order, then greedy decoding), independent of localrun's batched loop."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _sdist(cache: Path) -> Path:
    """The pinned llama-cpp-python sdist, unpacked once into ``llama-sdist`` beside ``cache`` (a folder of the
    pytest cache, or of the run's temporary directory) and shared by every test model built there (~290 MB
    each, were each to unpack its own); pip's cache makes a second download cheap."""
    version = importlib.metadata.version("llama-cpp-python")
    shared = cache.parent / "llama-sdist"
    root = shared / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        shared.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                            str(shared), f"llama-cpp-python=={version}"], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"the llama-cpp-python {version} sdist (its converter) cannot be had: {r.stderr[-300:]}")
        tar = shared / f"llama_cpp_python-{version}.tar.gz"
        with tarfile.open(tar) as t:
            t.extractall(shared, filter="data")
        tar.unlink()
    return root


def write_hf_model(tool_name: str, out: Path, cache: Path) -> tuple[Path, Path, dict]:
    """Runs the model writer tests/tools/<tool_name> (or shared/tools') into a fresh ``out``/hf:
    (the Hugging Face folder, the sdist's llama.cpp with its converter, the converter's environment)."""
    pytest.importorskip("sentencepiece")
    tool = next((d / tool_name for d in (REPO / "tests" / "tools", REPO.parent / "shared" / "tools")
                 if (d / tool_name).exists()), None)
    if tool is None:
        pytest.skip(f"{tool_name} (shared/tools) is not here")
    hf = out / "hf"
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run([sys.executable, str(tool), str(hf)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    vendor = _sdist(cache) / "vendor" / "llama.cpp"
    return hf, vendor, {**os.environ, "PYTHONPATH": str(vendor / "gguf-py")}


def convert(vendor: Path, env: dict, hf: Path, dst: Path, *args: str) -> None:
    """The Hugging Face folder ``hf`` converted to ``dst`` by the sdist's converter (written beside it, then
    renamed: an interrupted build leaves no half file under the cached name)."""
    tmp = dst.with_name(dst.name + ".part")
    r = subprocess.run([sys.executable, str(vendor / "convert_hf_to_gguf.py"), str(hf), *args, "--outfile", str(tmp)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    tmp.rename(dst)


def build_models(cache: Path, tool_name: str, files: dict[str, tuple[str, ...]]) -> list[Path]:
    """The GGUFs a test-model writer's output converts to, built once into ``cache``/<the tool's name>: ``files``
    maps each file's name to the Hugging Face subfolder it converts ("" for the whole output) and the
    converter's further arguments."""
    out = cache / tool_name.removesuffix(".py").replace("_", "-")
    paths = [out / name for name in files]
    if all(p.exists() for p in paths):
        return paths
    hf, vendor, env = write_hf_model(tool_name, out, cache)
    for path, (sub, *args) in zip(paths, files.values()):
        convert(vendor, env, hf / sub if sub else hf, path, *args)
    return paths


def build_tiny_vlm(cache: Path) -> tuple[Path, Path]:
    """(text GGUF, projector GGUF) of the tiny VLM, built once into ``cache``."""
    gguf, mmproj = build_models(cache, "tiny_vlm.py", {"tiny-vlm.gguf": ("",), "mmproj-tiny-vlm.gguf": ("", "--mmproj")})
    return gguf, mmproj


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 64), noise_seed: int | None = None) -> bytes:
    """A small PNG: one color, or random pixels."""
    import io

    import numpy as np
    from PIL import Image

    if noise_seed is not None:
        arr = np.random.default_rng(noise_seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        img = Image.fromarray(arr)
    else:
        img = Image.new("RGB", size, color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def mtmd_reference(gguf: Path, mmproj: Path, prompt: str, images: list[bytes], n_tokens: int) -> list[int]:
    """Greedy token ids for a prompt whose images sit at localrun.backends.base.MEDIA_MARKER, by llama.cpp's
    own multimodal path: one context, one sequence, libmtmd's helper evaluating every chunk in order."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib
    import llama_cpp.mtmd_cpp as mtmd

    from localrun.backends.base import MEDIA_MARKER

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=2, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.print_timings, params.n_threads = False, False, 2
    mctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert mctx
    bitmaps = []
    try:
        for data in images:
            bm = mtmd.mtmd_helper_bitmap_init_from_buf(mctx, (ctypes.c_uint8 * len(data)).from_buffer_copy(data),
                                                       len(data), False)
            mtmd.mtmd_bitmap_set_id(bm, hashlib.sha256(data).hexdigest().encode())
            bitmaps.append(bm)
        text = mtmd.mtmd_input_text()
        raw = prompt.replace(MEDIA_MARKER, mtmd.mtmd_default_marker().decode()).encode()
        text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), False, True
        chunks = mtmd.mtmd_input_chunks_init()
        arr = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        assert mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(text), arr, len(bitmaps)) == 0
        n_past = lib.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(mctx, llm.ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        mtmd.mtmd_input_chunks_free(chunks)
        greedy = lib.llama_sampler_init_greedy()
        out, pos = [], n_past.value
        for _ in range(n_tokens):
            tok = lib.llama_sampler_sample(greedy, llm.ctx, -1)
            out.append(tok)
            batch = lib.llama_batch_get_one((lib.llama_token * 1)(tok), 1)
            assert lib.llama_decode(llm.ctx, batch) == 0
            pos += 1
        lib.llama_sampler_free(greedy)
        return out
    finally:
        for bm in bitmaps:
            mtmd.mtmd_bitmap_free(bm)
        mtmd.mtmd_free(mctx)
        llm.close()


@contextmanager
def vision_daemon(home: Path, vlm: tuple[Path, Path], text_gguf: Path):
    """A real daemon whose library holds ``vlm`` (the tiny VLM with its projector, as a Modelfile's
    two FROM lines) and ``text`` (a model without a projector)."""
    from daemon import Daemon

    gguf, mmproj = vlm
    d = Daemon(home, LOCALRUN_CONTEXT_LENGTH="1024")
    try:
        for name, mf in (("vlm", f"FROM {gguf}\nFROM {mmproj}\n"), ("text", f"FROM {text_gguf}\n")):
            r = d.http.post("/api/create", json={"model": name, "modelfile": mf, "stream": False})
            assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop()
