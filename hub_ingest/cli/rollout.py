"""``hub-ingest release keygen|publish|list`` and ``hub-ingest rollout start|status|pause|
resume|abort``: updates that devices pull over their own link (`hub_ingest.fleet.rollout`)."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hub_ingest.core.config import HubConfig
from hub_ingest.core.connect import hub_connection, hub_jetstream
from hub_ingest.fleet import rollout
from hub_ingest.fleet.releases import list_records, new_release_key, publish

DEFAULT_KEY = Path("release.nk")


def register(sub: Any) -> None:
    release = sub.add_parser("release", help="signed release bundles devices can pull")
    actions = release.add_subparsers(dest="action", required=True)
    keygen = actions.add_parser(
        "keygen", help="make the operators' release key; prints the public key for devices"
    )
    keygen.add_argument("--key", type=Path, default=DEFAULT_KEY, help="seed file to create")
    keygen.set_defaults(handler=_keygen)
    pub = actions.add_parser("publish", help="bundle, sign and store a release on the hub")
    pub.add_argument("source", type=Path, help="a wheelhouse directory, or one wheel")
    pub.add_argument("--version", required=True, help="the edge-agent version it holds")
    pub.add_argument("--key", type=Path, default=DEFAULT_KEY, help="the release key's seed file")
    pub.add_argument("--json", action="store_true")
    pub.set_defaults(handler=lambda config, args: asyncio.run(_publish(config, args)))
    listing = actions.add_parser("list", help="the published releases")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=lambda config, args: asyncio.run(_list(config, args)))

    roll = sub.add_parser("rollout", help="which devices should run a release, batch by batch")
    steps = roll.add_subparsers(dest="action", required=True)
    start = steps.add_parser("start", help="start rolling a published release out")
    start.add_argument("version")
    start.add_argument("--canary", type=int, default=1, help="devices in the first batch")
    start.add_argument(
        "--batches",
        default="100%",
        help="cumulative shares of the fleet after the canary, e.g. 10%%,50%%,100%%",
    )
    start.add_argument(
        "--max-failures", type=int, default=0, help="failed devices the rollout tolerates"
    )
    start.set_defaults(handler=lambda config, args: asyncio.run(_start(config, args)))
    status = steps.add_parser("status", help="the rollout and each device's state")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=lambda config, args: asyncio.run(_status(config, args)))
    for action, text in (
        ("pause", "open no further batch"),
        ("resume", "go on; after a stop, accepting the failures so far"),
        ("abort", "devices not yet healthy on it no longer want it"),
    ):
        change = steps.add_parser(action, help=text)
        change.set_defaults(handler=lambda config, args: asyncio.run(_change(config, args.action)))


def _keygen(config: HubConfig, args: argparse.Namespace) -> int:
    print(new_release_key(args.key))
    return 0


async def _publish(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config) as nc:
        js = hub_jetstream(nc, config)
        record = await publish(js, config, args.source, args.version, args.key)
    if args.json:
        print(json.dumps(asdict(record), indent=2))
    else:
        print(f"release {record.version}: {record.size} bytes, sha256 {record.sha256}")
    return 0


async def _list(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config) as nc:
        records = await list_records(hub_jetstream(nc, config), config)
    if args.json:
        print(json.dumps([asdict(r) for r in records], indent=2))
    for record in [] if args.json else records:
        print(f"{record.version:<16} {record.size:>12} bytes  signed by {record.signer}")
    return 0


async def _start(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config) as nc:
        started = await rollout.start(
            hub_jetstream(nc, config),
            config,
            args.version,
            canary=args.canary,
            shares=rollout.parse_shares(args.batches),
            max_failures=args.max_failures,
        )
    sizes = ", ".join(str(len(b)) for b in started.batches)
    print(f"rollout of {started.version} started: batches of {sizes} devices")
    return 0


async def _status(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config) as nc:
        plan, reports = await rollout.status(hub_jetstream(nc, config), config)
    if args.json:
        doc = {"rollout": asdict(plan), "devices": [asdict(r) for r in reports]}
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"rollout of {plan.version}: {plan.state}, batch {plan.opened} of {len(plan.batches)}"
        f"{'  (' + plan.reason + ')' if plan.reason else ''}"
    )
    for r in reports:
        detail = f"{r.bytes} bytes" if r.state == "downloading" else r.reason
        if r.state == rollout.PENDING:
            detail = f"last seen {r.last_seen or 'never'}"
        print(f"  {r.device_id:<24} batch {r.batch}  {r.state:<12} {detail}")
    return 0


async def _change(config: HubConfig, action: str) -> int:
    async with hub_connection(config) as nc:
        changed = await rollout.change(hub_jetstream(nc, config), config, action)
    print(f"rollout of {changed.version}: {changed.state}")
    return 0
