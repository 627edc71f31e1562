"""``hub-ingest`` command line. Exit codes: 0 ok, 1 check failed, 2 usage or config error."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import nats.errors

from edge_agent.logs import configure_logging
from edge_agent.tomlconf import identifier
from hub_ingest.config import DEFAULT_CONFIG_PATH, HubConfig, load_hub_config
from hub_ingest.connect import hub_connection
from hub_ingest.errors import ConfigError, HubIngestError
from hub_ingest.provision import provision
from hub_ingest.registry import Registry
from hub_ingest.server import render_server_config

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _device_id(value: str) -> str:
    try:
        return identifier(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hub-ingest", description=__doc__)
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        default=Path(os.environ.get("HUB_INGEST_CONFIG", DEFAULT_CONFIG_PATH)),
        help="hub config file (default: $HUB_INGEST_CONFIG or %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("provision", help="create or update COMMANDS and the aggregate streams")

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

    render = sub.add_parser("render-nats-config", help="print the hub's nats-server config")
    render.add_argument("-o", "--output", type=Path, help="write to this file instead of stdout")
    return parser


async def _provision(config: HubConfig) -> int:
    async with hub_connection(config) as nc:
        js = nc.jetstream(domain=config.nats.domain)
        devices = await (await Registry.open(js)).list()
        for result in await provision(js, config, devices):
            print(f"{result.name:<24} {result.change}")
    return EXIT_OK


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
            return EXIT_OK
        if args.action == "add":
            domain = args.domain or f"edge-{args.device_id}"
            added = await registry.add(
                args.device_id, domain, config.aggregates.max_sources_per_stream
            )
            print(f"added {added.device_id} (domain {added.domain}, shard {added.shard})")
        else:
            removed = await registry.remove(args.device_id)
            print(f"removed {removed.device_id}")
        for result in await provision(js, config, await registry.list()):
            if result.change != "unchanged":
                print(f"{result.name:<24} {result.change}")
    return EXIT_OK


def _render(config: HubConfig, output: Path | None) -> int:
    text = render_server_config(config)
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging("warning")
    try:
        config = load_hub_config(args.config)
        if args.command == "render-nats-config":
            return _render(config, args.output)
        if args.command == "provision":
            return asyncio.run(_provision(config))
        return asyncio.run(_device(config, args))
    except ConfigError as exc:
        print(f"hub-ingest: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except HubIngestError as exc:
        print(f"hub-ingest: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        print(f"hub-ingest: cannot reach the hub: {exc or type(exc).__name__}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
