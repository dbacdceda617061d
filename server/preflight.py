"""The start-up checks that need no model and no torch: the --model folders, the
--port-file, the --auth-tokens file and the TLS files.  ``ferrum-rpc serve`` runs
them before it imports torch, so a misconfigured start fails in a fraction of a
second with one line.  ``app.build_server`` checks the TLS files itself too, for
servers started in process."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ferrum_rpc.errors import StartupError
from .config import ServerConfig
from .rpc.auth import TokenTable


def preflight(config: ServerConfig) -> None:
    """Raises StartupError naming the first option whose file or folder cannot serve."""
    check_model_folders(config)
    if config.port_file:
        PortFile(config.port_file).check()
    if config.auth_tokens:
        TokenTable.load(config.auth_tokens)
    if config.tls_cert:
        check_tls_files(config)


def check_model_folders(config: ServerConfig) -> None:
    """Refuses, before binding anything, a --model that is no model folder, or two with one name."""
    for number, spec in enumerate(config.models):
        where = f"--model {spec.name}={spec.path}"
        if any(other.name == spec.name for other in config.models[:number]):
            raise StartupError(f"{where}: a model named {spec.name!r} is given twice (name them: --model NAME=PATH)")
        try:
            if not Path(spec.path).is_dir():
                raise StartupError(f"{where}: no such folder")
            if not (Path(spec.path) / "config.json").is_file():
                raise StartupError(f"{where}: not a model folder (no config.json)")
        except OSError as exc:
            raise StartupError(f"{where}: {exc.strerror or exc}") from None


def check_tls_files(config: ServerConfig) -> None:
    """Refuses TLS files that gRPC would refuse saying only that it could not bind:
    each file must be readable PEM (the key unencrypted) and the key the certificate's."""
    import ssl

    files = (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key), ("--tls-client-ca", config.tls_client_ca))
    for option, path in files:
        if path:
            try:
                Path(path).read_bytes()
            except OSError as exc:
                raise StartupError(f"cannot read the {option} file {path}: {exc.strerror or exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for option, path in (("--tls-cert", config.tls_cert), ("--tls-client-ca", config.tls_client_ca)):
        if path:
            try:
                context.load_verify_locations(cafile=path)  # parses every certificate in it
            except (ssl.SSLError, ValueError) as exc:
                raise StartupError(f"the {option} file {path} holds no valid PEM certificate "
                                   f"({getattr(exc, 'reason', None) or exc})") from None
    try:  # the password callback fails an encrypted key instead of prompting on the terminal
        context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: b"")
    except (ssl.SSLError, ValueError) as exc:
        reason = getattr(exc, "reason", None)
        problem = "is not the private key of" if reason == "KEY_VALUES_MISMATCH" else \
            f"is no unencrypted PEM private key{f' ({reason})' if reason else ''} for"
        raise StartupError(f"the --tls-key file {config.tls_key} {problem} --tls-cert {config.tls_cert}") from None


class PortFile:
    """``--port-file``: a JSON object saying where a server listens (address, host, port,
    instance_id, pid, state), for whoever started it with port 0.  Each write goes to a
    temporary file in the same folder and then replaces the file, so a reader never sees
    half of one.  It is written once listening (state "listening"), again once every
    model serves ("serving"), once it drains ("draining"), and removed when it exits."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.fields: dict = {}

    def _put(self, text: str, keep: bool = True) -> None:
        """Writes ``text`` to a temporary file beside the path, then moves it there (or,
        with ``keep`` false, removes it: a test that the folder takes files)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            if keep:
                os.replace(tmp, self.path)
            else:
                tmp.unlink()
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StartupError(f"cannot write the --port-file {self.path}: {exc.strerror or exc}") from None

    def check(self) -> None:
        """Refuses, before binding anything, a path that cannot be written: its folder
        missing or read-only, or the path a folder."""
        if self.path.is_dir() or not self.path.parent.is_dir():
            problem = "it is a folder" if self.path.is_dir() else f"no folder {self.path.parent}"
            raise StartupError(f"cannot write the --port-file {self.path}: {problem}")
        self._put("", keep=False)

    def write(self, **fields) -> None:
        self.fields.update(fields, pid=os.getpid())
        self._put(json.dumps(self.fields) + "\n")

    def remove(self) -> None:
        """Removes the file if it is still the one this process wrote."""
        try:
            if self.fields and json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass
