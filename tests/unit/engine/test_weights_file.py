"""An UpdateWeights file read as its bytes arrive (``engine/weights_file.py``): whatever
the chunking, the tensors are the file's, checked against the checkpoint; a file that
is not one, or not this model's, is refused with a reason; the client's writer
(``client/admin.py``) makes files that safetensors' own parser reads back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save
from safetensors.torch import save as save_torch

from ferrum_rpc.client.admin import safetensors_parts
from ferrum_rpc.errors import InvalidInput, TransferCorrupted
from ferrum_rpc.hashing import stream_hasher
from ferrum_rpc.server.engine.weights_file import WeightsUpload

CHECKPOINT = {"a.weight": ((4, 3), "F32"), "b.weight": ((5,), "F32"), "c.weight": ((2, 2), "BF16")}
RNG = np.random.default_rng(3)
TENSORS = {"a.weight": RNG.standard_normal((4, 3)).astype(np.float32),
           "b.weight": RNG.standard_normal(5).astype(np.float16)}


def digest(data: bytes) -> bytes:
    h = stream_hasher()
    h.update(data)
    return h.digest()


def upload(data: bytes, chunk: int, total: int | None = None, checksum: bytes | None = None) -> dict:
    reading = WeightsUpload(len(data) if total is None else total, CHECKPOINT)
    for at in range(0, len(data), chunk):
        reading.add(memoryview(data)[at:at + chunk])
    return reading.finish(digest(data) if checksum is None else checksum)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_any_chunking_gives_the_files_tensors(chunk):
    bf16 = torch.randn(2, 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    data = save_torch({"_orig_mod.c.weight": bf16, **{n: torch.from_numpy(t) for n, t in TENSORS.items()}})
    got = upload(data, chunk)
    assert sorted(got) == ["a.weight", "b.weight", "c.weight"]
    assert got["c.weight"].dtype is torch.bfloat16 and torch.equal(got["c.weight"], bf16)
    for name, want in TENSORS.items():
        assert got[name].dtype is torch.from_numpy(want).dtype and np.array_equal(got[name].numpy(), want)


def test_the_clients_writer_makes_a_file_safetensors_reads():
    data = b"".join(safetensors_parts(TENSORS))
    assert (8 + int.from_bytes(data[:8], "little")) % 8 == 0  # the tensors' bytes start 8-aligned
    assert all(np.array_equal(load_numpy(data)[n], t) for n, t in TENSORS.items())
    assert np.array_equal(upload(data, 5)["a.weight"].numpy(), TENSORS["a.weight"])


def header_file(header: dict, data_bytes: int) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + bytes(data_bytes)


@pytest.mark.parametrize("data, why", [
    (b"short", "end inside its header"),
    ((1 << 30).to_bytes(8, "little") + b"{}", "a header of"),
    (header_file([1, 2], 0), "not a JSON object"),
    (b"\x04" + bytes(7) + b"{{{{", "not JSON"),
    (header_file({"a.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 40]}}, 40), "not a tensor's"),
    (header_file({"a.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [8, 56]}}, 56), "do not tile"),
    (header_file({"a.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
                  "b.weight": {"dtype": "F32", "shape": [5], "data_offsets": [40, 60]}}, 60), "do not tile"),
    (header_file({"a.weight": {"dtype": "Q4", "shape": [4, 3], "data_offsets": [0, 48]}}, 48), "not a tensor's"),
    (header_file({}, 0), "holds no tensors"),
    (save({"z.weight": np.zeros(3, np.float32)}), "tensor 'z.weight': the model has no tensor"),
    (save({"a.weight": np.zeros((3, 4), np.float32)}), "shape (3, 4), the model's is (4, 3)"),
    (save({"a.weight": np.zeros((4, 3), np.int32)}), "dtype I32, not a floating dtype"),
    (save({"a.weight": np.zeros((4, 3), np.float32), "_orig_mod.a.weight": np.zeros((4, 3), np.float32)}),
     "named twice"),
    (save({"b.weight": np.array([0, 1, np.inf, 3, 4], np.float16)}), "tensor 'b.weight': holds a NaN"),
    (save_torch({"c.weight": torch.tensor([[0.0, float("nan")], [1, 2]], dtype=torch.bfloat16)}),
     "tensor 'c.weight': holds a NaN"),
])
def test_what_is_not_this_models_file_is_refused(data, why):
    with pytest.raises(InvalidInput, match=why.replace("(", r"\(").replace(")", r"\)")):
        upload(data, 3)


def test_too_many_or_too_few_bytes_or_a_wrong_checksum_are_refused():
    data = save(TENSORS)
    with pytest.raises(InvalidInput, match="passes total_bytes"):
        upload(data, len(data), total=len(data) - 1)
    with pytest.raises(InvalidInput, match="do not tile"):  # the header says where the data ends
        upload(data, 16, total=len(data) + 8)
    truncated = WeightsUpload(len(data), CHECKPOINT)
    truncated.add(data[:len(data) - 10])
    with pytest.raises(InvalidInput, match=f"holds {len(data) - 10} bytes, total_bytes said {len(data)}"):
        truncated.finish(digest(data))
    with pytest.raises(TransferCorrupted):
        upload(data, 16, checksum=bytes(32))


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20])
def test_data_messages_written_by_hand_are_protobufs_and_read_without_a_copy(size):
    from ferrum_rpc.client.admin import DATA_TAG, _varint
    from ferrum_rpc.server.rpc.handler import weights_chunk
    from ferrum_rpc.v1 import executor_pb2 as pb

    payload = RNG.integers(0, 256, size, dtype=np.uint8).tobytes()
    wire = b"".join([DATA_TAG, _varint(size), payload])
    assert pb.WeightsChunk.FromString(wire).data == payload  # what any other server would read
    read = weights_chunk(pb.WeightsChunk.FromString)(wire)
    assert isinstance(read, memoryview) and read.obj is wire and bytes(read) == payload
    header = pb.WeightsChunk(header=pb.WeightsHeader(total_bytes=size)).SerializeToString()
    assert weights_chunk(pb.WeightsChunk.FromString)(header).header.total_bytes == size
