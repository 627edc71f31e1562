"""``edge-agent`` command line. Exit codes: 0 ok, 1 unhealthy / check failed, 2 usage or config."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from edge_agent import __version__
from edge_agent.app import Agent
from edge_agent.core.config import DEFAULT_CONFIG_PATH, Config, load_config
from edge_agent.core.errors import ConfigError, IslandUnavailable, ProtocolError
from edge_agent.core.statedb import StateDB
from edge_agent.island.server import (
    open_link,
    pid_file,
    read_seed,
    render_config,
    wait_healthy,
    write_config,
)
from edge_agent.outbox.store import Outbox, check_subject
from edge_agent.protocol.cliconfig import config_option
from edge_agent.protocol.logs import LOG_LEVELS, configure_logging
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.natsserver import check_version, resolve_nats_server
from edge_agent.protocol.release import UpdateState
from edge_agent.status.health import Status, collect_status, render_status, with_drain_rates
from edge_agent.status.metrics import exposition
from edge_agent.update.install import install
from edge_agent.update.updater import update_report

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2
# `agent.restart` ends the daemon with this (EX_TEMPFAIL); systemd's Restart= starts it again.
EXIT_RESTART = 75


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="The device's agent: runs its NATS island, buffers what it publishes until "
        "the hub has it, and runs the hub's commands. Exit codes: 0 ok, 1 unhealthy or a check "
        "failed, 2 usage or config error.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the agent until SIGTERM")
    run.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="default: info")

    status = sub.add_parser("status", help="island, link, streams and mirror health")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--require-link", action="store_true", help="count a leaf link that is down as unhealthy"
    )
    status.add_argument(
        "--prometheus", action="store_true", help="Prometheus text format (node_exporter textfile)"
    )

    render = sub.add_parser("render-nats-config", help="write the island's nats-server config")
    render.add_argument(
        "-o", "--output", type=Path, help="write here instead of island.config_path ('-': stdout)"
    )
    render.add_argument(
        "--link-closed",
        action="store_true",
        help="with the link to the hub disabled until open-link runs (edge-nats.service does "
        "this on every start)",
    )
    opener = sub.add_parser(
        "open-link",
        help="once the island is up, make its streams safe to resume and connect it to the hub",
    )
    opener.add_argument(
        "-o", "--output", type=Path, help="the config file the island runs from, if not the default"
    )
    opener.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the island to be up"
    )

    sub.add_parser("check-config", help="load the config and report the first problem")

    publish = sub.add_parser(
        "publish",
        help="queue a message in the outbox (works while the agent or island is down)",
        description="Commit a message to the agent's durable outbox; the agent sends it to the "
        "island. Exit 1 when the outbox is full.",
    )
    publish.add_argument("subject", help="a subject under tele. or evt.")
    publish.add_argument(
        "data", nargs="?", default="", help="the payload; '-' reads it from stdin (default: empty)"
    )

    dead = sub.add_parser(
        "dead-letter",
        help="outbox rows the island refused for good: list, retry or drop them",
    ).add_subparsers(dest="action", required=True)
    listing = dead.add_parser("list", help="the dead letters, oldest first")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    for action, text in (("retry", "queue again"), ("drop", "delete for good")):
        which = dead.add_parser(action, help=f"{text}: the rows named, or all")
        which.add_argument("ids", nargs="*", type=int, metavar="ID", help="dead letter ids")
        which.add_argument("--all", action="store_true", help="every dead letter")
    update = sub.add_parser(
        "update", help="releases the hub rolls out: install what was staged, or show where it is"
    ).add_subparsers(dest="action", required=True)
    update.add_parser(
        "install",
        help="install the staged release, switch to it, restart, and go back if unhealthy "
        "(edge-agent-update.service runs it)",
    )
    update_status = update.add_parser("status", help="the last state of each release seen")
    update_status.add_argument("--json", action="store_true", help="machine-readable output")
    default = Path(os.environ.get("EDGE_AGENT_CONFIG", DEFAULT_CONFIG_PATH))
    config_option(parser, default, "EDGE_AGENT_CONFIG", "agent")
    return parser


def _run(config: Config, log_level: str) -> int:
    configure_logging(log_level)
    agent = Agent(config)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.shutdown.set)
        await agent.run()

    asyncio.run(main())
    return EXIT_RESTART if agent.restart_requested else EXIT_OK


def _publish(config: Config, subject: str, data: str) -> int:
    try:
        check_subject(subject)
    except ValueError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    payload = sys.stdin.buffer.read() if data == "-" else data.encode()

    async def main() -> int:
        async with await StateDB.open(config.agent.database) as db:
            return await _outbox(db, config).append(subject, payload)

    row = asyncio.run(main())
    print(f"queued {len(payload)} bytes for {subject} (outbox row {row})")
    return EXIT_OK


def _outbox(db: StateDB, config: Config) -> Outbox:
    return Outbox(db, config.outbox.max_bytes, config.island.max_payload)


def _dead_letter(config: Config, args: argparse.Namespace) -> int:
    if args.action != "list" and bool(args.ids) == bool(args.all):
        print(f"edge-agent: dead-letter {args.action}: name ids or --all", file=sys.stderr)
        return EXIT_USAGE

    async def main() -> int:
        async with await StateDB.open(config.agent.database) as db:
            outbox = _outbox(db, config)
            if args.action == "list":
                rows = await outbox.dead_letters()
                if args.json:
                    print(json.dumps([asdict(r) for r in rows], indent=2))
                for r in [] if args.json else rows:
                    print(f"{r.id:>8}  {r.subject:<32} {r.size:>9} bytes  {r.reason}")
                return EXIT_OK
            ids = None if args.all else args.ids
            if args.action == "retry":
                print(f"queued again: {await outbox.retry_dead(ids)}")
            else:
                print(f"dropped: {await outbox.drop_dead(ids)}")
            return EXIT_OK

    return asyncio.run(main())


async def _sampled_status(config: Config) -> Status:
    """The status; while a backlog drains, sampled twice a second apart for its rate."""
    first = await collect_status(config, ask_hub=True)
    draining = any(s.uplink and s.uplink.backlog_messages for s in first.streams.values())
    if not (draining and first.link.up):
        return first
    await asyncio.sleep(1.0)  # the sampling interval of the drain rate
    return with_drain_rates(await collect_status(config, ask_hub=True), first)


def _status(config: Config, as_json: bool, require_link: bool, prometheus: bool) -> int:
    status = asyncio.run(_sampled_status(config))
    if require_link and not status.link.up:
        status.problems.append("leaf link to the hub is down")
    if prometheus:
        sys.stdout.write(exposition(status))
    elif as_json:
        print(json.dumps(status.to_dict(), indent=2))
    else:
        print(render_status(status))
    return EXIT_OK if status.healthy else EXIT_UNHEALTHY


def _render(config: Config, output: Path | None, link_open: bool) -> int:
    if output is None:
        print(write_config(config, link_open=link_open))
    elif str(output) == "-":
        check_version(resolve_nats_server(config.island.nats_server), "island.nats_server")
        sys.stdout.write(render_config(config, link_open=link_open))
    else:
        write_config(_with_config_path(config, output), link_open=link_open)
        print(output)
    return EXIT_OK


async def _open_link(config: Config, timeout: float) -> int:
    await wait_healthy(Monitor(config.island.monitor_url), timeout)
    try:
        pid = int(pid_file(config).read_text().strip())
    except (OSError, ValueError) as exc:
        raise IslandUnavailable(f"no island pid in {pid_file(config)}: {exc}") from None
    await open_link(config, pid)
    return EXIT_OK


def _update(config: Config, args: argparse.Namespace) -> int:
    if args.action == "install":
        configure_logging("info", stream=sys.stderr)
        outcome = install(config)
        return (
            EXIT_OK if outcome is None or outcome.state == UpdateState.HEALTHY else EXIT_UNHEALTHY
        )
    report = update_report(config)
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"running {report['running']}; staged: {report['staged'] or 'nothing'}")
    for version, entry in sorted(report["versions"].items()):
        reason = f" ({entry['reason']})" if entry.get("reason") else ""
        print(f"  {version}: {entry['state']} at {entry['at']}{reason}")
    return EXIT_OK


def _with_config_path(config: Config, path: Path) -> Config:
    return replace(config, island=replace(config.island, config_path=path))


def _dispatch(config: Config, args: argparse.Namespace) -> int:
    if args.command == "open-link" and args.output is not None:
        config = _with_config_path(config, args.output)
    handlers: dict[str, Callable[[], int]] = {
        "run": lambda: _run(config, args.log_level),
        "status": lambda: _status(config, args.json, args.require_link, args.prometheus),
        "render-nats-config": lambda: _render(config, args.output, not args.link_closed),
        "open-link": lambda: asyncio.run(_open_link(config, args.timeout)),
        "publish": lambda: _publish(config, args.subject, args.data),
        "dead-letter": lambda: _dead_letter(config, args),
        "check-config": lambda: _check_config(config, args.config),
        "update": lambda: _update(config, args),
    }
    return handlers[args.command]()


def _check_config(config: Config, path: Path) -> int:
    """What `run` needs beyond a config that parses: the device's seed, readable by it only."""
    credentials = config.hub.credentials
    if credentials is None:
        raise ConfigError("hub.credentials", "missing: the seed file `hub-ingest device add` wrote")
    read_seed(credentials)
    if credentials.stat().st_mode & 0o077:
        print(
            f"edge-agent: warning: hub.credentials: {credentials} is readable by others "
            f"(chmod 600 it)",
            file=sys.stderr,
        )
    print(f"{path}: ok")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "run":
        configure_logging("warning", stream=sys.stderr)
    try:
        return _dispatch(load_config(args.config), args)
    except ConfigError as exc:
        print(f"edge-agent: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ProtocolError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
