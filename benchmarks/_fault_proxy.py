"""An HTTP proxy on loopback in front of an S3 endpoint (moto's server) that injects the faults of a
real network and a real object store into a share of the requests, from a seeded generator:

- ``500`` / ``503``: an S3 error response instead of the object (the store's own retries apply);
- ``reset``: the connection closed before any response;
- ``slow``: the response delayed, then its body sent in small pieces;
- ``truncated``: the full ``Content-Length`` announced, half the body sent, the connection closed;
- ``412``: a GET made with ``If-Match`` refused as if the object had been rewritten (its ETag changed).

Only GETs are faulted (the reads; uploads and listings pass through). Counts what it injected.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

FAULTS = ("500", "503", "reset", "slow", "truncated", "412")

_ERROR = '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected</Message></Error>'


class FaultProxy:
    """``FaultProxy(upstream, rate, seed)``: a proxy on 127.0.0.1 (``endpoint``) faulting ``rate`` of
    the GETs (or, first, the GETs ``script`` names in order: ``[None, "truncated", "412"]``); `stop`
    it when done."""

    def __init__(self, upstream: str, *, rate: float = 0.05, seed: int = 0, faults=FAULTS, script=()):
        self.upstream = urlsplit(upstream)
        self.rate, self.faults = rate, tuple(faults)
        self.rng = random.Random(seed)
        self.script = list(script)
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.requests = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy._draw("If-Match" in self.headers) if self.command == "GET" else None
                if fault in ("500", "503", "412"):
                    code = {"500": "InternalError", "503": "SlowDown", "412": "PreconditionFailed"}[fault]
                    data = _ERROR.format(code=code).encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if fault == "reset":
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    )
                    self.close_connection = True
                    self.connection.close()
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                finally:
                    conn.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))  # a HEAD's: the object's
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault == "truncated" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "slow":
                    time.sleep(0.2)
                    for at in range(0, len(data), 16 << 10):
                        self.wfile.write(data[at : at + (16 << 10)])
                        self.wfile.flush()
                        time.sleep(0.002)
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client gone mid-request (a killed
                with proxy.lock:  # worker, a reset the proxy made): counted, not printed
                    proxy.broken += 1

        self.broken = 0
        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="fault-proxy")
        self._thread.start()

    def _draw(self, if_match: bool) -> str | None:
        with self.lock:
            self.requests += 1
            if self.script:
                fault = self.script.pop(0)
                if fault is not None:
                    self.injected[fault] += 1
                return fault
            if self.rng.random() >= self.rate:
                return None
            fault = self.rng.choice(self.faults)
            if fault == "412" and not if_match:
                return None
            self.injected[fault] += 1
            return fault

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
