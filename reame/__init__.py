"""Reame: a CPU-first LLM inference server built on llama.cpp through our own ctypes binding."""

__version__ = "0.2.0.dev0"
