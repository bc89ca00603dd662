"""A small HTTP/1.1 proxy on 127.0.0.1 for the object-tier tests: counts requests by method and
the request body bytes they carry (dedup is proven by what reaches the server), and can play a
faulty server (replies cut short, replies held back, 5xx answers, a writer that hangs)."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"


class CountingProxy:
    """A TCP proxy on 127.0.0.1 that parses HTTP/1.1 requests and counts them.

    `requests[method]` and `body_bytes[method]` add up over the proxy's life; `reset()` clears
    them. Responses are relayed as bytes (no parsing needed: the client frames them).
    """

    def __init__(
        self, upstream_port: int, cut_replies_after: int | None = None, delay_replies_s: float = 0.0
    ) -> None:
        self.upstream_port = upstream_port
        # Fault mode: hold every reply this long before forwarding it (a slow server).
        self.delay_replies_s = delay_replies_s
        # Fault mode: forward only this many bytes of each connection's replies, then close it
        # (a truncated body as a client sees it).
        self.cut_replies_after = cut_replies_after
        # Fault mode: answer the next this-many requests with this status, without forwarding
        # them (a server that is overloaded or failing).
        self.fail_status = 503
        self.fail_next = 0
        # Fault mode: also answer every request whose request line (b"GET /path?query HTTP/1.1")
        # this returns true for with `fail_status` (e.g. only the GETs of one kind of object).
        self.fail_matching: Callable[[bytes], bool] | None = None
        # Fault mode: a request whose body is larger than this is never forwarded nor answered
        # until `close()` (a writer whose uploads hang, as seen by the server: nothing).
        self.stall_bodies_over: int | None = None
        self.requests: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()
        # The scheme word of each request's Authorization header ("AWS4-HMAC-SHA256", or
        # "none"), and every request head seen (a test looks for credentials in them).
        self.auth: Counter[str] = Counter()
        self.heads: list[bytes] = []
        self.failed = 0
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((HOST, 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name="counting-proxy", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.body_bytes.clear()

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.requests), dict(self.body_bytes)

    def close(self) -> None:
        self._closed = True
        self._released.set()
        try:
            self._sock.close()
        except OSError:
            pass

    def _count_body(self, method: str) -> Callable[[int], None]:
        def add(n: int) -> None:
            with self._lock:
                self.body_bytes[method] += n

        return add

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection((HOST, self.upstream_port), timeout=30)
        except OSError:
            client.close()
            return
        cut = self.cut_replies_after
        args = (upstream, client, cut, lambda: self.delay_replies_s)
        threading.Thread(target=_pump, args=args, daemon=True).start()
        reader = client.makefile("rb")
        try:
            while True:
                head = _read_head(reader)
                if head is None:
                    break
                method, length, chunked = _parse_head(head)
                # Count before forwarding: the reply can reach the client before this thread
                # runs again, and a caller reading the counters then must see this request.
                with self._lock:
                    self.requests[method] += 1
                    self.auth[_auth_scheme(head)] += 1
                    self.heads.append(head)
                    fail = self.fail_next > 0
                    if fail:
                        self.fail_next -= 1
                    matcher = self.fail_matching
                    if not fail and matcher is not None:
                        fail = matcher(head.split(b"\r\n", 1)[0])
                    if fail:
                        self.failed += 1
                if self.stall_bodies_over is not None and length > self.stall_bodies_over:
                    self._released.wait()
                    break
                if fail:
                    _relay_body(reader, None, length, chunked, lambda n: None)
                    reason = f"HTTP/1.1 {self.fail_status} Injected Failure\r\n"
                    client.sendall(
                        (reason + "Content-Length: 0\r\nConnection: close\r\n\r\n").encode()
                    )
                    break
                upstream.sendall(head)
                _relay_body(reader, upstream, length, chunked, self._count_body(method))
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass


def _pump(
    src: socket.socket,
    dst: socket.socket,
    limit: int | None = None,
    delay_s: Callable[[], float] = lambda: 0.0,
) -> None:
    left = limit
    try:
        while chunk := src.recv(1 << 16):
            if (delay := delay_s()) > 0:
                time.sleep(delay)
            if left is not None:
                chunk = chunk[:left]
                left -= len(chunk)
            dst.sendall(chunk)
            if left == 0:
                break
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_RDWR if limit is not None else socket.SHUT_WR)
        except OSError:
            pass


def _read_head(reader: Any) -> bytes | None:
    lines = []
    while True:
        line = reader.readline(1 << 16)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _parse_head(head: bytes) -> tuple[str, int, bool]:
    first, _, rest = head.partition(b"\r\n")
    method = first.split(b" ", 1)[0].decode("ascii", "replace")
    length, chunked = 0, False
    for line in rest.split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return method, length, chunked


def _auth_scheme(head: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            return value.strip().split(b" ", 1)[0].decode("ascii", "replace")
    return "none"


def _relay_body(
    reader: Any,
    upstream: socket.socket | None,
    length: int,
    chunked: bool,
    count: Callable[[int], None],
) -> None:
    """Forward one request body (or only read it, with no `upstream`), counting its payload
    bytes (chunk framing not counted) before each piece is sent on."""
    send: Callable[[bytes], object] = upstream.sendall if upstream is not None else len
    if not chunked:
        left = length
        while left > 0:
            chunk = reader.read(min(left, 1 << 16))
            if not chunk:
                raise OSError("client closed mid-body")
            count(len(chunk))
            send(chunk)
            left -= len(chunk)
        return
    while True:
        size_line = reader.readline(1 << 12)
        send(size_line)
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            # trailers until the blank line
            while True:
                line = reader.readline(1 << 12)
                send(line)
                if line in (b"\r\n", b"\n", b""):
                    return
        data = reader.read(size + 2)
        count(size)
        send(data)
