"""Records the shared test vectors' expectations: ``make vectors``
(``python -m tests.vectors.record``).

Writes tiny_llama_dir's model (tests/conftest.py: TINY, seed 0) to a temporary folder,
serves it with running_server's defaults, runs the Python client's runner
(tests/vectors/runner.py) over every case of cases.json, and rewrites the file with each
case's ``expect`` (full logits as their digest), the model's weights digest and the
service's RPC names from the generated descriptor. The requests and the ``skipped`` list
are kept as they are. Run it after changing a case, or after a change that alters what
the server returns on purpose; review the diff of cases.json.

The functions here are also what tests/contract/test_vectors.py compares with.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

CASES = Path(__file__).resolve().parent / "cases.json"


def logits_digest(data: bytes) -> str:
    """BLAKE2b-128 (hex) of FULL float32 logits as little-endian bytes, row-major (the
    convention of ferrum_rpc/hashing.py's text_digest: BLAKE2b, 16 bytes, hex)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def digested(value):
    """A runner's result with every ``{"shape", "f32_hex"}`` logits replaced by
    ``{"shape", "blake2b128"}``: what ``expect`` holds."""
    if isinstance(value, dict):
        if "f32_hex" in value:
            return {"shape": value["shape"], "blake2b128": logits_digest(bytes.fromhex(value["f32_hex"]))}
        return {k: digested(v) for k, v in value.items()}
    if isinstance(value, list):
        return [digested(v) for v in value]
    return value


def service_rpcs() -> list[str]:
    """Every RPC of ferrum.executor.v1.ModelExecutor, in the proto's order."""
    from ferrum_rpc.v1 import executor_pb2 as pb

    return [m.name for m in pb.DESCRIPTOR.services_by_name["ModelExecutor"].methods]


def weights_digest(model_dir: Path) -> str:
    """The model's weights (model.safetensors alone: config.json names the transformers
    version, which changes no weight)."""
    from ferrum_rpc.hashing import files_digest

    return files_digest([Path(model_dir) / "model.safetensors"])


def write(doc: dict, path: Path = CASES) -> None:
    """cases.json with one case a line group: diffs of a re-recording stay readable."""
    head = {k: v for k, v in doc.items() if k != "cases"}
    lines = ["{"]
    for key, value in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, indent=None)},")
    lines.append('  "cases": [')
    for i, case in enumerate(doc["cases"]):
        fields = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in case.items() if k not in ("steps", "expect")]
        steps = ",\n".join(f"      {json.dumps(s)}" for s in case["steps"])
        text = "    {" + ", ".join(fields) + ',\n     "steps": [\n' + steps + "\n     ]"
        if "expect" in case:
            expect = ",\n".join(f"      {json.dumps(s)}" for s in case["expect"])
            text += ',\n     "expect": [\n' + expect + "\n     ]"
        lines.append(text + "}" + ("," if i + 1 < len(doc["cases"]) else ""))
    lines += ["  ]", "}"]
    path.write_text("\n".join(lines) + "\n")


def record(path: Path = CASES) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import _save_tiny, running_server
    from tests.vectors.runner import run_all

    doc = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as folder:
        model_dir = _save_tiny(Path(folder), LlamaConfig, LlamaForCausalLM, seed=0)
        with running_server(model_dir) as server:
            results = {r["case"]: r["steps"] for r in run_all(server.target, path)}
        doc["model"] = {"fixture": "tests/conftest.py tiny_llama_dir", "weights_digest": weights_digest(model_dir)}
    doc["rpcs"] = service_rpcs()
    for case in doc["cases"]:
        case["expect"] = digested(results[case["name"]])
    write(doc, path)
    return doc


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else CASES)
