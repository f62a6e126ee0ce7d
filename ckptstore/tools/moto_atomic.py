"""moto's S3 server handling one request at a time, so that its conditional writes are atomic.

moto checks ``If-None-Match`` and ``If-Match`` and then writes, in two steps, and its server
answers requests in threads: two racing conditional creates of one key can both pass the check
(the conformance suite's races layer saw two writers told they published one step on
``s3+versioned://``). S3 evaluates the condition atomically with the write, which is what
ckptstore relies on (docs/protocol.md §2) and what the embedded server stands in for. Every
request is therefore handled under one lock; moto is fast enough that tests do not notice.
A request's body is read whole before the lock is taken: a client that stalls or dies while
it sends a body (a crash-injected upload, a killed process whose socket lingers) holds up
nothing but its own request, never every other client of the server.
An ``UploadPart`` to an upload that was aborted (GC of a dead writer's upload) is answered
``NoSuchUpload`` (404), as S3 answers it; moto's own server answers 500 (a KeyError), which a
client retries as a transient failure for seconds.

All of it is a WSGI middleware around moto's S3 application (nothing of moto is patched; the
NoSuchUpload answer is moto's own, to a ``ListParts`` of the same upload asked after moto
failed the ``UploadPart``), served by cheroot, which keeps connections alive as S3 does.
Run as ``python -m ckptstore.tools.moto_atomic -H 127.0.0.1 -p PORT``.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
App = Callable[[Environ, StartResponse], Iterable[bytes]]


class OneAtATime:
    """A WSGI application that reads each request's body, then runs ``app`` under one lock;
    an UploadPart that moto fails (its server would answer 500) gets moto's answer to a
    ListParts of the same upload instead when that answer is a 404 (NoSuchUpload)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        _read_body(environ)
        with self.lock:
            try:
                status, headers, body = _call(self.app, environ)
            except Exception:  # moto's app raises (a KeyError) where its server answers 500
                if not _is_upload_part(environ):
                    raise
                status, headers, body = _call(self.app, _list_parts(environ))
                if not status.startswith("404"):  # the upload exists: not that failure
                    raise
        start_response(status, headers)
        return [body]


def _call(app: App, environ: Environ) -> tuple[str, list[tuple[str, str]], bytes]:
    """Run ``app`` on ``environ`` to the end: its status, headers and whole body."""
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
        answer["status"], answer["headers"] = status, headers

    chunks = app(environ, start_response)
    try:
        body = b"".join(chunks)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    return answer["status"], answer["headers"], body


def _is_upload_part(environ: Environ) -> bool:
    query = parse_qs(environ.get("QUERY_STRING", ""))
    return environ.get("REQUEST_METHOD") == "PUT" and "uploadId" in query and "partNumber" in query


def _list_parts(environ: Environ) -> Environ:
    """A ListParts request of the upload an UploadPart ``environ`` names."""
    upload = parse_qs(environ.get("QUERY_STRING", ""))["uploadId"][0]
    probe = {key: value for key, value in environ.items() if not key.startswith("CONTENT_")}
    probe.update(
        REQUEST_METHOD="GET",
        QUERY_STRING=f"uploadId={upload}",
        CONTENT_LENGTH="0",
    )
    probe["wsgi.input"] = io.BytesIO(b"")
    return probe


def _read_body(environ: Environ) -> None:
    """Replace the request's input stream by its whole body, read now."""
    stream = environ.get("wsgi.input")
    if stream is None:
        return
    length = environ.get("CONTENT_LENGTH") or ""
    if length.isdigit():
        body = stream.read(int(length)) if int(length) else b""
    elif environ.get("wsgi.input_terminated"):
        body = stream.read()  # chunked: the server ends the stream with the body
    else:
        return  # no body
    environ["wsgi.input"] = io.BytesIO(body)


def _open_files_to_the_hard_limit() -> None:
    """Raise this process's limit of open files to the hard limit: moto keeps an object larger
    than its key buffer in a temporary file, open for as long as the object exists, and copies
    every object of a bucket to list its versions. At a soft limit of 1024 a long session's
    bucket ran out of descriptors: moto answered 500 and stopped accepting connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 16 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # a limit the kernel caps lower (nr_open): keep the soft
            pass


def main(argv: list[str]) -> None:
    """Serve moto's S3 on ``-H HOST -p PORT``, keeping each client's connections alive.

    ``moto.server`` serves every service of moto through a dispatcher that scans moto's package
    directory per request, with werkzeug's development server, which closes each connection
    after one request and then waits 10 ms to drain it. A new TCP connection and thread per
    request were about a third of a request's time: moto's S3 application is served alone, by
    cheroot (a production WSGI server, keep-alive, a thread pool that grows on demand).
    """
    from cheroot.wsgi import Server
    from moto.moto_server.werkzeug_app import create_backend_app

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # moto's own URLs name this port
    _open_files_to_the_hard_limit()
    server = Server(
        (args.host, args.port),
        OneAtATime(create_backend_app("s3")),
        numthreads=8,
        max=-1,  # a client stalled in its body holds one thread, never the server
        timeout=120,  # an idle connection is closed after that (S3 closes them after 20 s)
        request_queue_size=128,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.start()
    finally:
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
