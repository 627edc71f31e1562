"""Pulled updates installed for real: each device laid out as the Ansible role lays it out, its
agent kept running from ``current`` as systemd would, the installer the agent starts making
the new release's venv from the bundle's wheels, switching, restarting and gating on health.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from edge_agent.protocol.release import UpdateState, write_bundle
from edge_agent.update.install import COMPLETE, make_release, switch_current
from hub_ingest.fleet import rollout
from hub_ingest.fleet.releases import new_release_key, publish
from hub_ingest.local.link import LinkProxy
from tests.support.cluster import Hub
from tests.support.powerswitch import PowerCut
from tests.support.releases import NEXT_VERSION, VERSION, release_dir, release_wheel
from tests.support.supervisor import InstalledDevice, installed_device
from tests.support.waiting import eventually

BAD_VERSION = "9999.1.0"  # its agent exits at once: it can never pass the health gate
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("wheelhouse")]


@pytest.fixture(scope="module")
def base_release(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """VERSION installed once, by the installer's own code; each device links to it."""
    work = tmp_path_factory.mktemp("base")
    bundle = work / "bundle.tar"
    with bundle.open("wb") as out:
        write_bundle(out, VERSION, sorted(release_dir(wheelhouse, VERSION, work / "w").glob("*")))
    python = os.path.realpath(sys._base_executable)  # type: ignore[attr-defined]
    return make_release(work / "prefix", python, bundle, VERSION)


@pytest.fixture(scope="module")
def bad_wheelhouse(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    def broken(tree: Path) -> None:
        cli = tree / "edge_agent" / "cli.py"
        text = cli.read_text()
        assert "    agent = Agent(config)\n" in text
        cli.write_text(
            text.replace(
                "    agent = Agent(config)\n", '    raise SystemExit("broken on purpose")\n'
            )
        )

    release_wheel(wheelhouse, BAD_VERSION, tmp_path_factory.mktemp("bad"), broken)
    return wheelhouse


@contextlib.asynccontextmanager
async def _devices(
    hub: Hub, base: Path, root: Path, ids: list[str], operator_key: str, **update: str
) -> AsyncIterator[dict[str, tuple[InstalledDevice, LinkProxy]]]:
    devices: dict[str, tuple[InstalledDevice, LinkProxy]] = {}
    try:
        for device_id in ids:
            devices[device_id] = await installed_device(
                hub, base, root, device_id, operator_key, **update
            )
        for device, _ in devices.values():
            await eventually(device.status, timeout=180, what=f"{device.device_id} healthy")
        yield devices
    finally:
        for device, proxy in devices.values():
            await device.close()
            await proxy.close()


async def _report(hub: Hub, device_id: str) -> rollout.DeviceReport:
    _, reports = await rollout.status(hub.js, hub.config)
    return next(r for r in reports if r.device_id == device_id)


async def _rollout_in(hub: Hub, state: rollout.RolloutState) -> rollout.Rollout | None:
    plan, _ = await rollout.status(hub.js, hub.config)
    return plan if plan.state == state else None


async def test_a_rollout_reaches_the_devices_that_were_offline_when_it_started(
    hub: Hub, wheelhouse: Path, base_release: Path, tmp_path: Path
) -> None:
    """10 devices, 3 of them cut off: the canary, then half the fleet, then the rest; the
    offline devices do not hold the batches up, wait as pending (last seen before the cut)
    and keep the rollout running; they take the release once their links return, and every
    device ends on it, its new agent running healthy."""
    key = tmp_path / "release.nk"
    operator = new_release_key(key)
    await publish(
        hub.js, hub.config, release_dir(wheelhouse, NEXT_VERSION, tmp_path / "w"), NEXT_VERSION, key
    )
    ids = [f"d{i:02d}" for i in range(10)]
    offline = ["d03", "d07", "d09"]  # in the second batch and the third
    async with _devices(
        hub, base_release, tmp_path, ids, operator, health_deadline="240s"
    ) as devices:
        for device_id in offline:
            devices[device_id][1].cut()
        await rollout.start(
            hub.js, hub.config, NEXT_VERSION, canary=1, shares=[0.5, 1.0], max_failures=0
        )
        plan, _ = await rollout.status(hub.js, hub.config)
        assert plan.batches == [ids[:1], ids[1:5], ids[5:]]

        async def online_healthy() -> bool:
            _, reports = await rollout.status(hub.js, hub.config)
            states = {r.device_id: r.state for r in reports}
            return all(states[d] == UpdateState.HEALTHY for d in ids if d not in offline)

        await eventually(online_healthy, timeout=600, what="the 7 online devices healthy")
        plan, reports = await rollout.status(hub.js, hub.config)
        assert plan.state == rollout.RolloutState.RUNNING and plan.opened == 3
        for report in reports:
            if report.device_id in offline:
                assert report.state == rollout.PENDING and report.last_seen, report
                assert devices[report.device_id][0].current == VERSION

        for device_id in offline:
            devices[device_id][1].restore()
        await eventually(
            lambda: _rollout_in(hub, rollout.RolloutState.DONE),
            timeout=600,
            what="rollout done once the offline devices returned",
        )
        for device, _ in devices.values():
            assert device.current == NEXT_VERSION and device.running == NEXT_VERSION
            assert device.restarts >= 1
            # Ends healthy with its link up: a link that just came back may drop once more
            # while a loaded hub accepts the others (seen in CI the second the rollout ended).
            await eventually(device.healthy, timeout=60, what=f"{device.config_path} healthy")


async def test_a_canary_that_fails_its_health_gate_is_rolled_back_and_the_rollout_stops(
    hub: Hub, bad_wheelhouse: Path, base_release: Path, tmp_path: Path
) -> None:
    key = tmp_path / "release.nk"
    operator = new_release_key(key)
    source = release_dir(bad_wheelhouse, BAD_VERSION, tmp_path / "w")
    await publish(hub.js, hub.config, source, BAD_VERSION, key)
    ids = ["a", "b"]
    async with _devices(
        hub, base_release, tmp_path, ids, operator, health_deadline="15s"
    ) as devices:
        await rollout.start(hub.js, hub.config, BAD_VERSION, canary=1, shares=[1.0], max_failures=0)
        plan = await eventually(
            lambda: _rollout_in(hub, rollout.RolloutState.STOPPED), timeout=240, what="stopped"
        )
        assert "a rolled_back: not healthy within 15s" in plan.reason, plan.reason
        a, b = devices["a"][0], devices["b"][0]
        assert a.current == VERSION
        assert (a.prefix / "releases" / BAD_VERSION / COMPLETE).exists()  # kept, not current
        await eventually(a.status, timeout=90, what="a healthy again on the old release")
        assert a.running == VERSION
        assert (await _report(hub, "b")).state == rollout.WAITING
        assert b.current == VERSION and not (b.prefix / "releases" / BAD_VERSION).exists()


def _imports(release: Path) -> str:
    """The version `release`'s own Python imports, with the agent's dependencies: a release
    that starts."""
    code = "import edge_agent, nats, nkeys, structlog; print(edge_agent.__version__)"
    done = subprocess.run(
        [str(release / "bin/python"), "-I", "-c", code], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_power_cut_during_an_install_leaves_a_release_that_starts(
    wheelhouse: Path, base_release: Path, tmp_path: Path
) -> None:
    """Cut while pip fills the new release: current still names the old one, which starts,
    and the next install makes the half-made release whole. Cut right after the switch: the
    new release is whole on disk, every file of it synced before its marker."""
    bundle = tmp_path / "next.tar"
    with bundle.open("wb") as out:
        wheels = release_dir(wheelhouse, NEXT_VERSION, tmp_path / "w").glob("*")
        write_bundle(out, NEXT_VERSION, sorted(wheels))
    python = os.path.realpath(sys._base_executable)  # type: ignore[attr-defined]
    disk = PowerCut(tmp_path / "backing", tmp_path / "mnt").start()
    try:
        prefix = disk.mount / "opt/edge-agent"
        (prefix / "releases").mkdir(parents=True)
        (prefix / "releases" / VERSION).symlink_to(base_release)
        (prefix / "current").symlink_to(f"releases/{VERSION}")
        target = prefix / "releases" / NEXT_VERSION
        code = (
            "import sys; from pathlib import Path; from edge_agent.update.install import "
            "make_release; make_release(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), "
            "sys.argv[4])"
        )
        installer = subprocess.Popen(
            [sys.executable, "-c", code, str(prefix), python, str(bundle), NEXT_VERSION]
        )
        try:
            deadline = time.monotonic() + 300
            # Until pip is writing the agent's own package into the new venv.
            while not list(target.glob("lib/python*/site-packages/edge_agent/*.py")):
                assert installer.poll() is None, "the install ended before the cut"
                assert time.monotonic() < deadline, "pip never wrote the agent's package"
                time.sleep(0.05)  # polling the install's progress, not waiting for a result
            # pip, writing under the mount, dies with the power; so does the installer.
            assert disk.cut().killed
        finally:
            installer.kill()
            installer.wait()
        assert os.readlink(prefix / "current") == f"releases/{VERSION}"
        assert _imports(prefix / "current") == VERSION
        assert not (target / COMPLETE).exists()

        make_release(prefix, python, bundle, NEXT_VERSION)
        switch_current(prefix, NEXT_VERSION)
        cut = disk.cut()
        assert cut.dropped_bytes == 0, "something of the release was left unsynced"
        assert os.readlink(prefix / "current") == f"releases/{NEXT_VERSION}"
        assert _imports(prefix / "current") == NEXT_VERSION
    finally:
        disk.stop()
