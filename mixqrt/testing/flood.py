"""A connection flood for tests and benchmarks (issue 39, item 4): `n` half-sent requests (full
headers, a tenth of the body, then nothing) from `addresses` loopback addresses (127.0.0.2, ...),
each reopened as soon as the server closes it; and timed real requests from new addresses.

    with Flood(port, n=500, addresses=10) as f:     # a thread keeps the 500 open
        status, seconds = real_request(port, source="127.0.0.100")

Linux routes all of 127.0.0.0/8 to loopback, so each source address is a distinct peer to the
server. Client side only: sockets, no mixqrt import (the benchmark runs it against other checkouts)."""
from __future__ import annotations

import json
import selectors
import socket
import threading
import time

HALF = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n" + b"{" + b" " * 99)


def loopback(i: int) -> str:
    """The i-th extra loopback address: 127.0.0.2, 127.0.0.3, ... (i from 0)."""
    i += 2
    return f"127.0.{i // 250}.{i % 250 or 1}" if i >= 250 else f"127.0.0.{i}"


class Flood:
    def __init__(self, port: int, n: int = 500, addresses: int = 10):
        self.port, self.n, self.addresses = port, n, addresses
        self.sel = selectors.DefaultSelector()
        self.stop = threading.Event()
        self.opened = self.closed_by_server = self.failed = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="flood")

    def _open(self, i: int) -> None:
        try:
            c = socket.create_connection(("127.0.0.1", self.port), timeout=5,
                                         source_address=(loopback(i % self.addresses), 0))
            c.sendall(HALF)
            c.setblocking(False)
            self.sel.register(c, selectors.EVENT_READ, i)
            self.opened += 1
        except OSError:
            self.failed += 1

    def _run(self) -> None:
        for i in range(self.n):
            if self.stop.is_set():
                break
            self._open(i)
        while not self.stop.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                c = key.fileobj
                try:
                    data = c.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data and not data.endswith(b"}"):
                    continue                    # the rest of a reply is on its way; read it next time
                self.sel.unregister(c)
                c.close()
                self.closed_by_server += 1
                self._open(key.data)            # and back it comes
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()

    def __enter__(self) -> "Flood":
        self.thread.start()
        deadline = time.monotonic() + 120
        while self.opened + self.failed < self.n and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def raw_status(port: int, data: bytes, timeout: float = 30.0, source: str = "127.0.0.1") -> int:
    """Send raw bytes on a fresh connection from `source` -> the reply's status code (0: none)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as c:
        c.sendall(data)
        head = b""
        while b"\r\n" not in head:
            got = c.recv(4096)
            if not got:
                break
            head += got
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") and head[9:12].isdigit() else 0


def real_request(port: int, source: str, timeout: float = 30.0) -> tuple[int, float]:
    """One complete completion request (1 token) from `source`: (HTTP status or 0, seconds)."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1, "temperature": 0}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    t = time.perf_counter()
    try:
        status = raw_status(port, req, timeout, source)
    except OSError:
        status = 0
    return status, time.perf_counter() - t
