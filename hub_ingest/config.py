"""The hub's configuration (``hub.toml``), loaded into frozen, typed dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent import errors as agent_errors
from edge_agent.tomlconf import (
    Section,
    host_port,
    identifier,
    path,
    positive_int,
    read_toml,
    url_list,
)
from edge_agent.units import parse_duration, parse_size
from hub_ingest.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/hub-ingest/hub.toml")


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """How the hub tools reach the hub's nats-server."""

    servers: tuple[str, ...]
    domain: str
    credentials: Path | None


@dataclass(frozen=True, slots=True)
class CommandsConfig:
    max_age: float
    max_bytes: int


@dataclass(frozen=True, slots=True)
class AggregatesConfig:
    max_sources_per_stream: int
    max_bytes: int  # per aggregate stream; -1 for no limit
    max_age: float


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The hub's own nats-server, rendered by ``hub-ingest render-nats-config``."""

    server_name: str
    listen: str
    monitor_listen: str
    leaf_listen: str
    store_dir: Path
    max_file_store: int
    max_memory_store: int


@dataclass(frozen=True, slots=True)
class HubConfig:
    nats: NatsConfig
    commands: CommandsConfig
    aggregates: AggregatesConfig
    server: ServerConfig
    state_dir: Path
    source: Path | None = None


def _listen(value: object) -> str:
    host, port = host_port(value, loopback=False)
    return f"{host}:{port}"


def _limit_size(value: object) -> int:
    return -1 if value == -1 else parse_size(value)


def _parse(data: dict[str, Any], source: Path | None) -> HubConfig:
    root = Section(data)
    state_dir = root.get("state_dir", path, Path("/var/lib/hub-ingest"))

    nats_sec = root.table("nats")
    nats = NatsConfig(
        servers=nats_sec.get("servers", url_list, ("nats://127.0.0.1:4222",)),
        domain=nats_sec.get("domain", identifier, "hub"),
        credentials=nats_sec.get("credentials", path, None),
    )
    nats_sec.finish()

    cmd_sec = root.table("commands")
    commands = CommandsConfig(
        max_age=cmd_sec.get("max_age", parse_duration, 7 * 86400.0),
        max_bytes=cmd_sec.get("max_bytes", _limit_size, 1024**3),
    )
    cmd_sec.finish()

    agg_sec = root.table("aggregates")
    aggregates = AggregatesConfig(
        max_sources_per_stream=agg_sec.get("max_sources_per_stream", positive_int, 100),
        max_bytes=agg_sec.get("max_bytes", _limit_size, -1),
        max_age=agg_sec.get("max_age", parse_duration, 0.0),
    )
    agg_sec.finish()

    srv = root.table("server")
    server = ServerConfig(
        server_name=srv.get("server_name", identifier, "hub"),
        listen=srv.get("listen", _listen, "127.0.0.1:4222"),
        monitor_listen=srv.get("monitor_listen", _listen, "127.0.0.1:8222"),
        leaf_listen=srv.get("leaf_listen", _listen, "0.0.0.0:7422"),
        store_dir=srv.get("store_dir", path, state_dir / "jetstream"),
        # Explicit: nats-server would otherwise take 75% of the disk free at start-up.
        max_file_store=srv.get("max_file_store", parse_size, 10 * 1024**3),
        max_memory_store=srv.get("max_memory_store", parse_size, 256 * 1024**2),
    )
    srv.finish()
    root.finish()
    return HubConfig(nats, commands, aggregates, server, state_dir, source)


def parse_hub_config(data: dict[str, Any], source: Path | None = None) -> HubConfig:
    try:
        return _parse(data, source)
    except agent_errors.ConfigError as exc:
        raise ConfigError(str(exc)) from None


def load_hub_config(config_path: Path) -> HubConfig:
    try:
        data = read_toml(config_path)
    except agent_errors.ConfigError as exc:
        raise ConfigError(str(exc)) from None
    return parse_hub_config(data, source=config_path)
