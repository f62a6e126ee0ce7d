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
Run as ``python -m ckptstore.tools.moto_atomic -H 127.0.0.1 -p PORT`` (moto.server's options).
"""

from __future__ import annotations

import io
import sys
import threading
from typing import Any


def main(argv: list[str]) -> None:
    """Start moto.server with its WSGI application wrapped in a lock."""
    from moto import server
    from moto.moto_server import werkzeug_app

    handle = werkzeug_app.DomainDispatcherApplication.__call__
    lock = threading.Lock()

    def one_at_a_time(self: Any, environ: dict[str, Any], start_response: Any) -> Any:
        _read_body(environ)
        with lock:
            return handle(self, environ, start_response)

    werkzeug_app.DomainDispatcherApplication.__call__ = one_at_a_time  # type: ignore[method-assign]
    _answer_no_such_upload()
    server.main(argv)


def _answer_no_such_upload() -> None:
    """UploadPart to an unknown (aborted, completed) upload: NoSuchUpload, not a 500."""
    from moto.s3.exceptions import NoSuchUpload
    from moto.s3.models import S3Backend

    upload_part = S3Backend.upload_part

    def checked(self: Any, bucket_name: str, multipart_id: str, part_id: int, value: bytes) -> Any:
        if multipart_id not in self.get_bucket(bucket_name).multiparts:
            raise NoSuchUpload(upload_id=multipart_id)
        return upload_part(self, bucket_name, multipart_id, part_id, value)

    S3Backend.upload_part = checked  # type: ignore[method-assign]


def _read_body(environ: dict[str, Any]) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1:])
