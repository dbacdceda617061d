"""Bearer-token tenants and TLS credentials for the server.

``--auth-tokens FILE`` holds one tenant per line: a name, whitespace, its token
(``#`` starts a comment).  Every call but health checks must carry
``authorization: Bearer <token>``; a missing or unknown token is answered
UNAUTHENTICATED / UNAUTHENTICATED before any handler runs (reflection follows
the same rule as the service).  Tokens are compared in constant time (every
known token is compared, whatever matches) and never logged.

The servicer's one wrapper finds the tenant a call authenticated as and
passes it explicitly to the worker and the executor: a sequence belongs to the
tenant that made it, and another tenant's cache id behaves exactly like an
unknown one.  With auth off everyone is the tenant "".
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from ferrum_rpc.errors import StartupError, Unauthenticated, to_rpc_status
from ferrum_rpc.metadata import TICKET_HEADER

log = logging.getLogger(__name__)

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes need these without credentials
# A push from another server carries an import ticket instead of a token (the servicer checks it)
TICKETED_METHODS = ("/ferrum.executor.v1.ModelExecutor/ImportSequence",)
_MIN_TOKEN_CHARS = 16
HANDLER_FACTORIES = {  # gRPC method-handler factories by (request streaming, response streaming)
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True)
class TokenTable:
    """Known tokens and their tenants."""

    entries: tuple[tuple[str, bytes], ...]  # (tenant, token)

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Parses a tokens file.  Errors (:class:`StartupError`) name the file and
        line, never the token."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise StartupError(f"cannot read the --auth-tokens file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise StartupError(f"the --auth-tokens file {path} is not UTF-8 text") from None
        entries, seen = [], set()
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise StartupError(f"{path}:{number}: expected '<tenant> <token>'")
            tenant, token = parts
            if len(token) < _MIN_TOKEN_CHARS:
                raise StartupError(f"{path}:{number}: tenant {tenant!r}'s token is shorter than "
                                   f"{_MIN_TOKEN_CHARS} characters")
            if token in seen:
                raise StartupError(f"{path}:{number}: tenant {tenant!r} reuses another line's token")
            seen.add(token)
            entries.append((tenant, token.encode()))
        if not entries:
            raise StartupError(f"{path}: no tokens")
        log.info("auth: %d token(s) for %d tenant(s) from %s", len(entries), len({t for t, _ in entries}), path)
        return cls(tuple(entries))

    def tenant_for(self, metadata) -> str | None:
        """The tenant whose token the call's ``authorization`` header carries, or None."""
        header = next((value for key, value in metadata or () if key == "authorization"), None)
        if not isinstance(header, str) or not header.startswith("Bearer "):
            return None
        candidate = header[len("Bearer "):].strip().encode()
        found = None
        for tenant, token in self.entries:  # no early exit: the time does not depend on which matched
            if hmac.compare_digest(token, candidate):
                found = tenant
        return found


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a known bearer token, except health checks."""

    def __init__(self, tokens: TokenTable):
        self.tokens = tokens

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_PREFIXES) or self.tokens.tenant_for(details.invocation_metadata) or (
                details.method in TICKETED_METHODS
                and any(key == TICKET_HEADER for key, _ in details.invocation_metadata or ())):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED."""
    status = to_rpc_status(Unauthenticated(
        "this server requires 'authorization: Bearer <token>' with a token it knows"))

    async def unary(request, context):
        await context.abort_with_status(status)

    async def streaming(request, context):
        await context.abort_with_status(status)
        yield  # pragma: no cover  (makes this an async generator)

    fn = streaming if handler.response_streaming else unary
    factory = HANDLER_FACTORIES[handler.request_streaming, handler.response_streaming]
    return factory(fn, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class TlsFiles:
    """Server TLS: certificate chain and key (PEM), and optionally the CA that
    client certificates must chain to (mTLS: required and verified)."""

    cert: str
    key: str
    client_ca: str = ""

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=client_ca, require_client_auth=client_ca is not None)
