"""The committed stubs in ferrum_rpc/v1 are exactly what protoc makes of protos/."""

from __future__ import annotations

import shutil

import pytest

from ferrum_rpc import codegen

COMMITTED = codegen.REPO_ROOT / "ferrum_rpc" / "v1"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("stubs")
    return {p.name: p for p in codegen.generate(out)}


def test_codegen_writes_the_three_stub_files(regenerated):
    assert sorted(regenerated) == sorted(codegen.GENERATED)
    for path in regenerated.values():
        assert path.is_file() and path.stat().st_size > 0


@pytest.mark.parametrize("name", codegen.GENERATED)
def test_committed_stub_matches_regenerated_byte_for_byte(regenerated, name):
    committed = (COMMITTED / name).read_bytes()
    fresh = regenerated[name].read_bytes()
    assert committed == fresh, (
        f"ferrum_rpc/v1/{name} is out of date with protos/; run `python -m ferrum_rpc.codegen`"
    )


def test_a_changed_proto_is_detected(tmp_path, monkeypatch):
    """The comparison above can fail: an edited .proto yields different stubs."""
    protos = tmp_path / "protos"
    shutil.copytree(codegen.PROTO_ROOT, protos)
    proto = protos / codegen.PROTO_FILES[0]
    proto.write_text(proto.read_text() + "\nmessage DriftProbe { uint32 x = 1; }\n")
    monkeypatch.setattr(codegen, "PROTO_ROOT", protos)
    out = tmp_path / "out"
    out.mkdir()
    fresh = {p.name: p.read_bytes() for p in codegen.generate(out)}
    assert fresh["executor_pb2.py"] != (COMMITTED / "executor_pb2.py").read_bytes()
    assert fresh["executor_pb2.pyi"] != (COMMITTED / "executor_pb2.pyi").read_bytes()


def test_committed_stubs_carry_the_wire_package_and_service():
    from ferrum_rpc.v1 import executor_pb2 as pb
    from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "ferrum.executor.v1"
    service = pb.DESCRIPTOR.services_by_name["ModelExecutor"]
    assert service.full_name == "ferrum.executor.v1.ModelExecutor"
    assert {m.name for m in service.methods} == {
        "GetModelInfo", "GetCapabilities", "GetStatus", "Prefill", "Decode", "BatchDecode",
        "ForwardVerify", "TruncateKv", "ReleaseCache", "Forward", "DecodeSession", "ForkCache",
        "RegisterSharedMemory", "UnregisterSharedMemory", "SpeculativeDecode", "BatchPrefill",
        "ListModels", "LoadModel", "UnloadModel",
        "ExportSequence", "ImportSequence", "CreateImportTicket", "PushSequence", "WatchKvEvents",
        "LoadAdapter", "UnloadAdapter", "ListAdapters", "UpdateWeights",
    }
    assert service.methods_by_name["BatchDecode"].server_streaming
    assert hasattr(pb_grpc, "ModelExecutorStub") and hasattr(pb_grpc, "ModelExecutorServicer")
