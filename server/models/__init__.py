"""Model architectures, one short module each, loaded from HF-style folders."""

from ferrum_rpc.server.models.loader import load_model

__all__ = ["load_model"]
