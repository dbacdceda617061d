"""Model architectures, one short module each, loaded from HF-style folders."""

from .loader import load_model

__all__ = ["load_model"]
