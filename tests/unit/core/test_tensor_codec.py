"""The wire Tensor codec: round trips, zero-copy decoding, refusal of bad messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_rpc import tensor_codec
from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.v1 import executor_pb2 as pb

NUMPY_DTYPES = ["float32", "float16", "int32", "int64", "uint32"]
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint32": torch.uint32,
}
PROTO_DTYPES = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "int32": pb.DTYPE_INT32,
    "int64": pb.DTYPE_INT64,
    "uint32": pb.DTYPE_UINT32,
}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint32": 4}


def sample(dtype: str, shape=(3, 5)) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dtype.startswith("float"):
        return (rng.standard_normal(shape) * 100).astype(dtype)
    info = np.iinfo(dtype)
    # include the extremes: sign and width handling must survive the trip
    values = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if values.size:
        values.flat[0], values.flat[-1] = info.min, info.max
    return values


def torch_sample(dtype: str, shape=(3, 5)) -> torch.Tensor:
    if dtype == "bfloat16":
        return (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 100).to(torch.bfloat16)
    if dtype == "uint32":
        return torch.from_numpy(sample("uint32", shape).astype(np.int64)).to(torch.uint32)
    return torch.from_numpy(sample(dtype, shape))


def base_object(array: np.ndarray):
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base


# -- numpy ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (7,), (2, 3, 4), (1,), (0, 4)])
def test_numpy_round_trip(dtype, shape):
    array = sample(dtype, shape)
    msg = tensor_codec.encode(array)
    assert msg.dtype == PROTO_DTYPES[dtype]
    assert tuple(msg.shape) == array.shape
    assert len(msg.data) == array.size * ITEMSIZE[dtype]
    back = tensor_codec.to_numpy(msg)
    assert back.dtype == np.dtype(dtype) and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_zero_dim_numpy_round_trip_keeps_its_shape():
    # np.ascontiguousarray returns ndim >= 1, so encode() must not rely on it for 0-d input
    scalar = np.array(np.float32(2.5))
    assert scalar.shape == ()
    msg = tensor_codec.encode(scalar)
    assert tuple(msg.shape) == (), "a 0-d array must travel with shape []"
    back = tensor_codec.to_numpy(msg)
    assert back.shape == () and back == scalar


def test_zero_dim_torch_round_trip_keeps_its_shape():
    scalar = torch.tensor(2.5)
    back = tensor_codec.to_torch(tensor_codec.encode(scalar))
    assert tuple(back.shape) == () and back.item() == 2.5


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_zero_dim_wire_tensor_decodes_to_a_scalar(dtype):
    msg = pb.Tensor(dtype=PROTO_DTYPES[dtype], shape=[], data=np.ones(1, dtype=dtype).tobytes())
    assert tensor_codec.to_numpy(msg).shape == ()
    assert tuple(tensor_codec.to_torch(msg).shape) == ()


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_wire_bytes_are_little_endian_row_major(dtype):
    array = sample(dtype, (2, 3))
    msg = tensor_codec.encode(array)
    assert msg.data == array.astype(np.dtype(dtype).newbyteorder("<")).tobytes(order="C")


def test_encode_makes_non_contiguous_and_big_endian_arrays_canonical():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[:, ::2].T  # (3, 4), neither C- nor F-contiguous
    back = tensor_codec.to_numpy(tensor_codec.encode(view))
    np.testing.assert_array_equal(back, view)
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    msg = tensor_codec.encode(big)
    assert msg.dtype == pb.DTYPE_INT32
    assert msg.data == np.arange(6, dtype="<i4").tobytes()
    np.testing.assert_array_equal(tensor_codec.to_numpy(msg), big)


def test_numpy_decode_is_zero_copy_and_read_only():
    array = sample("float32", (64, 32))
    msg = tensor_codec.encode(array)
    back = tensor_codec.to_numpy(msg)
    owner = base_object(back)
    assert isinstance(owner, bytes), f"decoded array owns a copy (base {type(owner).__name__})"
    assert owner == msg.data
    assert np.shares_memory(back, np.frombuffer(owner, dtype=np.uint8))
    assert not back.flags.owndata and not back.flags.writeable
    with pytest.raises(ValueError):
        back[0, 0] = 1.0


def test_bfloat16_from_numpy_side_is_widened_to_float32_exactly():
    reference = torch_sample("bfloat16", (4, 6))
    msg = tensor_codec.encode(reference)
    assert msg.dtype == pb.DTYPE_BFLOAT16 and len(msg.data) == reference.numel() * 2
    back = tensor_codec.to_numpy(msg)
    assert back.dtype == np.float32 and back.shape == (4, 6)
    np.testing.assert_array_equal(back, reference.float().numpy())


def test_bfloat16_special_values():
    special = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 3.0e38], dtype=torch.bfloat16)
    back = tensor_codec.to_numpy(tensor_codec.encode(special))
    np.testing.assert_array_equal(back, special.float().numpy())
    assert np.signbit(back[1])
    nan = tensor_codec.to_numpy(tensor_codec.encode(torch.tensor([float("nan")], dtype=torch.bfloat16)))
    assert np.isnan(nan[0])


@pytest.mark.parametrize("dtype", ["float64", "bool", "int8", "uint8", "complex64"])
def test_encode_refuses_dtypes_outside_the_wire_set(dtype):
    with pytest.raises(InvalidInput):
        tensor_codec.encode(np.zeros((2,), dtype=dtype))


# -- torch ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_round_trip(dtype):
    tensor = torch_sample(dtype, (3, 5))
    msg = tensor_codec.encode(tensor)
    assert msg.dtype == PROTO_DTYPES[dtype]
    assert tuple(msg.shape) == (3, 5) and len(msg.data) == 15 * ITEMSIZE[dtype]
    back = tensor_codec.to_torch(msg)
    assert back.dtype == TORCH_DTYPES[dtype] and tuple(back.shape) == (3, 5)
    if dtype == "uint32":  # few ops exist for uint32; compare through int64
        assert torch.equal(back.to(torch.int64), tensor.to(torch.int64))
    else:
        assert torch.equal(back, tensor)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_and_numpy_encode_the_same_bytes(dtype):
    tensor = torch_sample(dtype, (2, 4))
    msg = tensor_codec.encode(tensor)
    if dtype == "bfloat16":
        expected = tensor.view(torch.int16).numpy().astype("<i2").tobytes()
    else:
        expected = tensor_codec.encode(tensor.to(torch.int64).numpy().astype(dtype)
                                       if dtype == "uint32" else tensor.numpy()).data
    assert msg.data == expected


def test_torch_encode_of_non_contiguous_and_grad_tensors():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    np.testing.assert_array_equal(tensor_codec.to_numpy(tensor_codec.encode(t)), t.numpy())
    g = torch.ones(2, 2, requires_grad=True) * 3
    assert torch.equal(tensor_codec.to_torch(tensor_codec.encode(g)), torch.full((2, 2), 3.0))


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0)])
def test_torch_empty(shape):
    msg = tensor_codec.encode(torch.zeros(shape))
    assert msg.data == b""
    back = tensor_codec.to_torch(msg)
    assert tuple(back.shape) == shape and back.dtype == torch.float32


def test_torch_decode_shares_the_message_bytes():
    tensor = torch_sample("float32", (16, 8))
    msg = tensor_codec.encode(tensor)
    back = tensor_codec.to_torch(msg)
    assert torch.equal(back, tensor)
    assert back.data_ptr() != tensor.data_ptr()
    # torch-allocated storage is resizable; storage wrapping foreign bytes is not
    assert not back.untyped_storage().resizable(), "to_torch copied into torch-owned memory"


# -- refusals ---------------------------------------------------------------------
@pytest.mark.parametrize("decode", [tensor_codec.to_numpy, tensor_codec.to_torch])
@pytest.mark.parametrize("delta", [-4, -1, 1, 4])
def test_wrong_byte_length_is_invalid_input(decode, delta):
    good = tensor_codec.encode(np.zeros((2, 3), dtype=np.float32))
    bad = pb.Tensor(dtype=good.dtype, shape=good.shape, data=good.data[:24 + delta] if delta < 0
                    else good.data + b"\0" * delta)
    with pytest.raises(InvalidInput) as info:
        decode(bad)
    assert info.value.reason.value == "INVALID_INPUT"
    assert "24" in str(info.value)


@pytest.mark.parametrize("decode", [tensor_codec.to_numpy, tensor_codec.to_torch])
def test_shape_and_data_disagree_is_invalid_input(decode):
    data = np.zeros(6, dtype=np.float32).tobytes()
    with pytest.raises(InvalidInput):
        decode(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[4, 2], data=data))
    with pytest.raises(InvalidInput):  # right count for int16, wrong for float32
        decode(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[6], data=data[:12]))


@pytest.mark.parametrize("decode", [tensor_codec.to_numpy, tensor_codec.to_torch])
@pytest.mark.parametrize("dtype", [pb.DTYPE_UNSPECIFIED, 99])
def test_bad_dtype_is_invalid_input(decode, dtype):
    with pytest.raises(InvalidInput):
        decode(pb.Tensor(dtype=dtype, shape=[1], data=b"\0\0\0\0"))


@pytest.mark.parametrize("decode", [tensor_codec.to_numpy, tensor_codec.to_torch])
@pytest.mark.parametrize("shape", [[-1], [2, -3], [-2, -2]])
def test_negative_dims_are_invalid_input(decode, shape):
    # [-2, -2] multiplies to a plausible 4 elements: only the sign check catches it
    with pytest.raises(InvalidInput) as info:
        decode(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, data=b"\0" * 16))
    assert "negative" in str(info.value)


def test_dtype_names_map_both_ways():
    for name, value in PROTO_DTYPES.items():
        assert tensor_codec.dtype_to_proto(name) == value
        assert tensor_codec.dtype_from_proto(value) == name
    with pytest.raises(InvalidInput):
        tensor_codec.dtype_to_proto("float64")
    with pytest.raises(InvalidInput):
        tensor_codec.dtype_from_proto(pb.DTYPE_UNSPECIFIED)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_dtypes_the_wire_cannot_name_are_refused_never_mislabelled(dtype):
    """An int16 tensor was once sent as DTYPE_BFLOAT16 (its bits taken for bfloat16 patterns)."""
    with pytest.raises(InvalidInput, match="unsupported dtype"):
        tensor_codec.encode(torch.zeros(3, dtype=dtype))
    with pytest.raises(InvalidInput, match="unsupported dtype"):
        tensor_codec.encode(np.zeros(3, dtype=torch.empty(0, dtype=dtype).numpy().dtype))
