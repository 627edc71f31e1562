"""A release bundle fetched through the leaf link, chunk by chunk, resumably and throttled.

Each chunk is one JetStream direct get on the hub's object store stream (``next_by_subj``
from the sequence after the last chunk kept), so one chunk at most is in flight: commands and
telemetry share the link with at most one 128 KiB message, and `max_rate` spaces the chunks
further. A chunk is appended to ``<version>.part`` and fsynced before the progress file says
it is there, so a cut link, a SIGKILL or a power cut resumes at the first chunk not kept and
no chunk is fetched twice. The finished file must have the record's size and sha256.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from pathlib import Path

import structlog
from nats.aio.client import Client

from edge_agent.protocol.files import read_json, write_json
from edge_agent.protocol.release import RELEASES_BUCKET, ReleaseRecord, ReleaseRejected
from edge_agent.update.paths import Progress, UpdatePaths

log = structlog.get_logger(__name__)

REQUEST_TIMEOUT_S = 10.0  # one chunk over a slow link: 128 KiB at 256 kbit/s is 4 s


class HubReadUnavailable(Exception):
    """The hub did not answer a read (a chunk, the wanted release: its stream has no leader,
    …): retried later."""


async def download(
    nc: Client,
    api_prefix: str,
    paths: UpdatePaths,
    record: ReleaseRecord,
    *,
    max_rate: int,
    on_progress: Callable[[Progress], Awaitable[None]],
) -> Path:
    """The verified bundle of `record`, fetched from where an earlier attempt stopped."""
    bundle = paths.bundle(record.version)
    if bundle.exists():
        return bundle
    progress = _resume(paths, record)
    part = paths.part(record.version)
    subject = f"{api_prefix}.DIRECT.GET.OBJ_{RELEASES_BUCKET}"
    chunks = f"$O.{RELEASES_BUCKET}.C.{record.nuid}"
    started, taken = time.monotonic(), 0
    with part.open("ab") as out:
        while progress.received < record.size:
            request = json.dumps({"seq": progress.next_seq, "next_by_subj": chunks}).encode()
            reply = await nc.request(subject, request, timeout=REQUEST_TIMEOUT_S)
            headers = reply.headers or {}
            if headers.get("Status") == "404":
                raise ReleaseRejected(
                    f"release {record.version}: the bundle ends after {progress.received} "
                    f"bytes, short of the {record.size} its record says"
                )
            if headers.get("Status") or "Nats-Sequence" not in headers:
                raise HubReadUnavailable(f"no chunk from seq {progress.next_seq}: {headers}")
            data = reply.data
            progress = replace(progress, fetched=progress.fetched + len(data))
            if progress.received + len(data) > record.size:
                raise ReleaseRejected(
                    f"release {record.version}: the bundle is longer than its record says "
                    f"({record.size} bytes)"
                )
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
            progress = replace(
                progress,
                next_seq=int(headers["Nats-Sequence"]) + 1,
                received=progress.received + len(data),
            )
            write_json(paths.progress(record.version), asdict(progress))
            await on_progress(progress)
            taken += len(data)
            if max_rate > 0:  # keep the average at or below max_rate
                await asyncio.sleep(max(0.0, started + taken / max_rate - time.monotonic()))
    _check(part, record)
    part.replace(bundle)
    paths.progress(record.version).unlink(missing_ok=True)
    return bundle


def _resume(paths: UpdatePaths, record: ReleaseRecord) -> Progress:
    """Where to go on: the saved progress if it is for this object, else from the start; the
    .part file cut back to what the progress says it holds (bytes past it were appended by
    an attempt that died before saying so)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    part = paths.part(record.version)
    doc = read_json(paths.progress(record.version))
    progress = Progress(record.nuid, 1, 0, 0)
    if doc is not None and doc.get("nuid") == record.nuid:
        progress = Progress(**doc)
    size = part.stat().st_size if part.exists() else 0
    if size < progress.received:  # cannot happen with the fsync order; start over
        progress = Progress(record.nuid, 1, 0, progress.fetched)
    with part.open("ab") as f:
        f.truncate(progress.received)
    if progress.received:
        log.info("update_download_resumed", version=record.version, received=progress.received)
    return progress


def _check(part: Path, record: ReleaseRecord) -> None:
    with part.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    size = part.stat().st_size
    if size != record.size or digest != record.sha256:
        part.unlink()
        raise ReleaseRejected(
            f"release {record.version}: the bundle ({size} bytes, sha256 {digest}) does not "
            f"match its signed record ({record.size} bytes, sha256 {record.sha256})"
        )
