"""Where ferrum-rpc keeps its files (shared by the server and the client CLI)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """``$FERRUM_RPC_HOME``, default ``~/.cache/ferrum-rpc``."""
    return Path(os.environ.get("FERRUM_RPC_HOME", Path.home() / ".cache" / "ferrum-rpc"))


def default_model_dir() -> Path:
    """The converted embedded model (config, weights, tokenizer)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME
