"""Releases devices pull over their own link: signed bundles in the hub's object store, a
rollout as desired state, the agent's resumable download and its refusals.

Here the agents stage what they fetch for an installer that does not run (``installer =
"systemd"`` and no systemd); tests/test_update_install.py installs releases for real.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import nats
import nats.errors
import pytest

from edge_agent.protocol.names import inbox_prefix
from edge_agent.protocol.release import (
    ROLLOUT_BUCKET,
    UpdateState,
    desired_key,
    release_key,
    sign_record,
)
from edge_agent.update.updater import update_paths, update_report
from hub_ingest.core.errors import RolloutError
from hub_ingest.fleet import rollout
from hub_ingest.fleet.releases import (
    get_record,
    new_release_key,
    publish,
    release_store,
    rollout_bucket,
)
from tests.support.cluster import Device, Hub, run_cli, write_agent_config
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("wheelhouse")]


def _fake_release(root: Path, version: str, size: int) -> Path:
    """A wheelhouse whose agent 'wheel' is `size` random bytes: enough to travel, not to run."""
    house = root / version
    house.mkdir(parents=True)
    (house / f"edge_agent-{version}-py3-none-any.whl").write_bytes(os.urandom(size))
    return house


async def _device(hub: Hub, device_id: str, operator_key: str, **update: str) -> Device:
    settings = {"operator_key": operator_key, "check_interval": "0.5s", "max_rate": "0"}
    return await hub.device(
        device_id, sections={"update": {**settings, **update}}, register_when_ready=True
    )


async def _device_state(hub: Hub, device_id: str, want: str) -> rollout.DeviceReport | None:
    _, reports = await rollout.status(hub.js, hub.config)
    report = next(r for r in reports if r.device_id == device_id)
    return report if report.state == want else None


async def test_a_device_refuses_releases_that_do_not_verify_and_the_hub_stops_there(
    hub: Hub, tmp_path: Path
) -> None:
    """Signed by another key, a record altered after signing, a bundle shorter than its
    record, a bundle whose bytes differ: each is refused on the device with its reason, the
    refusal reaches the hub, and the rollout stops; a second rollout is refused while it is
    stopped. A release that verifies is fetched and staged."""
    key = tmp_path / "release.nk"
    operator = new_release_key(key)
    foreign = tmp_path / "foreign.nk"
    new_release_key(foreign)
    device = await _device(hub, "a", operator)
    kv = await rollout_bucket(hub.js, hub.config)

    async def forge(version: str, **changes: object) -> None:
        record = await get_record(kv, version)
        assert record is not None
        await kv.put(release_key(version), replace(record, **changes).to_json())  # type: ignore[arg-type]

    async def refused(version: str, reason: str) -> None:
        await rollout.start(hub.js, hub.config, version, canary=1, shares=[1.0], max_failures=0)
        report = await eventually(
            lambda: _device_state(hub, "a", UpdateState.REFUSED),
            timeout=60,
            what=f"{version} refused",
        )
        assert report is not None and reason in report.reason, report
        plan = await eventually(
            lambda: _stopped(hub), timeout=30, what=f"rollout of {version} stopped"
        )
        assert "a refused" in plan.reason
        entry = update_report(device.config)["versions"][version]
        assert entry["state"] == "refused" and reason in entry["reason"]
        assert not update_paths(device.config).staged.exists()
        with pytest.raises(RolloutError, match="stopped"):
            await rollout.start(hub.js, hub.config, version, canary=1, shares=[1.0], max_failures=0)
        resumed = await rollout.change(hub.js, hub.config, "resume")  # accepts that failure
        assert resumed.state == rollout.RolloutState.RUNNING and resumed.max_failures == 1
        aborted = await rollout.change(hub.js, hub.config, "abort")
        assert aborted.state == rollout.RolloutState.ABORTED

    releases = tmp_path / "releases"
    await publish(hub.js, hub.config, _fake_release(releases, "9.0.1", 1000), "9.0.1", foreign)
    await refused("9.0.1", "not by update.operator_key")

    await publish(hub.js, hub.config, _fake_release(releases, "9.0.2", 1000), "9.0.2", key)
    await forge("9.0.2", size=999)
    await refused("9.0.2", "signature does not verify")

    # Truncated: the record (signed) is of a bundle the hub holds only the start of.
    short = await (await release_store(hub.js, hub.config)).put("short", os.urandom(4096))
    await publish(hub.js, hub.config, _fake_release(releases, "9.0.3", 300_000), "9.0.3", key)
    record = await get_record(kv, "9.0.3")
    assert record is not None
    await kv.put(
        release_key("9.0.3"),
        sign_record(replace(record, nuid=short.nuid or ""), key.read_text().strip()).to_json(),
    )
    await refused("9.0.3", "the bundle ends after 4096 bytes")

    # Altered: every byte travels, and they are not the ones signed for.
    await publish(hub.js, hub.config, _fake_release(releases, "9.0.4", 300_000), "9.0.4", key)
    record = await get_record(kv, "9.0.4")
    assert record is not None
    await kv.put(
        release_key("9.0.4"),
        sign_record(replace(record, sha256="0" * 64), key.read_text().strip()).to_json(),
    )
    await refused("9.0.4", "does not match its signed record")

    good = await publish(
        hub.js, hub.config, _fake_release(releases, "9.0.5", 300_000), "9.0.5", key
    )
    await rollout.start(hub.js, hub.config, "9.0.5", canary=1, shares=[1.0], max_failures=0)
    await eventually(
        lambda: _device_state(hub, "a", UpdateState.STAGED), timeout=60, what="9.0.5 staged"
    )
    staged = json.loads(update_paths(device.config).staged.read_text())
    assert staged["version"] == "9.0.5"
    assert update_paths(device.config).bundle("9.0.5").stat().st_size == good.size


async def test_a_device_reads_its_own_desired_release_and_no_other(
    hub: Hub, tmp_path: Path
) -> None:
    """Through its leaf link (the hub's permissions for it), not through its agent."""
    device = await hub.device("a", register_when_ready=True)
    await device.wait_link()
    kv = await rollout_bucket(hub.js, hub.config)
    for device_id in ("a", "b"):
        await kv.put(desired_key(device_id), b"9.0.5")
    desired = f"$JS.hub.API.DIRECT.GET.KV_{ROLLOUT_BUCKET}.$KV.{ROLLOUT_BUCKET}"
    nc = await nats.connect(device.config.island.client_url, inbox_prefix=inbox_prefix("a"))
    try:
        assert (await nc.request(f"{desired}.{desired_key('a')}", b"", timeout=5)).data == b"9.0.5"
        # The hub drops what the device may not publish: nobody answers.
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(f"{desired}.{desired_key('b')}", b"", timeout=2)
    finally:
        await nc.close()


def test_batches_cut_the_fleet_at_each_share_after_the_canary() -> None:
    ids = [f"d{i:02d}" for i in range(20)]
    batches = rollout.plan_batches(ids, 1, rollout.parse_shares("10%,50%,100%"))
    assert [len(b) for b in batches] == [1, 1, 8, 10]
    assert [d for b in batches for d in b] == ids and batches[0] == ["d00"]
    assert rollout.plan_batches(["a", "b"], 5, [1.0]) == [["a", "b"]]
    for bad in ("50%,10%,100%", "10%,50%", "ten%,100%", "0%,100%"):
        with pytest.raises(RolloutError, match="--batches"):
            rollout.parse_shares(bad)


def test_a_heartbeat_that_reached_the_hub_late_does_not_make_its_device_look_online() -> None:
    """Sent before the link dropped, stored after the batch opened (mirror and source lag):
    the device has been offline since, and must not hold its batch up."""
    plan = rollout.Rollout(version="2", batches=[["a"]], max_failures=0, opened=1)
    plan.opened_at.append("2026-11-26T10:00:00.000Z")
    late = {
        "checked_at": "2026-11-26T09:59:50.000Z",  # device clock, 3 s behind the hub's
        "clock_offset_s": 3.0,
        "stored_at": "2026-11-26T10:00:05.000Z",
    }

    def pending(heartbeat: dict[str, object]) -> rollout.DeviceReport:
        return rollout.DeviceReport("a", 0, rollout.PENDING, last_seen=rollout.sent_at(heartbeat))

    assert rollout.sent_at(late) == "2026-11-26T09:59:53.000Z"
    assert rollout.lets_through(plan, pending(late))
    sent_after = {**late, "checked_at": "2026-11-26T10:00:01.000Z"}  # online since it opened
    assert not rollout.lets_through(plan, pending(sent_after))
    # never after its store time, whatever the device's clock says; unsynced: store time
    assert rollout.sent_at({**late, "clock_offset_s": 3600.0}) == late["stored_at"]
    assert rollout.sent_at({**late, "clock_offset_s": None}) == late["stored_at"]


async def _stopped(hub: Hub) -> rollout.Rollout | None:
    plan, _ = await rollout.status(hub.js, hub.config)
    return plan if plan.state == rollout.RolloutState.STOPPED else None


async def test_a_download_cut_midway_resumes_without_fetching_a_chunk_twice(
    hub: Hub, tmp_path: Path
) -> None:
    key = tmp_path / "release.nk"
    device = await _device(hub, "a", new_release_key(key), max_rate="512KiB")
    house = _fake_release(tmp_path / "releases", "9.1.0", 3 * 1024 * 1024)
    record = await publish(hub.js, hub.config, house, "9.1.0", key)
    assert record.chunks > 20
    await rollout.start(hub.js, hub.config, "9.1.0", canary=1, shares=[1.0], max_failures=0)
    paths = update_paths(device.config)

    async def received() -> int:
        doc = json.loads(paths.progress("9.1.0").read_text())
        return int(doc["received"])

    async def partway() -> bool:
        return await received() >= 512 * 1024

    await eventually(partway, timeout=60, what="a quarter of the bundle downloaded")
    device.proxy.cut()
    await device.wait_link(up=False)
    cut_at = await received()
    assert cut_at < record.size
    device.proxy.restore()
    await eventually(
        lambda: _device_state(hub, "a", UpdateState.STAGED), timeout=120, what="9.1.0 staged"
    )
    entry = update_report(device.config)["versions"]["9.1.0"]
    # Every byte taken from the link was kept: nothing before the cut was fetched again.
    assert entry.get("fetched") == record.size, entry
    assert paths.bundle("9.1.0").stat().st_size == record.size
    assert not paths.progress("9.1.0").exists()
    # What `edge-agent update status --json` shows on the device.
    operator = device.config.update.operator_key
    config = write_agent_config(
        device, tmp_path / "a.toml", f'[update]\noperator_key = "{operator}"'
    )
    shown = run_cli("edge_agent", "-c", str(config), "update", "status", "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["staged"] == "9.1.0" and report["versions"]["9.1.0"]["state"] == "staged"
