"""``hub-ingest provision``, ``hub-ingest watch`` and ``hub-ingest render-nats-config``."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import structlog
from nats.js import JetStreamContext

from edge_agent.protocol import errors as protocol
from edge_agent.protocol.files import write_durably
from edge_agent.protocol.logs import LOG_LEVELS
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.natsserver import check_version, resolve_nats_server
from hub_ingest.core.config import HubConfig
from hub_ingest.core.connect import hub_connection, hub_jetstream
from hub_ingest.core.errors import ConfigError
from hub_ingest.core.rounds import next_round
from hub_ingest.fleet.auth import sync_users, write_auth
from hub_ingest.fleet.provision import provision
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.server import render_server_config
from hub_ingest.fleet.watch import observe, watch
from hub_ingest.report.hub import monitor_url

log = structlog.get_logger(__name__)

USERS_SYNC_S = 5.0  # how soon another machine's `device add` reaches this node

ADOPT_HELP = (
    "take over streams with the fleet's names that hub-ingest did not create (otherwise "
    "they are refused, and nothing changes)"
)


def register(sub: Any) -> None:
    p = sub.add_parser("provision", help="create or update COMMANDS and the aggregate streams")
    p.add_argument("--adopt", action="store_true", help=ADOPT_HELP)
    p.set_defaults(handler=lambda config, args: asyncio.run(_provision(config, args.adopt)))
    w = sub.add_parser(
        "watch",
        help="run until stopped: notice re-imaged devices (new incarnations) and mirror them",
    )
    w.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="default: info (each new incarnation is logged at info)",
    )
    w.add_argument("--node", help="on a cluster: the node this runs beside (it watches its links)")
    w.set_defaults(handler=lambda config, args: asyncio.run(_watch(config.for_node(args.node))))
    r = sub.add_parser(
        "render-nats-config",
        help="write the hub's nats-server config (and, if missing, its users file)",
    )
    r.add_argument(
        "-o", "--output", type=Path, help="write here instead of server.config_file ('-': stdout)"
    )
    r.add_argument("--node", help="the cluster node to render (its name in [[cluster.nodes]])")
    c = sub.add_parser(
        "check-config",
        help="read the hub config and name the first bad key (exit 2), or say it is fine",
    )
    c.set_defaults(handler=_check_config)
    r.add_argument(
        "--nats-server",
        default="nats-server",
        help="the binary the config is for, checked to be recent enough "
        "(default: the one beside hub-ingest, else on PATH)",
    )
    r.set_defaults(handler=_render)


async def _provision(config: HubConfig, adopt: bool) -> int:
    async with hub_connection(config) as nc:
        js = hub_jetstream(nc, config)
        # The users file as this release renders it: an upgraded hub takes new permissions.
        if await sync_users(js, config):
            print(f"{config.server.auth_file!s:<24} rewritten")
        registry = await Registry.open(js)
        for result in await provision(js, config, await registry.list(), adopt=adopt):
            print(f"{result.name:<24} {result.change}")
        # Devices linked right now whose incarnations the hub has not seen yet.
        for new in await observe(js, nc, config, await registry.list()):
            print(f"{new.stream} incarnation {new.id} (command fence {new.command_fence})")
    return 0


async def _watch(config: HubConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    monitor = Monitor(monitor_url(config.server))
    async with hub_connection(config, name="hub-ingest-watch") as nc:
        js = hub_jetstream(nc, config)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(watch(js, nc, config, monitor, stop))
            if config.cluster is not None:
                tasks.create_task(_keep_users(js, config, stop))
    return 0


async def _keep_users(js: JetStreamContext, config: HubConfig, stop: asyncio.Event) -> None:
    """Keep this node's users file in line with the registry: `device add` rewrites and
    reloads only the nodes on the machine it runs on."""
    while not stop.is_set():
        try:
            await sync_users(js, config)
        except Exception as exc:  # a node restarting: log, and try again
            log.warning("users_sync_failed", error=repr(exc))
        await next_round(stop, USERS_SYNC_S)


def _render(config: HubConfig, args: argparse.Namespace) -> int:
    config = config.for_node(args.node)
    try:
        check_version(resolve_nats_server(args.nats_server, "--nats-server"), "--nats-server")
    except protocol.ConfigError as exc:
        raise ConfigError(str(exc)) from None
    if not config.server.auth_file.exists():
        # First start: only the operators; `device add` rewrites it from the registry.
        write_auth(config, [])
        print(f"wrote {config.server.auth_file} (operators only)", file=sys.stderr)
    # nats-server writes its pid file but does not make its directory: a cluster node's is
    # <state_dir>/<node>/, which hub-nats.service's StateDirectory= does not create.
    config.server.pid_file.parent.mkdir(parents=True, exist_ok=True)
    if args.output is not None and str(args.output) == "-":
        sys.stdout.write(render_server_config(config))
        return 0
    target = args.output or config.server.config_file
    write_durably(target, render_server_config(config, target))
    print(target)
    return 0


def _check_config(config: HubConfig, args: argparse.Namespace) -> int:
    """Reading the config is the check (`main` turns its error into exit 2)."""
    nodes = f" ({len(config.servers)} nodes, {config.replicas} replicas)" if config.cluster else ""
    print(f"{config.source}: ok{nodes}")
    return 0
