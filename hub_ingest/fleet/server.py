"""The hub's nats-server configuration: JetStream in the hub domain plus a leaf listener.

Users and their permissions live in a second file (`hub_ingest.fleet.auth`), included from this
one, so that registering a device rewrites only that file and reloads the server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edge_agent.protocol.names import LINK_MAX_PAYLOAD
from edge_agent.protocol.tomlconf import render_sync
from hub_ingest.core.config import ClusterConfig, HubConfig, LeafTlsConfig, NodeConfig
from hub_ingest.fleet.admission import issuer_key
from hub_ingest.fleet.auth import ACCOUNT, SYSTEM_ACCOUNT, ensure_operator_key, system_user

# The hub's nats-server runs with the Go runtime's GOGC at 25 (stock: 100): it collects when
# the heap has grown by a quarter instead of doubled. Measured at 50 devices: 0.97 MiB of RSS
# per device against 1.42, with no change in idle CPU (docs/scaling.md). The systemd unit
# (systemd/hub-nats.service) sets the same.
SERVER_ENV = {"GOGC": "25"}


def render_server_config(config: HubConfig, config_file: Path | None = None) -> str:
    """The config of `config.server`: for a cluster, pass `HubConfig.for_node`'s view."""
    srv = config.server
    where = (config_file or srv.config_file).resolve().parent
    # nats-server resolves includes relative to the including file.
    include = os.path.relpath(srv.auth_file.resolve(), where)
    source = f" from {config.source}" if config.source else ""
    return f"""\
# Rendered by hub-ingest{source}; edit the hub config instead.
server_name: {json.dumps(srv.server_name)}
listen: {json.dumps(srv.listen)}
http: {json.dumps(srv.monitor_listen)}
max_payload: {LINK_MAX_PAYLOAD}
pid_file: {json.dumps(str(srv.pid_file))}
include {json.dumps(include)}
{_system_account(config)}{_callout_block(config)}
jetstream {{
  domain: {json.dumps(config.nats.domain)}
  store_dir: {json.dumps(str(srv.store_dir))}
  max_file_store: {srv.max_file_store}
  max_memory_store: {srv.max_memory_store}
  {render_sync(srv.sync)}
}}

leafnodes {{
  listen: {json.dumps(srv.leaf_listen)}
  compression: {json.dumps(srv.leaf_compression)}
  # Devices dial the URLs in their own config (a load balancer, a NAT address); without
  # this the hub gossips its internal listen address and devices reconnect around it.
  no_advertise: true
  # A device needs no other device's interest: without this every subscription an island
  # makes or drops is weighed against every other link (a restart's storm at 500 devices).
  isolate_leafnode_interest: true
{_leaf_tls_block(srv.leaf_tls)}}}
{_cluster_block(config)}"""


def _system_account(config: HubConfig) -> str:
    """The system account is named when leaf nodes and gateways meet (nats-server asks for
    it), and under the callout, whose watcher has links closed (`hub_ingest.fleet.cutoff`)
    as its one user; else nats-server's own, which no one signs in to."""
    gateways = config.cluster is not None and bool(config.cluster.gateways)
    if not gateways and config.server.admission != "callout":
        return ""
    return f"system_account: {json.dumps(SYSTEM_ACCOUNT)}\n"


def _callout_block(config: HubConfig) -> str:
    """With ``server.admission = "callout"``: every connection but the operators' is asked
    about (`hub_ingest.fleet.admission`). nats-server reads this block at start only."""
    if config.server.admission != "callout":
        return ""
    return f"""
authorization {{
  auth_callout {{
    issuer: {issuer_key(config)}
    account: {ACCOUNT}
    auth_users: [{ensure_operator_key(config)}, {system_user(config).public_key.decode()}]
  }}
}}
"""


def _leaf_tls_block(tls: LeafTlsConfig | None) -> str:
    if tls is None:
        return ""
    lines = [
        f"cert_file: {json.dumps(str(tls.cert_file))}",
        f"key_file: {json.dumps(str(tls.key_file))}",
    ]
    if tls.ca_file is not None:
        lines.append(f"ca_file: {json.dumps(str(tls.ca_file))}")
    if tls.verify:
        lines.append("verify: true  # a client certificate from ca_file, on top of the NKey")
    lines.append("timeout: 5  # seconds for the handshake: LTE round trips are long")
    body = "\n    ".join(lines)
    return f"  tls {{\n    {body}\n  }}\n"


def _cluster_block(config: HubConfig) -> str:
    if config.cluster is None:
        return ""
    node = config.cluster.node(config.server.server_name)
    routes = [n.route for n in config.cluster.nodes if n.name != node.name]
    if not routes and config.cluster.gateways:
        # JetStream refuses a gateway on a server with no route configured; a route to itself,
        # which nats-server recognises and drops, makes a one-node region.
        routes = [node.route]
    return f"""
cluster {{
  name: {json.dumps(config.cluster.name)}
  listen: {json.dumps(node.cluster_listen)}
  routes: {json.dumps(routes)}
  # Clients and leaf nodes use the URLs they were given, as for the leaf listener.
  no_advertise: true
}}
{_gateway_block(config.cluster, node)}"""


def _gateway_block(cluster: ClusterConfig, node: NodeConfig) -> str:
    """This region's gateways to the others: one JetStream domain across them (one meta
    group; a stream lives in the cluster it is placed in), subjects routed by interest."""
    if not cluster.gateways:
        return ""
    peers = ",\n    ".join(
        f"{{name: {json.dumps(g.name)}, urls: {json.dumps(list(g.urls))}}}"
        for g in cluster.gateways
    )
    return f"""
gateway {{
  name: {json.dumps(cluster.name)}
  listen: {json.dumps(node.gateway_listen)}
  gateways: [
    {peers}
  ]
}}
"""
