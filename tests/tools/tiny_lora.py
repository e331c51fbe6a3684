"""Writes PEFT LoRA adapters (random, as a fine-tune would leave them: both matrices non-zero) for the test models,
in the layout PEFT saves (adapter_config.json + adapter_model.safetensors), with the base models' config.json that
llama.cpp's convert_lora_to_gguf.py reads (--base) instead of the weights:

    OUT/smollm2/base   config.json of SmolLM2-135M-Instruct (the bundled model)
    OUT/smollm2/lora   an adapter on its q_proj, v_proj and gate_proj (rank 8, alpha 16)
    OUT/other/base     config.json of a tiny llama (hidden 64): another model of the same architecture
    OUT/other/lora     an adapter for that one (its tensors fit no SmolLM2 layer)

Usage: python tiny_lora.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
           "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
           "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
OTHER = {**SMOLLM2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "_name_or_path": "tiny-llama"}
RANK, ALPHA = 8, 16
TARGETS = ("q_proj", "v_proj", "gate_proj")


def write(out: Path, cfg: dict, seed: int, scale: float) -> None:
    (out / "base").mkdir(parents=True, exist_ok=True)
    (out / "lora").mkdir(parents=True, exist_ok=True)
    (out / "base" / "config.json").write_text(json.dumps(cfg, indent=1))
    h, d = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    outs = {"q_proj": h, "v_proj": cfg["num_key_value_heads"] * d, "gate_proj": cfg["intermediate_size"]}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for t in TARGETS:
            mod = "mlp" if t == "gate_proj" else "self_attn"
            key = f"base_model.model.model.layers.{i}.{mod}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, h, generator=g) / h ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(outs[t], RANK, generator=g) * scale
    save_file(tensors, str(out / "lora" / "adapter_model.safetensors"))
    (out / "lora" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "base_model_name_or_path": cfg["_name_or_path"]}, indent=1))


if __name__ == "__main__":
    root = Path(sys.argv[1])
    write(root / "smollm2", SMOLLM2, 0, 0.12)
    write(root / "other", OTHER, 1, 0.05)
