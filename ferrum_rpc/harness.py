"""``ferrum-rpc serve`` in a child process, for tests and benchmarks: the one place that
starts a server process and learns where it listens.

The port comes from ``--port-file`` (a temporary file this object owns), not from
a log line: the server writes it as JSON once it listens and again, with state
"serving", once every model serves.  The server's stderr is read on a thread (no
pipe can fill and stall it) and kept as :attr:`ServerProcess.lines`, since tests
assert on log lines.  Standard library only: ``bench/`` imports it as well as the
tests, and it needs none of the server's dependencies in the process that uses it.

    with serve_process("tiny=/path/to/model", "--kv-tokens", "1024") as server:
        server.wait_serving()
        ExecutorClient(server.target)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

EOF = "<EOF>"  # the last of :attr:`ServerProcess.lines` once the process closed its stderr


class ServerDidNotStart(RuntimeError):
    """The process exited, or did not serve in time; the message holds its log."""


class ServerProcess:
    """One ``python -m ferrum_rpc.cli serve`` process on a loopback port, restartable on it.

    Args:
        model: ``--model`` as given (``NAME=PATH`` or a folder); None: the default model.
        *flags: more ``serve`` flags (not ``--port`` or ``--port-file``: use ``port``).
        port: the port of the first start (0: a free one); :meth:`restart` reuses the one it got.
        echo: stderr lines for which it returns true are copied to this process's stderr.
        start: start at once (else call :meth:`start`).

    The process starts at construction; :meth:`wait_serving` waits until it serves
    and sets :attr:`port` and :attr:`instance`.
    """

    def __init__(self, model: str | os.PathLike | None, *flags: str, port: int = 0,
                 echo: Callable[[str], bool] | None = None, start: bool = True):
        self.model, self.flags, self.port, self.echo = model, flags, port, echo
        self.instance = ""
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._cond = threading.Condition()
        folder = tempfile.mkdtemp(prefix="ferrum-rpc-serve-")
        self.port_file = Path(folder) / "port.json"
        self._cleanup = weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
        if start:
            self.start()

    # -- the process -------------------------------------------------------------------
    def command(self) -> list[str]:
        model = [] if self.model is None else ["--model", os.fspath(self.model)]
        return [sys.executable, "-m", "ferrum_rpc.cli", "serve", *model, *self.flags,
                "--port", str(self.port), "--port-file", str(self.port_file)]

    def start(self) -> None:
        """A new process (on :attr:`port`, 0 the first time), with a fresh log."""
        self.port_file.unlink(missing_ok=True)
        self.lines = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, args=(self.proc, self.lines, self._cond), daemon=True).start()

    def _read(self, proc: subprocess.Popen, lines: list[str], cond: threading.Condition) -> None:
        for line in proc.stderr:
            if self.echo is not None and self.echo(line):
                sys.stderr.write(line)
            with cond:
                lines.append(line.rstrip("\n"))
                cond.notify_all()
        with cond:
            lines.append(EOF)
            cond.notify_all()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _ended(self) -> bool:
        return bool(self.lines) and self.lines[-1] == EOF

    # -- waiting -------------------------------------------------------------------------
    def _read_port_file(self) -> dict | None:
        try:
            info = json.loads(self.port_file.read_text())
        except (OSError, ValueError):
            return None
        return info if info.get("pid") == self.proc.pid else None  # never a file of an earlier process

    def wait_serving(self, timeout: float = 60.0) -> ServerProcess:
        """Waits until the server serves every model; sets :attr:`port` and :attr:`instance`.
        Raises :class:`ServerDidNotStart` (with the log) if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            info = self._read_port_file()
            if info is not None and info.get("state") == "serving":
                self.port, self.instance = int(info["port"]), info["instance_id"]
                return self
            with self._cond:
                left = deadline - time.monotonic()
                if left <= 0 or self._ended():
                    raise ServerDidNotStart("server did not start:\n" + self.log())
                self._cond.wait(min(left, 0.05))  # a log line, or time to look at the file again

    def wait_for(self, pattern: re.Pattern | str, timeout: float) -> re.Match:
        """The first match of ``pattern`` in a stderr line, waiting up to ``timeout`` seconds."""
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if match := pattern.search(line):
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or self._ended():
                    raise AssertionError(f"no {pattern.pattern!r} in server stderr:\n{self.log()}")
                self._cond.wait(left)

    def log(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    # -- ending ----------------------------------------------------------------------------
    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL, and wait for it."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains) and wait; returns the exit status."""
        if self.alive():
            self.proc.terminate()
            self.proc.wait(timeout)
        return None if self.proc is None else self.proc.returncode

    def restart(self, timeout: float = 60.0) -> None:
        """Same port, new process (a new server instance id); waits until it serves."""
        self.kill()
        self.start()
        self.wait_serving(timeout)

    def close(self) -> None:
        """Stops the process if it still runs (SIGTERM, then SIGKILL) and removes the port file."""
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            self.kill()
        self._cleanup()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_process(model: str | os.PathLike | None, *flags: str, **kwargs) -> ServerProcess:
    """Starts ``ferrum-rpc serve`` (see :class:`ServerProcess`); use it as a context manager."""
    return ServerProcess(model, *flags, **kwargs)


@contextlib.contextmanager
def all_serving(*servers: ServerProcess, timeout: float = 60.0) -> Iterator[list[ServerProcess]]:
    """Waits until each of ``servers`` (started already, so they load side by side)
    serves; yields them as a list and kills them all on the way out."""
    try:
        for server in servers:
            server.wait_serving(timeout)
        yield list(servers)
    finally:
        for server in servers:
            server.kill()
        for server in servers:
            server.close()
