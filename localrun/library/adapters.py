"""A PEFT LoRA adapter (what PEFT, Unsloth and Axolotl save a fine-tune as: adapter_config.json +
adapter_model.safetensors) converted to the LoRA GGUF llama.cpp loads, as Ollama's ADAPTER takes a
safetensors adapter directory. The same tensors llama.cpp's own convert_lora_to_gguf.py writes (float32):
each ``<module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r] as ``blk.N.<gguf name>.weight.lora_a`` /
``.lora_b``, a llama's (and mistral's) q/k ``lora_B`` rows permuted as the converter permutes the model's Q/K
weights, ``adapter.lora.alpha`` the config's lora_alpha (x sqrt(r) for rsLoRA, whose scale is alpha / sqrt(r):
llama.cpp scales by alpha / r). Only what maps exactly is converted; anything else (DoRA, per-module alphas,
adapted embeddings or lm_head, another architecture) is refused with what to do instead.

Safetensors are read here with numpy (bounded header, F32 / F16 / BF16 tensors): the daemon's dependencies
need no torch or safetensors package for it."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from localrun.errors import InvalidRequest
from localrun.library.gguf_info import GGUFInfo
from localrun.library.paths import open_regular

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
MAX_ADAPTER_BYTES = 2 << 30  # read whole (rank 64 on every matrix of a 70B: ~1.7 GB in bf16)
# the architectures whose Hugging Face module names map one to one onto llama.cpp's; True: Q/K rows permuted
ARCHS = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False, "gemma2": False, "gemma3": False}
_MODULES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}
_KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d{1,4})\.([a-z_]+\.[a-z_]+)\.lora_([AB])\.weight")
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_ADVICE = ("convert it with llama.cpp's convert_lora_to_gguf.py (--base <the base model's directory>) and give "
           "ADAPTER the .gguf")


def is_peft_dir(path: Path) -> bool:
    return (path / CONFIG).is_file()


def read_config(path: Path, shown: str) -> dict:
    """adapter_config.json, checked for what a LoRA GGUF can hold."""
    f, size = open_regular(path, f"{shown}: {CONFIG}")
    with f:
        if size > MAX_CONFIG_BYTES:
            raise InvalidRequest(f"{shown}: {CONFIG} is {size} bytes (at most {MAX_CONFIG_BYTES})")
        try:
            cfg = json.loads(f.read())
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(f"{shown}: {CONFIG} is not JSON") from None
    if not isinstance(cfg, dict):
        raise InvalidRequest(f"{shown}: {CONFIG} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequest(f"{shown} is a {cfg.get('peft_type')!r} adapter: only LoRA adapters are applied")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise InvalidRequest(f"{shown}: {CONFIG} needs a positive integer 'r' and a positive 'lora_alpha'")
    for key, what in (("use_dora", "a DoRA adapter (weight-decomposed)"), ("modules_to_save", "modules saved whole "
                      "(modules_to_save)"), ("alpha_pattern", "a lora_alpha per module (alpha_pattern)")):
        if cfg.get(key):
            raise InvalidRequest(f"{shown} is {what}, which a LoRA GGUF cannot hold: merge it into the model "
                                 "(PEFT's merge_and_unload) and import the merged model instead")
    return cfg


def read_safetensors(path: Path, shown: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (F32, F16 and BF16 tensors only)."""
    display = f"{shown}: {path.name}"
    f, size = open_regular(path, display)
    with f:
        if size > MAX_ADAPTER_BYTES:
            raise InvalidRequest(f"{display} is {size} bytes, more than this conversion reads ({MAX_ADAPTER_BYTES}): "
                                 f"{_ADVICE}")
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise InvalidRequest(f"{display} is not a valid safetensors file: bad header length")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(f"{display} is not a valid safetensors file: header is not JSON") from None
        data = f.read(size - 8 - n)
    if not isinstance(header, dict):
        raise InvalidRequest(f"{display} is not a valid safetensors file: header is not an object")
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = t["dtype"], [int(d) for d in t["shape"]], t["data_offsets"]
            ok = (dtype in _DTYPES and len(shape) == 2 and min(shape) > 0 and isinstance(b, int) and isinstance(e, int)
                  and 0 <= b <= e <= len(data) and e - b == shape[0] * shape[1] * _DTYPES[dtype].itemsize)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidRequest(f"{display}: tensor {str(name)[:80]!r} is not a float matrix (F32, F16 or BF16) "
                                 "within the file")
        arr = np.frombuffer(data, dtype=_DTYPES[dtype], count=shape[0] * shape[1], offset=b)
        if dtype == "BF16":  # the high half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float32).reshape(shape)
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (LlamaModel.permute): each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(config: Path, weights: Path, model: GGUFInfo, out: Path, shown: str) -> None:
    """The PEFT adapter (its config and weights files) as a LoRA GGUF for `model` at `out`."""
    import gguf

    arch = model.architecture
    if arch not in ARCHS:
        raise InvalidRequest(f"{shown}: a safetensors adapter converts here for {', '.join(ARCHS)} models, and this "
                             f"model is {arch!r}: {_ADVICE}")
    cfg = read_config(config, shown)
    tensors = read_safetensors(weights, shown)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        m = _KEY.fullmatch(name)
        if m is None or m.group(2) not in _MODULES:
            raise InvalidRequest(f"{shown} adapts {name[:100]!r}, which does not map onto the model's layers "
                                 f"(adapted embeddings or lm_head, or another layout): {_ADVICE}")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = arr
    if not pairs:
        raise InvalidRequest(f"{shown}: {WEIGHTS} holds no LoRA tensors")
    heads, kv_heads = int(model.head_count or 0), int(model.head_count_kv or model.head_count or 0)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    alpha = float(cfg["lora_alpha"]) * (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else 1.0)
    w.add_float32("adapter.lora.alpha", alpha)
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise InvalidRequest(f"{shown}: layer {layer} {module} needs a lora_A [r, in] and a lora_B [out, r]")
        a, b = ab["A"], ab["B"]
        if ARCHS[arch] and module in ("self_attn.q_proj", "self_attn.k_proj"):
            n = heads if module == "self_attn.q_proj" else kv_heads
            if n <= 0 or b.shape[0] % (2 * n):
                raise InvalidRequest(f"{shown}: layer {layer} {module}'s lora_B has {b.shape[0]} rows, not whole "
                                     f"heads of this model's {n}")
            b = _permute(b, n)
        base = f"blk.{layer}.{_MODULES[module]}.weight"
        w.add_tensor(base + ".lora_a", np.ascontiguousarray(a))
        w.add_tensor(base + ".lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
