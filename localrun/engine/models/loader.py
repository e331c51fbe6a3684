"""Checkpoints to weights: GGUF or safetensors read by Hugging Face name, and model recipes.

GGUF is dequantized with the gguf library; a Hugging Face safetensors directory is
memory-mapped with safetensors.safe_open. Never unpickles anything.

Both produce (ModelConfig, get(hf_name) -> tensor, names); the model copies each tensor
into its fused parameters one at a time, so peak memory stays near the model's size. The
getters also have ``get.part(name, dim, start, n)``: rows (dim 0) or columns (dim 1) of a
tensor, read without the rest where the format allows (a tensor-parallel rank's shard).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from localrun.archs import NATIVE_ARCHS
from localrun.engine.config import EngineConfig, ModelConfig
from localrun.engine.models.shapes import get_shape
from localrun.engine.tokenizer import Tokenizer

log = logging.getLogger("localrun.engine")

Getter = Callable[[str], torch.Tensor]

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # qwen3
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q|k|v fused (its ffn_up holds gate|up: see read_gguf)
    # mixtures of experts (qwen3moe; Mixtral as llama): the router and the stacked experts [E, rows, cols]
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma 2 / 3: four norms per layer (llama.cpp's ffn_norm is the pre-feedforward one there) and q/k norms
_GGUF_GEMMA_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                           "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_GEMMA = ("gemma2", "gemma3")
# gpt-oss (llama.cpp's "gpt-oss"): its post-attention norm, the sink logits (attn_sinks.weight, read as
# self_attn.sinks), the router with its bias, the experts stacked [E, rows, cols] with their biases [E, rows]
# (the converter splits transformers' interleaved gate_up_proj into ffn_gate_exps and ffn_up_exps)
_GGUF_GPT_OSS_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                             "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router"}
# Hugging Face names only (llama.cpp writes gemma3 / qwen3moe / gpt-oss, and a Mixtral as llama)
_GGUF_ARCHS = tuple(a for a in NATIVE_ARCHS if a not in ("gemma3_text", "qwen3_moe", "mixtral", "gpt_oss"))


def _hf_name(gguf_name: str, layer_names: dict[str, str] = _GGUF_LAYER_NAMES) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time Q/K row permutation (as transformers' GGUF loader does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _lora_updates(path: str | Path, arch: str, hf_of: dict[str, str]) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """A LoRA adapter GGUF (llama.cpp's convert_lora_to_gguf.py) as updates by Hugging Face name: (B [out, r],
    A [r, in], scale), in the base GGUF's own layout (a llama's Q/K rows permuted as the base's are), so that
    W + scale * B @ A is the adapted weight as llama.cpp computes it (scale: alpha / rank, 1 without alpha)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - a corrupt file surfaces as a clear error
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    if _field(reader, "general.type") != "adapter" or _field(reader, "adapter.type") != "lora":
        raise ValueError(f"{path} is not a LoRA adapter")
    if (a_arch := _field(reader, "general.architecture")) != arch:
        raise ValueError(f"the LoRA adapter is for {a_arch!r} models, the model is {arch!r}")
    alpha = float(_field(reader, "adapter.lora.alpha", 0.0) or 0.0)
    parts: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        if kind not in ("lora_a", "lora_b"):
            raise ValueError(f"the LoRA adapter holds {t.name}, not a lora_a / lora_b tensor: the native engine "
                             "applies only those")
        parts.setdefault(base, {})[kind] = np.array(  # (a copy: F32 data comes back as a read-only view)
            gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
    out = {}
    for base, ab in parts.items():
        hf = hf_of.get(base)
        if hf is None or base.startswith("token_embd") or set(ab) != {"lora_a", "lora_b"}:
            raise ValueError(f"the LoRA adapter updates {base}, which the native engine cannot apply it to")
        a, b = ab["lora_a"], ab["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"the LoRA adapter's {base} pair has shapes {b.shape} and {a.shape}, not [out, r] and [r, in]")
        out[hf] = (b, a, alpha / a.shape[0] if alpha else 1.0)
    return out


def read_gguf(path: str | Path, adapter: str | Path | None = None) -> tuple[ModelConfig, Getter, set[str], dict]:
    """(config, getter, names, metadata) for a GGUF file; metadata has tokenizer ids and the template. With
    `adapter` (a LoRA adapter GGUF) the getter gives each adapted weight with its update merged in."""
    import gguf  # only here: engine-only machines may lack it

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - a corrupt file surfaces as a clear error
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = _field(reader, "general.architecture", "?")
    if arch not in _GGUF_ARCHS:
        from localrun.archs import unsupported_message

        raise ValueError(unsupported_message(arch, "GGUF architecture"))
    layer_names = (_GGUF_GEMMA_LAYER_NAMES if arch in _GGUF_GEMMA else
                   _GGUF_GPT_OSS_LAYER_NAMES if arch == "gpt-oss" else _GGUF_LAYER_NAMES)
    tensors = {_hf_name(t.name, layer_names): t for t in reader.tensors}
    if arch == "gpt-oss":  # transformers names the sinks without .weight
        tensors = {n.removesuffix(".weight") if n and n.endswith(".self_attn.sinks.weight") else n: t
                   for n, t in tensors.items()}
    extra = {t.name: t for t in reader.tensors}
    tensors.pop(None, None)
    if arch == "phi3":  # llama.cpp stores Phi-3's fused gate|up as ffn_up (and no ffn_gate)
        tensors = {n.replace(".mlp.up_proj.", ".mlp.gate_up_proj.") if ".mlp.up_proj." in n
                   and n.replace(".up_proj.", ".gate_proj.") not in tensors else n: t for n, t in tensors.items()}
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    scaling = None
    if "rope_freqs.weight" in extra:  # Llama 3.1+: llama.cpp stores the llama3 frequency factors
        scaling = {"rope_type": "freq_factors",
                   "factors": gguf.quants.dequantize(extra["rope_freqs.weight"].data,
                                                     extra["rope_freqs.weight"].tensor_type).ravel().tolist()}
    elif arch == "gpt-oss" and _field(reader, f"{arch}.rope.scaling.type") == "yarn":
        scaling = _gguf_yarn(a)
    elif _field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    elif "rope_factors_long.weight" in extra:  # Phi-3 longrope: both factor lists, as tensors
        factors = {k: gguf.quants.dequantize(extra[f"rope_factors_{k}.weight"].data,
                                             extra[f"rope_factors_{k}.weight"].tensor_type).ravel().tolist()
                   for k in ("long", "short")}
        orig = int(a("rope.scaling.original_context_length", 0) or a("context_length", 4096))
        scaling = {"rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"],
                   "original_max_position_embeddings": orig,
                   "factor": int(a("context_length", orig)) / orig}
        if a("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(a("rope.scaling.attn_factor"))
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    cfg = ModelConfig(
        hidden_size=hidden,
        num_layers=int(a("block_count")),
        num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        intermediate_size=int(a("feed_forward_length")),
        vocab_size=int(tensors["model.embed_tokens.weight"].shape[1]),
        head_dim=int(a("attention.key_length", 0) or 0),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(a("context_length", 4096)),
        tie_word_embeddings="lm_head.weight" not in tensors,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        arch=arch,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted({int(e) for e in eos if e is not None}),
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
        rotary_dim=_partial_rotary(int(a("rope.dimension_count", 0) or 0),
                                   int(a("attention.key_length", 0) or 0) or hidden // heads),
        **(_gguf_gpt_oss(a, tensors) if arch == "gpt-oss" else
           {**_gguf_attention_extras(reader, arch, a), **_gguf_moe(a, tensors)}),
    )
    if arch in ("qwen3moe", "gpt-oss"):
        cfg.arch = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}[arch]
    permuted = arch in ("llama", "mistral")
    updates = _lora_updates(adapter, arch, {t.name: hf for hf, t in tensors.items()}) if adapter else {}
    # llama.cpp's converter stores Gemma's norm weights as 1 + w: back to the Hugging Face form
    # (GemmaModel folds the +1 in again, in float32)
    norm_shift = 1.0 if arch in _GGUF_GEMMA else 0.0

    def unpermute(name: str, w: torch.Tensor) -> torch.Tensor:
        if norm_shift and name.endswith("norm.weight"):
            return w - norm_shift
        if permuted and ".q_proj." in name:
            return unpermute_qk(w, cfg.num_heads)
        if permuted and ".k_proj." in name:
            return unpermute_qk(w, cfg.num_kv_heads)
        return w

    def q8_0(name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Q8_0 tensor as it is stored: (int8 [rows, cols], float32 scales [rows, cols // 32]),
        rows in the HF order; None for any other tensor type (the quantized loader then quantizes
        the dequantized floats itself)."""
        t = tensors.get(name)
        if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q8_0 or name in updates:
            return None
        rows = int(np.prod(t.shape.tolist()[1:]))
        blocks = np.asarray(t.data).reshape(-1, 34)  # a block: float16 scale, 32 int8 values
        scales = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
        q = blocks[:, 2:].copy().view(np.int8).reshape(rows, -1)
        return unpermute(name, torch.from_numpy(q)), unpermute(name, torch.from_numpy(scales))

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise KeyError(f"GGUF file lacks tensor {name}")
        arr = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only memory map
            arr = arr.copy()
        w = torch.from_numpy(arr).reshape(tuple(reversed(t.shape.tolist())))
        if name in updates:  # W + scale * B @ A, in the GGUF's layout (before the Q/K rows are unpermuted)
            b, a, scale = updates[name]
            if w.dim() != 2 or tuple(w.shape) != (b.shape[0], a.shape[1]):
                raise ValueError(f"the LoRA adapter does not fit the model: its {t.name} update is "
                                 f"{b.shape[0]}x{a.shape[1]}, the weight {'x'.join(map(str, w.shape))}")
            w = w + scale * (torch.from_numpy(b) @ torch.from_numpy(a))
        return unpermute(name, w)

    get.q8_0 = q8_0  # type: ignore[attr-defined] - quant.QuantizedWeight.load looks for it

    def part(name: str, dim: int, start: int, n: int) -> torch.Tensor:
        t = tensors.get(name)
        if t is None or dim != 0 or name in updates:  # columns cut through quantization blocks (or an adapted
            return get(name).narrow(dim, start, n)  # weight): the whole tensor, then the part
        arr = np.ascontiguousarray(gguf.quants.dequantize(t.data[start:start + n], t.tensor_type), dtype=np.float32)
        w = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr).reshape(
            (n, *reversed(t.shape.tolist()[:-1])))
        if permuted and (".q_proj." in name or ".k_proj." in name):  # whole heads: undo their permutation
            w = unpermute_qk(w, n // cfg.head_dim)
        return w

    get.part = part  # type: ignore[attr-defined]
    meta = {"chat_template": _field(reader, "tokenizer.chat_template"), "eos_token_ids": cfg.eos_token_ids,
            "bos_token_id": cfg.bos_token_id, "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False))}
    return cfg, get, set(tensors), meta


def _gguf_moe(a, tensors: dict) -> dict:
    """A mixture of experts' fields from a GGUF's expert_count / expert_used_count / expert_feed_forward_length
    (llama.cpp renormalises the top-k weights of both Qwen3-MoE and Mixtral); a layer without a router
    (ffn_gate_inp) keeps a dense MLP. {} for a dense model."""
    experts = int(a("expert_count", 0) or 0)
    if not experts:
        return {}
    n = int(a("block_count"))
    sparse = [i for i in range(n) if f"model.layers.{i}.mlp.gate.weight" in tensors]
    if not sparse or any(f"model.layers.{i}.mlp.experts.gate_proj.weight" not in tensors for i in sparse):
        raise ValueError("this GGUF stores its experts one tensor each (an old llama.cpp conversion); the native "
                         "engine reads stacked ffn_*_exps tensors: convert the model again, or use the llama.cpp "
                         "backend for it")
    return {"num_experts": experts, "num_experts_per_tok": int(a("expert_used_count")), "norm_topk_prob": True,
            "moe_intermediate_size": int(a("expert_feed_forward_length", 0) or a("feed_forward_length")),
            "mlp_only_layers": [i for i in range(n) if i not in sparse]}


def _gguf_yarn(a) -> dict:
    """YaRN RoPE from a GGUF's rope.scaling keys, as llama.cpp applies it: the correction range rounded out
    to whole dims (ggml_rope_yarn_corr_dims' floor / ceil: transformers' truncate), the attention factor
    0.1 ln(factor) + 1 (llama.cpp's default without yarn_log_multiplier)."""
    if a("rope.scaling.yarn_log_multiplier") or a("rope.scaling.yarn_attn_factor") is not None:
        raise ValueError("this GGUF's YaRN sets yarn_log_multiplier / yarn_attn_factor, which the native engine "
                         "does not read for gpt-oss; use the llama.cpp backend for it")
    factor = float(a("rope.scaling.factor"))
    orig = int(a("rope.scaling.original_context_length", 0) or int(a("context_length")) / factor)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig, "truncate": True,
            "beta_fast": float(a("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(a("rope.scaling.yarn_beta_slow", 1.0))}


def _gguf_gpt_oss(a, tensors: dict) -> dict:
    """gpt-oss's fields from its GGUF (llama.cpp's llama_model_openai_moe): every layer a mixture of experts
    (top-k of the router's logits, then a softmax over the k; the clamped SwiGLU), attention sinks, the
    sliding window on alternate layers from the first (llama.cpp's swa pattern 2, as transformers' default
    layer_types; an explicit sliding_window_pattern list wins)."""
    n = int(a("block_count"))
    if "model.layers.0.mlp.experts.gate_proj.weight" not in tensors:
        raise ValueError("this gpt-oss GGUF lacks the stacked ffn_gate_exps tensors the native engine reads; "
                         "use the llama.cpp backend for it")
    pattern = a("attention.sliding_window_pattern")
    period = 2 if isinstance(pattern, list) or not pattern else int(pattern)
    sliding = [bool(x) for x in pattern] if isinstance(pattern, list) else [i % period < period - 1 for i in range(n)]
    return {"sliding_window": int(a("attention.sliding_window")),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "num_experts": int(a("expert_count")), "num_experts_per_tok": int(a("expert_used_count")),
            "moe_intermediate_size": int(a("expert_feed_forward_length", 0) or a("feed_forward_length")),
            "moe_scoring": "topk_softmax", "moe_activation": "swiglu_oai", "attention_sinks": True,
            "experts_mxfp4": getattr(tensors["model.layers.0.mlp.experts.gate_proj.weight"].tensor_type, "name",
                                     "") == "MXFP4"}


def _partial_rotary(rope_dims: int, head_dim: int) -> int:
    """ModelConfig.rotary_dim from a GGUF's rope.dimension_count: fewer dims than head_dim rotate
    (Phi-4-mini); 0 (all of them) when it is absent, equal, or not meaningful."""
    return rope_dims if 0 < rope_dims < head_dim and rope_dims % 2 == 0 else 0


def _gguf_attention_extras(reader, arch: str, a) -> dict:
    """Sliding window, soft-capping, attention scale and Gemma 3's local RoPE base from a GGUF
    file's metadata, with llama.cpp's built-in defaults where the converter writes no key."""
    if arch not in _GGUF_GEMMA:
        window = a("attention.sliding_window")  # (llama.cpp's converter writes none for Mistral)
        return {"sliding_window": int(window)} if window else {}
    n = int(a("block_count"))
    heads, hidden = int(a("attention.head_count")), int(a("embedding_length"))
    head_dim = int(a("attention.key_length", 0) or hidden // heads)
    pattern = a("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True = sliding
        sliding = [bool(x) for x in pattern]
    else:  # llama.cpp: Gemma 2 alternates, Gemma 3 has 5 sliding layers to 1 global
        period = int(pattern) if pattern else (2 if arch == "gemma2" else 6)
        sliding = [i % period < period - 1 for i in range(n)]
    scale = a("attention.scale")
    if scale:
        scalar = float(scale) ** -2
    else:  # llama.cpp: the 27B models scale by hidden / heads, the others by head_dim
        big = (arch == "gemma2" and n == 46) or (arch == "gemma3" and n == 62)
        scalar = float(hidden // heads if big else head_dim)
    return {
        "sliding_window": int(a("attention.sliding_window", 0) or 0) or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attn_logit_softcap": float(a("attn_logit_softcapping", 0.0) or 0.0),
        "final_logit_softcap": float(a("final_logit_softcapping", 0.0) or 0.0),
        "query_pre_attn_scalar": scalar,
        "rope_local_theta": float(a("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else 0.0,
    }


def read_safetensors(directory: str | Path, device: str | None = None
                     ) -> tuple[ModelConfig, Getter, set[str], Callable[[], None]]:
    """(config, getter, names, close) for a Hugging Face model directory. With a CUDA device the
    getter returns tensors already on it (safetensors reads them from the memory map straight
    to the device, in the checkpoint's dtype)."""
    from safetensors import safe_open

    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{d} has no config.json; a safetensors model directory needs one")
    cfg = ModelConfig.from_hf_config(json.loads(cfg_path.read_text()))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{d} has no *.safetensors files")
    handles, where = [], {}
    for f in files:
        h = safe_open(str(f), framework="pt", device=str(device) if device and device.startswith("cuda") else "cpu")
        handles.append(h)
        for k in h.keys():
            where[k] = h

    rename = _language_model_names(set(where))  # a multimodal Gemma 3: its language model's weights
    for ours, theirs in rename.items():
        where[ours] = where[theirs]

    def get(name: str) -> torch.Tensor:
        h = where.get(name)
        if h is None:
            raise KeyError(f"safetensors weights lack tensor {name}")
        return h.get_tensor(rename.get(name, name))

    def part(name: str, dim: int, start: int, n: int) -> torch.Tensor:
        name_in_file = rename.get(name, name)
        h = where.get(name)
        if h is None:
            raise KeyError(f"safetensors weights lack tensor {name}")
        sl = h.get_slice(name_in_file)  # reads only the rows / columns asked for
        return sl[start:start + n] if dim == 0 else sl[:, start:start + n]

    get.part = part  # type: ignore[attr-defined]

    def close() -> None:
        handles.clear()
        where.clear()

    return cfg, get, set(where), close


# a multimodal checkpoint's language model, under either transformers layout: the model's name -> the file's
_LANGUAGE_MODEL_PREFIXES = (("model.", "model.language_model."), ("model.", "language_model.model."),
                            ("lm_head.", "language_model.lm_head."))


def _language_model_names(names: set[str]) -> dict[str, str]:
    """For a vision-language checkpoint (Gemma3ForConditionalGeneration), the text decoder's tensors
    under the plain names the model loads (model.layers..., model.embed_tokens..., lm_head...); the
    vision tower and projector are left out. Empty for a text-only checkpoint."""
    out: dict[str, str] = {}
    for ours, theirs in _LANGUAGE_MODEL_PREFIXES:
        for n in names:
            if n.startswith(theirs):
                out.setdefault(ours + n[len(theirs):], n)
    return out


def recipe_source(recipe: tuple, config: EngineConfig) -> tuple[ModelConfig, Callable[[torch.nn.Module], None],
                                                                Callable[[], Tokenizer | None]]:
    """(config, fill(model), tokenizer()) for a recipe: ("gguf", path[, adapter]) | ("safetensors",
    directory) | ("random", shape, seed). fill copies the weights in (and closes the files)."""
    kind = recipe[0]
    if kind == "gguf":  # ("gguf", path) or ("gguf", path, a LoRA adapter GGUF merged in at load)
        path = recipe[1]
        mcfg, get, names, meta = read_gguf(path, recipe[2] if len(recipe) > 2 else None)
        return (mcfg, lambda m: m.load_hf_state(get, names),
                lambda: Tokenizer.from_gguf(path, meta["eos_token_ids"], meta["chat_template"]))
    if kind == "safetensors":
        directory = recipe[1]
        mcfg, get, names, close = read_safetensors(directory, device=config.device)

        def fill(m: torch.nn.Module) -> None:
            try:
                m.load_hf_state(get, names)
            finally:
                close()

        return mcfg, fill, lambda: Tokenizer.from_dir(directory, mcfg.eos_token_ids)
    if kind == "random":
        shape, seed = recipe[1], recipe[2]
        mcfg = get_shape(shape) if isinstance(shape, str) else shape
        return mcfg, lambda m: m.init_random(seed), lambda: None
    raise ValueError(f"unknown model recipe {kind!r}")
