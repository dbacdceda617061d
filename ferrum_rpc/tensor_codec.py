"""Tensor <-> wire ``Tensor`` (little-endian, row-major, no padding).

Decoding wraps the message's bytes without copying (``np.frombuffer``); the
resulting arrays are read-only.  bfloat16 has no numpy dtype, so it travels as
its raw 16-bit patterns and numpy decoding widens it to float32 exactly.
torch is imported lazily: the client needs only numpy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.v1 import executor_pb2 as pb

_NUMPY_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),  # raw bit patterns
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_UINT32: np.dtype("<u4"),
}
_DTYPE_BY_NAME = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "int32": pb.DTYPE_INT32,
    "int64": pb.DTYPE_INT64,
    "uint32": pb.DTYPE_UINT32,
}
_NAME_BY_DTYPE = {v: k for k, v in _DTYPE_BY_NAME.items()}


def dtype_to_proto(name: str) -> int:
    """'float32' -> DTYPE_FLOAT32, etc."""
    try:
        return _DTYPE_BY_NAME[name]
    except KeyError:
        raise InvalidInput(f"unsupported dtype {name!r}") from None


def dtype_from_proto(value: int) -> str:
    try:
        return _NAME_BY_DTYPE[value]
    except KeyError:
        raise InvalidInput(f"unsupported dtype enum value {value}") from None


def encode(array: Any) -> pb.Tensor:
    """Encodes a numpy array or a (CPU or CUDA) torch tensor."""
    message = pb.Tensor()
    encode_into(message, array)
    return message


def encode_into(message: pb.Tensor, array: Any) -> None:
    """Fills ``message`` in place: building a tensor inside its parent message
    avoids the copies that assigning a finished sub-message makes (large logits)."""
    array, message.dtype = as_numpy(array)
    message.shape[:] = array.shape
    message.data = array.tobytes()  # C order


def as_numpy(array: Any) -> tuple[np.ndarray, int]:
    """A numpy array or torch tensor as little-endian numpy in its wire layout, and
    the wire dtype (bfloat16 as its uint16 bit patterns)."""
    wire = None
    if not isinstance(array, np.ndarray):
        array, wire = _torch_to_numpy(array)
    wire = wire if wire is not None else dtype_to_proto(array.dtype.name)
    return array.astype(array.dtype.newbyteorder("<"), copy=False), wire


def _torch_to_numpy(tensor: Any) -> tuple[np.ndarray, int | None]:
    """A torch tensor as numpy, and the wire dtype where numpy's cannot say it.

    The branch is on the torch dtype: bfloat16 travels as its bit patterns, and
    any other dtype goes by its numpy name (an int16 tensor is refused as a
    dtype the wire cannot name, never mistaken for bfloat16)."""
    import torch

    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy(), pb.DTYPE_BFLOAT16
    return tensor.numpy(), None


def _checked_view(t: pb.Tensor, data: Any = None) -> np.ndarray:
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None:
        raise InvalidInput(f"unsupported tensor dtype enum value {t.dtype}")
    if any(d < 0 for d in t.shape):
        raise InvalidInput(f"negative dimension in tensor shape {list(t.shape)}")
    data = t.data if data is None else data
    expected = math.prod(t.shape) * dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"tensor of shape {list(t.shape)} and dtype {_NAME_BY_DTYPE[t.dtype]} needs "
            f"{expected} bytes, got {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(tuple(t.shape))


def to_numpy(t: pb.Tensor, data: Any = None) -> np.ndarray:
    """Decodes to numpy without copying; bfloat16 is widened to float32.

    ``data``: the tensor's bytes when they are not in the message (a buffer such
    as a shared-memory slice); the array then aliases that memory."""
    array = _checked_view(t, data)
    if t.dtype == pb.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def to_torch(t: pb.Tensor) -> Any:
    """Decodes to a CPU torch tensor of the wire dtype, sharing the message's bytes.

    The tensor aliases immutable memory: treat it as read-only (clone to write).
    """
    import warnings

    import torch

    array = _checked_view(t)
    torch_dtype = {
        pb.DTYPE_FLOAT32: torch.float32,
        pb.DTYPE_FLOAT16: torch.float16,
        pb.DTYPE_BFLOAT16: torch.bfloat16,
        pb.DTYPE_INT32: torch.int32,
        pb.DTYPE_INT64: torch.int64,
        pb.DTYPE_UINT32: torch.uint32,
    }[t.dtype]
    if array.size == 0:
        return torch.empty(array.shape, dtype=torch_dtype)
    with warnings.catch_warnings():  # "buffer is not writable": documented above
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(t.data, dtype=torch_dtype)
    return flat.reshape(array.shape)
