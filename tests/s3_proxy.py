"""A fault- and behaviour-injecting HTTP proxy on 127.0.0.1, in front of a real S3 server.

Every request goes through ``rule(request) -> Action``; the action decides what the client
sees: the upstream's answer (``Forward``), a canned error (``Respond``, ``slow_down()``,
``not_implemented()``), a connection reset before any answer (``Reset``, optionally after the
upstream did the work), a reset in the middle of the body (``Truncate``), an edited body
(``Rewrite``), or any of them late (``Delay``). Use it as a context manager::

    with S3Proxy(moto_s3, rule) as proxy:
        server = proxy.through(moto_s3)   # url(), options and client() now use the proxy
        store = ckptstore.open(server.url("run"), **server.options)

``proxy.requests`` records every request seen, for assertions (e.g. that a reader never
sent a PUT). The rule runs on the proxy's handler threads: keep its state thread-safe.
Stdlib only; leaves no thread running after ``__exit__``.
"""

from __future__ import annotations

import dataclasses
import http.client
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ckptstore.tools.embedded import EmbeddedS3

__all__ = [
    "Action", "CheckThenWrite", "Delay", "Forward", "LaggingListings", "Request", "Reset",
    "Respond", "Rewrite", "Rule", "S3Proxy", "Truncate", "blank_etag", "cut_listing",
    "drop_listed_keys", "flip_a_bit", "not_implemented", "once", "slow_down",
]  # fmt: skip


@dataclass(frozen=True)
class Request:
    """What a rule sees of one request: ``query`` maps S3 subresources like ``uploads`` to ''."""

    method: str
    path: str
    query: Mapping[str, str]
    headers: Mapping[str, str]

    def header(self, name: str) -> str | None:
        """A request header by its case-insensitive name."""
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)

    @property
    def operation(self) -> str:
        """The S3 operation, for the ones ckptstore sends (object-level, path-style)."""
        q, m = self.query, self.method
        if m == "POST":
            return "CreateMultipartUpload" if "uploads" in q else "CompleteMultipartUpload"
        if m == "PUT":
            return "UploadPart" if "partNumber" in q else "PutObject"
        if m == "DELETE":
            return "AbortMultipartUpload" if "uploadId" in q else "DeleteObject"
        if m == "GET":
            for marker, name in (
                ("list-type", "ListObjectsV2"),
                ("versions", "ListObjectVersions"),
                ("uploads", "ListMultipartUploads"),
                ("uploadId", "ListParts"),
            ):
                if marker in q:
                    return name
            return "GetObject" if self.path.strip("/").count("/") else "GetBucket"
        return "HeadObject" if self.path.strip("/").count("/") else "HeadBucket"


@dataclass(frozen=True)
class Forward:
    """Pass the request through and the upstream's answer back, unchanged."""


@dataclass(frozen=True)
class Respond:
    """Answer with this status and body; the upstream never sees the request."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Reset:
    """Reset the connection without an answer; with ``after_upstream`` the request took effect."""

    after_upstream: bool = False


@dataclass(frozen=True)
class Truncate:
    """Forward, send the upstream's headers and the first ``after_bytes`` of its body, then
    reset the connection ``pause`` seconds later, or with ``reset=False`` close it cleanly
    (the client then gets every byte sent, and a body shorter than its Content-Length).

    A reset makes the client's kernel drop what the client has not read yet: the pause lets
    it read what was sent, so that the reset lands in the middle of the body.
    """

    after_bytes: int
    reset: bool = True
    pause: float = 0.1


@dataclass(frozen=True)
class Rewrite:
    """Forward, then replace the upstream's body by ``edit(body)`` (Content-Length follows)."""

    edit: Callable[[bytes], bytes]


@dataclass(frozen=True)
class CheckThenWrite:
    """A conditional create (``If-None-Match: *``) done the way a multi-node gateway without
    atomic conditional writes does it: a HEAD of the key upstream (412 if it is there), then
    ``between()``, then the put without its condition, then ``after()`` before the answer.
    Racing creators that all pass the check all write, the last one's bytes staying."""

    between: Callable[[], None] = lambda: None
    after: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Delay:
    """Wait ``seconds``, then do ``then``."""

    seconds: float
    then: Action = Forward()


Action = Forward | Respond | Reset | Truncate | Rewrite | CheckThenWrite | Delay
Rule = Callable[[Request], Action]


def _s3_error(status: int, code: str, message: str) -> Respond:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>proxy</RequestId></Error>"
    ).encode()
    return Respond(status, body, {"Content-Type": "application/xml"})


def slow_down() -> Respond:
    """S3's throttling answer: 503 SlowDown."""
    return _s3_error(503, "SlowDown", "Please reduce your request rate.")


def not_implemented() -> Respond:
    """The answer of a server without the operation: 501 NotImplemented."""
    return _s3_error(501, "NotImplemented", "A header you provided implies functionality "
                     "that is not implemented")  # fmt: skip


def blank_etag(body: bytes) -> bytes:
    """Empty every ``<ETag>`` element (a server whose CompleteMultipartUpload omits it)."""
    return re.sub(rb"<ETag>[^<]*</ETag>", b"<ETag></ETag>", body)


def drop_listed_keys(drop: Callable[[str], bool]) -> Callable[[bytes], bytes]:
    """An edit removing the ListObjectsV2 ``<Contents>`` whose key ``drop`` selects and
    declaring the page the last one (a listing that ends early)."""

    def edit(body: bytes) -> bytes:
        def entry(match: re.Match[bytes]) -> bytes:
            key = re.search(rb"<Key>([^<]*)</Key>", match.group(0))
            return b"" if key and drop(key.group(1).decode()) else match.group(0)

        body = re.sub(rb"<Contents>.*?</Contents>", entry, body, flags=re.S)
        return re.sub(rb"<IsTruncated>true</IsTruncated>", b"<IsTruncated>false</IsTruncated>",
                      body)  # fmt: skip

    return edit


def cut_listing(keep: int) -> Callable[[bytes], bytes]:
    """An edit keeping the first ``keep`` ``<Contents>`` of a ListObjectsV2 page and presenting
    the page as complete (an incomplete page presented as complete)."""

    def edit(body: bytes) -> bytes:
        kept = [0]

        def entry(match: re.Match[bytes]) -> bytes:
            kept[0] += 1
            return match.group(0) if kept[0] <= keep else b""

        body = re.sub(rb"<Contents>.*?</Contents>", entry, body, flags=re.S)
        body = re.sub(rb"<NextContinuationToken>[^<]*</NextContinuationToken>", b"", body)
        return re.sub(rb"<IsTruncated>true</IsTruncated>", b"<IsTruncated>false</IsTruncated>",
                      body)  # fmt: skip

    return edit


def flip_a_bit(body: bytes) -> bytes:
    """An edit flipping the lowest bit of the body's first byte (damage in transit)."""
    return bytes([body[0] ^ 1]) + body[1:] if body else body


class LaggingListings:
    """A listing that lags behind writes: while ``lagging``, the objects written through the
    proxy (PutObject, CompleteMultipartUpload) are left out of every ListObjectsV2 answer,
    though a GET or HEAD of them succeeds; ``catch_up()`` shows them again. Use ``rule`` as
    the proxy's rule, or call it from one."""

    def __init__(self) -> None:
        self.lagging = False
        self.hidden: set[str] = set()
        self._lock = threading.Lock()

    def catch_up(self) -> None:
        with self._lock:
            self.lagging = False
            self.hidden.clear()

    def rule(self, request: Request) -> Action:
        if request.operation in ("PutObject", "CompleteMultipartUpload"):
            with self._lock:
                if self.lagging:  # the path is /bucket/key
                    self.hidden.add(unquote(request.path.lstrip("/").partition("/")[2]))
            return Forward()
        if request.operation == "ListObjectsV2":
            with self._lock:
                hidden = set(self.hidden)
            return Rewrite(_without_keys(hidden))
        return Forward()


def _without_keys(hidden: set[str]) -> Callable[[bytes], bytes]:
    def edit(body: bytes) -> bytes:
        def entry(match: re.Match[bytes]) -> bytes:
            key = re.search(rb"<Key>([^<]*)</Key>", match.group(0))
            return b"" if key and key.group(1).decode() in hidden else match.group(0)

        return re.sub(rb"<Contents>.*?</Contents>", entry, body, flags=re.S)

    return edit


def once(when: Callable[[Request], bool], action: Action, times: int = 1) -> Rule:
    """A rule applying ``action`` to the first ``times`` requests ``when`` selects."""
    left = [times]
    lock = threading.Lock()

    def rule(request: Request) -> Action:
        with lock:
            if left[0] > 0 and when(request):
                left[0] -= 1
                return action
        return Forward()

    return rule


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te",
               "trailer", "upgrade", "proxy-connection"}  # fmt: skip


class S3Proxy:
    """A threaded reverse proxy to ``upstream`` on an ephemeral port of 127.0.0.1."""

    def __init__(self, upstream: EmbeddedS3 | str, rule: Rule = lambda _: Forward()) -> None:
        url = upstream.endpoint_url if isinstance(upstream, EmbeddedS3) else upstream
        parts = urlsplit(url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rule = rule
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closing = False
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy")

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def through(self, server: EmbeddedS3) -> EmbeddedS3:
        """``server`` reached through this proxy: its url(), options and client() use it."""
        return dataclasses.replace(server, endpoint_url=self.endpoint_url)

    def __enter__(self) -> S3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        with self._lock:  # idle keep-alive connections: wake their handler threads with EOF
            self._closing = True
            for sock in self._open:
                _hang_up(sock)
        self._server.server_close()
        self._thread.join()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        return Handler


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or reset


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins every handler thread
    block_on_close = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # resets and hang-ups are the point
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint
    timeout = 60  # a client that vanishes silently cannot pin a thread forever
    owner: S3Proxy

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._open.add(self.connection)
            if self.owner._closing:
                _hang_up(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._open.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass  # the connection was reset on purpose

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest shows stderr of failing tests

    def _any(self) -> None:
        path, _, query = self.path.partition("?")
        body = self._read_body()
        request = Request(
            self.command, path, dict(parse_qsl(query, keep_blank_values=True)), dict(self.headers)
        )
        with self.owner._lock:
            self.owner.requests.append(request)
        action = self.owner.rule(request)
        while isinstance(action, Delay):
            time.sleep(action.seconds)
            action = action.then
        if isinstance(action, CheckThenWrite):
            self._check_then_write(action, body)
        elif isinstance(action, Respond):
            self._answer(action.status, dict(action.headers), action.body)
        elif isinstance(action, Reset) and not action.after_upstream:
            self._reset()
        else:
            status, headers, answer = self._forward(body)
            if isinstance(action, Reset):
                self._reset()
            elif isinstance(action, Truncate):
                self._answer(status, headers, answer, send=action.after_bytes)
                if action.reset:
                    time.sleep(action.pause)
                    self._reset()
                else:
                    self.close_connection = True
                    _hang_up(self.connection)
            else:
                if isinstance(action, Rewrite):
                    answer = action.edit(answer)
                self._answer(status, headers, answer)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _check_then_write(self, action: CheckThenWrite, body: bytes) -> None:
        status, _, _ = self._forward(b"", method="HEAD", drop={"if-none-match"})
        if status == 200:
            error = _s3_error(412, "PreconditionFailed", "At least one of the pre-conditions "
                              "you specified did not hold")  # fmt: skip
            self._answer(error.status, dict(error.headers), error.body)
            return
        action.between()
        status, headers, answer = self._forward(body, drop={"if-none-match"})
        action.after()
        self._answer(status, headers, answer)

    def _forward(
        self, body: bytes, method: str | None = None, drop: frozenset[str] | set[str] = frozenset()
    ) -> tuple[int, dict[str, str], bytes]:
        # The client's Host header is kept: it is part of the SigV4 signature the server checks
        # (moto does not check it: a header dropped, or another method, goes through).
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in _HOP_BY_HOP and k.lower() not in drop}  # fmt: skip
        headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self.owner._upstream, timeout=60)
        try:
            upstream.request(method or self.command, self.path, body, headers)
            response = upstream.getresponse()
            answer = response.read()
            kept = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
            if (method or self.command) == "HEAD":  # no body, but the object's length
                kept["Content-Length"] = response.getheader("Content-Length") or "0"
            return response.status, kept, answer
        finally:
            upstream.close()

    def _answer(self, status: int, headers: dict[str, str], body: bytes, send: int = -1) -> None:
        self.send_response_only(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body if send < 0 else body[:send])
        self.wfile.flush()

    def _reset(self) -> None:
        """Abort the connection with a TCP RST: the client sees 'connection reset by peer'."""
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
