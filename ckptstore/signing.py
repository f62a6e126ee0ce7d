"""Signed manifests and epoch records: a reader that trusts a key loads only what it signed.

A store opened with a signing key (``ckptstore.open(url, signing_key=PATH)``, or the
``CKPTSTORE_SIGNING_KEY`` environment variable) signs each manifest it publishes and each
epoch record it takes, with Ed25519 (RFC 8032, through ``cryptography``). A store opened with
trusted public keys (``trust=[PATH, ...]``, or ``CKPTSTORE_TRUST``: paths separated by
``os.pathsep``) refuses, with ``UntrustedCheckpointError``, a manifest that is unsigned, signed
by a key it does not trust, or whose signature does not match, and a signed manifest that
does not give every shard a cryptographic digest; readers check every byte against those
digests (``ckptstore.digest``). Why Ed25519 and what it proves: docs/protocol.md §10.

The signature covers the signed payload: a domain tag, the kind of document, and the canonical
JSON (sorted keys, no whitespace, UTF-8) of the document as stored, without its ``checksum``
and ``signature`` fields. The reader computes it from the document it parsed, never from a
re-encoding of its own, so what it checks is exactly what it then uses.

Keys are files: a private key as PKCS#8 PEM (``ckptstore keygen`` writes one, mode 0600, and
its public key beside it), public keys as SubjectPublicKeyInfo PEM, several to a file if
wanted (key rotation: trust the old and the new key while both sign). A key's value is never
printed, logged or put in an error; its id (``ed25519:`` and 16 hex digits of the SHA-256 of
the public key) is.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

from ckptstore.errors import BackendUnavailableError, InvalidOptionError, UntrustedCheckpointError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "SIGNING_KEY_ENV",
    "TRUST_ENV",
    "Signature",
    "SigningKey",
    "Trust",
    "generate_key",
    "signed_payload",
    "signing_key_from",
    "trust_from",
]

SIGNING_KEY_ENV = "CKPTSTORE_SIGNING_KEY"
TRUST_ENV = "CKPTSTORE_TRUST"
_DOMAIN = b"ckptstore.signed.v1\0"
_MAX_KEY_FILE = 1024 * 1024
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z ]+)-----.+?-----END \1-----", re.DOTALL)
_KEY_ID = re.compile(r"ed25519:[0-9a-f]{16}")


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise BackendUnavailableError(
            "signed checkpoints need the cryptography package: pip install 'ckptstore[trust]'"
        ) from exc
    return serialization, ed25519


@dataclass(frozen=True)
class Signature:
    """An Ed25519 signature of a document's signed payload, and the id of the signing key."""

    key_id: str
    value: bytes

    def to_document(self) -> dict[str, str]:
        """The ``signature`` field of a signed document."""
        return {"key": self.key_id, "ed25519": base64.b64encode(self.value).decode("ascii")}

    @classmethod
    def from_document(cls, entry: object) -> Signature:
        """Parse a ``signature`` field (ValueError if malformed)."""
        if not isinstance(entry, dict) or set(entry) != {"key", "ed25519"}:
            raise ValueError("signature must be an object with 'key' and 'ed25519'")
        key, value = entry["key"], entry["ed25519"]
        if not isinstance(key, str) or not _KEY_ID.fullmatch(key) or not isinstance(value, str):
            raise ValueError("signature has a malformed key id or value")
        try:
            raw = base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"signature value is not base64: {exc}") from exc
        if len(raw) != 64:
            raise ValueError(f"an Ed25519 signature has 64 bytes, this one {len(raw)}")
        return cls(key, raw)


def signed_payload(kind: str, document: Mapping[str, Any]) -> bytes:
    """The bytes a signature of ``document`` (a manifest, an epoch record) covers."""
    body = {key: value for key, value in document.items() if key not in ("checksum", "signature")}
    canonical = json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return _DOMAIN + kind.encode("ascii") + b"\0" + canonical.encode("utf-8")


def _key_id(public: Ed25519PublicKey) -> str:
    serialization, _ = _crypto()
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


class SigningKey:
    """An Ed25519 private key that signs payloads; its value is never shown."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.key_id = _key_id(private.public_key())

    def __repr__(self) -> str:
        return f"<SigningKey {self.key_id}>"

    def sign(self, payload: bytes) -> Signature:
        """Sign ``payload``."""
        return Signature(self.key_id, self._private.sign(payload))

    def public_key(self) -> Ed25519PublicKey:
        """The public key that checks this key's signatures."""
        return self._private.public_key()

    def public_pem(self) -> bytes:
        """The public key as SubjectPublicKeyInfo PEM (a file ``trust`` reads)."""
        serialization, _ = _crypto()
        pem: bytes = self.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return pem

    def private_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (``ckptstore keygen`` writes it 0600)."""
        serialization, _ = _crypto()
        pem: bytes = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return pem


def generate_key() -> SigningKey:
    """A new random Ed25519 signing key."""
    _, ed25519 = _crypto()
    return SigningKey(ed25519.Ed25519PrivateKey.generate())


SigningKeyLike: TypeAlias = "SigningKey | Ed25519PrivateKey | str | os.PathLike[str]"
TrustLike: TypeAlias = "Trust | Iterable[Ed25519PublicKey | SigningKey | str | os.PathLike[str]]"


def _key_text(value: str) -> str | None:
    """``value`` as a PEM key's text, if it is one (quotes, a BOM and blanks around it taken
    off, as ``.env`` files and shells leave them), else None: a path."""
    text = value.strip().lstrip("\ufeff").strip().strip("\"'").strip()
    return text if text.startswith("-----BEGIN") else None


def _shown(value: str) -> str:
    """A path as an error may show it: never a key's text given where a path was expected."""
    looks_like_a_key = "-----" in value or "PRIVATE" in value or "\n" in value
    if looks_like_a_key or len(value) > 4096:
        return "(a value that is not a path: not shown, it may be a key)"
    return repr(value)


def _read_key_file(path: str | os.PathLike[str], what: str) -> bytes:
    """A key file's bytes: a regular file (a symbolic link is followed: secrets are mounted
    so), opened without blocking, at most 1 MiB."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    shown = _shown(os.fspath(path))
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InvalidOptionError(f"{what} {shown} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidOptionError(f"{what} {shown} is not a regular file")
        if info.st_size > _MAX_KEY_FILE:
            raise InvalidOptionError(f"{what} {shown} is larger than a key file can be")
        with os.fdopen(fd, "rb", closefd=False) as stream:
            return stream.read(_MAX_KEY_FILE + 1)
    finally:
        os.close(fd)


def _private_from_pem(data: bytes, what: str) -> Ed25519PrivateKey:
    serialization, ed25519 = _crypto()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:  # the message never holds the key's bytes
        raise InvalidOptionError(
            f"{what} is not an unencrypted PEM private key ({type(exc).__name__}); "
            f"`ckptstore keygen` makes one"
        ) from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise InvalidOptionError(f"{what} is a {type(key).__name__}, not an Ed25519 key")
    return cast("Ed25519PrivateKey", key)


def signing_key_from(source: SigningKeyLike | Literal[False] | None) -> SigningKey | None:
    """The signing key ``source`` names (a key, or the path of a PEM file), or, for None, the
    one ``CKPTSTORE_SIGNING_KEY`` names (a path; None if unset or empty); False: none, whatever
    the environment says."""
    if source is False:
        return None
    if source is None:
        value = os.environ.get(SIGNING_KEY_ENV, "")
        if not value.strip():
            return None
        text = _key_text(value)
        if text is not None:  # the key itself: accepted, never shown
            return SigningKey(_private_from_pem(text.encode(), f"${SIGNING_KEY_ENV}"))
        data = _read_key_file(value, f"${SIGNING_KEY_ENV}")
        return SigningKey(_private_from_pem(data, f"${SIGNING_KEY_ENV} {_shown(value)}"))
    if isinstance(source, SigningKey):
        return source
    _, ed25519 = _crypto()
    if isinstance(source, ed25519.Ed25519PrivateKey):
        return SigningKey(source)
    if isinstance(source, str) and _key_text(source) is not None:  # the key's text
        return SigningKey(_private_from_pem(str(_key_text(source)).encode(), "signing key"))
    if isinstance(source, (str, os.PathLike)):
        where = f"signing key {_shown(os.fspath(source))}"
        return SigningKey(_private_from_pem(_read_key_file(source, "signing key"), where))
    raise InvalidOptionError(
        f"signing_key must be a key file's path or an Ed25519 private key, got "
        f"{type(source).__name__}"
    )


class Trust:
    """The public keys whose signatures a reader accepts (several at once: key rotation)."""

    def __init__(self, keys: Iterable[Ed25519PublicKey]) -> None:
        self.keys: dict[str, Ed25519PublicKey] = {_key_id(key): key for key in keys}
        if not self.keys:
            raise InvalidOptionError(
                "trust names no key: give at least one public key (an empty trust would "
                "refuse every checkpoint)"
            )

    def __repr__(self) -> str:
        return f"<Trust {', '.join(sorted(self.keys))}>"

    def check(self, signature: Signature | None, payload: bytes, *, what: str, **where: Any) -> str:
        """The id of the trusted key that signed ``payload``; UntrustedCheckpointError
        saying why not (``what`` names the document in the message)."""
        if signature is None:
            raise UntrustedCheckpointError(f"{what} is not signed", reason="unsigned", **where)
        key = self.keys.get(signature.key_id)
        if key is None:
            raise UntrustedCheckpointError(
                f"{what} is signed by {signature.key_id}, which is not trusted (trusted: "
                f"{', '.join(sorted(self.keys))})",
                reason="untrusted-key",
                **where,
            )
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(signature.value, payload)
        except InvalidSignature:
            raise UntrustedCheckpointError(
                f"{what}: its signature by {signature.key_id} does not match its contents "
                f"(changed after it was signed)",
                reason="bad-signature",
                **where,
            ) from None
        return signature.key_id


def _public_keys_from(data: bytes, what: str) -> list[Ed25519PublicKey]:
    serialization, ed25519 = _crypto()
    blocks = [match.group(0) for match in _PEM_BLOCK.finditer(data)]
    keys = []
    for block in blocks:
        if b"PRIVATE KEY" in block.split(b"\n", 1)[0]:
            raise InvalidOptionError(
                f"{what} holds a private key: trust takes public keys (the .pub file "
                f"`ckptstore keygen` wrote)"
            )
        try:
            key = serialization.load_pem_public_key(block)
        except (ValueError, TypeError):
            raise InvalidOptionError(f"{what}: a PEM block is not a public key") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise InvalidOptionError(f"{what}: {type(key).__name__} is not an Ed25519 key")
        keys.append(key)
    if not keys:
        raise InvalidOptionError(f"{what} holds no PEM public key")
    return keys


def trust_from(source: TrustLike | Literal[False] | None) -> Trust | None:
    """The trust ``source`` gives (public keys, signing keys, paths of PEM files), or, for
    None, the one ``CKPTSTORE_TRUST`` names (paths separated by ``os.pathsep``; None if unset);
    False: none, whatever the environment says. An empty list, or a set but empty variable,
    is refused: it would trust nothing."""
    if source is False:
        return None
    if source is None:
        if TRUST_ENV not in os.environ:
            return None
        paths = [part for part in os.environ[TRUST_ENV].split(os.pathsep) if part]
        if not paths:
            raise InvalidOptionError(f"${TRUST_ENV} is set but names no public key file")
        source = paths
    if isinstance(source, Trust):
        return source
    _, ed25519 = _crypto()
    if isinstance(source, (str, os.PathLike, SigningKey, ed25519.Ed25519PublicKey)):
        source = [source]  # one key, or one file
    keys: list[Ed25519PublicKey] = []
    for item in source:
        if isinstance(item, SigningKey):
            keys.append(item.public_key())
        elif isinstance(item, ed25519.Ed25519PublicKey):
            keys.append(item)
        elif isinstance(item, str) and _key_text(item) is not None:  # a key's text
            keys.extend(_public_keys_from(str(_key_text(item)).encode(), "a trusted key"))
        elif isinstance(item, (str, os.PathLike)):
            where = f"trusted key {_shown(os.fspath(item))}"
            keys.extend(_public_keys_from(_read_key_file(item, "trusted key"), where))
        else:
            raise InvalidOptionError(
                f"trust takes public keys or paths of PEM files, got {type(item).__name__}"
            )
    return Trust(keys)


def write_key_pair(key: SigningKey, path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``key`` to ``path`` (created, mode 0600; never over an existing file) and its
    public key to ``path.pub``; return both paths."""
    private = Path(path)
    public = private.with_name(private.name + ".pub")
    for target in (private, public):
        if target.exists() or target.is_symlink():
            raise InvalidOptionError(f"{str(target)!r} exists: keygen never overwrites a key")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(private, flags, 0o600)
    with os.fdopen(fd, "wb") as stream:
        stream.write(key.private_pem())
    fd = os.open(public, flags, 0o644)
    with os.fdopen(fd, "wb") as stream:
        stream.write(key.public_pem())
    return private, public
