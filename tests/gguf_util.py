"""Writing tiny GGUF files from transformers models, as llama.cpp's convert_hf_to_gguf.py does."""

from __future__ import annotations


def add_decoder_metadata(w, cfg) -> None:
    """The metadata every decoder GGUF carries: lengths, layer and head counts, the norm epsilon."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
