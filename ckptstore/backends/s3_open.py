"""Opening an ``s3://`` or ``s3+versioned://`` store (docs/backends/s3.md): the URL and its
options, the boto3 client shared by equal options, ``S3Driver`` under the commit strategy; and
``install_abort_incomplete_uploads_rule``, which reads a URL as opening does.

The driver module, ``ckptstore.backends.s3``, imports none of this and still serves its names.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError

from ckptstore.backends.client_cache import ClientCache
from ckptstore.backends.s3 import S3_MIN_PART_SIZE, S3Driver
from ckptstore.backends.s3_errors import translate_s3_errors
from ckptstore.backends.transfer_options import (
    TRANSFER_OPTIONS,
    TransferOptions,
    bucket_of,
    refuse_credentials_in_url,
)
from ckptstore.commit.conditional_put import DEFAULT_READ_RANGE_SIZE, ConditionalPutCommit
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.errors import InvalidOptionError, InvalidURLError, StorageError
from ckptstore.urls import StoreURL, endpoint_option, option_int

__all__ = [
    "CREDENTIAL_OPTIONS",
    "URL_OPTIONS",
    "install_abort_incomplete_uploads_rule",
    "make_client",
    "open_s3",
    "open_s3_versioned",
    "parse_location",
]

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

URL_OPTIONS = (
    *TRANSFER_OPTIONS,
    "region",
    "profile",
    "addressing_style",
    "sse",
    "sse_kms_key_id",
    "read_concurrency",
    "read_range_size",
)
CREDENTIAL_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_CLIENT_OPTIONS = frozenset(
    {"endpoint_url", "region", "profile", "addressing_style", "concurrency", "connect_timeout",
     "read_timeout", *CREDENTIAL_OPTIONS}
)  # fmt: skip


_SECRET_ENVIRONMENT = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_clients: ClientCache[Any] = ClientCache(
    _CLIENT_OPTIONS,
    (*CREDENTIAL_OPTIONS, *_SECRET_ENVIRONMENT),
    disconnect=lambda client: client.close(),
    environment=(
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        *_SECRET_ENVIRONMENT,
    ),
)
"""boto3 clients by their options (``ckptstore.backends.client_cache``)."""


def make_client(options: Mapping[str, object]) -> Any:
    """A boto3 S3 client from options, shared by stores opened with the same options.

    Credentials come from boto3's standard chain unless given explicitly. botocore's own
    retries are off: ckptstore retries (tenacity) only what is safe to retry.
    """
    return _clients.get(options, lambda: _new_client(options))


def _new_client(options: Mapping[str, object]) -> Any:
    addressing = str(options.get("addressing_style", "auto"))
    if addressing not in ("auto", "path", "virtual"):
        raise InvalidOptionError(
            f"addressing_style must be auto, path or virtual, not {addressing}"
        )
    transfer = TransferOptions.read(options, min_part_size=S3_MIN_PART_SIZE)
    config = Config(
        s3={"addressing_style": addressing},
        # One attempt in all: botocore's ``max_attempts`` counts retries and 1 would resend a
        # conditional put blindly (a lost answer then comes back as a 412 for our own write).
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=transfer.connect_timeout,
        read_timeout=transfer.read_timeout,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        max_pool_connections=transfer.pool_size,
    )
    endpoint = endpoint_option(options) or None
    given = [name for name in CREDENTIAL_OPTIONS if options.get(name)]
    if given and not {"aws_access_key_id", "aws_secret_access_key"} <= set(given):
        # botocore fails on half a key pair with a TypeError of its own; named, never shown
        raise InvalidOptionError(
            f"{', '.join(given)} given without "
            f"{' and '.join(n for n in CREDENTIAL_OPTIONS[:2] if n not in given)}: an access key "
            f"is aws_access_key_id and aws_secret_access_key together (aws_session_token "
            f"with both); or pass none, and the AWS credential chain is used"
        )
    try:
        session = boto3.session.Session(
            profile_name=str(options["profile"]) if options.get("profile") else None,
            region_name=str(options["region"]) if options.get("region") else None,
            **{k: str(options[k]) for k in CREDENTIAL_OPTIONS if options.get(k)},
        )
        return session.client("s3", endpoint_url=endpoint, config=config)
    except (ValueError, BotoCoreError) as exc:
        # A malformed endpoint_url or region, an unknown profile: a bad option, not a crash.
        raise InvalidOptionError(f"s3:// client options: {exc}") from exc


def parse_location(url: StoreURL) -> tuple[str, str]:
    """Bucket and prefix of an s3:// URL, validated."""
    bucket = bucket_of(url, "an s3:// URL", "the AWS credential chain")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise InvalidURLError(f"{url.shown}: {bucket!r} is not a valid S3 bucket name")
    return bucket, url.path.strip("/")


def open_s3(url: StoreURL, options: Mapping[str, object]) -> ConditionalPutCommit:
    """Open an ``s3://bucket/prefix`` store: S3Driver + ConditionalPutCommit."""
    return _s3_store(ConditionalPutCommit, url, options, versioned=False)


def open_s3_versioned(url: StoreURL, options: Mapping[str, object]) -> VersionPinCommit:
    """Open an ``s3+versioned://bucket/prefix`` store: S3Driver + VersionPinCommit.

    The bucket must have versioning enabled; opening checks and refuses otherwise.
    """
    return _s3_store(VersionPinCommit, url, options, versioned=True)


Commit = TypeVar("Commit", ConditionalPutCommit, VersionPinCommit)


def _s3_store(
    commit: type[Commit], url: StoreURL, options: Mapping[str, object], *, versioned: bool
) -> Commit:
    """``commit`` over an S3Driver, reading a large shard as ``read_concurrency`` ranged GETs
    at once (default: the upload ``concurrency``) of ``read_range_size`` bytes each (default
    16 MiB)."""
    driver, part_size, concurrency = _s3_driver(url, options, versioned=versioned)
    return commit(
        driver,
        part_size=part_size,
        concurrency=concurrency,
        read_concurrency=option_int(options, "read_concurrency", concurrency, minimum=1),
        read_range_size=option_int(options, "read_range_size", DEFAULT_READ_RANGE_SIZE, minimum=1),
    )


def _s3_driver(
    url: StoreURL, options: Mapping[str, object], *, versioned: bool
) -> tuple[S3Driver, int, int]:
    refuse_credentials_in_url(url, CREDENTIAL_OPTIONS, "the AWS credential chain")
    url.reject_unknown(options, allowed=URL_OPTIONS + CREDENTIAL_OPTIONS)
    bucket, prefix = parse_location(url)
    transfer = TransferOptions.read(options, min_part_size=S3_MIN_PART_SIZE)
    lease = _clients.lease(options, lambda: _new_client(options))
    driver = S3Driver(
        lease.client,
        bucket,
        prefix,
        url=f"{url.scheme}://{bucket}/{prefix}".rstrip("/"),
        min_part_size=transfer.min_part_size,
        sse=str(options["sse"]) if options.get("sse") else None,
        sse_kms_key_id=str(options["sse_kms_key_id"]) if options.get("sse_kms_key_id") else None,
        checksums=transfer.checksums,
        max_attempts=transfer.max_attempts,
        versioned=versioned,
    )
    driver.on_close(lease.release)  # the store's close lets go of the client's connections
    return driver, transfer.part_size, transfer.concurrency


def install_abort_incomplete_uploads_rule(
    url: str, *, days: int = 7, **options: object
) -> dict[str, Any]:
    """Add (or replace) the bucket lifecycle rule that aborts incomplete multipart uploads
    under the store's prefix after ``days``; other rules are kept. Returns the rule.

    ``url`` and ``options`` are read as opening the store reads them (``open_s3``): the same
    refusal of credentials in the URL, of unknown options, and the same client.
    """
    from ckptstore.urls import parse_url

    parsed = parse_url(url)
    if parsed.scheme not in ("s3", "s3+versioned"):
        raise InvalidURLError(f"{parsed.shown}: lifecycle rules apply to s3:// stores")
    driver = _s3_driver(
        parsed, {**parsed.query, **options}, versioned=parsed.scheme == "s3+versioned"
    )[0]
    try:
        client, bucket, prefix = driver.client, driver.bucket, driver.prefix.rstrip("/")
        rule_id = (
            f"ckptstore-abort-incomplete-uploads-{hashlib.sha1(prefix.encode()).hexdigest()[:10]}"
        )
        rule = {
            "ID": rule_id,
            "Status": "Enabled",
            "Filter": {"Prefix": f"{prefix}/" if prefix else ""},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": days},
        }
        what = f"lifecycle of s3://{bucket}"
        try:
            with translate_s3_errors(f"GetBucketLifecycleConfiguration {what}", bucket=bucket):
                rules = client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
        except StorageError as exc:
            if "NoSuchLifecycleConfiguration" not in str(exc):
                raise
            rules = []
        rules = [r for r in rules if r.get("ID") != rule_id] + [rule]
        with translate_s3_errors(f"PutBucketLifecycleConfiguration {what}", bucket=bucket):
            client.put_bucket_lifecycle_configuration(
                Bucket=bucket, LifecycleConfiguration={"Rules": rules}
            )
        return rule
    finally:
        driver.close()  # its lease on the client
