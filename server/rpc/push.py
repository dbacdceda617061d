"""Where and how this server pushes sequences to another (PushSequence): the
networks a target may lie in, TLS toward it, and the push's own channel."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from ..config import parse_allow


# A push's channel to its receiver.  Keepalive as the clients' (ferrum_rpc.client.Keepalive):
# a receiver that stops answering (frozen, partitioned) is noticed within 2-4 s, and the
# ferrum-rpc server accepts a ping a second.  A subchannel of its own: gRPC's global pool
# would keep a subchannel, and its reconnection attempts, alive after the channel closed.
PUSH_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.use_local_subchannel_pool", 1),
]
# What a caller learns when a push's receiver could not be reached, was no ferrum-rpc
# server, or did not answer in time: one message for all (the cause is logged here), so
# pushes cannot tell a closed port from one something else listens on.
PUSH_FAILED = ("the push did not complete: the target could not be reached, is not a ferrum-rpc server, or "
               "did not answer in time (the server's log says which)")


@dataclass(frozen=True)
class PushConfig:
    """Where and how this server pushes sequences.

    Attributes:
        allowed: networks a push target's addresses must lie in (``--push-allow``).
        tls: connect to receivers over TLS (this server serves TLS).
        ca: PEM CA bundle the receiver's certificate must chain to ("": the system roots).
        cert, key: this server's certificate and key, shown to receivers that require mTLS.
        max_message_bytes: the channel's message limit.
        timeout_s: the deadline of the call to the receiver when the caller set none.
    """

    allowed: tuple = parse_allow("loopback")
    tls: bool = False
    ca: str = ""
    cert: str = ""
    key: str = ""
    max_message_bytes: int = 256 << 20
    timeout_s: float = 60.0

    def channel(self, address: str, host: str) -> grpc.aio.Channel:
        """A channel of one push: closed when the push ends."""
        options = [("grpc.max_send_message_length", self.max_message_bytes + (1 << 20)),
                   ("grpc.max_receive_message_length", self.max_message_bytes + (1 << 20)),
                   *PUSH_CHANNEL_OPTIONS]
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options)
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        creds = grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))
        return grpc.aio.secure_channel(address, creds, options=options + [("grpc.ssl_target_name_override", host)])
