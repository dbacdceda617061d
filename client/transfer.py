"""The request builders and reply parsers of the RPCs in the clients' table (``rpc.py``,
which names them ``transfer.<name>``) that move a sequence between servers and files:
export, import, import tickets and pushes.  Each builder's parameters and docstring are
the client method's."""

from __future__ import annotations

from typing import BinaryIO

from ferrum_rpc import convert, sequence_file
from ferrum_rpc.rules import check_push_target, check_ticket_ttl
from ferrum_rpc.types import KvCacheHandle, SequencePush
from ferrum_rpc.v1 import executor_pb2 as pb


def export_sequence(c, kv_cache: KvCacheHandle, file: BinaryIO | None = None,
                     chunk_bytes: int = 0) -> pb.ExportSequenceRequest:
    """Reads a sequence out (it is unchanged on the server): its tokens, KV and
    compatibility fingerprint in the export byte format (``ferrum_rpc.sequence_file``).
    Returns the bytes; with ``file`` (a binary file), writes them there as they
    arrive and returns how many.  ``chunk_bytes``: KV per message (0: 4 MiB)."""
    return pb.ExportSequenceRequest(model=c.model or kv_cache.model, kv_cache=convert.handle_to_proto(kv_cache),
                                    chunk_bytes=chunk_bytes)


def export_each(c, message: pb.SequenceChunk, kv_cache, file=None, chunk_bytes: int = 0) -> None:
    if file is not None:
        file.write(sequence_file.frame(message))


def export_result(c, messages, kv_cache, file=None, chunk_bytes: int = 0) -> bytes | int:
    if file is not None:
        return sum(len(sequence_file.frame(m)) for m in messages)
    return b"".join(sequence_file.frame(m) for m in messages)


def import_sequence(c, data: bytes | BinaryIO):
    """Writes an export (bytes, or a binary file read as it goes) into the server: a new
    sequence of the caller's tenant, as long as the exported one, whose next decode
    gives what the exporter's would have.  Checked whole before anything is taken."""
    return sequence_file.messages(data)


def create_import_ticket(c, fingerprint: str = "", ttl_s: float = 0.0) -> pb.CreateImportTicketRequest:
    """A single-use ticket (``.ticket``) that lets another server push one sequence here
    for this caller's tenant within ``ttl_s`` seconds (0: 30); ``fingerprint``: the
    digest the pushed sequence must have (empty: this server's)."""
    check_ticket_ttl(ttl_s)
    return pb.CreateImportTicketRequest(model=c.model, fingerprint=fingerprint, ttl_s=ttl_s)


def push_sequence(c, kv_cache: KvCacheHandle, target: str, ticket: str, move: bool = False,
                   chunk_bytes: int = 0) -> pb.PushSequenceRequest:
    """Has the server stream ``kv_cache`` straight to the server at ``target`` (which
    issued ``ticket``); with ``move``, released here once the receiver has it.
    Returns the receiver's handle, the bytes sent and whether it was released."""
    check_push_target(target)
    return pb.PushSequenceRequest(model=c.model or kv_cache.model, kv_cache=convert.handle_to_proto(kv_cache),
                                  target=target, ticket=ticket, move=move, chunk_bytes=chunk_bytes)


def pushed(c, reply: pb.PushSequenceResponse) -> SequencePush:
    return SequencePush(convert.handle_from_proto(reply.kv_cache), reply.bytes_sent, reply.released)
