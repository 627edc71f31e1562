"""``hub-ingest device add|remove|list``: the registry, re-provisioning on every change."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from typing import Any

from edge_agent.tomlconf import identifier
from hub_ingest.config import HubConfig
from hub_ingest.connect import hub_connection
from hub_ingest.provision import provision
from hub_ingest.registry import Registry


def _device_id(value: str) -> str:
    try:
        return identifier(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: Any) -> None:
    device = sub.add_parser("device", help="manage the device registry").add_subparsers(
        dest="action", required=True
    )
    add = device.add_parser("add", help="register a device and source its streams")
    add.add_argument("device_id", type=_device_id)
    add.add_argument("--domain", type=_device_id, help="its island's domain (default edge-<id>)")
    remove = device.add_parser("remove", help="stop sourcing a device (archived data stays)")
    remove.add_argument("device_id", type=_device_id)
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
            domain = args.domain or f"edge-{args.device_id}"
            per_shard = config.aggregates.max_sources_per_stream
            added = await registry.add(args.device_id, domain, per_shard)
            print(f"added {added.device_id} (domain {added.domain}, shard {added.shard})")
        else:
            removed = await registry.remove(args.device_id)
            print(f"removed {removed.device_id}")
        for result in await provision(js, config, await registry.list()):
            if result.change != "unchanged":
                print(f"{result.name:<24} {result.change}")
    return 0
