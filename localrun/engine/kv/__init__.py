"""The KV cache: the page pool (pool.py), the prefix cache (radix.py), its host tier (host.py), their interfaces (base.py)."""
