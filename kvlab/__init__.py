"""kvlab: KV prefix-cache policy experiments for LLM serving."""

__version__ = "0.1.0"
