"""The request builders of the administrative RPCs in the clients' table (``rpc.py``,
which names them ``admin.<method>``):
the model registry, LoRA adapters and weights updated in place.  Each builder's
parameters and docstring are the client method's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ferrum_rpc import hashing
from ferrum_rpc.v1 import executor_pb2 as pb


def list_models(c) -> pb.ListModelsRequest:
    """Every hosted model: name, state, folder, default flag and live status."""
    return pb.ListModelsRequest()


def load_model(c, name: str, path: str, progress=None) -> pb.LoadModelRequest:
    """Loads the model in ``path`` (a folder on the server) as ``name``; returns once
    it serves.  ``progress(stage, elapsed_s)`` sees each stage."""
    return pb.LoadModelRequest(name=name, path=path)


def load_progress(c, message: pb.LoadModelResponse, name: str, path: str, progress=None) -> None:
    if progress is not None:
        progress(message.stage, message.elapsed_s)


def unload_model(c, name: str) -> pb.UnloadModelRequest:
    """Stops serving ``name`` (its sequences go); returns how many sequences it held."""
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


def update_weights(c, tensors, invalidate_sequences: bool = False, chunk_bytes: int = 4 << 20):
    """Replaces the model's weights in place (admin): ``tensors`` is one safetensors
    file (its bytes or its path) or ``{checkpoint name: numpy array}``, some or all of
    the checkpoint's tensors.  ``invalidate_sequences``: live sequences are dropped
    (their next call fails WEIGHTS_CHANGED) instead of going on with their old KV.
    Returns the reply (weights_version, tensors, rebuild_s, paused_s, sequences_invalidated)."""
    if isinstance(tensors, dict):
        from safetensors.numpy import save
        data = save({name: np.ascontiguousarray(array) for name, array in tensors.items()})
    elif isinstance(tensors, (str, os.PathLike)):
        data = Path(tensors).read_bytes()
    else:
        data = bytes(tensors)
    def messages():  # hashed as it goes: the hash of one chunk overlaps the sending of the one before
        checksum = hashing.stream_hasher()
        yield pb.WeightsChunk(header=pb.WeightsHeader(model=c.model, total_bytes=len(data),
                                                      invalidate_sequences=invalidate_sequences))
        for start in range(0, len(data), chunk_bytes):
            chunk = data[start:start + chunk_bytes]
            yield pb.WeightsChunk(data=chunk)
            checksum.update(chunk)
        yield pb.WeightsChunk(trailer=pb.WeightsTrailer(checksum=checksum.digest()))
    return messages()
