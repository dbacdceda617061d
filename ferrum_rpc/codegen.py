"""Regenerates the protobuf/gRPC stubs in ``ferrum_rpc/v1`` from ``protos/``.

The generated modules are committed (users install them, grpcurl users read
the .proto); a test regenerates them into a temporary folder and compares, so
the two can never drift apart.  Run ``python -m ferrum_rpc.codegen``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = ("ferrum_rpc/v1/executor.proto",)
GENERATED = ("executor_pb2.py", "executor_pb2.pyi", "executor_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) writing ``ferrum_rpc/v1/*`` under out_root.

    Returns:
        The paths of the generated files.
    """
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    # google/rpc/status.proto ships with googleapis-common-protos, beside its modules.
    googleapis = Path(importlib.util.find_spec("google.rpc.status_pb2").origin).parents[2]
    (out_root / "ferrum_rpc" / "v1").mkdir(parents=True, exist_ok=True)
    out = str(out_root)
    for proto in PROTO_FILES:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"-I{googleapis}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(PROTO_ROOT / proto),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
    return [out_root / "ferrum_rpc" / "v1" / name for name in GENERATED]


if __name__ == "__main__":
    paths = generate(REPO_ROOT)
    sys.stdout.write("".join(f"wrote {p.relative_to(REPO_ROOT)}\n" for p in paths))
