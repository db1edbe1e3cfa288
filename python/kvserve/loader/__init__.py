"""Checkpoint loading: safetensors weights, checked against the config, renamed and fused for the
C++ runtime."""

from kvserve.loader.safetensors_loader import load_embedding, load_weights

__all__ = ["load_embedding", "load_weights"]
