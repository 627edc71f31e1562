"""``hub-ingest command send`` and ``hub-ingest command status``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterable
from typing import Any

from hub_ingest.cli.args import duration
from hub_ingest.commands.send import (
    BROADCAST,
    ResultReader,
    command_status,
    describe,
    event_streams,
    new_envelope,
    send,
)
from hub_ingest.core.config import HubConfig
from hub_ingest.core.connect import hub_connection, hub_jetstream
from hub_ingest.fleet.registry import Registry

DEFAULT_WAIT = 60.0


def _arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)  # numbers, lists, objects; anything else stays a string
    except ValueError:
        value = raw
    return key, value


def register(sub: Any) -> None:
    command = sub.add_parser("command", help="send commands to devices, follow their results")
    actions = command.add_subparsers(dest="action", required=True)

    send_p = actions.add_parser("send", help="publish a command; prints its id")
    target = send_p.add_mutually_exclusive_group(required=True)
    target.add_argument("--device", metavar="ID", help="one device")
    target.add_argument("--all", action="store_true", help="every device (cmd.all.<type>)")
    send_p.add_argument("type", help="command type: ping, config.get, exec, agent.restart, …")
    send_p.add_argument(
        "--arg",
        action="append",
        type=_arg,
        default=[],
        metavar="K=V",
        help="argument (JSON or text)",
    )
    send_p.add_argument(
        "--ttl", type=duration, default=86400.0, help="expires after this long (default 1d)"
    )
    send_p.add_argument(
        "--wait",
        nargs="?",
        type=float,
        const=DEFAULT_WAIT,
        metavar="SECONDS",
        help=f"print each device's result as it arrives (default {DEFAULT_WAIT:g}s); "
        "exit 1 if any failed or did not answer (as command status does)",
    )
    send_p.set_defaults(handler=lambda config, args: asyncio.run(_send(config, args)))

    status_p = actions.add_parser(
        "status",
        help="per device: pending, ok, error, rejected or expired; exit 0 only when all are ok",
    )
    status_p.add_argument("command_id")
    status_p.add_argument("--json", action="store_true")
    status_p.set_defaults(handler=lambda config, args: asyncio.run(_status(config, args)))


async def _send(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config) as nc:
        js = hub_jetstream(nc, config)
        registry = await Registry.open(js)
        devices = await registry.list() if args.all else [await registry.get(args.device)]
        envelope = new_envelope(
            BROADCAST if args.all else args.device, args.type, dict(args.arg), args.ttl
        )
        if args.wait is None:
            await send(js, envelope)
            print(envelope.id)
            return 0
        # Listen before sending, so that no result can slip in between.
        async with ResultReader.open(js, event_streams(devices), since=None) as reader:
            await send(js, envelope)
            print(envelope.id, flush=True)
            waiting = {d.device_id for d in devices}
            statuses: dict[str, str] = {}
            deadline = time.monotonic() + args.wait
            while waiting and time.monotonic() < deadline:
                for sender, result in await reader.read(timeout=min(1.0, args.wait)):
                    device = sender.device_id
                    if result.get("command_id") != envelope.id or device is None:
                        continue
                    if not sender.trusted:
                        print(
                            f"ignored a result forged by {device}: {sender.forgery}",
                            file=sys.stderr,
                        )
                        continue
                    if device not in waiting:
                        continue
                    waiting.discard(device)
                    statuses[device] = str(result.get("status"))
                    print(f"{device:<24} {result.get('status'):<9} {describe(result)}", flush=True)
            for device in sorted(waiting):
                statuses[device] = "timeout"
                print(f"{device:<24} {'timeout':<9} no result within {args.wait:g}s")
        return outcome_code(statuses.values())


async def _status(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config) as nc:
        js = hub_jetstream(nc, config)
        devices = await (await Registry.open(js)).list()
        status = await command_status(js, args.command_id, devices, replicas=config.replicas)
    code = outcome_code(status.per_device().values())
    if args.json:
        print(json.dumps(status.to_dict(), indent=2))
        return code
    env = status.envelope or {}
    print(
        f"command {args.command_id}  type {env.get('type', '?')}  subject {status.subject or '?'}"
        f"  issued {env.get('issued_at', '?')}  expires {env.get('expires_at', '?')}"
    )
    for device, state in status.per_device().items():
        result = status.results.get(device)
        detail = f"{result.get('finished_at')}  {describe(result)}" if result else ""
        print(f"{device:<24} {state:<9} {detail}")
    for forged in status.forged:
        print(f"ignored a forged result: {forged}", file=sys.stderr)
    return code


def outcome_code(states: Iterable[str]) -> int:
    """`send --wait` and `status` alike: 0 when every device answered ok (and there was one
    to answer), 1 when any failed, was refused, expired or has not answered yet."""
    states = list(states)
    return 0 if states and all(state == "ok" for state in states) else 1
