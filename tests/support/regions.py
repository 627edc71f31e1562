"""Two regional hubs joined by a gateway on loopback, for the supercluster test.

Each region is a one-node hub cluster (``eu``, ``us``) with a gateway to the other; together
they are one JetStream domain with one meta group, and a stream lives in the cluster of the
client that made it. They share the operator key, so the fleet's tools work against either.
Each region is a `Hub` whose devices link to that region's leaf listener.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from edge_agent.protocol.files import write_durably
from edge_agent.protocol.natsserver import ServerProcess
from hub_ingest.core.config import HubConfig, parse_hub_config
from hub_ingest.fleet.auth import write_auth
from hub_ingest.fleet.server import SERVER_ENV, render_server_config
from hub_ingest.local.fleet import admin_connection, free_port
from tests.support.cluster import Hub, provisioned
from tests.support.waiting import eventually

REGIONS = ("eu", "us")


def region_configs(root: Path) -> dict[str, HubConfig]:
    """Each region's hub config (its one node's view), each with a gateway to the other."""
    gateways = {region: free_port() for region in REGIONS}
    configs = {}
    for region in REGIONS:
        route = free_port()
        client = f"127.0.0.1:{free_port()}"
        node = {
            "name": f"hub-{region}",
            "route": f"nats-route://127.0.0.1:{route}",
            "cluster_listen": f"127.0.0.1:{route}",
            "gateway_listen": f"127.0.0.1:{gateways[region]}",
            "listen": client,
            "monitor_listen": f"127.0.0.1:{free_port()}",
            "leaf_listen": f"127.0.0.1:{free_port()}",
        }
        others = [
            {"name": other, "urls": [f"nats://127.0.0.1:{gateways[other]}"]}
            for other in REGIONS
            if other != region
        ]
        config = parse_hub_config(
            {
                "state_dir": str(root / region),
                "nats": {
                    "servers": [f"nats://{client}"],
                    "credentials": str(root / "operator.nk"),
                },
                "commands": {"max_bytes": "64MiB"},
                "ingest": {
                    "archive": str(root / "archive"),
                    "checkpoint": str(root / "checkpoint"),
                },
                "server": {"max_file_store": "1GiB"},
                "cluster": {"name": region, "nodes": [node], "gateways": others},
            }
        )
        configs[region] = config.for_node(f"hub-{region}")
    return configs


async def start_regions(root: Path) -> dict[str, Hub]:
    """Both regions started and provisioned, each as a `Hub` with its own connection."""
    configs = region_configs(root)
    servers = {}
    for region, config in configs.items():
        write_auth(config, [])
        write_durably(config.server.config_file, render_server_config(config))
        servers[region] = ServerProcess(
            config.server.config_file, f"http://{config.server.monitor_listen}", env=SERVER_ENV
        )
    # The meta group spans both regions: neither is healthy before the other is up.
    await asyncio.gather(*(server.start(timeout=60) for server in servers.values()))
    hubs: dict[str, Hub] = {}
    try:
        for region, config in configs.items():
            nc, js = await admin_connection(config)
            hubs[region] = Hub(config, servers[region], nc, js, root / region)
            hubs[region].start_admission()  # each region's watcher lets its devices in
        # The fleet-wide streams are made from the first region: they live there.
        first = hubs[REGIONS[0]]
        await eventually(lambda: provisioned(first), timeout=60, what="regions provisioned")
    except BaseException:
        for hub in hubs.values():
            await hub.close()
        for server in servers.values():
            server.kill()
        raise
    return hubs
