"""Admitting devices to the fleet and retiring them: registry, credentials, auth, streams.

Both steps end with the hub's users file rewritten and the server reloaded before the
streams are provisioned, so a device's leaf connection is accepted by the time the hub
starts mirroring its streams.

Enrolment is planned in full before anything changes: every requested device is checked
against the registry (and the others requested with it), and a conflict is refused naming
where the device was asked for. Then each new device gets its seed (when the hub makes its
key) and its registry entry, and the whole batch ends with *one* users-file write, *one*
reload and *one* provisioning pass, however many devices it holds. A device already
registered with the same key (or with no key asked for) is left as it is, so a batch cut short
by a crash is finished by running it again: only the missing devices are enrolled, and no
device that has a key gets a new one.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nkeys
import structlog
from nats.js import JetStreamContext

from edge_agent.protocol.names import command_stream, island_name
from edge_agent.protocol.reconcile import Reconciled
from edge_agent.protocol.tomlconf import identifier
from hub_ingest.core import failpoints
from hub_ingest.core.config import HubConfig
from hub_ingest.core.errors import EnrolmentError, RegistryError
from hub_ingest.fleet.auth import (
    check_admission,
    new_seed,
    public_key,
    reload_if_changed,
    write_auth,
    write_secret,
)
from hub_ingest.fleet.clashes import check_names
from hub_ingest.fleet.provision import mirror_targets, provision
from hub_ingest.fleet.registry import Device, Registry, assign_shards
from hub_ingest.fleet.retired import drained

log = structlog.get_logger(__name__)

PROGRESS_EVERY = 100  # new devices between two progress reports while registering
_HEADER = ("id", "public_key")  # an optional CSV header line


@dataclass(frozen=True, slots=True)
class Change:
    device: Device
    seed_file: Path | None  # where the new device's seed was written, if the hub made one
    # False: the users file changed and no local hub server was there to signal; reload it
    # by other means. True too when it did not change (a device admitted by the callout).
    reloaded: bool
    streams: list[Reconciled]
    # A removed device's rows its shard had not sourced when it stopped (never archived).
    unsourced: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Enrolment:
    """One device asked for: its id, its own public key (None: the hub makes a key pair)."""

    device_id: str
    key: str | None
    line: int  # where it was asked for: its line in the input (0: the command line)
    domain: str | None = None  # None: edge-<id>
    seed_file: Path | None = None  # None: <state_dir>/credentials/<id>.nk


@dataclass(frozen=True, slots=True)
class Enrolled:
    device: Device
    seed_file: Path | None


@dataclass(frozen=True, slots=True)
class BulkChange:
    enrolled: tuple[Enrolled, ...]  # new in the registry, in input order
    present: tuple[Device, ...]  # already registered as asked: left as they were
    reloaded: bool
    streams: list[Reconciled]


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a batch got: `phase` is ``planned``, ``registered``, ``auth_written``,
    ``reloaded`` or ``provisioned``; `done` of `total` devices (or streams, once
    provisioned)."""

    phase: str
    done: int
    total: int


OnProgress = Callable[[Progress], None]


def seed_path(config: HubConfig, device_id: str) -> Path:
    return config.state_dir / "credentials" / f"{device_id}.nk"


def valid_public_key(key: str) -> bool:
    """Whether `key` is a well-formed NATS user public key (``U…``, checksum included)."""
    if len(key) != 56 or not key.startswith("U"):
        return False
    try:
        raw = base64.b32decode(key + "=" * (-len(key) % 8))
    except (binascii.Error, ValueError):
        return False
    crc: bytes = nkeys.crc16_checksum(raw[:-2])
    return raw[0] == nkeys.PREFIX_BYTE_USER and crc == raw[-2:]


def parse_line(text: str, line: int, source: str) -> Enrolment | None:
    """One line of a ``--from`` file: ``ID`` or ``ID,PUBLIC_KEY``; None for a blank line, a
    comment or the header."""
    body = text.split("#", 1)[0].strip()
    if not body:
        return None
    fields = [f.strip() for f in body.split(",")]
    if len(fields) > 2:
        raise EnrolmentError(source, line, fields[0], "expected ID or ID,PUBLIC_KEY")
    if tuple(f.lower() for f in fields) == _HEADER[: len(fields)] and len(fields) == 2:
        return None
    try:
        device_id = identifier(fields[0])
    except ValueError as exc:
        raise EnrolmentError(source, line, fields[0], f"device id: {exc}") from None
    key = fields[1] if len(fields) == 2 and fields[1] else None
    if key is not None and not valid_public_key(key):
        raise EnrolmentError(
            source, line, device_id, f"{key!r} is not a NATS user public key (U…, 56 characters)"
        )
    return Enrolment(device_id, key, line)


def read_enrolments(lines: Iterable[str], source: str) -> list[Enrolment]:
    """Every device a ``--from`` file asks for, in order; a malformed line is refused."""
    wanted = [parse_line(text, n, source) for n, text in enumerate(lines, start=1)]
    return [e for e in wanted if e is not None]


@dataclass(frozen=True, slots=True)
class _Plan:
    new: tuple[Enrolment, ...]
    present: tuple[Device, ...]


# `$JS.<domain>.API` must not overlap the server's own `$JS.API`, `$JS.FC` and `$JS.ACK`
# subjects: the hub's users file imports some of them the other way, and nats-server refuses
# a file with a cycle of imports whole.
_RESERVED_DOMAINS = frozenset({"API", "FC", "ACK"})


def _plan(
    wanted: Sequence[Enrolment], existing: Sequence[Device], source: str, *, refuse_present: bool
) -> _Plan:
    """Check every requested device before anything changes (`EnrolmentError` names the
    first line that cannot be done as asked)."""
    registered = {d.device_id: d for d in existing}
    domains = {d.domain: d.device_id for d in existing}
    keys = {d.nkey: d.device_id for d in existing}
    asked: dict[str, int] = {}
    new: list[Enrolment] = []
    present: list[Device] = []
    for e in wanted:

        def refuse(reason: str, e: Enrolment = e) -> EnrolmentError:
            return EnrolmentError(source, e.line, e.device_id, reason)

        if e.device_id in asked:
            raise refuse(f"already asked for on line {asked[e.device_id]}")
        asked[e.device_id] = e.line
        domain = e.domain or island_name(e.device_id)
        device = registered.get(e.device_id)
        if device is not None:
            if refuse_present:
                raise RegistryError(f"device {e.device_id!r} is already registered")
            if e.key is not None and e.key != device.nkey:
                raise refuse(f"key {e.key} differs from the registered key {device.nkey}")
            if e.domain is not None and e.domain != device.domain:
                raise refuse(f"domain {e.domain!r} differs from the registered {device.domain!r}")
            present.append(device)
            continue
        if domain in _RESERVED_DOMAINS:
            raise refuse(f"domain {domain!r} is a token of nats-server's own $JS subjects")
        if domain in domains:
            raise refuse(f"domain {domain!r} is already used by device {domains[domain]!r}")
        if e.key is not None and e.key in keys:
            raise refuse(f"key {e.key} is already used by device {keys[e.key]!r}")
        domains[domain] = e.device_id
        if e.key is not None:
            keys[e.key] = e.device_id
        new.append(e)
    return _Plan(tuple(new), tuple(present))


async def _register(
    registry: Registry,
    config: HubConfig,
    plan: _Plan,
    existing: Sequence[Device],
    on_progress: OnProgress,
) -> list[Enrolled]:
    """Write each new device's seed (when the hub makes its key), then its registry entry:
    a crash in between leaves a seed of an unregistered device, replaced on the next run."""
    shards = assign_shards(existing, len(plan.new), config.aggregates.max_sources_per_stream)
    done: list[Enrolled] = []
    for e, shard in zip(plan.new, shards, strict=True):
        written = None
        nkey = e.key
        if nkey is None:
            seed = new_seed()
            written = e.seed_file or seed_path(config, e.device_id)
            write_secret(written, seed)
            nkey = public_key(seed)
        domain = e.domain or island_name(e.device_id)
        device = await registry.create(Device.new(e.device_id, domain, shard, nkey))
        done.append(Enrolled(device, written))
        if len(done) == len(plan.new) // 2:
            failpoints.reach("mid_enrol")
        log.info("device_registered", device_id=device.device_id, shard=shard)
        if len(done) % PROGRESS_EVERY == 0 and len(done) < len(plan.new):
            on_progress(Progress("registered", len(done), len(plan.new)))
    on_progress(Progress("registered", len(done), len(plan.new)))
    return done


def _quiet(progress: Progress) -> None:
    """No progress reports: the default for callers that only want the result."""


async def enrol_many(
    js: JetStreamContext,
    config: HubConfig,
    wanted: Sequence[Enrolment],
    *,
    source: str = "input",
    streams: bool = True,
    adopt: bool = False,
    refuse_present: bool = False,
    on_progress: OnProgress = _quiet,
) -> BulkChange:
    """Enrol every device in `wanted` that is not registered yet, then write the users file,
    reload the server and provision the streams once (``streams=False``: provisioning left
    for later). Nothing changes if any device cannot be enrolled as asked, nor if a stream of
    another owner is in the way (`adopt`: see `provision`). A device already registered is
    refused with `refuse_present`, else left as it is (same key, or no key asked for)."""
    check_admission(config)
    # Only the names these devices would take: a pass over every stream is `provision`'s.
    await check_names(js, [command_stream(e.device_id) for e in wanted], adopt=adopt)
    registry = await Registry.open(js)
    existing = await registry.list()
    plan = _plan(wanted, existing, source, refuse_present=refuse_present)
    on_progress(Progress("planned", len(plan.new), len(wanted)))
    log.info("enrolment_planned", new=len(plan.new), present=len(plan.present))
    enrolled = await _register(registry, config, plan, existing, on_progress)
    devices = [*existing, *(e.device for e in enrolled)]
    written = write_auth(config, devices)
    on_progress(Progress("auth_written", len(devices), len(devices)))
    reloaded = await reload_if_changed(config, written)
    on_progress(Progress("reloaded", int(reloaded), 1))
    new_ids = {e.device.device_id for e in enrolled}
    changed = await provision(js, config, devices, adopt=adopt, only=new_ids) if streams else []
    if streams:
        touched = sum(1 for r in changed if r.change != "unchanged")
        on_progress(Progress("provisioned", touched, len(changed)))
    log.info(
        "devices_enrolled", enrolled=len(enrolled), present=len(plan.present), reloaded=reloaded
    )
    return BulkChange(tuple(enrolled), plan.present, reloaded, changed)


async def enrol(
    js: JetStreamContext,
    config: HubConfig,
    device_id: str,
    *,
    domain: str | None = None,
    key: str | None = None,
    seed_file: Path | None = None,
    streams: bool = True,
    adopt: bool = False,
) -> Change:
    """Register `device_id` with its public `key`, or with a new key whose seed is written to
    `seed_file` (default ``<state_dir>/credentials/<id>.nk``, mode 0600). With
    ``streams=False`` the hub's streams are left for a later `provision`. A stream of another
    owner in the way is refused before anything changes (`adopt`: see `provision`); so is a
    device that is already registered."""
    wanted = Enrolment(device_id, key, 0, domain, seed_file)
    if key is not None and not valid_public_key(key):
        raise EnrolmentError("--key", 0, device_id, f"{key!r} is not a NATS user public key")
    change = await enrol_many(
        js,
        config,
        [wanted],
        source="command line",
        streams=streams,
        adopt=adopt,
        refuse_present=True,
    )
    (new,) = change.enrolled
    log.info("device_enrolled", device_id=device_id, shard=new.device.shard)
    return Change(new.device, new.seed_file, change.reloaded, change.streams)


async def retire(js: JetStreamContext, config: HubConfig, device_id: str) -> Change:
    """Remove `device_id`: its key stops working and its streams stop being mirrored."""
    check_admission(config)
    registry = await Registry.open(js)
    device = await registry.remove(device_id)
    devices = await registry.list()
    reloaded = await reload_if_changed(config, write_auth(config, devices))
    # What its hub mirrors hold is archived: their shard sources it before it stops (the
    # mirrors stay until the archive has it, `hub_ingest.fleet.retired`).
    mirrors = list(mirror_targets([device]).values())
    unsourced = await drained(js, mirrors)
    if unsourced:
        log.warning("device_removed_unsourced", device_id=device_id, rows=unsourced)
    streams = await provision(js, config, devices)
    log.info("device_retired", device_id=device_id, reloaded=reloaded)
    return Change(device, None, reloaded, streams, unsourced)
