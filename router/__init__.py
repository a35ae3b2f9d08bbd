"""kvrouter: a KV-cache-aware routing proxy for LLM inference (the `router` package)."""

__version__ = "0.1.0"
