"""Serving localrun past one machine. Nothing here imports Ray at import time (``localrun[ray]`` is optional)."""
