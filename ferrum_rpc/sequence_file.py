"""The export byte format: an ExportSequence stream's ``SequenceChunk``
messages one after another, each prefixed with its length as a varint (protobuf's
"delimited" framing: Java's ``writeDelimitedTo``, C++'s
``SerializeDelimitedToOstream``), so any protobuf library reads it back.

Kept as bytes or in a file, it imports later into any server with the same
fingerprint, the exporting server after a restart included.
"""

from __future__ import annotations

from typing import BinaryIO, Iterator, Union

from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.v1 import executor_pb2 as pb

Source = Union[bytes, bytearray, memoryview, BinaryIO]
MAX_MESSAGE_BYTES = 1 << 30  # a frame longer than this is no export of ours


def frame(message: pb.SequenceChunk) -> bytes:
    """One message with its varint length prefix."""
    body = message.SerializeToString()
    n, prefix = len(body), bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        prefix.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(prefix) + body


def _read_varint(read) -> int | None:
    """A varint from ``read(1)``; None at a clean end of input."""
    shift = value = 0
    while True:
        byte = read(1)
        if not byte:
            if shift:
                raise InvalidInput("the export ends inside a length prefix")
            return None
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
        if shift > 35:
            raise InvalidInput("a length prefix of the export is longer than 5 bytes")


def messages(source: Source) -> Iterator[pb.SequenceChunk]:
    """The messages of an export held as bytes or in a binary file (read as it goes).
    A file that ends inside a message, or a frame that does not parse, is INVALID_INPUT;
    one that ends early between messages yields what it holds (the server then says
    the stream was truncated)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        view, at = memoryview(source), 0

        def read(n: int) -> bytes:
            nonlocal at
            chunk = view[at:at + n].tobytes()
            at += len(chunk)
            return chunk
    else:
        read = source.read
    while (size := _read_varint(read)) is not None:
        if size > MAX_MESSAGE_BYTES:
            raise InvalidInput(f"a frame of {size} bytes: this is no sequence export")
        body = read(size)
        if len(body) != size:
            raise InvalidInput(f"the export ends inside a message ({len(body)} of {size} bytes)")
        try:
            yield pb.SequenceChunk.FromString(body)
        except Exception as exc:  # protobuf's DecodeError
            raise InvalidInput(f"a frame of the export is no SequenceChunk ({type(exc).__name__})") from None
