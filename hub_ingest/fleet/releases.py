"""Releases on the hub: signed bundles in the object store (`edge_agent.protocol.release`).

``hub-ingest release publish`` bundles a wheelhouse once, stores it in `RELEASES_BUCKET` and
writes its record, signed with the operators' release key, to `ROLLOUT_BUCKET`. Devices fetch
the bundle chunk by chunk through their leaf link and check it against the record.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import nkeys
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from edge_agent.protocol.release import (
    RELEASES_BUCKET,
    ROLLOUT_BUCKET,
    ReleaseRecord,
    ReleaseRejected,
    check_version,
    release_key,
    sign_record,
    write_bundle,
)
from hub_ingest.core.buckets import bucket_keys, open_bucket
from hub_ingest.core.config import HubConfig
from hub_ingest.core.errors import RolloutError

log = structlog.get_logger(__name__)


def new_release_key(path: Path) -> str:
    """Write a new operators' release key (an operator NKey seed) to `path`, mode 0600, and
    return its public key for the devices' ``update.operator_key``."""
    if path.exists():
        raise RolloutError(f"{path} exists: a release key is never overwritten")
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_OPERATOR)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(seed.decode() + "\n")
    return release_public_key(path)


def release_public_key(path: Path) -> str:
    key: bytes = nkeys.from_seed(bytearray(_seed(path).encode())).public_key
    return key.decode()


def _seed(path: Path) -> str:
    try:
        seed = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise RolloutError(f"cannot read the release key {path}: {exc.strerror}") from None
    if not seed.startswith("SO"):
        raise RolloutError(f"{path} is not an operator seed (SO…): make one with release keygen")
    return seed


async def rollout_bucket(js: JetStreamContext, config: HubConfig) -> KeyValue:
    return await open_bucket(js, ROLLOUT_BUCKET, replicas=config.replicas, direct=True)


async def release_store(js: JetStreamContext, config: HubConfig) -> ObjectStore:
    try:
        return await js.object_store(RELEASES_BUCKET)
    except BucketNotFoundError:
        return await js.create_object_store(
            RELEASES_BUCKET,
            config=ObjectStoreConfig(storage=StorageType.FILE, replicas=config.replicas),
        )


def _wheels(source: Path, version: str) -> list[Path]:
    wheels = sorted(source.glob("*.whl")) if source.is_dir() else [source]
    if not wheels or any(w.suffix != ".whl" or not w.is_file() for w in wheels):
        raise RolloutError(f"{source}: expected a wheel or a directory of wheels")
    agent = f"edge_agent-{version}-"
    if not any(w.name.startswith(agent) for w in wheels):
        raise RolloutError(f"{source} has no {agent}*.whl: build the release {version} first")
    return wheels


async def get_record(kv: KeyValue, version: str) -> ReleaseRecord | None:
    try:
        entry = await kv.get(release_key(version))
    except KeyNotFoundError:
        return None
    return ReleaseRecord.from_json(entry.value or b"")


async def publish(
    js: JetStreamContext, config: HubConfig, source: Path, version: str, key_file: Path
) -> ReleaseRecord:
    """Bundle the wheels at `source` as `version`, store and sign it. Publishing the same
    bundle again is a no-op; another bundle under a published version is refused."""
    try:
        check_version(version)
    except ValueError as exc:
        raise RolloutError(f"--version: {exc}") from None
    seed = _seed(key_file)
    wheels = _wheels(source, version)
    kv = await rollout_bucket(js, config)
    with tempfile.TemporaryFile() as bundle:
        write_bundle(bundle, version, wheels)
        size = bundle.tell()
        bundle.seek(0)
        digest = hashlib.file_digest(bundle, "sha256").hexdigest()
        existing = await get_record(kv, version)
        if existing is not None:
            if existing.sha256 != digest:
                raise RolloutError(
                    f"release {version} is published with another bundle "
                    f"(sha256 {existing.sha256}): publish under a new version"
                )
            return existing
        bundle.seek(0)
        store = await release_store(js, config)
        info = await store.put(version, bundle)
    unsigned = ReleaseRecord(version, size, digest, info.nuid or "", info.chunks or 0, "", "")
    try:
        record = sign_record(unsigned, seed)
    except ValueError as exc:
        raise RolloutError(f"{key_file}: {exc}") from None
    await kv.put(release_key(version), record.to_json())
    log.info("release_published", version=version, size=size, chunks=record.chunks)
    return record


async def list_records(js: JetStreamContext, config: HubConfig) -> list[ReleaseRecord]:
    kv = await rollout_bucket(js, config)
    records = []
    for key in await bucket_keys(js, ROLLOUT_BUCKET, "release.>"):
        try:
            record = await get_record(kv, key.removeprefix("release."))
        except ReleaseRejected:
            continue
        if record is not None:
            records.append(record)
    return records
