"""Values as the object stores' SDKs write them: the checksum an upload carries, the time an
answer gives."""

from __future__ import annotations

import base64
import time
from datetime import datetime

from ckptstore.checksum import crc32c_of
from ckptstore.driver import Buffer

__all__ = ["crc32c_b64", "timestamp"]


def crc32c_b64(data: Buffer) -> str:
    """The CRC32C of ``data`` as S3 and GCS take it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc32c_of(data).to_bytes(4, "big")).decode("ascii")


def timestamp(value: object) -> float:
    """A time an SDK answered (a datetime), as seconds since the epoch; now if it gave none."""
    return value.timestamp() if isinstance(value, datetime) else time.time()
