"""Model architectures, one short module each, loaded from HF-style folders."""

import torch

from .loader import load_model, return_freed_memory

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["TORCH_DTYPES", "load_model", "return_freed_memory"]
