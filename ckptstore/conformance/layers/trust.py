"""Signed checkpoints on this storage: a reader that trusts a key never loads a forgery (I6).

A writer with a signing key saves checkpoints; a forger with write access to the storage (and no
key) then changes them behind the store's back, one attack per checkpoint: a shard's bytes
replaced (the manifest left as signed), a shard replaced with its CRC32Cs, its digests and the
manifest's checksum recomputed (the stale signature kept), the manifest's metadata edited, the
signature stripped, and a validly signed manifest of another step copied over a newer one's. A
reader that trusts the writer's key must refuse each one (an ``IntegrityError``: never the
forged bytes, never the forged manifest), and ``latest(verified=True)`` must return the one
intact checkpoint. Then a takeover written without the key, and one signed by another key: a
trusting reader must refuse to read the store's history at all. What the storage does matters
here: a store that serves a stale manifest, or hides a write, could make a refused forgery look
accepted or the reverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ckptstore.checkpoint import Checkpoint
from ckptstore.checksum import crc32c_hex
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.location import Location
from ckptstore.conformance.outcomes import storage_failure
from ckptstore.digest import BlockDigests
from ckptstore.errors import CapabilityError, CkptStoreError, IntegrityError
from ckptstore.manifest import ShardRecord
from ckptstore.signing import Trust, generate_key
from ckptstore.store import Store

__all__ = ["ATTACKS", "INVARIANTS", "run_layer"]

INVARIANTS = ("I6",)
_SHARD = "model/rank_0.pt"
_DATA = bytes(range(256)) * 64  # 16 KiB: one block

ATTACKS = (
    "shard bytes replaced",
    "shard replaced, its CRC32Cs, digests and checksum recomputed",
    "manifest metadata edited",
    "signature stripped",
    "manifest replayed from another step",
)
"""The manifest-level attacks, one per checkpoint (steps 2, 3, ...; step 1 stays intact)."""


def run_layer(run: SuiteRun, found: Findings) -> None:
    """Every attack on a fresh location of ``run``'s target, then the two forged takeovers."""
    cases = 0
    impossible: list[str] = []
    for attack in (_attack_checkpoints, _attack_epochs):
        location = run.locations()
        try:
            cases += attack(location, found, impossible)
        except CapabilityError as exc:
            found.not_applicable.setdefault("I6", f"the store refused to save: {exc}")
            return
        except CkptStoreError as exc:
            failure = storage_failure(exc)
            if failure is None:
                raise
            found.storage_error(INVARIANTS, f"trust: {type(failure).__name__}: {failure}")
            return
        finally:
            location.destroy()
    found.check(*INVARIANTS)
    made = [a for a in ATTACKS if not any(i.startswith(f"{a} (") for i in impossible)]
    found.coverage["trust"] = (
        f"{cases} forgeries by a writer without the key, each refused by a reader that trusts "
        f"it: {', '.join(made)}; a takeover unsigned, and signed by another key"
        + "".join(f"; not possible here: {what}" for what in impossible)
    )


def _attack_checkpoints(location: Location, found: Findings, impossible: list[str]) -> int:
    """The manifest-level attacks, one per checkpoint; how many were made (one this storage
    rules out is added to ``impossible``, with why, and its checkpoint is not judged)."""
    key = generate_key()
    trust = Trust([key.public_key()])
    writer, _ = location.open(signing_key=key)
    steps = range(1, len(ATTACKS) + 2)
    for step in steps:
        with writer.begin(step, metadata={"lr": 0.1}) as pending:
            pending.write(_SHARD, _DATA)
            pending.write("trainer_state.json", b'{"step": %d}' % step)
    forger = location.base
    done = 0
    untouched = {1}
    for step, attack in zip(steps[1:], ATTACKS, strict=True):
        manifest = forger.read_manifest(step)
        record = manifest.shard(_SHARD)
        assert record is not None
        done += 1
        if attack == "shard bytes replaced":
            if location.corrupt(step, _SHARD, "bitflip") is None:
                done -= 1
                untouched.add(step)
                impossible.append(f"{attack} (a pinned version can be neither changed nor deleted)")
        elif attack == "shard replaced, its CRC32Cs, digests and checksum recomputed":
            forged = bytes([_DATA[0] ^ 1]) + _DATA[1:]
            if "version_id" in record.locator:  # a new version, and the manifest pins it
                info = forger.driver.put(record.locator["key"], forged)
                pinned = {**record.locator, "version_id": str(info.version_id)}
                if "etag" in pinned:
                    pinned["etag"] = info.etag
                record = dataclasses.replace(record, locator=pinned)
            elif location.corrupt(step, _SHARD, "bitflip") == "bitflip":
                with forger.open_shard_reader(manifest, record) as stream:
                    forged = stream.read()  # what the forger wrote, read back
            digests = BlockDigests(record.digest_algorithm or "sha256", record.block_size)
            digests.update(forged)
            digests.finish()
            shard = dataclasses.replace(
                record,
                crc32c=crc32c_hex(forged),
                block_crc32c=crc32c_hex(forged),
                digest=f"{digests.algorithm}:{digests.hexdigest()}",
                block_digests=digests.block_hexdigests(),
            )
            edited = dataclasses.replace(manifest, shards=_with(manifest.shards, shard))
            location.replace_manifest(step, edited.encode())
        elif attack == "manifest metadata edited":
            edited = dataclasses.replace(manifest, metadata={"lr": 10.0})
            location.replace_manifest(step, edited.encode())
        elif attack == "signature stripped":
            location.replace_manifest(step, dataclasses.replace(manifest, signature=None).encode())
        else:
            location.replace_manifest(step, forger.read_manifest(1).encode())
    reader, _ = location.open(trust=trust)
    for step, attack in zip(steps[1:], ATTACKS, strict=True):
        if step in untouched:
            continue  # not forged: nothing to refuse
        accepted = _loads(reader, step)
        if accepted is not None:
            found.violated(
                "I6",
                f"trust: {attack} (step {step}): a reader that trusts only the writer's key "
                f"{accepted}",
            )
    checkpoint = _quietly(lambda: reader.latest(verified=True))
    newest = max(untouched)
    if checkpoint is None or checkpoint.step != newest:
        found.violated(
            "I6",
            f"trust: latest(verified=True) returned "
            f"{'nothing' if checkpoint is None else f'step {checkpoint.step}'}, not step "
            f"{newest}, the newest checkpoint no forger touched",
        )
    return done


def _attack_epochs(location: Location, found: Findings, impossible: list[str]) -> int:
    key, stranger = generate_key(), generate_key()
    trust = Trust([key.public_key()])
    writer, _ = location.open(signing_key=key)
    with writer.begin(1) as pending:
        pending.write(_SHARD, _DATA)
    writer.take_over(1)  # signed: trusted
    reader, _ = location.open(trust=trust)
    if _quietly(reader.latest) is None:
        found.violated("I6", "trust: a takeover signed with the trusted key hid the checkpoint")
    cases = 0
    for taker_key, what in ((None, "unsigned"), (stranger, "signed by another key")):
        taker, _ = location.open(signing_key=taker_key)
        taker.take_over(1)
        cases += 1
        reader, _ = location.open(trust=trust)
        try:
            reader.latest()
        except IntegrityError:
            continue
        found.violated(
            "I6",
            f"trust: a takeover {what}: a reader that trusts only the writer's key read the "
            f"store's history through it",
        )
        break
    return cases


def _loads(reader: Store, step: int) -> str | None:
    """What a trusting reader let through of checkpoint ``step``, or None if it refused."""
    try:
        checkpoint = reader.get(step)
        for name in checkpoint.names:
            checkpoint.read(name)
    except IntegrityError:
        return None
    if step in reader.steps():
        return "read every shard of it and lists it"
    return "read every shard of it"


def _quietly(call: Callable[[], Checkpoint | None]) -> Checkpoint | None:
    """``call()``, or None where it raises an IntegrityError (a refusal)."""
    try:
        return call()
    except IntegrityError:
        return None


def _with(shards: tuple[ShardRecord, ...], shard: ShardRecord) -> tuple[ShardRecord, ...]:
    return tuple(shard if s.name == shard.name else s for s in shards)
