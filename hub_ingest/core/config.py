"""The hub's configuration (``hub.toml``), loaded into frozen, typed dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edge_agent.protocol import errors as agent_errors
from edge_agent.protocol.tomlconf import (
    Section,
    boolean,
    compression,
    host_port,
    identifier,
    path,
    positive_int,
    read_toml,
    string,
    sync_policy,
    url_list,
)
from edge_agent.protocol.units import parse_duration, parse_size
from hub_ingest.core.ddl import DdlError, check_ddl
from hub_ingest.core.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/hub-ingest/hub.toml")
ADMISSIONS = ("users_file", "callout")  # how devices are let in: hub_ingest.fleet.admission


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """How the hub tools reach the hub's nats-server."""

    servers: tuple[str, ...]
    domain: str
    credentials: Path  # the operators' NKey seed; created by `render-nats-config` if missing


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
class LeafTlsConfig:
    """TLS on the leaf listener (``[server.leaf_tls]``): the hub's certificate, and with
    `verify` a client certificate from `ca_file` required of every device (mTLS, on top of
    its NKey)."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    verify: bool = False


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The hub's own nats-server, rendered by ``hub-ingest render-nats-config``."""

    server_name: str
    listen: str
    monitor_listen: str
    leaf_listen: str
    leaf_compression: str  # what the hub offers devices; see tomlconf.COMPRESSION_MODES
    store_dir: Path
    max_file_store: int
    max_memory_store: int
    sync: float | None  # JetStream's fsync policy, as the agent's island.sync
    config_file: Path  # where `render-nats-config` writes the server's config
    auth_file: Path  # users and permissions, rendered from the registry on every device change
    pid_file: Path  # signalled to reload auth_file when it changes
    leaf_tls: LeafTlsConfig | None = None  # None: a plaintext leaf listener (NKeys only)
    admission: str = "callout"  # or "users_file": see hub_ingest.fleet.admission
    link_life: float = 86400.0  # callout: a link signs in again within it (fleet.cutoff)
    shared_key_hold: float = 600.0  # callout: a key on two machines refused (fleet.shared_keys)
    max_incarnations: int = 16  # a device stream's hub mirrors, one an incarnation (fleet.watch)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One nats-server of a clustered hub: ``[server]`` with this node's own values."""

    name: str
    route: str  # nats-route://host:port, where the other nodes reach this one
    cluster_listen: str
    server: ServerConfig
    gateway_listen: str | None = None  # where other regions' gateways reach this node


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Another region of a supercluster (``[[cluster.gateways]]``): its cluster's name and
    its nodes' gateway URLs."""

    name: str
    urls: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A hub of several nats-servers in one JetStream cluster and domain (``[cluster]``)."""

    name: str
    replicas: int  # of the fleet-wide streams: aggregates, COMMANDS, FLEET_REFILL, buckets
    nodes: tuple[NodeConfig, ...]
    # Of each device's own streams (its mirrors, CMD_<id>). 1, the default, gives them no Raft
    # group: what a device's streams hold, its island holds too (docs/scaling.md).
    device_replicas: int = 1
    gateways: tuple[GatewayConfig, ...] = ()  # the other regions of a supercluster, if any

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        names = ", ".join(n.name for n in self.nodes)
        raise ConfigError(f"no node {name!r} in [cluster] (its nodes: {names})")


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """The Spark job that archives the aggregate streams (``hub-ingest run``)."""

    archive: Path  # the Iceberg table's location; a local path or a URI (s3://, hdfs://)
    catalog: str | None  # sqlite:///…, postgresql+psycopg://…, a REST URL; None: in the archive
    table: str  # the table's name in the catalog: "<namespace>.<name>"
    checkpoint: Path  # Spark's checkpoint: which stream ranges each batch reads
    master: str
    trigger_interval: float  # seconds between micro-batches when running continuously
    max_messages_per_trigger: int
    messages_per_partition: int
    fail_on_data_loss: bool
    payload_schema: str | None  # Spark DDL of JSON payloads, e.g. "temp DOUBLE, unit STRING"
    clock_tolerance: float = 120.0  # a device clock further off marks device_time suspect
    compact_after_run: bool = False  # `run --once` compacts and expires when it is done
    keep_snapshots: float = 86400.0  # older snapshots are expired, their files deleted
    compact_file_size: int = 256 * 1024**2  # what `compact` aims at per file
    trim_hub: bool = True  # `run` trims the hub's streams of what it archived (`fleet.trim`)
    keep_on_hub: float = 86400.0  # what is archived but younger stays on the hub


@dataclass(frozen=True, slots=True)
class HubConfig:
    nats: NatsConfig
    commands: CommandsConfig
    aggregates: AggregatesConfig
    server: ServerConfig
    state_dir: Path
    ingest: IngestConfig
    source: Path | None = None
    cluster: ClusterConfig | None = None

    @property
    def replicas(self) -> int:
        """How many copies of each fleet-wide hub stream the hub keeps."""
        return self.cluster.replicas if self.cluster else 1

    @property
    def device_replicas(self) -> int:
        """How many copies of each device's own hub streams the hub keeps."""
        return self.cluster.device_replicas if self.cluster else 1

    @property
    def servers(self) -> tuple[ServerConfig, ...]:
        """Every nats-server of the hub: the cluster's nodes, or the one server."""
        return tuple(n.server for n in self.cluster.nodes) if self.cluster else (self.server,)

    def for_node(self, name: str | None) -> HubConfig:
        """This config as node `name` sees it (its ``server``); a hub without a cluster has none."""
        if self.cluster is None:
            if name is not None:
                raise ConfigError(f"--node {name}: the hub config has no [cluster]")
            return self
        if name is None:
            names = ", ".join(n.name for n in self.cluster.nodes)
            raise ConfigError(f"the hub is a cluster: name the node with --node ({names})")
        return replace(self, server=self.cluster.node(name).server)


def _listen(value: object) -> str:
    return "{}:{}".format(*host_port(value, loopback=False))


def _limit_size(value: object) -> int:
    return -1 if value == -1 else parse_size(value)


def _admission(value: object) -> str:
    if value not in ADMISSIONS:
        raise ValueError(f"expected one of {', '.join(ADMISSIONS)}, got {value!r}")
    return str(value)


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"expected a duration > 0, got {value!r}")
    return seconds


def _payload_schema(value: object) -> str:
    try:
        return check_ddl(string(value))
    except DdlError as exc:
        raise ValueError(f'not Spark column DDL like "temp DOUBLE, unit STRING": {exc}') from None


def _catalog_uri(value: object) -> str:
    uri = string(value)
    if not uri.startswith(("sqlite:///", "postgresql", "mysql", "http://", "https://")):
        raise ValueError(
            "expected sqlite:///<file>, a SQLAlchemy URL (postgresql+psycopg://…) "
            f"or a REST catalog URL, got {uri!r}"
        )
    return uri


def _table_name(value: object) -> str:
    namespace, dot, name = string(value).rpartition(".")
    if not dot or not all(map(identifier, (namespace, name))):
        raise ValueError(f'expected "<namespace>.<name>", got {value!r}')
    return f"{namespace}.{name}"


def _parse(data: dict[str, Any], source: Path | None) -> HubConfig:
    root = Section(data)
    state_dir = root.get("state_dir", path, Path("/var/lib/hub-ingest"))

    nats_sec = root.table("nats")
    nats = NatsConfig(
        servers=nats_sec.get("servers", url_list, ("nats://127.0.0.1:4222",)),
        domain=nats_sec.get("domain", identifier, "hub"),
        credentials=nats_sec.get("credentials", path, state_dir / "operator.nk"),
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

    server_data = root.get("server", _table, {})
    server = _server(Section(server_data, "server"), state_dir, state_dir)
    has_cluster = root.has("cluster")
    cluster = _cluster(root.table("cluster"), server_data, state_dir) if has_cluster else None
    if commands.max_bytes >= server.max_file_store:
        # JetStream reserves a stream's max_bytes: nothing would be left for the fleet.
        raise agent_errors.ConfigError(
            "commands.max_bytes",
            f"{commands.max_bytes} leaves nothing of server.max_file_store "
            f"({server.max_file_store}) for the fleet's streams",
        )

    ing = root.table("ingest")
    ingest = IngestConfig(
        archive=(archive := ing.get("archive", path, state_dir / "archive")),
        catalog=ing.get("catalog", _catalog_uri, None),
        table=ing.get("table", _table_name, "hub.archive"),
        checkpoint=ing.get("checkpoint", path, state_dir / "checkpoint"),
        master=ing.get("master", string, "local[*]"),
        trigger_interval=ing.get("trigger_interval", _positive_duration, 10.0),
        max_messages_per_trigger=ing.get("max_messages_per_trigger", positive_int, 500_000),
        messages_per_partition=ing.get("messages_per_partition", positive_int, 50_000),
        fail_on_data_loss=ing.get("fail_on_data_loss", boolean, True),
        payload_schema=ing.get("payload_schema", _payload_schema, None),
        clock_tolerance=ing.get("clock_tolerance", parse_duration, 120.0),
        compact_after_run=ing.get("compact_after_run", boolean, False),
        keep_snapshots=ing.get("keep_snapshots", parse_duration, 86400.0),
        compact_file_size=ing.get("compact_file_size", parse_size, 256 * 1024**2),
        trim_hub=ing.get("trim_hub", boolean, True),
        keep_on_hub=ing.get("keep_on_hub", parse_duration, 86400.0),
    )
    ing.finish()
    if ingest.catalog is None and ":/" in str(archive):
        raise agent_errors.ConfigError(
            "ingest.catalog", f"required when ingest.archive is not a local path ({archive})"
        )
    root.finish()
    return HubConfig(nats, commands, aggregates, server, state_dir, ingest, source, cluster)


def _table(value: object) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise ValueError(f"expected a table, got {value!r}")


def _server(srv: Section, state_dir: Path, home: Path) -> ServerConfig:
    """``[server]``; a cluster node's files default to under `home` (``<state_dir>/<node>``)."""
    server = ServerConfig(
        server_name=srv.get("server_name", identifier, "hub"),
        listen=srv.get("listen", _listen, "127.0.0.1:4222"),
        monitor_listen=srv.get("monitor_listen", _listen, "127.0.0.1:8222"),
        leaf_listen=srv.get("leaf_listen", _listen, "0.0.0.0:7422"),
        leaf_compression=srv.get("leaf_compression", compression, "accept"),
        store_dir=srv.get("store_dir", path, home / "jetstream"),
        # Explicit: nats-server would otherwise take 75% of the disk free at start-up.
        max_file_store=srv.get("max_file_store", parse_size, 10 * 1024**3),
        max_memory_store=srv.get("max_memory_store", parse_size, 256 * 1024**2),
        sync=srv.get("sync", sync_policy, None),
        config_file=srv.get("config_file", path, home / "nats-server.conf"),
        auth_file=srv.get("auth_file", path, state_dir / "auth.conf"),
        pid_file=srv.get("pid_file", path, home / "nats-server.pid"),
        leaf_tls=_leaf_tls(srv.table("leaf_tls")) if srv.has("leaf_tls") else None,
        admission=srv.get("admission", _admission, "callout"),
        link_life=srv.get("link_life", _positive_duration, 86400.0),
        shared_key_hold=srv.get("shared_key_hold", parse_duration, 600.0),
        max_incarnations=srv.get("max_incarnations", positive_int, 16),
    )
    srv.finish()
    return server


def _leaf_tls(section: Section) -> LeafTlsConfig:
    tls = LeafTlsConfig(
        cert_file=section.get("cert_file", path),
        key_file=section.get("key_file", path),
        ca_file=section.get("ca_file", path, None),
        verify=section.get("verify", boolean, False),
    )
    section.finish()
    if tls.verify and tls.ca_file is None:
        raise agent_errors.ConfigError(
            section.key("ca_file"), "required with verify = true: the CA devices' certificates"
        )
    return tls


# What a cluster node may set for itself; everything else of [server] is the cluster's.
_NODE_KEYS = ("listen", "monitor_listen", "leaf_listen", "store_dir", "config_file", "pid_file")
MAX_REPLICAS = 5  # JetStream's limit


def _cluster(section: Section, server_data: dict[str, Any], state_dir: Path) -> ClusterConfig:
    name = section.get("name", identifier, "hub")
    raw_nodes = section.get("nodes", _node_tables)
    nodes = tuple(
        _node(Section(raw, f"cluster.nodes[{i}]"), server_data, state_dir)
        for i, raw in enumerate(raw_nodes)
    )
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise agent_errors.ConfigError("cluster.nodes", f"node names must differ: {names}")
    replicas = _replicas(section, "replicas", min(3, len(nodes)), len(nodes))
    device_replicas = _replicas(section, "device_replicas", 1, len(nodes))
    gateways = tuple(
        _gateway(Section(raw, f"cluster.gateways[{i}]"))
        for i, raw in enumerate(section.get("gateways", _tables, []))
    )
    section.finish()
    if gateways:
        for node in nodes:
            if node.gateway_listen is None:
                raise agent_errors.ConfigError(
                    f"cluster.nodes[{node.name}].gateway_listen",
                    "required when the cluster has gateways to other regions",
                )
    return ClusterConfig(name, replicas, nodes, device_replicas, gateways)


def _gateway(sec: Section) -> GatewayConfig:
    gateway = GatewayConfig(sec.get("name", identifier), sec.get("urls", url_list))
    sec.finish()
    return gateway


def _tables(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError("expected an array of tables")
    return value


def _replicas(section: Section, key: str, default: int, nodes: int) -> int:
    replicas: int = section.get(key, positive_int, default)
    if replicas > min(MAX_REPLICAS, nodes):
        raise agent_errors.ConfigError(
            f"cluster.{key}",
            f"{replicas} is more than the {nodes} nodes (or JetStream's {MAX_REPLICAS})",
        )
    return replicas


def _node_tables(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise ValueError("expected [[cluster.nodes]] tables, one per nats-server")
    return value


def _node(sec: Section, server_data: dict[str, Any], state_dir: Path) -> NodeConfig:
    name = sec.get("name", identifier)
    route = sec.get("route", _route)
    port = route.rsplit(":", 1)[1]
    cluster_listen = sec.get("cluster_listen", _listen, f"0.0.0.0:{port}")
    gateway_listen = sec.get("gateway_listen", _listen, None)
    own = {key: sec.get(key, _raw, None) for key in _NODE_KEYS}
    sec.finish()
    if "server_name" in server_data:
        raise agent_errors.ConfigError(
            "server.server_name", "a cluster's nodes are named in [[cluster.nodes]]"
        )
    data = {**server_data, **{k: v for k, v in own.items() if v is not None}, "server_name": name}
    server = _server(Section(data, f"cluster.nodes[{name}]"), state_dir, state_dir / name)
    return NodeConfig(name, route, cluster_listen, server, gateway_listen)


def _raw(value: object) -> object:
    return value


def _route(value: object) -> str:
    url = string(value)
    scheme, sep, rest = url.partition("://")
    if scheme != "nats-route" or not sep:
        raise ValueError(f'expected "nats-route://HOST:PORT", got {url!r}')
    host_port(rest, loopback=False)
    return url


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
