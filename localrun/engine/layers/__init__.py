"""What the models are built of: attention backends (attention/), pointwise ops (ops.py), quantized linear (quant.py)."""
