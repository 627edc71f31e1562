"""``hub-ingest device add|remove|list``: the registry, re-provisioning on every change.

``device add --from FILE`` enrols a whole batch (one ``ID`` or ``ID,PUBLIC_KEY`` a line) with
one users-file write, one reload and one provisioning pass; progress goes to stderr, the
summary to stdout (``--json``: as one JSON document).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hub_ingest.cli.args import device_id
from hub_ingest.cli.provision import ADOPT_HELP
from hub_ingest.core.config import HubConfig
from hub_ingest.core.connect import hub_connection, hub_jetstream
from hub_ingest.core.errors import HubIngestError
from hub_ingest.fleet.enrol import (
    BulkChange,
    Change,
    Enrolled,
    Progress,
    enrol,
    enrol_many,
    read_enrolments,
    retire,
)
from hub_ingest.fleet.registry import Registry

if TYPE_CHECKING:
    from nats.js import JetStreamContext


def register(sub: Any) -> None:
    device = sub.add_parser("device", help="manage the device registry").add_subparsers(
        dest="action", required=True
    )
    add = device.add_parser("add", help="register devices and source their streams")
    which = add.add_mutually_exclusive_group(required=True)
    which.add_argument("device_id", nargs="?", type=device_id)
    which.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="enrol every device in FILE ('-': stdin): one ID or ID,PUBLIC_KEY a line, "
        "blank lines and # comments ignored; devices already registered are left as they are",
    )
    add.add_argument("--json", action="store_true", help="the summary as JSON on stdout")
    add.add_argument("--domain", type=device_id, help="its island's domain (default edge-<id>)")
    add.add_argument(
        "--key", help="the device's own public NKey (U...); without it the hub makes a key pair"
    )
    add.add_argument(
        "--seed-out",
        type=Path,
        help="where to write a new key's seed (mode 0600; default <state_dir>/credentials/ID.nk)",
    )
    add.add_argument("--adopt", action="store_true", help=ADOPT_HELP)
    remove = device.add_parser("remove", help="stop sourcing a device (archived data stays)")
    remove.add_argument("device_id", type=device_id)
    listing = device.add_parser("list", help="registered devices")
    listing.add_argument("--json", action="store_true")
    for p in (add, remove, listing):
        p.set_defaults(handler=lambda config, args: asyncio.run(_device(config, args)))


async def _device(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config) as nc:
        js = hub_jetstream(nc, config)
        registry = await Registry.open(js)
        if args.action == "list":
            devices = await registry.list()
            if args.json:
                print(json.dumps([asdict(d) for d in devices], indent=2))
            else:
                for d in devices:
                    print(f"{d.device_id:<24} {d.domain:<28} shard {d.shard}  added {d.added_at}")
            return 0
        if args.action == "add" and args.from_file is not None:
            return await _add_from(js, config, args)
        if args.action == "add":
            change = await enrol(
                js,
                config,
                args.device_id,
                domain=args.domain,
                key=args.key,
                seed_file=args.seed_out,
                adopt=args.adopt,
            )
            if args.json:
                one = BulkChange(
                    (Enrolled(change.device, change.seed_file),),
                    (),
                    change.reloaded,
                    change.streams,
                )
                print(json.dumps(bulk_summary(one, config.state_dir / "credentials"), indent=2))
                return 0
            d = change.device
            print(f"added {d.device_id} (domain {d.domain}, shard {d.shard}, key {d.nkey})")
            if change.seed_file is not None:
                print(f"credentials: {change.seed_file} (copy to the device; hub.credentials)")
        else:
            change = await retire(js, config, args.device_id)
            _print_removed(change)
        if not change.reloaded:
            print("reload the hub's nats-server to apply the new users file", file=sys.stderr)
        for result in change.streams:
            if result.change != "unchanged":
                print(f"{result.name:<24} {result.change}")
    return 0


def _print_removed(change: Change) -> None:
    print(f"removed {change.device.device_id}")
    for mirror, rows in change.unsourced.items():
        print(
            f"{mirror}: {rows} rows its shard had not sourced; they will not be archived "
            "(its island still holds them)",
            file=sys.stderr,
        )
    # nats-server keeps a linked leaf through a reload (docs/security.md).
    print(
        f"a link {change.device.device_id} holds now stays up until it drops; restart "
        "the hub's nats-server to end it at once",
        file=sys.stderr,
    )


def _read_lines(name: str) -> list[str]:
    if name == "-":
        return sys.stdin.read().splitlines()
    try:
        return Path(name).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise HubIngestError(f"cannot read {name}: {exc}") from None


def _progress(progress: Progress) -> None:
    print(f"enrol: {progress.phase} {progress.done}/{progress.total}", file=sys.stderr, flush=True)


async def _add_from(js: JetStreamContext, config: HubConfig, args: argparse.Namespace) -> int:
    if args.key or args.domain or args.seed_out:
        print(
            "hub-ingest: --key, --domain and --seed-out go with one ID, not --from", file=sys.stderr
        )
        return 2
    source = "stdin" if args.from_file == "-" else args.from_file
    wanted = read_enrolments(_read_lines(args.from_file), source)
    print(f"enrol: read {len(wanted)} devices from {source}", file=sys.stderr, flush=True)
    change = await enrol_many(
        js, config, wanted, source=source, adopt=args.adopt, on_progress=_progress
    )
    summary = bulk_summary(change, config.state_dir / "credentials")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"enrolled {len(change.enrolled)}, already present {len(change.present)}; "
            f"seeds written: {summary['seeds_written']} in {summary['seeds_dir']} "
            "(copy each to its device; hub.credentials)"
        )
    if not change.reloaded:
        print("reload the hub's nats-server to apply the new users file", file=sys.stderr)
    return 0


def bulk_summary(change: BulkChange, seeds_dir: Path) -> dict[str, Any]:
    """The ``device add --from --json`` document (README, "Enrolling devices")."""
    return {
        "enrolled": [
            {
                "device_id": e.device.device_id,
                "domain": e.device.domain,
                "shard": e.device.shard,
                "nkey": e.device.nkey,
                "seed_file": None if e.seed_file is None else str(e.seed_file),
            }
            for e in change.enrolled
        ],
        "already_present": [d.device_id for d in change.present],
        "seeds_written": sum(1 for e in change.enrolled if e.seed_file is not None),
        "seeds_dir": str(seeds_dir),
        "reloaded": change.reloaded,
        "streams_changed": sorted(r.name for r in change.streams if r.change != "unchanged"),
    }
