"""Writing tiny GGUF files from transformers models, as llama.cpp's convert_hf_to_gguf.py does; requantizing one
with llama.cpp's own quantizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def requantize(src: Path, out: Path, ftype: int) -> Path:
    """`src` written as llama_ftype `ftype` (1 = F16, 2 = Q4_0, ...) by llama.cpp's quantizer, in a child process
    (allow_requantize: the bundled Q4_1 becomes another type); `out`."""
    code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]); "
            "p.allow_requantize = True; p.nthread = 2; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(out), str(ftype)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def add_decoder_metadata(w, cfg) -> None:
    """The metadata every decoder GGUF carries: lengths, layer and head counts, the norm epsilon."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
