"""The request builders of the administrative RPCs in the clients' table (``rpc.py``,
which names them ``admin.<method>``):
the model registry, LoRA adapters and weights updated in place.  Each builder's
parameters and docstring are the client method's."""

from __future__ import annotations

import json
import mmap
import os

import numpy as np

from ferrum_rpc import hashing
from ferrum_rpc.rules import check_model_name
from ferrum_rpc.v1 import executor_pb2 as pb


def list_models(c) -> pb.ListModelsRequest:
    """Every hosted model: name, state, folder, default flag and live status."""
    return pb.ListModelsRequest()


def load_model(c, name: str, path: str, progress=None) -> pb.LoadModelRequest:
    """Loads the model in ``path`` (a folder on the server) as ``name``; returns once
    it serves.  ``progress(stage, elapsed_s)`` sees each stage."""
    check_model_name(name, path)
    return pb.LoadModelRequest(name=name, path=path)


def load_progress(c, message: pb.LoadModelResponse, name: str, path: str, progress=None) -> None:
    if progress is not None:
        progress(message.stage, message.elapsed_s)


def unload_model(c, name: str) -> pb.UnloadModelRequest:
    """Stops serving ``name`` (its sequences go); returns how many sequences it held."""
    check_model_name(name)
    return pb.UnloadModelRequest(name=name)


def load_adapter(c, name: str, path: str, replace: bool = False) -> pb.LoadAdapterRequest:
    """Loads the PEFT LoRA adapter in ``path`` (a folder on the server) as ``name``
    (``replace``: reload a name no live sequence uses); returns its entry."""
    return pb.LoadAdapterRequest(model=c.model, name=name, path=path, replace=replace)


def unload_adapter(c, name: str) -> pb.UnloadAdapterRequest:
    """Unloads adapter ``name`` (refused while live sequences run with it)."""
    return pb.UnloadAdapterRequest(model=c.model, name=name)


def list_adapters(c) -> pb.ListAdaptersRequest:
    """The model's adapters (name, path, rank, scaling, modules, bytes, live sequences, digest)."""
    return pb.ListAdaptersRequest(model=c.model)


# numpy dtype name -> safetensors dtype ("bfloat16": ml_dtypes' arrays)
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "uint64": "U64", "int32": "I32", "uint32": "U32", "int16": "I16", "uint16": "U16", "int8": "I8",
                      "uint8": "U8", "bool": "BOOL"}
DATA_TAG = b"\x12"  # WeightsChunk.data: field 2, length-delimited


def safetensors_parts(tensors: dict) -> list[memoryview]:
    """One safetensors file of ``{name: array}`` as its parts: its header's bytes, then
    each array's own bytes (views: nothing is copied)."""
    header, views, offset = {}, [], 0
    for name, array in tensors.items():
        array = np.asarray(array)
        shape = list(array.shape)
        if SAFETENSORS_DTYPES.get(array.dtype.name) is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
        view = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False)).reshape(-1).view(np.uint8)
        header[name] = {"dtype": SAFETENSORS_DTYPES[array.dtype.name], "shape": shape,
                        "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        views.append(memoryview(view))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-aligned
    return [memoryview(len(text).to_bytes(8, "little") + text), *views]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def serialize_chunk(message) -> bytes:
    """UpdateWeights' request serializer: data messages are built on the wire already."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def update_weights(c, tensors, invalidate_sequences: bool = False, chunk_bytes: int = 1 << 20):
    """Replaces the model's weights in place (admin): ``tensors`` is one safetensors
    file (its bytes or its path) or ``{checkpoint name: numpy array}``, some or all of
    the checkpoint's tensors.  ``invalidate_sequences``: live sequences are dropped
    (their next call fails WEIGHTS_CHANGED) instead of going on with their old KV.
    Returns the reply (weights_version, tensors, rebuild_s, paused_s, sequences_invalidated)."""
    if isinstance(tensors, dict):
        parts = safetensors_parts(tensors)
    elif isinstance(tensors, (str, os.PathLike)):
        with open(tensors, "rb") as f:  # mapped: its pages are read as the chunks go
            parts = [memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if os.fstat(f.fileno()).st_size
                     else memoryview(b"")]
    else:
        parts = [memoryview(tensors).cast("B")]
    total = sum(part.nbytes for part in parts)

    def messages():
        """The header, the data messages (each written on the wire with one copy of its
        bytes, which are hashed in place) and the trailer."""
        checksum = hashing.stream_hasher()
        yield pb.WeightsChunk(header=pb.WeightsHeader(model=c.model, total_bytes=total,
                                                      invalidate_sequences=invalidate_sequences))
        for piece in _pieces(parts, chunk_bytes):
            for view in piece:
                checksum.update(view)
            yield b"".join([DATA_TAG, _varint(sum(view.nbytes for view in piece)), *piece])
        yield pb.WeightsChunk(trailer=pb.WeightsTrailer(checksum=checksum.digest()))
    return messages()


def _pieces(parts: list[memoryview], size: int):
    """The parts' bytes in order, as lists of views of ``size`` bytes in all (the last fewer)."""
    piece, filled = [], 0
    for view in parts:
        while view.nbytes:
            take = min(size - filled, view.nbytes)
            piece.append(view[:take])
            view, filled = view[take:], filled + take
            if filled == size:
                yield piece
                piece, filled = [], 0
    if piece:
        yield piece
