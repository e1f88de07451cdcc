"""A test's HTTP server on 127.0.0.1 (a free port), for node tools that talk to a replica's API; a free port of
127.0.0.1 for a server the test starts itself; and requests: a GET, and one sent exactly as written, for tests of what
a router lets through."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    """A test server's request handler that keeps the test's output clean (no access log, no traceback when the
    peer resets a kept-alive connection, as a router that stops does)."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError):
            super().handle()

    def answer(self, status: int, body: bytes) -> None:
        """Send ``status`` with ``body`` as the whole answer."""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ReplicaHandler(QuietHandler):
    """A stand-in replica behind a router: ``GET`` (its health check) answers at once; ``POST`` reads the JSON
    body and answers what :meth:`complete` returns (status, body)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.answer(200, b"{}")

    def do_POST(self) -> None:
        status, body = self.complete(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        if isinstance(body, bytes):
            self.answer(status, body)
            return
        self.send_response(status)  # streamed as vLLM streams: each part a chunk of its own, sent as it comes
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in body:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def complete(self, request: dict[str, Any]) -> tuple[int, bytes | list[bytes]]:
        """The answer's status and body: whole (bytes), or streamed in chunks (a list of them)."""
        raise NotImplementedError


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler], port: int = 0) -> Iterator[str]:
    """Serve ``handler`` on ``port`` (0: a free one) until the block ends; yields the server's base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    # a short poll interval: shutdown() waits for the serving loop's next look (0.5 s by default)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def raw_request(host: str, port: int, method: str, path: str, body: bytes | Iterable[bytes],
                headers: dict[str, str], tls: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """One request with ``path`` as written (no client library normalizes it), over TLS with ``tls``: the status
    and the answer; a body given as chunks goes without a length (Transfer-Encoding: chunked)."""
    connection = (http.client.HTTPSConnection(host, port, timeout=120, context=tls) if tls is not None
                  else http.client.HTTPConnection(host, port, timeout=120))
    try:
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def http_get(url: str) -> bytes:
    """The body of a GET of ``url`` (an error status raises)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()
