"""A hub of three nats-servers (or more) in one JetStream cluster on loopback, for the
cluster tests and `bench/fleet_scale.py`.

Each node has its own client, route, leaf and monitoring port and its own store under
``root/hub/<node>``; they share the users file, as nodes on one machine would. Devices list
every node's leaf listener in ``hub.urls`` (the first through their link proxy), so a link
moves to another node when its node dies.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.protocol.files import write_durably
from edge_agent.protocol.monitor import Monitor
from edge_agent.protocol.natsserver import ServerProcess
from hub_ingest.core.config import HubConfig, parse_hub_config
from hub_ingest.fleet.auth import write_auth
from hub_ingest.fleet.server import SERVER_ENV, render_server_config
from hub_ingest.fleet.streams import stream_names
from hub_ingest.fleet.watch import watch
from hub_ingest.local.fleet import admin_connection, free_port
from tests.support.cluster import Hub, provisioned
from tests.support.waiting import eventually


def node_names(count: int) -> tuple[str, ...]:
    return tuple(f"hub-{i}" for i in range(1, count + 1))


NODES = node_names(3)  # the tests' cluster


def loopback_cluster_nodes(count: int = len(NODES)) -> list[dict[str, str]]:
    """`[[cluster.nodes]]` for `count` nodes on free loopback ports."""
    nodes = []
    for name in node_names(count):
        route = free_port()
        nodes.append(
            {
                "name": name,
                "route": f"nats-route://127.0.0.1:{route}",
                "cluster_listen": f"127.0.0.1:{route}",
                "listen": f"127.0.0.1:{free_port()}",
                "monitor_listen": f"127.0.0.1:{free_port()}",
                "leaf_listen": f"127.0.0.1:{free_port()}",
            }
        )
    return nodes


def loopback_cluster_config(
    root: Path,
    *,
    replicas: int = 3,
    leaf_compression: str = "accept",
    count: int = len(NODES),
    admission: str | None = None,
) -> HubConfig:
    nodes = loopback_cluster_nodes(count)
    return parse_hub_config(
        {
            "state_dir": str(root / "hub"),
            "nats": {"servers": [f"nats://{n['listen']}" for n in nodes]},
            "commands": {"max_bytes": "64MiB"},
            "ingest": {"archive": str(root / "archive"), "checkpoint": str(root / "checkpoint")},
            "server": {
                "max_file_store": "1GiB",
                "leaf_compression": leaf_compression,
                **({"admission": admission} if admission else {}),
            },
            "cluster": {"replicas": replicas, "nodes": nodes},
        }
    )


@dataclass
class ClusterHub(Hub):
    """`Hub` on a cluster: `server` is the first node; `nodes` has them all by name."""

    nodes: dict[str, ServerProcess] = field(default_factory=dict)

    def leaf_port_of(self, node: str) -> int:
        assert self.config.cluster is not None
        return int(self.config.cluster.node(node).server.leaf_listen.rsplit(":", 1)[1])

    def leaf_urls(self, proxy_port: int) -> list[str]:
        """The first node through the device's link proxy, the others directly."""
        others = [f"nats-leaf://127.0.0.1:{self.leaf_port_of(n)}" for n in list(self.nodes)[1:]]
        return [f"nats-leaf://127.0.0.1:{proxy_port}", *others]

    def start_watch(self) -> None:
        """One `hub-ingest watch` per node, as each node's service runs it."""
        self.stop_watch.clear()
        for name in self.nodes:
            server = self.config.for_node(name).server
            monitor = Monitor(f"http://{server.monitor_listen}")
            self.watchers.append(
                asyncio.create_task(watch(self.js, self.nc, self.config, monitor, self.stop_watch))
            )

    async def kill(self, node: str) -> None:
        """SIGKILL one node."""
        self.nodes[node].kill()

    async def wipe(self, node: str, *, down_for: float) -> None:
        """SIGKILL one node and start it `down_for` seconds later with an empty store, as
        after its disk was replaced: its replicas of R3 streams come back from the others,
        its one-replica streams come back empty (the engine makes them again from the
        cluster's records)."""
        await self.kill(node)
        assert self.config.cluster is not None
        shutil.rmtree(self.config.for_node(node).server.store_dir)
        await asyncio.sleep(down_for)  # how long the node stays away
        await self.start(node)

    async def start(self, node: str) -> None:
        await self.nodes[node].start(timeout=60)

    async def stop(self, node: str) -> None:
        """Stop one node as an upgrade would (SIGTERM: JetStream flushes and leaves)."""
        await self.nodes[node].stop()

    async def restart(self) -> None:
        """A hub restart, in the cluster: every node SIGKILLed, then all started again."""
        for node in self.nodes:
            await self.kill(node)
        await asyncio.gather(*(self.start(n) for n in self.nodes))

    async def current(self) -> bool:
        """Whether every node is up and every stream has all its replicas current."""
        for name in self.nodes:
            if not await self.nodes[name].monitor.healthy():
                return False
        for name in await stream_names(self.js):
            info = await self.js.stream_info(name)
            peers = (info.cluster.replicas or []) if info.cluster else []
            if len(peers) != (info.config.num_replicas or 1) - 1 or not all(
                p.current and not p.offline for p in peers
            ):
                return False
        return True

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            for node in self.nodes.values():
                await node.stop()


async def start_cluster_hub(
    root: Path,
    *,
    replicas: int = 3,
    watching: bool = True,
    leaf_compression: str = "accept",
    count: int = len(NODES),
    admission: str | None = None,
) -> ClusterHub:
    config = loopback_cluster_config(
        root, replicas=replicas, leaf_compression=leaf_compression, count=count, admission=admission
    )
    write_auth(config, [])
    nodes = {}
    for name in node_names(count):
        node = config.for_node(name)
        write_durably(node.server.config_file, render_server_config(node))
        nodes[name] = ServerProcess(
            node.server.config_file, f"http://{node.server.monitor_listen}", env=SERVER_ENV
        )
    # A node is healthy once the cluster has a JetStream leader: start them together.
    await asyncio.gather(*(server.start(timeout=60) for server in nodes.values()))
    nc, js = await admin_connection(config)
    hub = ClusterHub(config, next(iter(nodes.values())), nc, js, root, nodes=nodes)
    try:
        await eventually(lambda: provisioned(hub), timeout=60, what="cluster provisioned")
    except BaseException:
        await hub.close()
        raise
    if watching:
        hub.start_watch()
    return hub


__all__ = ["NODES", "ClusterHub", "loopback_cluster_config", "start_cluster_hub"]
