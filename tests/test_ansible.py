"""The Ansible role and rollout, run for real with ``-c local`` into scratch roots on loopback.

Every inventory host is localhost with its own root, ports and device id; services are not
managed (no systemd here), so the tests start the installed agents themselves. The tests run
as root, so the role can give the secrets it copies to another owner (``nobody``, standing in
for the agent's user, which the role creates only where it manages services).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from hub_ingest.fleet import rollout
from hub_ingest.fleet.releases import new_release_key
from hub_ingest.local.fleet import write_hub_toml
from tests.support.ansible import ANSIBLE, BIN, playbook, recap
from tests.support.certs import Authority
from tests.support.cluster import Hub, free_port
from tests.support.releases import NEXT_VERSION, VERSION, release_dir
from tests.support.scratch_root import scratch_root
from tests.support.waiting import eventually

SECRET_OWNER = "nobody"

# A converge takes minutes on a loaded machine, and the first test may build the wheelhouse.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("wheelhouse")]


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


def _host(root: Path, device_id: str, hub_url: str, **settings: Any) -> dict[str, Any]:
    return {
        "edge_agent_root": str(scratch_root(root)),
        "edge_agent_device_id": device_id,
        "edge_agent_hub_urls": [hub_url],
        "edge_agent_client_listen": f"127.0.0.1:{free_port()}",
        "edge_agent_monitor_listen": f"127.0.0.1:{free_port()}",
        **settings,
    }


def _secret(path: Path) -> str:
    """The secret in `path`, after checking it is mode 0600 and owned by the agent's user."""
    info = path.stat()
    assert oct(info.st_mode & 0o777) == "0o600", path
    assert info.st_uid == pwd.getpwnam(SECRET_OWNER).pw_uid, path
    return path.read_text().strip()


def _config(root: Path) -> dict[str, Any]:
    with (root / "etc/edge-agent/agent.toml").open("rb") as f:
        return tomllib.load(f)


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


def _assert_never_shown(run: subprocess.CompletedProcess[str], secrets: dict[str, str]) -> None:
    for name, secret in secrets.items():
        for line in secret.splitlines():
            if "-----" not in line:  # PEM armour lines are not secret
                assert line not in run.stdout + run.stderr, f"{name} appears in the output"


def test_example_inventory_names_a_hub_and_a_device_id_per_device() -> None:
    """ansible/inventory.example.yml parses; its hub hosts are its cluster's nodes, and every
    device (in a depot group under `edge`) has its own device id and seed source."""
    out = subprocess.run(
        [BIN / "ansible-inventory", "-i", ANSIBLE / "inventory.example.yml", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    inventory = json.loads(out)
    hostvars = inventory["_meta"]["hostvars"]
    hubs = inventory["hub"]["hosts"]
    assert [n["name"] for n in hostvars[hubs[0]]["hub_cluster_nodes"]] == hubs
    devices = [h for group in inventory["edge"]["children"] for h in inventory[group]["hosts"]]
    ids = [hostvars[h]["edge_agent_device_id"] for h in devices]
    assert len(devices) >= 2 and len(set(ids)) == len(ids)
    assert {hostvars[h]["edge_agent_seed_from"] for h in devices} == {"hub", "device"}


async def test_role_converges_twice_and_installs_a_healthy_agent(
    tls_hub: Hub, pki: Authority, wheelhouse: Path, tmp_path: Path
) -> None:
    """The seed `device add` wrote, copied from the controller's credentials directory, and
    the device's TLS files land mode 0600 (the key and the seed) owned by the agent's user,
    never appear in the play's output (run with --diff -vvv), and agent.toml names them; a
    second run changes nothing; the installed agent links to the hub over mTLS and reports
    healthy."""
    await tls_hub.register("dev1")
    seeds = tmp_path / "credentials"  # the hub's <state_dir>/credentials, on the controller
    seeds.mkdir()
    shutil.copy(tls_hub.seed_file("dev1"), seeds / "dev1.nk")
    device = pki.issue("dev1", server=False)
    root = tmp_path / "dev1"
    host = _host(
        root,
        "dev1",
        f"nats-leaf://127.0.0.1:{tls_hub.leaf_port}",
        edge_agent_seed_dir=str(seeds),
        edge_agent_secret_owner=SECRET_OWNER,
        edge_agent_tls_ca_src=str(pki.cert_file),
        edge_agent_tls_cert_src=str(device.cert_file),
        edge_agent_tls_key_src=str(device.key_file),
        edge_agent_update_operator_key=new_release_key(tmp_path / "release.nk"),
    )
    inventory = _inventory(tmp_path / "inventory.yml", wheelhouse, {"dev1": host})

    first = await asyncio.to_thread(playbook, "site.yml", inventory, "--diff", "-vvv")
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr
    assert recap(first.stdout)["dev1"]["changed"] > 0
    second = await asyncio.to_thread(playbook, "site.yml", inventory, "--diff", "-vvv")
    assert second.returncode == 0, second.stdout[-6000:] + second.stderr
    assert recap(second.stdout)["dev1"]["changed"] == 0, second.stdout[-6000:]

    config_dir = root / "etc/edge-agent"
    seed = _secret(config_dir / "hub.nk")
    assert seed == (seeds / "dev1.nk").read_text().strip()
    key = _secret(config_dir / "tls/device-key.pem")
    for run in (first, second):
        _assert_never_shown(run, {"seed": seed, "TLS key": key})
    hub_section = _config(root)["hub"]
    assert hub_section["credentials"] == str(config_dir / "hub.nk")
    assert hub_section["tls"] == {
        "ca_file": str(config_dir / "tls/ca.pem"),
        "cert_file": str(config_dir / "tls/device.pem"),
        "key_file": str(config_dir / "tls/device-key.pem"),
    }

    update = _config(root)["update"]
    assert update["operator_key"] == host["edge_agent_update_operator_key"]
    assert update["prefix"] == str(root / "opt/edge-agent")
    assert _current(root) == f"releases/{VERSION}"
    units = sorted(p.name for p in (root / "etc/systemd/system").glob("edge-*"))
    assert units == [
        "edge-agent-update.path",
        "edge-agent-update.service",
        "edge-agent.service",
        "edge-nats.service",
    ]
    async with installed_agent(root):
        status = await eventually(lambda: _status(root), timeout=90, what="installed agent healthy")
    assert status is not None
    assert status["device_id"] == "dev1" and status["healthy"] and status["link"]["up"]


async def test_role_makes_the_device_key_and_only_its_public_key_is_enrolled(
    hub: Hub, wheelhouse: Path, tmp_path: Path
) -> None:
    """With `edge_agent_seed_from: device` the role makes the seed on the device (0600, never
    in the output) and leaves `<id>,<public key>` on the controller; `hub-ingest device add
    --from` enrols that, and the installed agent links. Converging again keeps the key."""
    root = tmp_path / "dev1"
    enrol_dir = tmp_path / "enrol"
    host = _host(
        root,
        "dev1",
        f"nats-leaf://127.0.0.1:{hub.leaf_port}",
        edge_agent_seed_from="device",
        edge_agent_enrol_dir=str(enrol_dir),
        edge_agent_secret_owner=SECRET_OWNER,
    )
    inventory = _inventory(tmp_path / "inventory.yml", wheelhouse, {"dev1": host})
    first = await asyncio.to_thread(playbook, "site.yml", inventory, "--diff", "-vvv")
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr
    seed = _secret(root / "etc/edge-agent/hub.nk")
    assert seed.startswith("SU")
    line = (enrol_dir / "dev1.csv").read_text()
    assert line.startswith("dev1,U") and line.count(",") == 1
    second = await asyncio.to_thread(playbook, "site.yml", inventory, "--diff", "-vvv")
    assert second.returncode == 0, second.stdout[-6000:] + second.stderr
    assert recap(second.stdout)["dev1"]["changed"] == 0, second.stdout[-6000:]
    assert _secret(root / "etc/edge-agent/hub.nk") == seed
    for run in (first, second):
        _assert_never_shown(run, {"seed": seed})

    hub_toml = write_hub_toml(hub.config, tmp_path / "hub.toml")
    _run(BIN / "hub-ingest", "-c", hub_toml, "device", "add", "--from", enrol_dir / "dev1.csv")
    assert not (hub.config.state_dir / "credentials/dev1.nk").exists(), "the hub made no seed"
    async with installed_agent(root):
        status = await eventually(lambda: _status(root), timeout=90, what="installed agent healthy")
    assert status is not None
    assert status["device_id"] == "dev1" and status["link"]["up"]


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
        hosts[name] = _host(
            tmp_path / name, name, url, edge_agent_hub_seed_src=str(hub.seed_file(name))
        )
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
    # The gate said what was missing on every check while it waited.
    for check in range(1, 6):
        assert f"dev2 not healthy yet (check {check}/5): " in out, out[-8000:]
    assert "leaf link to the hub is down" in out
    assert "dev1 not healthy yet (check 5/5)" not in out

    assert _current(roots["dev1"]) == f"releases/{NEXT_VERSION}"
    assert _current(roots["dev2"]) == f"releases/{VERSION}"
    assert (roots["dev2"] / f"opt/edge-agent/releases/{NEXT_VERSION}").is_dir()
    for name in ("dev3", "dev4"):
        assert _current(roots[name]) == f"releases/{VERSION}"
        assert not (roots[name] / f"opt/edge-agent/releases/{NEXT_VERSION}").exists()


async def test_rollout_in_pull_mode_publishes_and_starts_a_rollout_without_touching_devices(
    hub: Hub, wheelhouse: Path, tmp_path: Path
) -> None:
    """rollout.yml -e rollout_mode=pull: the hub host publishes the signed release and starts
    the rollout; the devices, here unreachable, are not contacted; the key does not stay."""
    for name in ("dev1", "dev2"):
        await hub.register(name)
    key = tmp_path / "release.nk"
    new_release_key(key)
    # As an operator would give them: -e (the play's own vars outrank the inventory's).
    extra = {
        "rollout_mode": "pull",
        "edge_agent_version": NEXT_VERSION,
        "edge_agent_wheelhouse": str(release_dir(wheelhouse, NEXT_VERSION, tmp_path / "w")),
        "rollout_release_key": str(key),
        "rollout_hub_ingest": str(BIN / "hub-ingest"),
        "rollout_hub_config": str(write_hub_toml(hub.config, tmp_path / "hub.toml")),
        "rollout_staging": str(tmp_path / "staging"),
    }
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    shared = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    unreachable = {"ansible_host": "192.0.2.1", "ansible_connection": "ssh"}
    doc = {
        "all": {
            "vars": shared,
            "children": {
                "hub": {"hosts": {"hub-1": {}}},
                "edge": {"hosts": {"dev1": unreachable, "dev2": unreachable}},
            },
        }
    }
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(json.dumps(doc))
    run = await asyncio.to_thread(
        playbook, "rollout.yml", inventory, "-e", f"@{tmp_path / 'extra.json'}"
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr
    counts = recap(run.stdout)
    assert set(counts) == {"hub-1"}, counts
    assert f"rollout of {NEXT_VERSION} started: batches of 1, 1 devices" in run.stdout
    plan, reports = await rollout.status(hub.js, hub.config)
    assert plan.version == NEXT_VERSION and plan.state == rollout.RolloutState.RUNNING
    assert [r.state for r in reports] == [rollout.PENDING, rollout.WAITING]
    assert not (tmp_path / "staging").exists()
