"""An UpdateWeights file (safetensors) read as its bytes arrive, off the event loop and
off the model's worker: hashed as they come, its header parsed and checked against the
checkpoint as soon as it is whole (names, shapes, dtypes, offsets), and every tensor's
bytes copied once, straight into an array of its own, then checked finite.  So when the
trailer arrives only the checksum's comparison is left, and the worker gets tensors
ready to build the model from."""

from __future__ import annotations

import json
import math
import secrets

import numpy as np
import torch

from ferrum_rpc.errors import InvalidInput, TransferCorrupted, shown
from ferrum_rpc.hashing import stream_hasher

HEADER_SLACK = 1 << 20  # an update's file may exceed the tensors' bytes by its header, at most this
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# bytes per element of every safetensors dtype (a file's offsets are checked with them)
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}
# how numpy reads a floating dtype's bytes (it has no bfloat16: its bits, as uint16)
NUMPY_VIEWS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
BF16_EXPONENT = 0x7F80  # all ones in a bfloat16's exponent: an infinity or a NaN


def not_safetensors(why: str) -> InvalidInput:
    return InvalidInput(f"the update is not one safetensors file ({why})")


def all_finite(array: np.ndarray, dtype: str) -> bool:
    """No NaN or infinity among a tensor's values (numpy: one thread, no OpenMP team
    beside the worker's)."""
    if dtype == "BF16":
        return not np.any((array & BF16_EXPONENT) == BF16_EXPONENT)
    return bool(np.isfinite(array).all())


def _entry(entry) -> tuple[int, int, str, tuple[int, ...]] | None:
    """(begin, end, dtype, shape) of a header's entry; None unless it describes a tensor
    whose bytes fill its offsets exactly."""
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) \
            or not isinstance(entry.get("data_offsets"), list) or len(entry["data_offsets"]) != 2:
        return None
    dtype, shape, (begin, end) = entry.get("dtype"), tuple(entry["shape"]), entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES or not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
        return None
    return (begin, end, dtype, shape) if end - begin == math.prod(shape) * DTYPE_BYTES[dtype] else None


class Slot:
    """One tensor of the file: where its bytes lie in the data and the array they fill."""

    __slots__ = ("name", "dtype", "shape", "begin", "array")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], begin: int, nbytes: int):
        self.name, self.dtype, self.shape, self.begin = name, dtype, shape, begin
        self.array = np.empty(nbytes, np.uint8)

    def tensor(self) -> torch.Tensor:
        values = torch.from_numpy(self.array.view(NUMPY_VIEWS[self.dtype]))
        return (values.view(torch.bfloat16) if self.dtype == "BF16" else values).reshape(self.shape)


class WeightsUpload:
    """One UpdateWeights file of ``total`` bytes, fed in order with :meth:`add` and
    closed with :meth:`finish`.  ``checkpoint``: the model's name -> (shape, dtype).
    Holds at most ``total`` bytes (the header, then the tensors' arrays)."""

    def __init__(self, total: int, checkpoint: dict[str, tuple[tuple[int, ...], str]]):
        self.total, self.checkpoint = total, checkpoint
        self.received = 0
        self.digest = stream_hasher()
        self.head = bytearray()  # the header's 8-byte length and its JSON, until whole
        self.data_start: int | None = None  # where the tensors' bytes start, once the header is read
        self.slots: list[Slot] = []  # in the order of their bytes
        self.placed = 0  # tensor bytes placed so far
        self.next = 0  # the slot the next tensor byte goes to

    def add(self, data) -> None:
        """The next bytes of the file (bytes or a memoryview of them)."""
        if self.received + len(data) > self.total:
            raise InvalidInput(f"the data passes total_bytes ({self.total})")
        self.received += len(data)
        self.digest.update(data)
        view = memoryview(data)
        if self.data_start is None:
            view = self._read_head(view)
        while len(view):
            slot = self.slots[self.next]
            at = self.placed - slot.begin
            take = min(slot.array.nbytes - at, len(view))
            slot.array[at:at + take] = np.frombuffer(view[:take], np.uint8)
            view, self.placed = view[take:], self.placed + take
            if at + take == slot.array.nbytes:
                self._complete(slot)

    def _read_head(self, view: memoryview) -> memoryview:
        """Takes the header's bytes from ``view`` and parses it once whole; returns the rest."""
        while self.data_start is None and len(view):
            need = 8 if len(self.head) < 8 else 8 + int.from_bytes(self.head[:8], "little")
            take = min(need - len(self.head), len(view))
            self.head += view[:take]
            view = view[take:]
            if len(self.head) < 8:
                continue
            length = int.from_bytes(self.head[:8], "little")
            if length > min(HEADER_SLACK, self.total - 8):
                raise not_safetensors(f"a header of {length} bytes")
            if len(self.head) == 8 + length:
                self._parse_header(bytes(self.head[8:]))
                self.data_start, self.head = 8 + length, bytearray()
                while self.next < len(self.slots) and not self.slots[self.next].array.nbytes:
                    self._complete(self.slots[self.next])  # a tensor with no elements is whole already
        return view

    def _parse_header(self, text: bytes) -> None:
        """The tensors the header names, checked as a file (offsets that tile the data
        exactly) and against the model (names, shapes, floating dtypes)."""
        try:
            header = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise not_safetensors(f"its header is not JSON: {type(exc).__name__}") from None
        if not isinstance(header, dict):
            raise not_safetensors("its header is not a JSON object")
        header.pop("__metadata__", None)
        if not header:
            raise InvalidInput("the update holds no tensors")
        entries = []
        for name, entry in header.items():
            tensor = _entry(entry)
            if tensor is None:
                raise not_safetensors(f"the entry of {shown(name)} is not a tensor's")
            entries.append((*tensor, name))
        entries.sort()
        data_bytes = self.total - 8 - len(text)
        if [e[0] for e in entries] != [0] + [e[1] for e in entries[:-1]] or entries[-1][1] != data_bytes:
            raise not_safetensors(f"its tensors' offsets do not tile its {data_bytes} data bytes")
        names = set()
        for begin, end, dtype, shape, name in entries:
            name = name.removeprefix("_orig_mod.")
            if name not in self.checkpoint:
                raise InvalidInput(f"tensor {shown(name)}: the model has no tensor of that name")
            if name in names:
                raise InvalidInput(f"tensor {shown(name)}: named twice")
            names.add(name)
            want, _ = self.checkpoint[name]
            if shape != want:
                raise InvalidInput(f"tensor {shown(name)}: shape {shape}, the model's is {want}")
            if dtype not in FLOAT_DTYPES:
                raise InvalidInput(f"tensor {shown(name)}: dtype {dtype}, not a floating dtype "
                                   f"(float32, bfloat16 or float16)")
        self.slots = [Slot(name.removeprefix("_orig_mod."), dtype, shape, begin, end - begin)
                      for begin, end, dtype, shape, name in entries]

    def _complete(self, slot: Slot) -> None:
        self.next += 1
        if not all_finite(slot.array.view(NUMPY_VIEWS[slot.dtype]), slot.dtype):
            raise InvalidInput(f"tensor {shown(slot.name)}: holds a NaN or an infinity")

    def finish(self, checksum: bytes) -> dict[str, torch.Tensor]:
        """The file's tensors by checkpoint name, once every byte arrived and ``checksum``
        (the trailer's) is theirs."""
        if self.received != self.total:
            raise InvalidInput(f"the data holds {self.received} bytes, total_bytes said {self.total}")
        if self.data_start is None:
            raise not_safetensors(f"{self.total} bytes end inside its header")
        if not secrets.compare_digest(checksum, self.digest.digest()):
            raise TransferCorrupted("the checksum does not match the data: it was altered on the way")
        return {slot.name: slot.tensor() for slot in self.slots}
