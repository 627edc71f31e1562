"""``hub-ingest run`` (the Spark ingest), ``audit`` (is the archive complete?), and the
archive table's upkeep: ``compact`` and ``relocate``."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
from datetime import date
from typing import Any

from hub_ingest.archive import maintenance
from hub_ingest.archive.audit import AuditReport, audit_archive, backlog
from hub_ingest.archive.table import location as table_location
from hub_ingest.core.config import HubConfig
from hub_ingest.core.connect import hub_connection
from hub_ingest.fleet.gaps import healed
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.streams import aggregate_stream_names
from hub_ingest.ingest.durability import only_run


def register(sub: Any) -> None:
    r = sub.add_parser(
        "run", help="archive the aggregate streams into the archive table with Spark"
    )
    r.add_argument("--once", action="store_true", help="archive what is there now, then exit")
    r.add_argument(
        "--master",
        help="Spark master URL, e.g. spark://host:7077 (default: spark-submit's, else "
        "ingest.master, local[*])",
    )
    r.add_argument("--log-level", default="info", help="progress is logged at info")
    r.set_defaults(handler=_run)
    a = sub.add_parser("audit", help="check the archive: duplicates, gaps, unarchived messages")
    a.add_argument("--json", action="store_true")
    a.set_defaults(handler=lambda config, args: asyncio.run(_audit(config, args)))
    c = sub.add_parser("compact", help="rewrite small files into large ones, expire old snapshots")
    c.add_argument("--date", type=_date, help="only this day (YYYY-MM-DD, UTC)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(handler=_compact)
    t = sub.add_parser(
        "trim", help="purge from the hub's streams what is archived and older than keep_on_hub"
    )
    t.add_argument("--json", action="store_true")
    t.set_defaults(handler=lambda config, args: asyncio.run(_trim(config, args)))
    m = sub.add_parser("relocate", help="adopt an archive directory that was copied or moved")
    m.add_argument("--json", action="store_true")
    m.set_defaults(handler=_relocate)


def _run(config: HubConfig, args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Imported here: Spark is heavy, and every other subcommand starts without it.
    from hub_ingest.ingest.job import run  # noqa: PLC0415

    return run(config, once=args.once, master=args.master, stop=stop)


async def _trim(config: HubConfig, args: argparse.Namespace) -> int:
    report = await maintenance.trim(config)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 1 if report.failed else 0
    for trimmed in report.streams:
        print(f"{trimmed.stream}: {trimmed.messages} messages purged, first now {trimmed.first}")
    for mirror in report.held_for_refill:
        print(f"{mirror}: skipped a range the refill has not settled; its shard is kept whole")
    for shard in report.failed:
        print(f"{shard}: not trimmed, a request failed (hub-ingest's log says which)")
    for stream in report.deleted:
        print(f"{stream}: deleted, its device was removed (a mirror: its rows are archived)")
    print(f"{report.messages} messages purged from {len(report.streams)} streams")
    return 1 if report.failed else 0


def _date(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date like 2026-11-23, got {text!r}") from None


def _compact(config: HubConfig, args: argparse.Namespace) -> int:
    with only_run(config.ingest.checkpoint, "compact"):
        report = maintenance.compact(config.ingest, args.date)
        maintenance.expire(config.ingest, report)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    for day in report.days:
        print(
            f"{day.day}: {day.files_before} files -> {day.files_after} "
            f"({day.rows} rows, {day.seconds} s)"
        )
    print(
        f"{len(report.days)} days compacted, {report.snapshots_expired} snapshots expired, "
        f"{report.files_deleted} unlisted files deleted"
    )
    return 0


def _relocate(config: HubConfig, args: argparse.Namespace) -> int:
    with only_run(config.ingest.checkpoint, "relocate"):
        files = maintenance.relocate(config.ingest)
    where = table_location(config.ingest.archive)
    if args.json:
        print(json.dumps({"table": config.ingest.table, "location": where, "data_files": files}))
    else:
        print(f"{config.ingest.table} now reads its {files} data files under {where}")
    return 0


async def _audit(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config, name="hub-ingest-audit") as nc:
        js = nc.jetstream(domain=config.nats.domain)
        report = audit_archive(config.ingest, await healed(js))
        streams = await backlog(js, config.ingest, await aggregate_stream_names(js))
        devices = await (await Registry.open(js)).list()
    refused = {d.device_id: d.refused for d in devices if d.refused}
    report = AuditReport(report.devices, tuple(streams), report.incarnation_changes, refused)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print(report)
    return 0 if report.ok else 1


def _print(report: AuditReport) -> None:
    head = ("device", "incarnation", "stream", "rows", "first", "last", "dups")
    print("{:<16} {:<12} {:<16} {:>9} {:>9} {:>9} {:>5}  missing".format(*head))
    for d in report.devices:
        gaps = ", ".join(
            f"{g.first}..{g.last} ({g.reason if g.explained else 'unexplained'})" for g in d.missing
        )
        print(
            f"{d.device_id:<16} {d.incarnation or '-':<12} {d.hub_stream:<16} {d.rows:>9}"
            f" {d.first_seq:>9} {d.last_seq:>9} {d.duplicates:>5}  {gaps or '-'}"
        )
    for d in report.devices:
        if d.refilled:
            print(
                f"{d.device_id} {d.incarnation or '-'} {d.hub_stream}: {d.refilled} readings "
                f"refilled from the island, {d.refilled_archived} of them archived"
            )
    for c in report.incarnation_changes:
        print(
            f"{c.device_id}: new incarnation {c.incarnation} after {c.previous} in {c.hub_stream}"
            f" (from hub seq {c.first_hub_seq}; re-imaged or a new store)"
        )
    for s in report.streams:
        print(f"{s.stream}: {s.unarchived} messages not archived yet (hub seq {s.last_seq})")
    for device, refusals in report.refused.items():
        for r in refusals:
            print(
                f"{device}: the hub does not take its {r.stream} incarnation {r.id!r}"
                f" (since {r.at}): {r.reason}"
            )
    print(
        "archive ok"
        if report.ok
        else "archive NOT ok: duplicates, unexplained gaps or incarnations the hub refuses"
    )
