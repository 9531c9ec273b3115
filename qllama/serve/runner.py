"""Running the application with uvicorn: on a socket bound first (so port 0 gives an ephemeral
port whose number is known before the first request), in the foreground (``qllama serve``) or
on a thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from qllama.errors import QllamaError

LOCALHOST = "127.0.0.1"


def bind(host: str = LOCALHOST, port: int = 8000) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: a response written as head then body is not held
    # back by Nagle's algorithm waiting for the client's delayed ACK (40 ms a request)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _server(app: Any, sock: socket.socket, log_level: str) -> uvicorn.Server:
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # the app's own access log escapes what it prints
        timeout_keep_alive=5,
        lifespan="on",
    )
    return uvicorn.Server(config)


def serve_forever(app: Any, sock: socket.socket, *, log_level: str = "info") -> None:
    """Serve until interrupted (uvicorn handles SIGINT/SIGTERM)."""
    _server(app, sock, log_level).run(sockets=[sock])


class ServerThread:
    """The application on a background thread, on ``host`` and an ephemeral port.

    ``with ServerThread(app) as s: ... s.url ...``: started and stopped by the block.
    """

    def __init__(self, app: Any, host: str = LOCALHOST, *, log_level: str = "warning") -> None:
        self.app = app
        self.sock = bind(host, 0)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = _server(app, self.sock, log_level)
        self.thread = threading.Thread(target=self._run, name="qllama-http", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # seen by start() and stop()
            self.error = e

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start serving (once; a started server is returned as it is)."""
        if self.thread.ident is not None:
            return self
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise QllamaError(f"the server did not start: {self.error!r}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
