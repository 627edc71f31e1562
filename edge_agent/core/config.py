"""The agent's configuration: one TOML file, loaded into frozen, typed dataclasses.

Every value is checked once, here; an unknown key or a bad value is a `ConfigError` that names
the key (``island.max_file_store: expected size like "2GiB", got 'lots'``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from edge_agent.core.errors import ConfigError
from edge_agent.protocol.names import LINK_MAX_PAYLOAD, island_name, js_api
from edge_agent.protocol.release import decode_public_key
from edge_agent.protocol.tomlconf import (
    BY_RTT,
    Section,
    boolean,
    host_port,
    identifier,
    link_compression,
    path,
    read_toml,
    string,
    sync_policy,
    url_list,
)
from edge_agent.protocol.units import parse_duration, parse_size

DEFAULT_CONFIG_PATH = Path("/etc/edge-agent/agent.toml")
DEFAULT_RESTART = ("systemctl", "restart", "edge-nats.service", "edge-agent.service")

Supervise = Literal["child", "external"]


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class IslandConfig:
    domain: str
    server_name: str
    store_dir: Path
    max_file_store: int
    max_memory_store: int
    # fsync policy of the store: None = before every PubAck ("always"), else every so many
    # seconds (a power cut may then lose what was acknowledged in the last interval).
    sync: float | None
    max_payload: int  # the largest message the island takes (nats-server's max_payload)
    client_listen: Listen
    monitor_listen: Listen
    supervise: Supervise
    nats_server: str
    config_path: Path

    @property
    def client_url(self) -> str:
        return f"nats://{self.client_listen}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.monitor_listen}"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    ca_file: Path | None
    cert_file: Path | None
    key_file: Path | None


@dataclass(frozen=True, slots=True)
class HubLinkConfig:
    urls: tuple[str, ...]
    domain: str
    credentials: Path | None
    tls: TlsConfig | None
    reconnect: float
    # Added per device, a share of it fixed by the device id (`island.leaf_reconnect`).
    reconnect_spread: float
    compression: str  # of the leaf link; see tomlconf.COMPRESSION_MODES and BY_RTT
    compress_rtt: float  # with "by_rtt": compress from this round trip on
    # Telemetry crosses in packs of readings (`edge_agent.protocol.pack`); fixed for an
    # island when its TELEMETRY stream is made.
    pack: bool = True

    @property
    def api_prefix(self) -> str:
        return js_api(self.domain)


@dataclass(frozen=True, slots=True)
class StreamBudget:
    max_bytes: int
    max_age: float  # seconds; 0 keeps messages until the byte budget forces them out


@dataclass(frozen=True, slots=True)
class StreamsConfig:
    telemetry: StreamBudget
    events: StreamBudget
    commands: StreamBudget


@dataclass(frozen=True, slots=True)
class AgentConfig:
    state_dir: Path
    heartbeat_interval: float
    link_poll_interval: float
    # A hub mirror's consumer with a window out and no movement this long, the link up, is
    # stuck, not slow, and is bound afresh (`edge_agent.island.unstall`).
    uplink_stall_after: float = 60.0
    # Prometheus text format for node_exporter's textfile collector, rewritten at every
    # heartbeat; None: not written.
    metrics_file: Path | None = None

    @property
    def database(self) -> Path:
        """The SQLite file holding the outbox and the command ledger."""
        return self.state_dir / "agent.sqlite3"


@dataclass(frozen=True, slots=True)
class CommandsConfig:
    handler_timeout: float
    max_payload: int
    # Each entry is an exact argv; a last element "*" allows any further arguments.
    exec_allow: tuple[tuple[str, ...], ...]
    exec_max_output: int
    shutdown_grace: float
    # Read the hub's COMMANDS directly while the mirror is stalled after a link return.
    fast_resume: bool


@dataclass(frozen=True, slots=True)
class OutboxConfig:
    max_bytes: int


Installer = Literal["systemd", "spawn"]


@dataclass(frozen=True, slots=True)
class UpdateConfig:
    """Releases the hub rolls out (`edge_agent.update`); off while `operator_key` is empty."""

    operator_key: str  # the operators' release key (O…): nothing else's signature is trusted
    check_interval: float  # how often, while the link is up, the desired release is read
    max_rate: int  # bytes per second a download may take from the link; 0: no limit
    prefix: Path  # releases/<version> and the `current` link, as the Ansible role lays them
    python: str  # makes each release's venv
    health_deadline: float  # after a restart on a new release, to be healthy with the link up
    # systemd: a root unit (edge-agent-update.path) installs what the agent staged;
    # spawn: the agent starts the installer itself (a device without systemd, the tests)
    installer: Installer
    restart: tuple[str, ...]  # restarts the island and the agent on the release `current` names

    @property
    def enabled(self) -> bool:
        return bool(self.operator_key)


@dataclass(frozen=True, slots=True)
class Config:
    device_id: str
    island: IslandConfig
    hub: HubLinkConfig
    streams: StreamsConfig
    agent: AgentConfig
    commands: CommandsConfig
    outbox: OutboxConfig
    update: UpdateConfig
    source: Path | None = None


def _duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds < 0:
        raise ValueError(f"expected a duration >= 0, got {value!r}")
    return seconds


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"expected a duration > 0, got {value!r}")
    return seconds


def _loopback_listen(value: object) -> Listen:
    return Listen(*host_port(value, loopback=True))


def _one_of(kind: Any) -> Callable[[object], Any]:
    """A parser that takes exactly the strings of the ``Literal`` type `kind`."""
    allowed = get_args(kind)

    def parse(value: object) -> Any:
        if value in allowed:
            return value
        raise ValueError(f"expected {' or '.join(map(json.dumps, allowed))}, got {value!r}")

    return parse


def _argv_list(value: object) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list):
        raise ValueError(f'expected a list of argv lists like [["uptime"]], got {value!r}')
    allowed = []
    for argv in value:
        if (
            not isinstance(argv, list)
            or not argv
            or not all(isinstance(a, str) and a for a in argv)
            or "*" in argv[:-1]
            or argv[0] == "*"
        ):
            raise ValueError(
                f'expected an argv list of non-empty strings ("*" only last), got {argv!r}'
            )
        allowed.append(tuple(argv))
    return tuple(allowed)


def _operator_key(value: object) -> str:
    text = string(value)
    if text:
        decode_public_key(text)
    return text


def _argv(value: object) -> tuple[str, ...]:
    (argv,) = _argv_list([value])
    return argv


def _positive_size(value: object) -> int:
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"expected a size > 0, got {value!r}")
    return size


def _link_payload(value: object) -> int:
    size = _positive_size(value)
    if size > LINK_MAX_PAYLOAD:
        raise ValueError(
            f"expected at most {LINK_MAX_PAYLOAD} bytes (1MiB), got {value!r}: the hub takes no "
            f"larger message across the link, and one stored on the island would stall the "
            f"device's uplink behind it for good"
        )
    return size


# Each stream's share of island.max_file_store (per cent) when its max_bytes is not given.
_BUDGET_SHARES = {"telemetry": 70, "events": 15, "commands": 5}


def _budget(section: Section, max_bytes: int) -> StreamBudget:
    budget = StreamBudget(
        max_bytes=section.get("max_bytes", parse_size, max_bytes),
        max_age=section.get("max_age", parse_duration, 0.0),
    )
    section.finish()
    return budget


def _tls(section: Section) -> TlsConfig | None:
    if not any(section.has(k) for k in ("ca_file", "cert_file", "key_file")):
        section.finish()
        return None
    tls = TlsConfig(
        ca_file=section.get("ca_file", path, None),
        cert_file=section.get("cert_file", path, None),
        key_file=section.get("key_file", path, None),
    )
    section.finish()
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError(section.key("cert_file"), "cert_file and key_file go together")
    return tls


def parse_config(data: dict[str, Any], source: Path | None = None) -> Config:
    """Build a `Config` from a parsed TOML document."""
    root = Section(data)
    device_id = root.get("device_id", identifier)

    agent_sec = root.table("agent")
    agent = AgentConfig(
        state_dir=agent_sec.get("state_dir", path, Path("/var/lib/edge-agent")),
        heartbeat_interval=agent_sec.get("heartbeat_interval", _positive_duration, 30.0),
        link_poll_interval=agent_sec.get("link_poll_interval", _positive_duration, 0.5),
        uplink_stall_after=agent_sec.get("uplink_stall_after", _positive_duration, 60.0),
        metrics_file=agent_sec.get("metrics_file", path, None),
    )
    agent_sec.finish()

    isl = root.table("island")
    island = IslandConfig(
        domain=isl.get("domain", identifier, island_name(device_id)),
        server_name=isl.get("server_name", identifier, island_name(device_id)),
        store_dir=isl.get("store_dir", path, agent.state_dir / "jetstream"),
        # Required: nats-server would otherwise take 75% of the disk free at start-up.
        max_file_store=isl.get("max_file_store", parse_size),
        max_memory_store=isl.get("max_memory_store", parse_size, 64 * 1024**2),
        sync=isl.get("sync", sync_policy, None),
        max_payload=isl.get("max_payload", _link_payload, LINK_MAX_PAYLOAD),
        client_listen=isl.get("client_listen", _loopback_listen, Listen("127.0.0.1", 4222)),
        monitor_listen=isl.get("monitor_listen", _loopback_listen, Listen("127.0.0.1", 8222)),
        supervise=isl.get("supervise", _one_of(Supervise), "external"),
        nats_server=isl.get("nats_server", string, "nats-server"),
        config_path=isl.get("config_path", path, agent.state_dir / "nats-server.conf"),
    )
    isl.finish()

    hub_sec = root.table("hub")
    hub = HubLinkConfig(
        urls=hub_sec.get("urls", url_list),
        domain=hub_sec.get("domain", identifier, "hub"),
        credentials=hub_sec.get("credentials", path, None),
        tls=_tls(hub_sec.table("tls")),
        reconnect=hub_sec.get("reconnect", _positive_duration, 0.25),
        reconnect_spread=hub_sec.get("reconnect_spread", _duration, 0.0),
        compression=hub_sec.get("compression", link_compression, BY_RTT),
        compress_rtt=hub_sec.get("compress_rtt", _positive_duration, 0.02),
        pack=hub_sec.get("pack", boolean, True),
    )
    hub_sec.finish()
    if hub.domain == island.domain:
        raise ConfigError("hub.domain", f"must differ from island.domain ({island.domain!r})")

    streams_sec = root.table("streams")
    # Default budgets split the store; each stream's max_bytes is reserved in JetStream, so
    # telemetry filling up can never evict events, results or commands.
    total = island.max_file_store
    tables = {name: streams_sec.table(name) for name in _BUDGET_SHARES}
    explicit = {name: table.has("max_bytes") for name, table in tables.items()}
    streams = StreamsConfig(
        **{
            name: _budget(tables[name], total * share // 100)
            for name, share in _BUDGET_SHARES.items()
        }
    )
    streams_sec.finish()
    budgets = streams.telemetry.max_bytes + streams.events.max_bytes + streams.commands.max_bytes
    if budgets > total:
        raise ConfigError(
            "streams",
            f"budgets add up to {budgets} bytes, more than island.max_file_store ({total})",
        )
    for name, share in _BUDGET_SHARES.items():
        if getattr(streams, name).max_bytes > 0:
            continue
        if explicit[name]:
            raise ConfigError(f"streams.{name}.max_bytes", "must be > 0")
        # A derived budget: name the key the user wrote.
        raise ConfigError(
            "island.max_file_store",
            f"{total} bytes leaves streams.{name} ({share} % of it) nothing: raise it, or "
            f"set streams.{name}.max_bytes",
        )

    cmd_sec = root.table("commands")
    commands = CommandsConfig(
        handler_timeout=cmd_sec.get("handler_timeout", _positive_duration, 60.0),
        max_payload=cmd_sec.get("max_payload", _positive_size, 64 * 1024),
        exec_allow=cmd_sec.get("exec_allow", _argv_list, ()),
        exec_max_output=cmd_sec.get("exec_max_output", _positive_size, 64 * 1024),
        shutdown_grace=cmd_sec.get("shutdown_grace", parse_duration, 10.0),
        fast_resume=cmd_sec.get("fast_resume", boolean, True),
    )
    cmd_sec.finish()

    outbox_sec = root.table("outbox")
    outbox = OutboxConfig(max_bytes=outbox_sec.get("max_bytes", _positive_size, 64 * 1024**2))
    outbox_sec.finish()

    update_sec = root.table("update")
    update = UpdateConfig(
        operator_key=update_sec.get("operator_key", _operator_key, ""),
        check_interval=update_sec.get("check_interval", _positive_duration, 30.0),
        max_rate=update_sec.get("max_rate", parse_size, 128 * 1024),
        prefix=update_sec.get("prefix", path, Path("/opt/edge-agent")),
        python=update_sec.get("python", string, "/usr/bin/python3"),
        health_deadline=update_sec.get("health_deadline", _positive_duration, 120.0),
        installer=update_sec.get("installer", _one_of(Installer), "systemd"),
        restart=update_sec.get("restart", _argv, DEFAULT_RESTART),
    )
    update_sec.finish()

    root.finish()
    return Config(device_id, island, hub, streams, agent, commands, outbox, update, source)


def load_config(config_path: Path) -> Config:
    """Read and check the TOML file at `config_path`."""
    return parse_config(read_toml(config_path), source=config_path)
