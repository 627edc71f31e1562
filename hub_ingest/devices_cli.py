"""``hub-ingest device add|remove|list``: the registry, re-provisioning on every change."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hub_ingest.cliargs import device_id
from hub_ingest.config import HubConfig
from hub_ingest.connect import hub_connection
from hub_ingest.enrol import enrol, retire
from hub_ingest.provision_cli import ADOPT_HELP
from hub_ingest.registry import Registry


def register(sub: Any) -> None:
    device = sub.add_parser("device", help="manage the device registry").add_subparsers(
        dest="action", required=True
    )
    add = device.add_parser("add", help="register a device and source its streams")
    add.add_argument("device_id", type=device_id)
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
        js = nc.jetstream(domain=config.nats.domain)
        registry = await Registry.open(js)
        if args.action == "list":
            devices = await registry.list()
            if args.json:
                print(json.dumps([asdict(d) for d in devices], indent=2))
            else:
                for d in devices:
                    print(f"{d.device_id:<24} {d.domain:<28} shard {d.shard}  added {d.added_at}")
            return 0
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
            d = change.device
            print(f"added {d.device_id} (domain {d.domain}, shard {d.shard}, key {d.nkey})")
            if change.seed_file is not None:
                print(f"credentials: {change.seed_file} (copy to the device; hub.credentials)")
        else:
            change = await retire(js, config, args.device_id)
            print(f"removed {change.device.device_id}")
        if not change.reloaded:
            print("reload the hub's nats-server to apply the new users file", file=sys.stderr)
        for result in change.streams:
            if result.change != "unchanged":
                print(f"{result.name:<24} {result.change}")
    return 0
