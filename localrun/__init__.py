"""localrun: a local model runner with a model library, llama.cpp and a native engine."""

__version__ = "0.1.0"
